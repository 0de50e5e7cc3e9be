"""Triton kernels for the row-wise and element-wise ops: RMSNorm, SwiGLU, rotary embedding, and
QK-norm fused with rotary embedding.

Imported only by `omniloom.kernels.custom_ops` (the model never imports Triton). Every launcher
takes and returns torch tensors and does no autograd; math is fp32 inside the kernels, results in
the input dtype. Shapes: M rows, D width (RMSNorm), N columns (SwiGLU), B batch, S sequence,
H heads, Dh head dim, d = Dh/2 rotary half.

TRITON_INTERPRET=1 (read when triton is first imported) runs the same kernels on CPU tensors:
that is how the parity tests run without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _num_warps(block: int) -> int:
    # one warp per 256 fp32 elements of a row, between 1 and 16
    return max(1, min(16, block // 256))


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    """[..., N] -> [M, N] with unit last stride, copying only when no such view exists."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:  # leading dims not collapsible into one row stride
        return t.contiguous().view(-1, t.shape[-1])


# ---------------------------------------------------------------------------------------- RMSNorm


@triton.jit
def _rms_norm_fwd_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, D, rows_per_prog,
    stride_dy, stride_x, stride_dx, BLOCK_D: tl.constexpr,
):
    # Each program walks a contiguous run of rows and keeps its share of dw in registers, so dw
    # needs one [programs, D] fp32 buffer instead of atomics on every row.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    row_start = pid * rows_per_prog  # int32: M < 2**31 rows
    n_rows = tl.minimum(row_start + rows_per_prog, M) - row_start
    for i in range(0, n_rows):
        r64 = row_start.to(tl.int64) + i  # int64 offsets: M * D may pass 2**31
        x = tl.load(x_ptr + r64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + r64 * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + r64)
        xhat = x * rstd
        dyw = dy * w
        # d/dx of x*rstd: rstd * (dyw - xhat * mean(dyw * xhat))
        dx = rstd * (dyw - xhat * (tl.sum(dyw * xhat, axis=0) / D))
        tl.store(dx_ptr + r64 * stride_dx + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
    tl.store(dw_part_ptr + pid * D + cols, dw, mask=mask)


def rms_norm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rsqrt(mean(x^2) + eps) * weight in fp32, y in x's dtype; also returns rstd (fp32, x.shape[:-1])."""
    D = x.shape[-1]
    x_MD = _rows_view(x)
    M = x_MD.shape[0]
    y_MD = torch.empty((M, D), dtype=x.dtype, device=x.device)
    rstd_M = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(D)
        _rms_norm_fwd_kernel[(M,)](
            x_MD, weight.contiguous(), y_MD, rstd_M, D, x_MD.stride(0), y_MD.stride(0), eps,
            BLOCK_D=block, num_warps=_num_warps(block),
        )
    return y_MD.view(x.shape), rstd_M.view(x.shape[:-1])


def _num_programs(M: int, device: torch.device) -> int:
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(M, 4 * sms))
    return max(1, min(M, 4))  # interpreter: programs run one after another, fewer is faster


