"""`torch.library.custom_op` wrappers around the Triton kernels: fake (meta) implementations for
torch.compile, autograd through `register_autograd`, and the public functions of the "triton"
backend with exactly the signatures of `omniloom.kernels.reference`.

Every op is registered as `omniloom::NAME` (callable as `torch.ops.omniloom.NAME`). Forward ops
return the tensors their backward needs (rstd, lse, inverse permutation) as extra outputs; the
public functions drop them. float64 inputs (parity checks only) go to the reference, since the
kernels compute in fp32.

Shapes: T tokens, D width, V vocab, E experts, K experts per token, N = T*K routed rows,
B batch, S sequence, H heads, Dh head dim, d = Dh/2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import reference
from . import triton_ce as tce
from . import triton_moe as tmoe
from . import triton_norm as tnorm

LIB = "omniloom"


def _check_device(*ts: Tensor) -> None:
    # Triton launches need CUDA tensors, or CPU tensors under the interpreter (tests).
    for t in ts:
        if t.device.type != "cuda" and not tnorm.INTERPRET:
            raise ValueError(
                f"kernels='triton' got a {t.device.type} tensor; Triton kernels need CUDA tensors "
                "(use kernels='auto' or 'reference' for CPU)"
            )


# --------------------------------------------------------------------------------------- RMSNorm


@torch.library.custom_op(f"{LIB}::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return tnorm.rms_norm_fwd(x, weight, eps)


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return tnorm.rms_norm_bwd(dy, x, weight, rstd)


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = torch.ops.omniloom.rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


def rms_norm(x: Tensor, weight: Tensor, eps: float = 1e-6) -> Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype."""
    if x.dtype == torch.float64:
        return reference.rms_norm(x, weight, eps)
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm weight must be [{x.shape[-1]}], got {tuple(weight.shape)}")
    _check_device(x, weight)
    return torch.ops.omniloom.rms_norm_fwd(x, weight, float(eps))[0]


# ---------------------------------------------------------------------------------------- SwiGLU


