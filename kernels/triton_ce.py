"""Triton linear + cross-entropy + z-loss, chunked over tokens (Liger-style fusion).

For each chunk of C tokens the logits `h_C @ W.T` come from one matmul in the compute dtype
(bf16 under autocast) with fp32 logits out (cuBLAS does that part best); one Triton kernel then reads the [C, V] chunk once for logsumexp, target logit, ce and
z; in backward the chunk is recomputed and a second kernel overwrites it in place with
d(loss)/d(logits) (softmax scaled by the incoming gradients, minus the one-hot), which two more
matmuls turn into grad_h and grad_W. So at most one [C, V] fp32 buffer is alive, in forward and
in backward, instead of the whole [T, V] logits and their softmax.

Shapes: T tokens, C tokens per chunk, D width, V vocab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import head_logits

CE_BLOCK_V = 2048


@triton.jit
def _ce_fwd_kernel(
    logits_ptr, labels_ptr, ce_ptr, z_ptr, lse_ptr, V, stride_l, ignore_index, BLOCK_V: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    cols = tl.arange(0, BLOCK_V)
    # online logsumexp over vocab tiles: one pass over the row
    x = tl.load(base + cols, mask=cols < V, other=float("-inf"))
    m = tl.max(x, axis=0)
    s = tl.sum(tl.exp(x - m), axis=0)
    for start in range(BLOCK_V, V, BLOCK_V):
        x = tl.load(base + start + cols, mask=start + cols < V, other=float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - new_m) + tl.sum(tl.exp(x - new_m), axis=0)
        m = new_m
    lse = m + tl.log(s)
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    target = tl.load(base + tl.where(valid, label, 0))
    tl.store(ce_ptr + row, tl.where(valid, lse - target, 0.0))
    tl.store(z_ptr + row, tl.where(valid, lse * lse, 0.0))
    tl.store(lse_ptr + row, lse)


@triton.jit
def _ce_bwd_kernel(
    logits_ptr, labels_ptr, lse_ptr, gce_ptr, gz_ptr, V, stride_l, ignore_index, BLOCK_V: tl.constexpr
):
    # Overwrites the logits row with d/dlogits of (gce * ce + gz * z):
    # softmax * (gce + 2 * lse * gz) - onehot(label) * gce; a zero row for ignored tokens.
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_l
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    lse = tl.load(lse_ptr + row)
    gce = tl.where(valid, tl.load(gce_ptr + row).to(tl.float32), 0.0)
    gz = tl.where(valid, tl.load(gz_ptr + row).to(tl.float32), 0.0)
    scale = gce + 2.0 * lse * gz
    cols = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        c = start + cols
        mask = c < V
        x = tl.load(base + c, mask=mask, other=0.0)
        g = tl.exp(x - lse) * scale - tl.where(c == label, gce, 0.0)
        tl.store(base + c, g, mask=mask)


def _check_labels(labels_T: torch.Tensor, V: int, ignore_index: int) -> None:
    # An out-of-range label would read outside the logits row. On CUDA the check is an
    # asynchronous device assert (no host sync in the step); under the CPU interpreter, a ValueError.
    bad = (labels_T != ignore_index) & ((labels_T < 0) | (labels_T >= V))
    if labels_T.is_cuda:
        torch._assert_async(~bad.any(), f"linear_cross_entropy: a label is outside the vocab [0, {V})")
        return
    if bool(bad.any()):
        first = labels_T[bad][0].item()
        raise ValueError(f"linear_cross_entropy: label {first} is outside the vocab [0, {V}); use {ignore_index} for no loss")


def _launch_cfg(V: int) -> dict:
    block = min(CE_BLOCK_V, triton.next_power_of_2(V))
    return dict(BLOCK_V=block, num_warps=8 if block >= 1024 else 4)


def linear_ce_fwd(
    h_TD: torch.Tensor, weight_VD: torch.Tensor, labels_T: torch.Tensor, ignore_index: int, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ce_T, z_T, lse_T) in fp32; ce and z are 0 at ignored tokens, lse is kept for backward."""
    T, V = h_TD.shape[0], weight_VD.shape[0]
    _check_labels(labels_T, V, ignore_index)
    dev = h_TD.device
    ce_T = torch.empty(T, dtype=torch.float32, device=dev)
    z_T, lse_T = torch.empty_like(ce_T), torch.empty_like(ce_T)
    labels_T = labels_T.contiguous()
    cfg = _launch_cfg(V)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        # the GEMM in h's dtype (bf16 under autocast) with fp32 logits out
        logits_CV = head_logits(h_TD[s:e], weight_VD)
        _ce_fwd_kernel[(e - s,)](
            logits_CV, labels_T[s:e], ce_T[s:e], z_T[s:e], lse_T[s:e], V, logits_CV.stride(0), ignore_index, **cfg
        )
        del logits_CV
    return ce_T, z_T, lse_T


def linear_ce_bwd(
    grad_ce_T: torch.Tensor, grad_z_T: torch.Tensor, h_TD: torch.Tensor, weight_VD: torch.Tensor,
    labels_T: torch.Tensor, lse_T: torch.Tensor, ignore_index: int, chunk_size: int, need_h: bool, need_w: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_h in h's dtype, grad_W in W's dtype); a gradient that is not needed comes back empty.
    The three GEMMs run in h's dtype; the logits gradient and grad_W accumulate in fp32."""
    T, V = h_TD.shape[0], weight_VD.shape[0]
    dev = h_TD.device
    grad_h = torch.empty((T, h_TD.shape[1]), dtype=h_TD.dtype, device=dev) if need_h else h_TD.new_empty(0)
    grad_w32 = torch.zeros(weight_VD.shape, dtype=torch.float32, device=dev) if need_w else None
    labels_T = labels_T.contiguous()
    gce, gz = grad_ce_T.contiguous(), grad_z_T.contiguous()
    cfg = _launch_cfg(V)
    for s in range(0, T, chunk_size):
        e = min(s + chunk_size, T)
        h_CD = h_TD[s:e]
        g_CV = head_logits(h_CD, weight_VD)
        _ce_bwd_kernel[(e - s,)](g_CV, labels_T[s:e], lse_T[s:e], gce[s:e], gz[s:e], V, g_CV.stride(0), ignore_index, **cfg)
        g_CV = g_CV.to(h_TD.dtype)
        if need_h:
            grad_h[s:e] = g_CV @ weight_VD
        if grad_w32 is not None:
            grad_w32 += head_logits(g_CV.t(), h_CD.t())
        del g_CV
    grad_w = grad_w32.to(weight_VD.dtype) if grad_w32 is not None else weight_VD.new_empty(0)
    return grad_h, grad_w