def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dx in x's dtype, dweight in weight's dtype) of rms_norm_fwd."""
    D = x.shape[-1]
    x_MD, dy_MD = _rows_view(x), _rows_view(dy)
    M = x_MD.shape[0]
    dx_MD = torch.empty((M, D), dtype=x.dtype, device=x.device)
    progs = _num_programs(M, x.device)
    dw_part_PD = torch.zeros((progs, D), dtype=torch.float32, device=x.device)
    if M:
        block = triton.next_power_of_2(D)
        _rms_norm_bwd_kernel[(progs,)](
            dy_MD, x_MD, weight.contiguous(), rstd.reshape(-1).contiguous(), dx_MD, dw_part_PD,
            M, D, triton.cdiv(M, progs), dy_MD.stride(0), x_MD.stride(0), dx_MD.stride(0),
            BLOCK_D=block, num_warps=_num_warps(block),
        )
    return dx_MD.view(x.shape), dw_part_PD.sum(0).to(weight.dtype)


# ----------------------------------------------------------------------------------------- SwiGLU

SWIGLU_BLOCK = 1024


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, o_ptr, N, stride_g, stride_u, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(o_ptr + row * stride_o + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, N, stride_dy, stride_g, stride_u, stride_dg, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # silu'(g) = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    du = dy * silu
    tl.store(dg_ptr + row * stride_dg + cols, dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * stride_dg + cols, du.to(du_ptr.dtype.element_ty), mask=mask)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in fp32, gate's dtype out. Strided rows (e.g. `h.chunk(2, -1)` halves) are read in place."""
    N = gate.shape[-1]
    g_MN, u_MN = _rows_view(gate), _rows_view(up)
    M = g_MN.shape[0]
    out_MN = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    if M and N:
        block = min(SWIGLU_BLOCK, triton.next_power_of_2(N))
        _swiglu_fwd_kernel[(M, triton.cdiv(N, block))](
            g_MN, u_MN, out_MN, N, g_MN.stride(0), u_MN.stride(0), out_MN.stride(0), BLOCK=block, num_warps=4
        )
    return out_MN.view(gate.shape)


def swiglu_bwd(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) of swiglu_fwd, in the inputs' dtypes."""
    N = gate.shape[-1]
    dy_MN, g_MN, u_MN = _rows_view(dy), _rows_view(gate), _rows_view(up)
    M = g_MN.shape[0]
    dg_MN = torch.empty((M, N), dtype=gate.dtype, device=gate.device)
    du_MN = torch.empty((M, N), dtype=up.dtype, device=up.device)
    if M and N:
        block = min(SWIGLU_BLOCK, triton.next_power_of_2(N))
        _swiglu_bwd_kernel[(M, triton.cdiv(N, block))](
            dy_MN, g_MN, u_MN, dg_MN, du_MN, N, dy_MN.stride(0), g_MN.stride(0), u_MN.stride(0), dg_MN.stride(0),
            BLOCK=block, num_warps=4,
        )
    return dg_MN.view(gate.shape), du_MN.view(up.shape)


