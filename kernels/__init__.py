"""omniloom.kernels: Triton kernels, their PyTorch references and custom-op wrappers.

Always imported as `omniloom.kernels`; a bare `import kernels` is not this package.

    ops.py          get_ops("auto" | "reference" | "triton"): the API the model calls
    reference.py    plain PyTorch references: the CPU path and the parity ground truth
    custom_ops.py   torch.library custom ops (fake impls, autograd) over the Triton launchers
    triton_norm.py  RMSNorm, SwiGLU, RoPE kernels;  triton_ce.py  chunked linear + CE + z-loss;
    triton_moe.py   MoE counting-sort permute, gather, weighted combine
    parity.py       shared parity harness (tests, bench, GPU check)
    bench.py, cli.py  `omniloom bench kernels`;  gpu_check.py  `python -m omniloom.kernels.gpu_check`
"""

if __name__ == "kernels":  # `import kernels` from the checkout's root found this folder, not the real package
    # Hand the name over to the installed package of that name (what the importer meant), looking
    # past the checkout's root, so `python` started in the checkout can still use it (transformers
    # imports Hugging Face's `tokenizers`). omniloom itself is always `omniloom.kernels`.
    import importlib.machinery as _machinery
    import importlib.util as _util
    import os as _os
    import sys as _sys

    _root = _os.path.dirname(_os.path.dirname(_os.path.realpath(__file__)))
    _path = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _root]
    _spec = _machinery.PathFinder.find_spec(__name__, _path)
    if _spec is None:
        del _sys.modules[__name__]
        raise ModuleNotFoundError(f"No module named {__name__!r}: the {__name__}/ folder of the omniloom checkout "
                                  f"at {_root} is omniloom.{__name__}, not that package", name=__name__)
    _real = _util.module_from_spec(_spec)
    _sys.modules[__name__] = _real
    try:
        _spec.loader.exec_module(_real)
    except BaseException:
        del _sys.modules[__name__]
        raise
