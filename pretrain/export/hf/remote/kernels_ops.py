"""omniloom's kernel API (omniloom/kernels/ops.py) in a Hugging Face export: every mode gives the
plain PyTorch reference ops of kernels_reference.py (a copy of omniloom/kernels/reference.py).
The Triton kernels stay out of the export (they would make triton a requirement); the results
agree with them within the tolerances omniloom's kernel parity tests hold."""

from __future__ import annotations

from types import SimpleNamespace

from . import kernels_reference as reference
from .kernels_reference import __name__ as _hf_copies_kernels_reference  # noqa: F401

# the op names of omniloom.kernels.ops.OP_NAMES (tests/pretrain/test_hf_export.py keeps the two equal)
OP_NAMES = ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope", "linear_cross_entropy", "moe_permute", "moe_unpermute")


def get_ops(mode: str = "auto", device: str | None = None) -> SimpleNamespace:
    """The reference ops, whatever `mode` the model's config records."""
    return SimpleNamespace(name="reference", **{n: getattr(reference, n) for n in OP_NAMES})