# ------------------------------------------------------------------------------------------- RoPE


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, o_ptr, S, H, d,
    sxb, sxs, sxh, scb, scs, ssb, sss, sob, sos, soh,
    SIGN: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: one token (b, s) and BLOCK_H heads; cos/sin are loaded once per token and
    # shared by every head. SIGN=-1 applies the inverse rotation (the backward pass).
    bs = tl.program_id(0).to(tl.int64)
    b = bs // S
    s = bs % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < d
    cos = tl.load(cos_ptr + b * scb + s * scs + cols, mask=cmask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + b * ssb + s * sss + cols, mask=cmask, other=0.0).to(tl.float32) * SIGN
    mask = (heads[:, None] < H) & cmask[None, :]
    xoff = x_ptr + b * sxb + s * sxs + heads[:, None] * sxh + cols[None, :]
    x1 = tl.load(xoff, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xoff + d, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    ooff = o_ptr + b * sob + s * sos + heads[:, None] * soh + cols[None, :]
    tl.store(ooff, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(ooff + d, o2.to(o_ptr.dtype.element_ty), mask=mask)


def _per_token(t: torch.Tensor, B: int, S: int, d: int) -> torch.Tensor:
    """cos/sin [B or 1, S, d] -> a [B, S, d] view with unit last stride (stride 0 over a broadcast batch)."""
    if t.dim() != 3 or t.shape[1:] != (S, d) or t.shape[0] not in (1, B):
        raise ValueError(f"rope cos/sin must be [B, S, Dh/2] = [{B}, {S}, {d}] (or [1, S, Dh/2]); got {tuple(t.shape)}")
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.expand(B, S, d)


def rope_apply(x_BSHD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Half-split rotary embedding (inverse=True rotates by -angle: the gradient w.r.t. x).
    x may be any strided view with a unit last stride (e.g. q/k sliced out of a fused projection)."""
    B, S, H, Dh = x_BSHD.shape
    if Dh % 2:
        raise ValueError(f"rope needs an even head dim, got {Dh}")
    d = Dh // 2
    cos, sin = _per_token(cos_BSd, B, S, d), _per_token(sin_BSd, B, S, d)
    x = x_BSHD if x_BSHD.stride(-1) == 1 else x_BSHD.contiguous()
    out = torch.empty((B, S, H, Dh), dtype=x.dtype, device=x.device)
    if out.numel():
        block_h = min(16, triton.next_power_of_2(H))
        block_d = triton.next_power_of_2(d)
        _rope_kernel[(B * S, triton.cdiv(H, block_h))](
            x, cos, sin, out, S, H, d,
            x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            out.stride(0), out.stride(1), out.stride(2),
            SIGN=-1.0 if inverse else 1.0, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
        )
    return out


# ---------------------------------------------------------------------------- QK-norm + RoPE, fused


@triton.jit
def _qk_norm_rope_fwd_kernel(
    x_ptr, w_ptr, cos_ptr, sin_ptr, o_ptr, rstd_ptr, S, H, d, eps,
    sxb, sxs, sxh, scb, scs, ssb, sss,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program: one token (b, s) and BLOCK_H heads. Each head's row of Dh = 2d is normalised
    # (RMSNorm over Dh, per-channel weight) and rotated by the token's angles in registers: one
    # read of x and one write of the output, where QK-norm then RoPE read and write twice.
    bs = tl.program_id(0).to(tl.int64)
    b = bs // S
    s = bs % S
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < d
    hmask = heads < H
    mask = hmask[:, None] & cmask[None, :]
    xoff = x_ptr + b * sxb + s * sxs + heads[:, None] * sxh + cols[None, :]
    x1 = tl.load(xoff, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xoff + d, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * d) + eps)  # [BLOCK_H]
    w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + d + cols, mask=cmask, other=0.0).to(tl.float32)
    y1 = x1 * rstd[:, None] * w1[None, :]
    y2 = x2 * rstd[:, None] * w2[None, :]
    cos = tl.load(cos_ptr + b * scb + s * scs + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + b * ssb + s * sss + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    ooff = o_ptr + bs * H * 2 * d + heads[:, None] * 2 * d + cols[None, :]  # output [B, S, H, Dh] contiguous
    tl.store(ooff, (y1 * cos - y2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(ooff + d, (y2 * cos + y1 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + bs * H + heads, rstd, mask=hmask)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, cos_ptr, sin_ptr, rstd_ptr, dx_ptr, dw_part_ptr, M, S, H, d, tokens_per_prog,
    sdb, sds, sdh, sxb, sxs, sxh, scb, scs, ssb, sss,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # Each program walks a contiguous run of tokens, every head of each at once, and keeps its
    # share of the weight's gradient in registers (one [programs, Dh] fp32 buffer, no atomics).
    # The rotation is orthogonal: its gradient is the opposite rotation, undone first; then the
    # RMSNorm backward per head row.
    pid = tl.program_id(0)
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < d
    mask = (heads[:, None] < H) & cmask[None, :]
    w1 = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w_ptr + d + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    dw1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    start = pid * tokens_per_prog  # int32: fewer than 2**31 tokens
    n = tl.minimum(start + tokens_per_prog, M) - start
    for i in range(0, n):
        t = start.to(tl.int64) + i
        b = t // S
        s = t % S
        cos = tl.load(cos_ptr + b * scb + s * scs + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + b * ssb + s * sss + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        doff = dy_ptr + b * sdb + s * sds + heads[:, None] * sdh + cols[None, :]
        do1 = tl.load(doff, mask=mask, other=0.0).to(tl.float32)
        do2 = tl.load(doff + d, mask=mask, other=0.0).to(tl.float32)
        g1 = do1 * cos + do2 * sin  # gradient w.r.t. the normalised row (inverse rotation)
        g2 = do2 * cos - do1 * sin
        xoff = x_ptr + b * sxb + s * sxs + heads[:, None] * sxh + cols[None, :]
        rstd = tl.load(rstd_ptr + t * H + heads, mask=heads < H, other=0.0)[:, None]
        xh1 = tl.load(xoff, mask=mask, other=0.0).to(tl.float32) * rstd
        xh2 = tl.load(xoff + d, mask=mask, other=0.0).to(tl.float32) * rstd
        gw1 = g1 * w1
        gw2 = g2 * w2
        mean = (tl.sum(gw1 * xh1, axis=1) + tl.sum(gw2 * xh2, axis=1))[:, None] / (2 * d)
        dxoff = dx_ptr + t * H * 2 * d + heads[:, None] * 2 * d + cols[None, :]  # dx [B, S, H, Dh] contiguous
        tl.store(dxoff, (rstd * (gw1 - xh1 * mean)).to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dxoff + d, (rstd * (gw2 - xh2 * mean)).to(dx_ptr.dtype.element_ty), mask=mask)
        dw1 += tl.sum(g1 * xh1, axis=0)
        dw2 += tl.sum(g2 * xh2, axis=0)
    tl.store(dw_part_ptr + pid * 2 * d + cols, dw1, mask=cmask)
    tl.store(dw_part_ptr + pid * 2 * d + d + cols, dw2, mask=cmask)


def _qk_shapes(x_BSHD: torch.Tensor, weight: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor):
    B, S, H, Dh = x_BSHD.shape
    if Dh % 2:
        raise ValueError(f"qk_norm_rope needs an even head dim, got {Dh}")
    if weight.shape != (Dh,):
        raise ValueError(f"qk_norm_rope weight must be [{Dh}] (the head dim), got {tuple(weight.shape)}")
    d = Dh // 2
    return B, S, H, d, _per_token(cos_BSd, B, S, d), _per_token(sin_BSd, B, S, d)


def qk_norm_rope_fwd(x_BSHD: torch.Tensor, weight: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rope(rms_norm(x, weight, eps), cos, sin) in one pass, fp32 math, output in x's dtype
    ([B, S, H, Dh] contiguous); also rstd [B, S, H] fp32. x may be a strided view with a unit
    last stride (q or k sliced out of a fused projection)."""
    B, S, H, d, cos, sin = _qk_shapes(x_BSHD, weight, cos_BSd, sin_BSd)
    x = x_BSHD if x_BSHD.stride(-1) == 1 else x_BSHD.contiguous()
    out = torch.empty((B, S, H, 2 * d), dtype=x.dtype, device=x.device)
    rstd = torch.empty((B, S, H), dtype=torch.float32, device=x.device)
    if out.numel():
        block_h = min(16, triton.next_power_of_2(H))
        _qk_norm_rope_fwd_kernel[(B * S, triton.cdiv(H, block_h))](
            x, weight.contiguous(), cos, sin, out, rstd, S, H, d, eps,
            x.stride(0), x.stride(1), x.stride(2), cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            BLOCK_H=block_h, BLOCK_D=triton.next_power_of_2(d), num_warps=4,
        )
    return out, rstd


def qk_norm_rope_bwd(dy: torch.Tensor, x_BSHD: torch.Tensor, weight: torch.Tensor, cos_BSd: torch.Tensor,
                     sin_BSd: torch.Tensor, rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dx [B, S, H, Dh] in x's dtype, dweight in weight's dtype) of qk_norm_rope_fwd."""
    B, S, H, d, cos, sin = _qk_shapes(x_BSHD, weight, cos_BSd, sin_BSd)
    x = x_BSHD if x_BSHD.stride(-1) == 1 else x_BSHD.contiguous()
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    M = B * S
    dx = torch.empty((B, S, H, 2 * d), dtype=x.dtype, device=x.device)
    progs = _num_programs(M, x.device)
    dw_part = torch.zeros((progs, 2 * d), dtype=torch.float32, device=x.device)
    if dx.numel():
        _qk_norm_rope_bwd_kernel[(progs,)](
            dy, x, weight.contiguous(), cos, sin, rstd.contiguous(), dx, dw_part, M, S, H, d, triton.cdiv(M, progs),
            dy.stride(0), dy.stride(1), dy.stride(2), x.stride(0), x.stride(1), x.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(d), num_warps=4,
        )
    return dx, dw_part.sum(0).to(weight.dtype)