@torch.library.custom_op(f"{LIB}::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: Tensor, up: Tensor) -> Tensor:
    return tnorm.swiglu_fwd(gate, up)


@swiglu_fwd.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op(f"{LIB}::swiglu_bwd", mutates_args=())
def swiglu_bwd(dy: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return tnorm.swiglu_bwd(dy, gate, up)


@swiglu_bwd.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return torch.ops.omniloom.swiglu_bwd(dy, gate, up)


swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up (fp32 math, gate's dtype out). gate and up must have one shape and dtype."""
    if gate.dtype == torch.float64:
        return reference.swiglu(gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(
            f"swiglu needs gate and up of one shape and dtype, got {tuple(gate.shape)} {gate.dtype} "
            f"and {tuple(up.shape)} {up.dtype}"
        )
    _check_device(gate, up)
    return torch.ops.omniloom.swiglu_fwd(gate, up)


# ------------------------------------------------------------------------------------------ RoPE


@torch.library.custom_op(f"{LIB}::rope", mutates_args=())
def rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return tnorm.rope_apply(x, cos, sin, inverse)


@rope.register_fake
def _(x, cos, sin, inverse):
    return x.new_empty(x.shape)


def _rope_setup(ctx, inputs, output):
    x, cos, sin, inverse = inputs
    ctx.inverse = inverse
    ctx.save_for_backward(x, cos, sin)


def _rope_backward(ctx, dy):
    x, cos, sin = ctx.saved_tensors
    # the rotation is orthogonal: the gradient is the opposite rotation of dy
    dx = torch.ops.omniloom.rope(dy, cos, sin, not ctx.inverse) if ctx.needs_input_grad[0] else None
    dcos = dsin = None
    if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
        # cos/sin normally come from positions and need no gradient; computed in torch when asked
        d = x.shape[-1] // 2
        x1, x2 = x[..., :d].float(), x[..., d:].float()
        g1, g2 = dy[..., :d].float(), dy[..., d:].float()
        sign = -1.0 if ctx.inverse else 1.0
        dcos = (g1 * x1 + g2 * x2).sum(2)
        dsin = sign * (g2 * x1 - g1 * x2).sum(2)
        dcos = dcos.sum_to_size(cos.shape).to(cos.dtype)
        dsin = dsin.sum_to_size(sin.shape).to(sin.dtype)
    return dx, dcos, dsin, None


rope.register_autograd(_rope_backward, setup_context=_rope_setup)


def apply_rope(x_BSHD: Tensor, cos_BSd: Tensor, sin_BSd: Tensor) -> Tensor:
    """Half-split rotary embedding: out[..., :d] = x1*cos - x2*sin; out[..., d:] = x2*cos + x1*sin,
    cos/sin [B, S, Dh/2] per token (or [1, S, Dh/2]), broadcast over heads."""
    if x_BSHD.dtype == torch.float64:
        return reference.apply_rope(x_BSHD, cos_BSd, sin_BSd)
    if x_BSHD.dim() != 4:
        raise ValueError(f"apply_rope expects x as [B, S, H, Dh], got {tuple(x_BSHD.shape)}")
    _check_device(x_BSHD, cos_BSd, sin_BSd)
    return torch.ops.omniloom.rope(x_BSHD, cos_BSd, sin_BSd, False)


# -------------------------------------------------------------------------- QK-norm + RoPE, fused


@torch.library.custom_op(f"{LIB}::qk_norm_rope_fwd", mutates_args=())
def qk_norm_rope_fwd(x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return tnorm.qk_norm_rope_fwd(x, weight, cos, sin, eps)


@qk_norm_rope_fwd.register_fake
def _(x, weight, cos, sin, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::qk_norm_rope_bwd", mutates_args=())
def qk_norm_rope_bwd(dy: Tensor, x: Tensor, weight: Tensor, cos: Tensor, sin: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return tnorm.qk_norm_rope_bwd(dy, x, weight, cos, sin, rstd)


@qk_norm_rope_bwd.register_fake
def _(dy, x, weight, cos, sin, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _qk_setup(ctx, inputs, output):
    x, weight, cos, sin, _ = inputs
    ctx.save_for_backward(x, weight, cos, sin, output[1])


def _qk_backward(ctx, dy, _drstd):
    x, weight, cos, sin, rstd = ctx.saved_tensors
    dx, dw = torch.ops.omniloom.qk_norm_rope_bwd(dy, x, weight, cos, sin, rstd)
    return dx, dw, None, None, None


qk_norm_rope_fwd.register_autograd(_qk_backward, setup_context=_qk_setup)


def qk_norm_rope(x_BSHD: Tensor, weight: Tensor, cos_BSd: Tensor, sin_BSd: Tensor, eps: float = 1e-6) -> Tensor:
    """apply_rope(rms_norm(x, weight, eps), cos, sin) in one kernel: x [B, S, H, Dh] (a strided
    view is fine), weight [Dh], cos/sin [B, S, Dh/2] (or [1, S, Dh/2]); fp32 math, x's dtype out."""
    if x_BSHD.dtype == torch.float64:
        return reference.qk_norm_rope(x_BSHD, weight, cos_BSd, sin_BSd, eps)
    if x_BSHD.dim() != 4:
        raise ValueError(f"qk_norm_rope expects x as [B, S, H, Dh], got {tuple(x_BSHD.shape)}")
    if cos_BSd.requires_grad or sin_BSd.requires_grad:
        # angles normally come from positions and need no gradient; the two ops give one when asked
        return apply_rope(rms_norm(x_BSHD, weight, eps), cos_BSd, sin_BSd)
    _check_device(x_BSHD, weight, cos_BSd, sin_BSd)
    return torch.ops.omniloom.qk_norm_rope_fwd(x_BSHD, weight, cos_BSd, sin_BSd, float(eps))[0]


# -------------------------------------------------------------------------- linear cross-entropy


@torch.library.custom_op(f"{LIB}::linear_ce_fwd", mutates_args=())
def linear_ce_fwd(h: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, chunk_size: int) -> tuple[Tensor, Tensor, Tensor]:
    return tce.linear_ce_fwd(h, weight, labels, ignore_index, chunk_size)


@linear_ce_fwd.register_fake
def _(h, weight, labels, ignore_index, chunk_size):
    T = h.shape[0]
    return tuple(h.new_empty((T,), dtype=torch.float32) for _ in range(3))


@torch.library.custom_op(f"{LIB}::linear_ce_bwd", mutates_args=())
def linear_ce_bwd(
    grad_ce: Tensor, grad_z: Tensor, h: Tensor, weight: Tensor, labels: Tensor, lse: Tensor,
    ignore_index: int, chunk_size: int, need_h: bool, need_w: bool,
) -> tuple[Tensor, Tensor]:
    return tce.linear_ce_bwd(grad_ce, grad_z, h, weight, labels, lse, ignore_index, chunk_size, need_h, need_w)


@linear_ce_bwd.register_fake
def _(grad_ce, grad_z, h, weight, labels, lse, ignore_index, chunk_size, need_h, need_w):
    return (h.new_empty(h.shape) if need_h else h.new_empty(0), weight.new_empty(weight.shape) if need_w else weight.new_empty(0))


def _ce_setup(ctx, inputs, output):
    h, weight, labels, ignore_index, chunk_size = inputs
    ctx.ignore_index, ctx.chunk_size = ignore_index, chunk_size
    ctx.save_for_backward(h, weight, labels, output[2])


def _ce_backward(ctx, grad_ce, grad_z, _grad_lse):
    h, weight, labels, lse = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    # an output that did not reach the loss arrives as None: it contributes nothing
    grad_ce = torch.zeros_like(lse) if grad_ce is None else grad_ce
    grad_z = torch.zeros_like(lse) if grad_z is None else grad_z
    with torch.autocast(h.device.type, enabled=False):  # backward() may run inside an autocast region
        gh, gw = torch.ops.omniloom.linear_ce_bwd(
            grad_ce, grad_z, h, weight, labels, lse, ctx.ignore_index, ctx.chunk_size, need_h, need_w
        )
    return (gh if need_h else None), (gw if need_w else None), None, None, None


linear_ce_fwd.register_autograd(_ce_backward, setup_context=_ce_setup)


def linear_cross_entropy(
    h_TD: Tensor, weight_VD: Tensor, labels_T: Tensor, *, ignore_index: int = -100, chunk_size: int = 4096
) -> tuple[Tensor, Tensor]:
    """Per-token cross-entropy and z (= logsumexp^2) of `h @ weight.T` (GEMM in the compute dtype,
    lse/ce/z in fp32), both 0 where
    labels == ignore_index; chunked over tokens in forward and backward so the [T, V] logits are
    never held whole."""
    if h_TD.dtype == torch.float64:
        return reference.linear_cross_entropy(h_TD, weight_VD, labels_T, ignore_index=ignore_index, chunk_size=chunk_size)
    if h_TD.dim() != 2 or weight_VD.dim() != 2 or h_TD.shape[1] != weight_VD.shape[1] or labels_T.shape != h_TD.shape[:1]:
        raise ValueError(
            f"linear_cross_entropy expects h [T, D], weight [V, D], labels [T]; got {tuple(h_TD.shape)}, "
            f"{tuple(weight_VD.shape)}, {tuple(labels_T.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_device(h_TD, weight_VD, labels_T)
    # the GEMMs run in the autocast dtype (bf16 on GPU); lse, ce and z stay fp32 (reference.head_dtype)
    dt = reference.head_dtype(h_TD, weight_VD)
    with torch.autocast(h_TD.device.type, enabled=False):
        ce, z, _ = torch.ops.omniloom.linear_ce_fwd(h_TD.to(dt), weight_VD.to(dt), labels_T, int(ignore_index), int(chunk_size))
    return ce, z


# --------------------------------------------------------------------------------- MoE permute


@torch.library.custom_op(f"{LIB}::moe_permute", mutates_args=())
def moe_permute_op(x: Tensor, topk_idx: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    perm, inv, counts = tmoe.sort_pairs(topk_idx, num_experts)
    return tmoe.gather_rows(x, perm, topk_idx.shape[1]), perm, counts, inv


@moe_permute_op.register_fake
def _(x, topk_idx, num_experts):
    N = topk_idx.numel()
    i64 = dict(dtype=torch.int64)
    return x.new_empty((N, x.shape[1])), x.new_empty((N,), **i64), x.new_empty((num_experts,), **i64), x.new_empty((N,), **i64)


@torch.library.custom_op(f"{LIB}::moe_combine", mutates_args=())
def moe_combine(y: Tensor, inv: Tensor, weights: Tensor, num_tokens: int, use_weights: bool) -> Tensor:
    """out[t] = sum_k w[t, k] * y[inv[t*K + k]] (plain sum when use_weights is False)."""
    K = inv.numel() // max(num_tokens, 1)
    return tmoe.combine_rows(y, inv, num_tokens, K, weights if use_weights else None)


@moe_combine.register_fake
def _(y, inv, weights, num_tokens, use_weights):
    return y.new_empty((num_tokens, y.shape[1]))


def _permute_setup(ctx, inputs, output):
    x, topk_idx, _ = inputs
    ctx.T, ctx.x_dtype = x.shape[0], x.dtype
    ctx.save_for_backward(output[3])


def _permute_backward(ctx, grad_x_ND, _gp, _gc, _gi):
    (inv,) = ctx.saved_tensors
    # every token row was copied to its K routed rows: its gradient is their sum
    gx = torch.ops.omniloom.moe_combine(grad_x_ND.contiguous(), inv, inv.new_empty(0, dtype=ctx.x_dtype), ctx.T, False)
    return gx, None, None


moe_permute_op.register_autograd(_permute_backward, setup_context=_permute_setup)


@torch.library.custom_op(f"{LIB}::moe_unpermute", mutates_args=())
def moe_unpermute_op(y: Tensor, perm: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    inv = tmoe.invert_perm(perm)
    T, K = weights.shape
    return tmoe.combine_rows(y, inv, T, K, weights), inv


@moe_unpermute_op.register_fake
def _(y, perm, weights):
    return y.new_empty((weights.shape[0], y.shape[1])), perm.new_empty(perm.shape)


@torch.library.custom_op(f"{LIB}::moe_unpermute_bwd", mutates_args=())
def moe_unpermute_bwd(grad_out: Tensor, y: Tensor, perm: Tensor, inv: Tensor, weights: Tensor) -> tuple[Tensor, Tensor]:
    K = weights.shape[1]
    # d y[row of (t, k)] = w[t, k] * g[t]; d w[t, k] = <g[t], y[row of (t, k)]>
    grad_y = tmoe.gather_rows(grad_out, perm, K, weights, out_dtype=y.dtype)
    grad_w = tmoe.pair_dot(grad_out, y, inv, K).view(weights.shape).to(weights.dtype)
    return grad_y, grad_w


@moe_unpermute_bwd.register_fake
def _(grad_out, y, perm, inv, weights):
    return y.new_empty(y.shape), weights.new_empty(weights.shape)


def _unpermute_setup(ctx, inputs, output):
    y, perm, weights = inputs
    ctx.save_for_backward(y, perm, output[1], weights)


def _unpermute_backward(ctx, grad_out, _ginv):
    y, perm, inv, weights = ctx.saved_tensors
    gy, gw = torch.ops.omniloom.moe_unpermute_bwd(grad_out.contiguous(), y, perm, inv, weights)
    return gy, None, gw


moe_unpermute_op.register_autograd(_unpermute_backward, setup_context=_unpermute_setup)


def moe_permute(x_TD: Tensor, topk_idx_TK: Tensor, num_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the T*K (token, expert) pairs by expert, stably. Returns (x_ND rows gathered in expert
    order, perm_N indices into the flattened T*K pairs, counts_E tokens per expert as int64)."""
    if x_TD.dtype == torch.float64:
        return reference.moe_permute(x_TD, topk_idx_TK, num_experts)
    if x_TD.dim() != 2 or topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"moe_permute expects x [T, D] and topk_idx [T, K]; got {tuple(x_TD.shape)}, {tuple(topk_idx_TK.shape)}")
    _check_device(x_TD, topk_idx_TK)
    x_ND, perm_N, counts_E, _ = torch.ops.omniloom.moe_permute(x_TD, topk_idx_TK, int(num_experts))
    return x_ND, perm_N, counts_E


def moe_unpermute(y_ND: Tensor, perm_N: Tensor, weights_TK: Tensor) -> Tensor:
    """Inverse of moe_permute, weighted: out[t] = sum_k weights[t, k] * y[row of pair (t, k)]."""
    if y_ND.dtype == torch.float64:
        return reference.moe_unpermute(y_ND, perm_N, weights_TK)
    if weights_TK.dim() != 2 or perm_N.numel() != weights_TK.numel() or y_ND.shape[0] != perm_N.numel():
        raise ValueError(
            f"moe_unpermute expects y [N, D], perm [N], weights [T, K] with N = T*K; got {tuple(y_ND.shape)}, "
            f"{tuple(perm_N.shape)}, {tuple(weights_TK.shape)}"
        )
    _check_device(y_ND, perm_N, weights_TK)
    return torch.ops.omniloom.moe_unpermute(y_ND, perm_N, weights_TK)[0]


OPS = {
    "rms_norm": rms_norm,
    "swiglu": swiglu,
    "apply_rope": apply_rope,
    "qk_norm_rope": qk_norm_rope,
    "linear_cross_entropy": linear_cross_entropy,
    "moe_permute": moe_permute,
    "moe_unpermute": moe_unpermute,
}
