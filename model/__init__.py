"""omniloom.model: config, embeddings, attention (masks + backends), MoE, the decoder.

    from omniloom.model import OmniModel, ModelConfig
    out = OmniModel(cfg)(input_ids, labels, positions, doc_ids, block_ids, modality, patches, patch_kind)

Heavy modules (torch) load on first attribute access, so importing the config stays cheap.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "OmniModel": "decoder",
    "ModelOutput": "decoder",
    "ModelConfig": "config",
    "AttentionConfig": "config",
    "MoEConfig": "config",
    "num_params": "accounting",
    "num_active_params": "accounting",
    "flops_per_token": "accounting",
    "load_pretrained": "pretrained",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
