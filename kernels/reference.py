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


def qk_norm_rope(x_BSHD: torch.Tensor, weight: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor,
                 eps: float = 1e-6) -> torch.Tensor:
    """QK-norm (RMSNorm over the head dim, per-channel `weight` [Dh]) then the rotary embedding:
    apply_rope(rms_norm(x, weight, eps), cos, sin). One op so that the Triton backend can fuse
    them (one read and one write of q or k instead of two)."""
    return apply_rope(rms_norm(x_BSHD, weight, eps), cos_BSd, sin_BSd)


def linear_cross_entropy(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    *,
    ignore_index: int = -100,
    chunk_size: int = 4096,
    keep_bytes: int = 256 * 2**20,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token cross-entropy and z (= logsumexp^2) of `h @ weight.T`, chunk by chunk with
    recomputation in backward, so the [T, V] logits are never held whole: the peak is about one
    [chunk_size, V] fp32 buffer. When all of a call's fp32 logits fit in `keep_bytes` (small
    vocabularies and batches, as on CPU) the forward's exponentials are kept for backward
    instead, which saves the recomputing GEMM (0 disables).

    The head GEMM runs in `head_dtype` (the autocast dtype inside an autocast region, else the
    inputs' dtype): under bf16 autocast it is a bf16 GEMM (`head_logits`: with an fp32 output on
    CUDA; on CPU its product is rounded to bf16, then upcast), and
    the log-sum-exp, ce and z are computed in fp32 (the "fp32 head" of Chameleon and OLMo; an
    fp32 GEMM over the vocabulary cost a third of an H200 step). Autocast is off inside forward
    and backward, so backward() may also be called inside an autocast region.

    Returns (ce_T, z_T) in fp32 (float64 for float64 inputs), both 0 where labels == ignore_index.
    The caller reduces (mean over valid tokens, z-loss coefficient, per-modality sums)."""
    dt = head_dtype(h_TD, weight_VD)
    if not (torch.is_grad_enabled() and (h_TD.requires_grad or weight_VD.requires_grad)):
        keep_bytes = 0  # no backward will come
    return _ChunkedLinearCE.apply(h_TD.to(dt), weight_VD.to(dt), labels_T, ignore_index, chunk_size, keep_bytes)


def head_dtype(h: torch.Tensor, w: torch.Tensor) -> torch.dtype:
    """Dtype of the output-head GEMM: autocast's inside an autocast region (float64 parity
    checks stay float64), else the promoted dtype of the operands."""
    dev = h.device.type
    if torch.is_autocast_enabled(dev) and h.dtype != torch.float64:
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(h.dtype, w.dtype)


_MM_OUT_DTYPE: bool | None = None  # torch.mm(..., out_dtype=) works here (CUDA, torch >= 2.8)


def head_logits(h_CD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """h @ w.T with the operands in their own (low-precision) dtype and the result in fp32 at
    least: on CUDA one bf16/fp16 GEMM with an fp32 output (no bf16 rounding of the logits),
    elsewhere (CPU, or torch without `mm(out_dtype=)`) the product rounded to the operands'
    dtype, then upcast: those logits carry bf16 rounding. Kept so on purpose (see README)."""
    global _MM_OUT_DTYPE
    acc = _acc_dtype(h_CD)
    if h_CD.dtype == acc:
        return h_CD @ w_VD.t()
    if h_CD.is_cuda:
        if _MM_OUT_DTYPE is None:
            try:
                torch.mm(h_CD[:1], w_VD[:1].t(), out_dtype=acc)
                _MM_OUT_DTYPE = True
            except (TypeError, RuntimeError, NotImplementedError):
                _MM_OUT_DTYPE = False
        if _MM_OUT_DTYPE:
            return torch.mm(h_CD, w_VD.t(), out_dtype=acc)
    return (h_CD @ w_VD.t()).to(acc)


class LogitsPool:
    """Reusable [C, V] logits buffers for the head's loss on CPU.

    A fresh buffer that large comes from mmap, and its first touch costs a page fault per 4 KiB
    page: at 2,048 tokens x 8,192 vocabulary (64 MiB) the head GEMM took 59 ms into a fresh output
    and 44 ms into a reused one. CUDA's caching allocator reuses memory by itself; CPU has none.
    A buffer is handed back only when the loss is done with it (at the end of its chunk's forward,
    or after its backward when the forward kept it), so one still in use is never handed out
    again. Between steps it holds at most `max_buffers` buffers and `max_bytes` in all, the
    newest first (memory a step needs at its peak anyway)."""

    def __init__(self, max_buffers: int = 2, max_bytes: int = 2**30):
        self.max_buffers, self.max_bytes = max_buffers, max_bytes
        self._free: list[torch.Tensor] = []

    @staticmethod
    def _pooled(device: torch.device) -> bool:
        return device.type == "cpu" and not torch.compiler.is_compiling()

    def take(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised [rows, cols] buffer: a free pooled one of that shape, else a new one."""
        if self._pooled(device):
            for i, t in enumerate(self._free):
                if t.shape == (rows, cols) and t.dtype == dtype:
                    return self._free.pop(i)
        return torch.empty((rows, cols), dtype=dtype, device=device)

    def give(self, t: torch.Tensor) -> None:
        """Hand back a buffer from `take` that nothing reads or writes any more."""
        if self._pooled(t.device) and self.max_buffers > 0:
            self._free.append(t)
            del self._free[:-self.max_buffers]
            while sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop(0)

    def clear(self) -> None:
        self._free.clear()


