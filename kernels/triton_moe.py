"""Triton kernels for MoE dispatch: stable sort of (token, expert) pairs by expert, row gather,
and the weighted combine back to token order.

Shapes: T tokens, K experts per token, N = T*K routed pairs/rows, E experts, D width,
NB blocks of BLOCK_N pairs. A pair p = t*K + k; perm_N[n] is the pair sitting in routed row n and
inv_N[p] (its inverse) the routed row of pair p.

The sort is a counting sort in two kernels: per-block expert histograms, then (after a tiny
exclusive scan in torch over [NB, E]) each pair's destination = start of its expert + pairs of the
same expert in earlier blocks + earlier pairs of the same expert in its own block. That keeps the
order of equal experts (stable), like `argsort(stable=True)`, without a general sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_hist_kernel(idx_ptr, hist_ptr, N, E, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    e = tl.load(idx_ptr + offs, mask=offs < N, other=-1)
    experts = tl.arange(0, BLOCK_E)
    counts = tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    tl.store(hist_ptr + pid * E + experts, counts, mask=experts < E)


@triton.jit
def _scatter_perm_kernel(idx_ptr, base_ptr, perm_ptr, inv_ptr, N, E, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK_N)
    offs = pid * BLOCK_N + lane
    valid = offs < N
    e = tl.load(idx_ptr + offs, mask=valid, other=-1)
    # rank among earlier pairs of the same expert inside this block (keeps the sort stable)
    earlier_same = (e[:, None] == e[None, :]) & (lane[None, :] < lane[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    base = tl.load(base_ptr + pid * E + e, mask=valid, other=0)
    dest = (base + rank).to(tl.int64)
    tl.store(perm_ptr + dest, offs.to(tl.int64), mask=valid)
    tl.store(inv_ptr + offs, dest, mask=valid)


@triton.jit
def _gather_rows_kernel(
    src_ptr, pair_ptr, scale_ptr, out_ptr, D, K, stride_src, stride_out, HAS_SCALE: tl.constexpr, BLOCK_D: tl.constexpr
):
    # out[n] = scale[pair] * src[pair // K] with pair = perm[n]
    n = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    pair = tl.load(pair_ptr + n)
    v = tl.load(src_ptr + (pair // K) * stride_src + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        v = v * tl.load(scale_ptr + pair).to(tl.float32)
    tl.store(out_ptr + n * stride_out + cols, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _combine_kernel(
    y_ptr, inv_ptr, w_ptr, out_ptr, D, K, stride_y, stride_out, HAS_W: tl.constexpr, BLOCK_D: tl.constexpr
):
    # out[t] = sum_k w[t, k] * y[inv[t*K + k]], accumulated in fp32
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for k in range(K):
        row = tl.load(inv_ptr + t * K + k)
        v = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_W:
            v = v * tl.load(w_ptr + t * K + k).to(tl.float32)
        acc += v
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _pair_dot_kernel(g_ptr, y_ptr, inv_ptr, out_ptr, D, K, stride_g, stride_y, BLOCK_D: tl.constexpr):
    # out[p] = <g[p // K], y[inv[p]]>: the gradient of the combine weight of pair p
    p = tl.program_id(0).to(tl.int64)
    row = tl.load(inv_ptr + p)
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, D, BLOCK_D):
        c = start + cols
        mask = c < D
        g = tl.load(g_ptr + (p // K) * stride_g + c, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row * stride_y + c, mask=mask, other=0.0).to(tl.float32)
        acc += g * y
    tl.store(out_ptr + p, tl.sum(acc, axis=0))


@triton.jit
def _invert_kernel(perm_ptr, inv_ptr, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    p = tl.load(perm_ptr + offs, mask=mask, other=0)
    tl.store(inv_ptr + p, offs.to(tl.int64), mask=mask)


def _block_d(D: int) -> int:
    return min(1024, triton.next_power_of_2(max(D, 1)))


def _contig_rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def sort_pairs(topk_idx_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stable counting sort of the flattened pairs by expert: (perm_N, inv_N, counts_E int64).
    Expert ids must lie in [0, num_experts); the router guarantees it, so it is not re-checked here
    (that would cost a host sync every layer)."""
    idx_N = topk_idx_TK.reshape(-1).contiguous()
    N, E, dev = idx_N.numel(), num_experts, idx_N.device
    block_e = triton.next_power_of_2(max(E, 1))
    # keep the [BLOCK_N, BLOCK_N] rank matrix and the [BLOCK_N, BLOCK_E] one-hot small
    block_n = max(16, min(128, 8192 // block_e))
    nb = triton.cdiv(N, block_n)
    perm_N = torch.empty(N, dtype=torch.int64, device=dev)
    inv_N = torch.empty(N, dtype=torch.int64, device=dev)
    if N == 0:
        return perm_N, inv_N, torch.zeros(E, dtype=torch.int64, device=dev)
    hist_BE = torch.empty((nb, E), dtype=torch.int32, device=dev)
    _block_hist_kernel[(nb,)](idx_N, hist_BE, N, E, BLOCK_N=block_n, BLOCK_E=block_e, num_warps=4)
    counts_E = hist_BE.sum(0, dtype=torch.int64)
    expert_start_E = torch.cumsum(counts_E, 0) - counts_E
    base_BE = (torch.cumsum(hist_BE, 0, dtype=torch.int64) - hist_BE + expert_start_E).to(torch.int64).contiguous()
    _scatter_perm_kernel[(nb,)](idx_N, base_BE, perm_N, inv_N, N, E, BLOCK_N=block_n, num_warps=4)
    return perm_N, inv_N, counts_E


def invert_perm(perm_N: torch.Tensor) -> torch.Tensor:
    """inv[perm[n]] = n."""
    N = perm_N.numel()
    inv_N = torch.empty(N, dtype=torch.int64, device=perm_N.device)
    if N:
        _invert_kernel[(triton.cdiv(N, 1024),)](perm_N.contiguous(), inv_N, N, BLOCK=1024, num_warps=4)
    return inv_N


def gather_rows(src_TD: torch.Tensor, perm_N: torch.Tensor, K: int, scale_TK: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[n] = scale[perm[n]] * src[perm[n] // K] (scale optional), fp32 math."""
    src = _contig_rows(src_TD)
    N, D = perm_N.numel(), src.shape[1]
    out_ND = torch.empty((N, D), dtype=out_dtype or src.dtype, device=src.device)
    if N and D:
        bd = _block_d(D)
        scale = scale_TK.reshape(-1).contiguous() if scale_TK is not None else perm_N
        _gather_rows_kernel[(N, triton.cdiv(D, bd))](
            src, perm_N.contiguous(), scale, out_ND, D, K, src.stride(0), out_ND.stride(0),
            HAS_SCALE=scale_TK is not None, BLOCK_D=bd, num_warps=4,
        )
    return out_ND


def combine_rows(y_ND: torch.Tensor, inv_N: torch.Tensor, T: int, K: int, w_TK: torch.Tensor | None = None,
                 out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[inv[t*K + k]] (w optional: plain sum), fp32 accumulation."""
    y = _contig_rows(y_ND)
    D = y.shape[1]
    out_TD = torch.empty((T, D), dtype=out_dtype or y.dtype, device=y.device)
    if T and D:
        bd = _block_d(D)
        w = w_TK.contiguous() if w_TK is not None else inv_N
        _combine_kernel[(T, triton.cdiv(D, bd))](
            y, inv_N.contiguous(), w, out_TD, D, K, y.stride(0), out_TD.stride(0),
            HAS_W=w_TK is not None, BLOCK_D=bd, num_warps=4,
        )
    elif T:
        out_TD.zero_()
    return out_TD


def pair_dot(g_TD: torch.Tensor, y_ND: torch.Tensor, inv_N: torch.Tensor, K: int) -> torch.Tensor:
    """out[p] = <g[p // K], y[inv[p]]> in fp32, shape [N]."""
    g, y = _contig_rows(g_TD), _contig_rows(y_ND)
    N, D = inv_N.numel(), y.shape[1]
    out_N = torch.zeros(N, dtype=torch.float32, device=y.device)
    if N and D:
        bd = min(1024, triton.next_power_of_2(D))
        _pair_dot_kernel[(N,)](g, y, inv_N.contiguous(), out_N, D, K, g.stride(0), y.stride(0), BLOCK_D=bd, num_warps=4)
    return out_N
