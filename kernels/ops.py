"""The kernel API the model calls: `get_ops(mode)` picks a backend once.

    ops = get_ops("auto")          # "auto": Triton on CUDA when available, reference elsewhere
    y = ops.rms_norm(x, w, eps); ops.swiglu(g, u); ops.apply_rope(x_BSHD, cos, sin)
    q = ops.qk_norm_rope(q_BSHD, w_Dh, cos, sin, eps)   # rms_norm then apply_rope, fused on GPU
    ce_T, z_T = ops.linear_cross_entropy(h_TD, w_VD, labels_T)
    x_ND, perm_N, counts_E = ops.moe_permute(x_TD, topk_idx_TK, E); ops.moe_unpermute(y_ND, perm_N, w_TK)

The Triton backend (kernels/custom_ops.py over kernels/triton_*.py) sits behind the same names;
the model never imports Triton.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Literal

from . import reference

KernelMode = Literal["auto", "reference", "triton", "compiled"]
OP_NAMES = ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope", "linear_cross_entropy", "moe_permute", "moe_unpermute")
# What mode "compiled" puts under torch.compile: the element- and row-wise ops, where fusing the
# reference's many small passes pays. The chunked cross-entropy (an autograd.Function with a
# Python loop and a buffer pool) and the permute (a sort) stay plain PyTorch.
COMPILED_OPS = ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope", "moe_unpermute")


def triton_usable() -> tuple[bool, str]:
    """Whether the Triton backend can run here, and if not, why (for error messages)."""
    import os

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    try:
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    import torch

    if torch.cuda.is_available() or interpret:
        return True, ""
    return False, "Triton kernels need a CUDA GPU (or TRITON_INTERPRET=1 for CPU tests)"


def get_ops(mode: KernelMode = "auto", device: str | None = None) -> SimpleNamespace:
    """Return a namespace with one function per op (see OP_NAMES) for the chosen backend, and
    `name` ("triton", "auto", "reference" or "compiled").

    mode "auto": on a machine with CUDA and triton, name "auto": every call runs Triton on CUDA
    tensors and the reference on CPU tensors; elsewhere (or with a non-CUDA `device`) the plain
    reference. "reference": plain PyTorch on any device. "triton": the Triton kernels only (CPU
    tensors are refused); a ValueError when they cannot run here (no CUDA, no TRITON_INTERPRET=1).
    "compiled": the references, with COMPILED_OPS under torch.compile (fused by inductor; on CPU
    it needs a C++ compiler, and each op compiles on its first call, seconds each)."""
    if mode not in ("auto", "reference", "triton", "compiled"):
        raise ValueError(f"unknown kernels mode '{mode}'; choose auto, reference, triton or compiled")
    if mode == "compiled":
        return compiled_ops()
    if mode == "auto":
        usable, _ = triton_usable()
        import torch

        if not (usable and torch.cuda.is_available()) or (device is not None and not str(device).startswith("cuda")):
            return _reference_ops()
        # A model built with "auto" on a CUDA machine may still run on CPU (tests, CPU eval):
        # each call picks Triton for CUDA tensors and the reference otherwise, by device, not by
        # trying and failing.
        from . import custom_ops

        return SimpleNamespace(name="auto", **{n: _by_device(n, custom_ops.OPS[n], getattr(reference, n)) for n in OP_NAMES})
    if mode == "triton":
        usable, why = triton_usable()
        if not usable:
            raise ValueError(f"kernels='triton' cannot run here: {why}; use 'auto' or 'reference'")
        from . import custom_ops

        return SimpleNamespace(name="triton", **{n: custom_ops.OPS[n] for n in OP_NAMES})
    return _reference_ops()


def cpp_compiler() -> str | None:
    """The C++ compiler torch.compile's CPU backend would find on PATH (inductor honours CXX), or None."""
    import os
    import shutil

    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


_COMPILED: SimpleNamespace | None = None


def compiled_ops() -> SimpleNamespace:
    """Mode "compiled": the reference ops, COMPILED_OPS under torch.compile (built once per
    process, so every model shares the compiled code)."""
    global _COMPILED
    if _COMPILED is None:
        import torch

        if not torch.cuda.is_available() and cpp_compiler() is None:
            raise ValueError("kernels='compiled' needs a C++ compiler on CPU (torch.compile builds C++; "
                             "install g++ or set CXX), or use kernels='reference'")
        _COMPILED = SimpleNamespace(name="compiled", **{
            n: torch.compile(getattr(reference, n)) if n in COMPILED_OPS else getattr(reference, n) for n in OP_NAMES})
    return _COMPILED


def _reference_ops() -> SimpleNamespace:
    return SimpleNamespace(name="reference", **{n: getattr(reference, n) for n in OP_NAMES})


def _by_device(name: str, fast, ref):
    def op(x, *args, **kwargs):
        return (fast if x.is_cuda else ref)(x, *args, **kwargs)

    op.__name__, op.__qualname__, op.__doc__ = name, name, ref.__doc__
    return op
