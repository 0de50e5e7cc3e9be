"""omniloom.kernels: Triton kernels, their PyTorch references and custom-op wrappers.

Always imported as `omniloom.kernels`; a bare `import kernels` is not this package.

    ops.py          get_ops("auto" | "reference" | "triton"): the API the model calls
    reference.py    plain PyTorch references: the CPU path and the parity ground truth
    custom_ops.py   torch.library custom ops (fake impls, autograd) over the Triton launchers
    triton_norm.py  RMSNorm, SwiGLU, RoPE kernels;  triton_ce.py  chunked linear + CE + z-loss;
    triton_moe.py   MoE counting-sort permute, gather, weighted combine
    parity.py       shared parity harness (tests, bench, GPU check)
    bench.py, cli.py  `omniloom bench kernels`;  gpu_check.py  `python -m omniloom.pretrain.bench.gpu_check`
"""

if __name__ == "kernels":  # `import kernels` from the checkout's root found this folder: kernels/bare_import.py says what now
    import importlib.util as _util
    import os as _os

    _spec = _util.spec_from_file_location("_bare", _os.path.join(_os.path.dirname(_os.path.realpath(__file__)), "bare_import.py"))
    _spec.loader.exec_module(_helper := _util.module_from_spec(_spec))
    _helper.hand_over(__name__, __file__)
