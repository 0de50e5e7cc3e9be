"""Plain PyTorch references for every kernel: the ground truth of parity tests and the CPU path.

Shapes: T tokens, D width, V vocab, E experts, K experts per token, N = T*K routed rows,
B batch, S sequence, H heads, Dh head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 (float64 for float64 x), returned in x's dtype."""
    acc = _acc_dtype(x)
    x32 = x.to(acc)
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.to(acc)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up."""
    return F.silu(gate) * up


def apply_rope(x_BSHD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, half-split (GPT-NeoX) convention, d = Dh/2:
    out[..., :d] = x1*cos - x2*sin; out[..., d:] = x2*cos + x1*sin.
    cos/sin are per token (M-RoPE builds them from 3-D positions), broadcast over heads."""
    d = x_BSHD.shape[-1] // 2
    acc = _acc_dtype(x_BSHD)  # fp32, float64 for float64 parity checks
    x1, x2 = x_BSHD[..., :d].to(acc), x_BSHD[..., d:].to(acc)
    cos, sin = cos_BSd.to(acc).unsqueeze(2), sin_BSd.to(acc).unsqueeze(2)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BSHD.dtype)


def linear_cross_entropy(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy and z (= logsumexp^2) of `h @ weight.T`, computed in fp32 chunk
    by chunk with recomputation in backward, so the [T, V] logits are never held whole: the peak
    is about one [chunk_size, V] buffer (plus the fp32 copy of W for low-precision weights).

    Returns (ce_T, z_T) in fp32 (float64 for float64 inputs), both 0 where labels == ignore_index. The caller reduces
    (mean over valid tokens, z-loss coefficient, per-modality sums)."""
    return _ChunkedLinearCE.apply(h_TD, weight_VD, labels_T, ignore_index, chunk_size)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    # fp32 at least; float64 inputs (parity references) stay float64
    return torch.promote_types(t.dtype, torch.float32)


def _ce_chunk_forward(h, w, labels, ignore_index):
    """(ce, z, lse) of one chunk. The [C, V] logits buffer is the only big allocation: lse is
    computed in place on it (max, subtract, exp, sum) after the target logits are read out."""
    acc = _acc_dtype(h)
    logits = h.to(acc) @ w.t()  # w already in acc dtype
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    m = logits.amax(dim=-1, keepdim=True)
    lse = (logits.sub_(m).exp_().sum(-1, keepdim=True).log_() + m).squeeze(1)
    ce = torch.where(valid, lse - target, torch.zeros_like(lse))
    z = torch.where(valid, lse * lse, torch.zeros_like(lse))
    return ce, z, lse


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, chunk_size):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        ce = torch.empty(h.shape[0], dtype=_acc_dtype(h), device=h.device)
        z, lse = torch.empty_like(ce), torch.empty_like(ce)
        w_acc = w.to(ce.dtype)  # once per call, not once per chunk
        for s in range(0, h.shape[0], chunk_size):
            e = min(s + chunk_size, h.shape[0])
            ce[s:e], z[s:e], lse[s:e] = _ce_chunk_forward(h[s:e], w_acc, labels[s:e], ignore_index)
        ctx.save_for_backward(h, w, labels, lse)
        ctx.ignore_index, ctx.chunk_size = ignore_index, chunk_size
        return ce, z

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        h, w, labels, lse_T = ctx.saved_tensors
        acc = _acc_dtype(h)
        grad_h = torch.zeros_like(h, dtype=acc) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w, dtype=acc) if ctx.needs_input_grad[1] else None
        w_acc = w.to(acc)
        grad_ce = torch.zeros_like(lse_T) if grad_ce is None else grad_ce
        grad_z = torch.zeros_like(lse_T) if grad_z is None else grad_z
        for s in range(0, h.shape[0], ctx.chunk_size):
            e = min(s + ctx.chunk_size, h.shape[0])
            h_acc = h[s:e].to(acc)
            valid = labels[s:e] != ctx.ignore_index
            safe = torch.where(valid, labels[s:e], torch.zeros_like(labels[s:e]))
            lse = lse_T[s:e]
            gce = torch.where(valid, grad_ce[s:e].to(acc), torch.zeros_like(lse))
            gz = torch.where(valid, grad_z[s:e].to(acc), torch.zeros_like(lse))
            # d ce / d logits = softmax - onehot; d z / d logits = 2 * lse * softmax.
            # The recomputed logits become the gradient in place: one [C, V] buffer.
            g = (h_acc @ w_acc.t()).sub_(lse.unsqueeze(1)).exp_().mul_((gce + 2.0 * lse * gz).unsqueeze(1))
            g.scatter_add_(1, safe.unsqueeze(1), -gce.unsqueeze(1))
            if grad_h is not None:
                grad_h[s:e] = g @ w_acc
            if grad_w is not None:
                grad_w.addmm_(g.t(), h_acc)
            del g
        return (
            None if grad_h is None else grad_h.to(h.dtype),
            None if grad_w is None else grad_w.to(w.dtype),
            None, None, None,
        )


def moe_permute(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int):
    """Sort the T*K (token, expert) pairs by expert, stably.

    Returns (x_ND rows gathered in expert order, perm_N indices into the flattened T*K pairs,
    counts_E tokens per expert as int64)."""
    flat_N = topk_idx_TK.reshape(-1)
    perm_N = torch.argsort(flat_N, stable=True)
    k = topk_idx_TK.shape[1]
    x_ND = x_TD.index_select(0, perm_N // k)
    counts_E = torch.bincount(flat_N, minlength=num_experts)
    return x_ND, perm_N, counts_E


def moe_unpermute(y_ND: torch.Tensor, perm_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of moe_permute, weighted: out[t] = sum_k weights[t, k] * y[row of pair (t, k)]."""
    T, K = weights_TK.shape
    y_TKD = torch.empty((T * K, y_ND.shape[-1]), dtype=y_ND.dtype, device=y_ND.device)
    y_TKD = y_TKD.index_copy(0, perm_N, y_ND).view(T, K, -1)
    return (y_TKD * weights_TK.unsqueeze(-1).to(y_ND.dtype)).sum(1)
