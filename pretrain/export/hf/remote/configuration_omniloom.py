"""The Hugging Face config of an omniloom export (written by `omniloom export`).

config.json is omniloom's own export config (`format`, `model`, `tokenizer`, ...) with the keys
Hugging Face needs added (`model_type`, `architectures`, `auto_map`, special token ids). The
model's settings stay in one place, the `model` object, read by omniloom's own reader
(model_pretrained.model_config_from_dict: every ModelConfig field, nested attention and moe
configs included), so a field omniloom adds later needs nothing here. A folder saved with
`save_pretrained` keeps these keys, so omniloom (`load_pretrained`, `train.init_from`) reads it too.
"""

from __future__ import annotations

import dataclasses

try:  # transformers >= 5 spells it PreTrainedConfig; 4.x PretrainedConfig
    from transformers import PreTrainedConfig as _BaseConfig
except ImportError:
    from transformers import PretrainedConfig as _BaseConfig

from .model_pretrained import model_config_from_dict

# backends that need more than torch (flash: flash-attn) or a GPU compiler setup (flex): the
# export runs their models with blocksparse, the same mask rule, as omniloom's load_pretrained
# does on a machine without CUDA
PORTABLE_BACKENDS = ("sdpa", "blocksparse")


class OmniloomConfig(_BaseConfig):
    model_type = "omniloom"

    def __init__(self, model: dict | None = None, tokenizer: dict | None = None, attention_backend: str | None = None,
                 **kwargs):
        """`model`: omniloom's ModelConfig as JSON; `tokenizer`: the export's tokenizer facts
        (special ids, media settings); `attention_backend`: run the attention with this omniloom
        backend instead (sdpa, blocksparse), e.g. `from_pretrained(DIR, attention_backend="sdpa")`."""
        self.model = dict(model or {})
        self.tokenizer = dict(tokenizer or {})
        self.attention_backend = attention_backend
        specials = self.tokenizer.get("special_ids") or {}
        for name in ("bos", "eos", "pad"):
            if specials.get(name) is not None:
                kwargs.setdefault(f"{name}_token_id", specials[name])
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def omniloom_model_config(self):
        """The omniloom ModelConfig this model is built from (its backend made portable)."""
        cfg = model_config_from_dict(self.model)
        backend = self.attention_backend or cfg.attention.backend
        if backend not in PORTABLE_BACKENDS:
            backend = "blocksparse"
        return dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend=backend))

    # the names tools look for (PEFT, lm-evaluation-harness, DeepSpeed), read from `model`
    @property
    def vocab_size(self) -> int:
        return int(self.model.get("vocab_size", 0))

    @property
    def hidden_size(self) -> int:
        return int(self.model.get("dim", 0))

    @property
    def num_hidden_layers(self) -> int:
        return int(self.model.get("num_layers", 0))

    @property
    def num_attention_heads(self) -> int:
        return int(self.model.get("num_heads", 0))

    @property
    def num_key_value_heads(self) -> int:
        return int(self.model.get("num_kv_heads", 0))

    @property
    def max_position_embeddings(self) -> int:
        """The training sequence length (RoPE sets no hard limit); 2048 when not recorded."""
        return int((getattr(self, "source", None) or {}).get("seq_len") or 2048)
