"""Hands a bare `import kernels` / `import tokenizers` over to the installed package of that name.

`kernels` and `tokenizers` are also PyPI packages (transformers imports Hugging Face's
`tokenizers`, and looks for PyPI's `kernels`). Python started in the checkout's root finds this
repository's folder of that name first; its `__init__` then calls `hand_over`, which loads the
real package from the rest of sys.path in its place. omniloom itself is always imported as
`omniloom.kernels` / `omniloom.tokenizers`, so this runs only for that mistaken import.

The one copy of this code: both `__init__` files load it by its path (not as an omniloom import,
since the bare folder is not omniloom), so tokenizers/ still imports nothing of another room.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, init_file: str) -> None:
    """Replace `sys.modules[name]` (the checkout's folder, mid-import) by the package of that name
    found on sys.path past the checkout's root, or raise ModuleNotFoundError naming the mix-up."""
    root = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None:
        del sys.modules[name]
        raise ModuleNotFoundError(f"No module named {name!r}: the {name}/ folder of the omniloom checkout "
                                  f"at {root} is omniloom.{name}, not that package", name=name)
    real = importlib.util.module_from_spec(spec)
    sys.modules[name] = real
    try:
        spec.loader.exec_module(real)
    except BaseException:
        del sys.modules[name]
        raise
