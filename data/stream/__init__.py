"""The data stream: shards -> tokenized documents -> packed PackedBatch rows, resumable per rank
and worker.

    reader.py       samples read from shards by manifest offset, untrusted (skips counted by reason)
    loader.py       StreamLoader, build_loader, DocumentTokenizer
    worker.py       WorkerStream (one reader slot's pipeline), StreamDataset, the workers' signal guard
    cursor.py, elastic.py, state_check.py   the exact and elastic resume state
    doc_cache.py    tokenized documents kept per loader worker
    stream_bench.py `omniloom bench data stream`

Imports the data root (batch, packing, manifest, config), never data.prep. Loaded lazily.
"""

from __future__ import annotations

import importlib

_LAZY = {"build_loader": "loader", "StreamLoader": "loader", "StreamDataset": "worker", "WorkerStream": "worker",
         "StreamDataError": "worker"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