LOGITS_POOL = LogitsPool()


def _logits_buffer(h_CD: torch.Tensor, w_VD: torch.Tensor) -> torch.Tensor:
    """fp32 (at least) logits h @ w.T of one chunk, in a pooled buffer when the GEMM can write
    into it directly (operands already in the accumulation dtype, on CPU); hand it back with
    `LOGITS_POOL.give` when done."""
    acc = _acc_dtype(h_CD)
    if h_CD.dtype == acc == w_VD.dtype and LOGITS_POOL._pooled(h_CD.device):
        buf = LOGITS_POOL.take(h_CD.shape[0], w_VD.shape[0], acc, h_CD.device)
        return torch.mm(h_CD, w_VD.t(), out=buf)
    return head_logits(h_CD, w_VD)


def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    # fp32 at least; float64 inputs (parity references) stay float64
    return torch.promote_types(t.dtype, torch.float32)


def _ce_chunk_forward(h, w, labels, ignore_index):
    """(ce, z, lse, e, m) of one chunk. The fp32 [C, V] logits buffer is the only big allocation:
    it becomes e = exp(logits - m) in place (row max m) after the target logits are read out
    (a LOGITS_POOL buffer on CPU: the caller hands it back)."""
    logits = _logits_buffer(h, w)
    valid = labels != ignore_index
    safe = torch.where(valid, labels, torch.zeros_like(labels))
    target = logits.gather(1, safe.unsqueeze(1)).squeeze(1)
    m = logits.amax(dim=-1, keepdim=True)
    e = logits.sub_(m).exp_()
    lse = (e.sum(-1, keepdim=True).log_() + m).squeeze(1)
    ce = torch.where(valid, lse - target, torch.zeros_like(lse))
    z = torch.where(valid, lse * lse, torch.zeros_like(lse))
    return ce, z, lse, e, m.squeeze(1)


