"""`omniloom export`: a training checkpoint to a self-contained safetensors folder.

    write.py  export_checkpoint, save_export (weights, config.json, tokenizer files)
    card.py   the model card (README.md)
    complete.py  whether an export folder is whole; a finished export moved into place in one step
    hf/       the Hugging Face files and the remote code generated from omniloom's own modules
    cli.py    `omniloom export`

Reading a checkpoint lives in `omniloom.pretrain.checkpoint.offline`; its names stay importable
from here. Loaded lazily.
"""

from __future__ import annotations

import importlib

_LAZY = {"export_checkpoint": "write", "save_export": "write", "ExportResult": "write", "check_export_dir": "write",
         "model_card": "card"}
_OFFLINE = ("find_tokenizer_dir", "load_checkpoint_config", "load_checkpoint_model", "portable_model_config",
            "read_checkpoint_weights", "read_dcp_state_dict", "resolve_checkpoint")
_LAZY.update({name: "omniloom.pretrain.checkpoint.offline" for name in _OFFLINE})
_LAZY.update({name: "omniloom.pretrain.checkpoint.safe_io" for name in ("SINGLE_NAME", "INDEX_NAME")})

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        module = _LAZY[name] if "." in _LAZY[name] else f"{__name__}.{_LAZY[name]}"
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
