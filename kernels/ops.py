"""The kernel API the model calls: `get_ops(mode)` picks a backend once (DESIGN 3.3).

    ops = get_ops("auto")          # "auto": Triton on CUDA when available, reference elsewhere
    y = ops.rms_norm(x, w, eps); ops.swiglu(g, u); ops.apply_rope(x_BSHD, cos, sin)
    ce_T, z_T = ops.linear_cross_entropy(h_TD, w_VD, labels_T)
    x_ND, perm_N, counts_E = ops.moe_permute(x_TD, topk_idx_TK, E); ops.moe_unpermute(y_ND, perm_N, w_TK)

The kernels issue adds the Triton backend behind the same names; the model never imports Triton.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

from . import reference

KernelMode = Literal["auto", "reference", "triton"]
OP_NAMES = ("rms_norm", "swiglu", "apply_rope", "linear_cross_entropy", "moe_permute", "moe_unpermute")


def get_ops(mode: KernelMode = "auto", device: str | None = None) -> SimpleNamespace:
    """Return a namespace with one function per op for the chosen backend."""
    if mode not in ("auto", "reference", "triton"):
        raise ValueError(f"unknown kernels mode '{mode}'; choose auto, reference or triton")
    if mode == "triton":
        raise ValueError("kernels='triton' is not available in this build; use 'auto' or 'reference'")
    return SimpleNamespace(name="reference", **{n: getattr(reference, n) for n in OP_NAMES})