class _ChunkedLinearCE(torch.autograd.Function):
    """h and w arrive in the head's compute dtype (linear_cross_entropy casts them)."""

    @staticmethod
    def forward(ctx, h, w, labels, ignore_index, chunk_size, keep_bytes=0):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        acc = _acc_dtype(h)
        keep = h.shape[0] * w.shape[0] * torch.finfo(acc).bits // 8 <= keep_bytes
        kept = []
        with torch.autocast(h.device.type, enabled=False):
            ce = torch.empty(h.shape[0], dtype=acc, device=h.device)
            z, lse = torch.empty_like(ce), torch.empty_like(ce)
            for s in range(0, h.shape[0], chunk_size):
                e = min(s + chunk_size, h.shape[0])
                ce[s:e], z[s:e], lse[s:e], exp_CV, m_C = _ce_chunk_forward(h[s:e], w, labels[s:e], ignore_index)
                if keep:  # softmax = exp_CV * exp(m - lse): kept with its row scale, backward needs no
                    # recomputing GEMM, and the scale folds into backward's one pass over the buffer
                    kept.append((exp_CV, (m_C - lse[s:e]).exp_()))
                else:
                    LOGITS_POOL.give(exp_CV)
        ctx.save_for_backward(h, w, labels, lse)
        ctx.ignore_index, ctx.chunk_size, ctx.kept = ignore_index, chunk_size, kept
        return ce, z

    @staticmethod
    def backward(ctx, grad_ce, grad_z):
        h, w, labels, lse_T = ctx.saved_tensors
        kept, ctx.kept = ctx.kept, []  # released as soon as they are used
        with torch.autocast(h.device.type, enabled=False):
            return _ChunkedLinearCE._backward(ctx, h, w, labels, lse_T, grad_ce, grad_z, kept)

    @staticmethod
    def _backward(ctx, h, w, labels, lse_T, grad_ce, grad_z, kept):
        acc = _acc_dtype(h)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(w, dtype=acc) if ctx.needs_input_grad[1] else None
        grad_ce = torch.zeros_like(lse_T) if grad_ce is None else grad_ce
        grad_z = torch.zeros_like(lse_T) if grad_z is None else grad_z
        for i, s in enumerate(range(0, h.shape[0], ctx.chunk_size)):
            e = min(s + ctx.chunk_size, h.shape[0])
            h_c = h[s:e]
            valid = labels[s:e] != ctx.ignore_index
            safe = torch.where(valid, labels[s:e], torch.zeros_like(labels[s:e]))
            lse = lse_T[s:e]
            gce = torch.where(valid, grad_ce[s:e].to(acc), torch.zeros_like(lse))
            gz = torch.where(valid, grad_z[s:e].to(acc), torch.zeros_like(lse))
            # d ce / d logits = softmax - onehot; d z / d logits = 2 * lse * softmax.
            # The softmax (kept unnormalised with its row scale, or recomputed from the logits)
            # becomes the gradient in place.
            row = gce + 2.0 * lse * gz
            if kept:
                (buf, scale), kept[i] = kept[i], None
                row = row * scale
            else:
                buf = _logits_buffer(h_c, w).sub_(lse.unsqueeze(1)).exp_()
            buf.mul_(row.unsqueeze(1))
            buf.scatter_add_(1, safe.unsqueeze(1), -gce.unsqueeze(1))
            g = buf.to(h.dtype)  # the two gradient GEMMs run in the compute dtype too
            if grad_h is not None:
                grad_h[s:e] = g @ w
            if grad_w is not None:
                grad_w += head_logits(g.t(), h_c.t())
            del g
            LOGITS_POOL.give(buf)
        return (
            grad_h,
            None if grad_w is None else grad_w.to(w.dtype),
            None, None, None, None,
        )


def moe_permute(x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int):
    """Sort the T*K (token, expert) pairs by expert, stably.

    Returns (x_ND rows gathered in expert order, perm_N indices into the flattened T*K pairs,
    counts_E tokens per expert as int64). Counts by index_add into a fixed-size buffer, not
    bincount (which reads its input's max back to the host on CUDA)."""
    flat_N = topk_idx_TK.reshape(-1)
    perm_N = torch.argsort(flat_N, stable=True)
    k = topk_idx_TK.shape[1]
    x_ND = x_TD.index_select(0, perm_N // k)
    counts_E = torch.zeros(num_experts, dtype=torch.int64, device=flat_N.device).index_add_(0, flat_N, torch.ones_like(flat_N))
    return x_ND, perm_N, counts_E


def moe_unpermute(y_ND: torch.Tensor, perm_N: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of moe_permute, weighted: out[t] = sum_k weights[t, k] * y[row of pair (t, k)].

    Rows go back to pair order with index_copy (its backward is a gather), then a weighted sum
    over K. A weighted index_add in one pass was measured 1.9x slower on CPU (its CPU kernel and
    its index_select backward are the slow ones); the Triton kernel does the one-pass combine on GPU."""
    T, K = weights_TK.shape
    y_TKD = torch.empty((T * K, y_ND.shape[-1]), dtype=y_ND.dtype, device=y_ND.device)
    y_TKD = y_TKD.index_copy(0, perm_N, y_ND).view(T, K, -1)
    return (y_TKD * weights_TK.unsqueeze(-1).to(y_ND.dtype)).sum(1)
