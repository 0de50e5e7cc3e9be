"""The trainer: the only room that builds an Accelerator.

    python -m omniloom.pretrain.train --config tiny ...          (__main__.py -> main.py)
    accelerate launch -m omniloom.pretrain.train --config ...

    main.py        entry point: argparse, the run, failures in one line;  args.py  the shared flags
    loop.py        Trainer (the loop, top to bottom), run(), make_accelerator
    build.py       the seams to model / data / tokenizers;  optim.py  parallel.py  expert_parallel.py
    guards.py      non-finite and spike guards;  metrics.py  window.py (a logging window's metrics)
    preflight.py   resume_batch.py  trackers.py  adapter.py
    init_from.py   start from an export's weights;  runlock.py  one run per run folder
    cli.py         `omniloom train`

Loaded lazily, so that `omniloom --help` does not import torch.
"""

from __future__ import annotations

import importlib

_LAZY = {"Trainer": "loop", "TrainResult": "loop", "run": "loop", "make_accelerator": "loop",
         "main": "main", "build_arg_parser": "main"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
