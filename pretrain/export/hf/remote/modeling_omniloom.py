"""Hugging Face wrapper of an omniloom model (written by `omniloom export`; docs/huggingface.md).

The model is omniloom's own code: model_*.py, kernels_*.py and tokenizers_layout.py are copies of
omniloom's modules made at export time. This file only adapts them to Hugging Face's API:

- `OmniloomForCausalLM` is an `OmniModel` (built by OmniModel's own constructor), so its weights
  have exactly the names of the export's safetensors and of omniloom checkpoints;
- `forward` takes Hugging Face's inputs (input_ids, attention_mask, labels shifted inside) plus
  omniloom's layout tensors (positions, doc_ids, block_ids, modality, patches, patch_kind: what
  the processor builds) and returns omniloom's logits and loss (cross-entropy + z-loss + the
  MoE and indexer terms, exactly what training minimises);
- `generate()` runs on `OmniloomCache`, which holds omniloom's CachedDecoder (model_kv_cache.py):
  each layer kind keeps its own rule (L: the window, G: all keys, B: the block choice), so greedy
  output equals `omniloom generate` token for token.

Padding: rows may be padded on either side (attention_mask 0). Each row is moved so its tokens
start at column 0, the padding becomes a document of its own (attention never crosses
documents), and outputs go back to the caller's columns: a padded row computes what it computes
alone. (B layers choose among blocks of model.attention.block_size tokens counted from the row's
start, so left padding left in place would change their choice.)
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_omniloom import OmniloomConfig
from .model_decoder import IGNORE_INDEX, OmniModel
from .model_kv_cache import CachedDecoder
from .model_moe import VISUAL_MODALITIES, MoE, allowed_experts
from .tokenizers_layout import token_modality

LAYOUT_INPUTS = ("positions", "doc_ids", "block_ids", "modality", "patches", "patch_kind")
# projections the model reads as fused weight matrices (q/k/v, gate/up, the head) and never calls:
# a wrapper around one (a PEFT LoRA layer) would be skipped silently, so forward refuses it
FUSED_PROJECTIONS = ("wq", "wk", "wv", "w_gate", "w_up", "head")
# transformers 5 names the cache argument and output `cache`, 4.x `past_key_values`
CACHE_NAME = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def _output(**fields) -> CausalLMOutputWithPast:
    if "cache" in fields:
        fields[CACHE_NAME] = fields.pop("cache")
    return CausalLMOutputWithPast(**fields)


class OmniloomPreTrainedModel(PreTrainedModel):
    config_class = OmniloomConfig
    base_model_prefix = ""
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    supports_gradient_checkpointing = False

    @torch.no_grad()
    def _init_weights(self, module):
        """Weights come from the export, or for a model built from a config from OmniModel's own
        initialisation. Only what no checkpoint holds is filled here: every MoE layer's
        allowed-expert table, a non-persistent buffer that a meta-device load leaves empty."""
        if isinstance(module, MoE):
            module.allowed_ME.copy_(allowed_experts(self.cfg, device=module.allowed_ME.device))


class OmniloomForCausalLM(OmniModel, OmniloomPreTrainedModel, GenerationMixin):
    def __init__(self, config: OmniloomConfig):
        OmniloomPreTrainedModel.__init__(self, config)
        # omniloom's constructor builds the model; this module takes over its parameters, buffers,
        # submodules and settings, so every OmniModel method runs on it unchanged
        built = OmniModel(config.omniloom_model_config())
        for key, value in vars(built).items():
            mine = self.__dict__.get(key)
            if isinstance(mine, dict) and isinstance(value, dict):
                mine.update(value)
            elif isinstance(mine, set) and isinstance(value, set):
                mine |= value
            else:
                self.__dict__[key] = value
        self.post_init()

    def get_input_embeddings(self):
        return self.embed.tok

    def get_output_embeddings(self):
        return self.head

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # generate() gets OmniloomCache from the first forward instead

    def forward(self, input_ids=None, attention_mask=None, positions=None, doc_ids=None, block_ids=None, modality=None,
                patches=None, patch_kind=None, labels=None, cache=None, past_key_values=None, use_cache=None,
                logits_to_keep=0, return_dict=None, **kwargs):
        """Logits [B, S, V] in fp32 (the last `logits_to_keep` columns when > 0) and, with `labels`
        (Hugging Face's convention: aligned with input_ids, -100 to ignore; the shift is done
        here, and targets that are padding, patches or in another document are ignored as in
        omniloom's packed batches), omniloom's training loss.

        Layout inputs (all [B, S] but positions [B, 3, S], patches [P, D], patch_kind [P]): the
        processor's output. Omitted: text, one document per row, positions counting its tokens.
        Shorter than input_ids (generation without a cache): the extra tokens continue the row as
        generated text does in `omniloom generate`."""
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, OmniloomCache) and cache.started:
            return _output(logits=cache.step(input_ids[:, -1])[:, None], cache=cache)
        self._check_projections()
        rows = Rows(self, input_ids, attention_mask, positions=positions, doc_ids=doc_ids, block_ids=block_ids,
                    modality=modality, patches=patches, patch_kind=patch_kind)
        if use_cache and labels is None and logits_to_keep == 1:  # generate()'s prefill
            cache = OmniloomCache(self)
            return _output(logits=cache.prefill(rows)[:, None], cache=cache)
        out = OmniModel.forward(self, **rows.tensors(), labels=rows.labels(labels), return_logits=True)
        logits = rows.restore(out.logits)
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return _output(loss=out.loss if labels is not None else None, logits=logits)

    def _check_projections(self) -> None:
        for name, module in self.named_modules():
            if name.rsplit(".", 1)[-1] in FUSED_PROJECTIONS and ".indexer." not in f".{name}." \
                    and not isinstance(module, torch.nn.Linear):
                raise ValueError(f"{name} is wrapped ({type(module).__name__}), but the model reads its weight "
                                 f"directly (fused with its siblings), so the wrapper would have no effect: apply "
                                 f"LoRA and other adapters to wo and w_down, not to {', '.join(FUSED_PROJECTIONS)}")

    def prepare_inputs_for_generation(self, input_ids, cache=None, past_key_values=None, attention_mask=None,
                                      use_cache=True, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        if isinstance(cache, OmniloomCache) and cache.started:
            return {"input_ids": input_ids[:, -1:], CACHE_NAME: cache, "use_cache": True, "logits_to_keep": 1}
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "use_cache": use_cache,
                  "logits_to_keep": logits_to_keep}
        inputs.update({k: kwargs[k] for k in LAYOUT_INPUTS if kwargs.get(k) is not None})
        return inputs

    def _expand_inputs_for_generation(self, expand_size=1, is_encoder_decoder=False, input_ids=None, **model_kwargs):
        """num_return_sequences > 1: `patches` is one [P, D] tensor for the whole batch, so its rows
        repeat by prompt row, not one by one as Hugging Face repeats [B, ...] inputs."""
        flat = {k: model_kwargs.pop(k, None) for k in ("patches", "patch_kind")}
        per_row = (input_ids == self.cfg.patch_token_id).sum(1).tolist() if input_ids is not None else []
        input_ids, model_kwargs = super()._expand_inputs_for_generation(expand_size, is_encoder_decoder, input_ids,
                                                                        **model_kwargs)
        for key, value in flat.items():
            if value is not None and expand_size > 1:
                value = torch.cat([part for part in value.split(per_row) for _ in range(expand_size)])
            if value is not None:
                model_kwargs[key] = value
        return input_ids, model_kwargs


class Rows:
    """A batch in omniloom's layout with each row moved so that its tokens (attention_mask 1, one
    contiguous run) start at column 0, and the padding after them a document of its own."""

    def __init__(self, model, input_ids, attention_mask=None, **layout):
        B, S = input_ids.shape
        dev = input_ids.device
        cfg = model.cfg
        mask = torch.ones(B, S, dtype=torch.bool, device=dev) if attention_mask is None else attention_mask.to(dev).bool()
        self.count = mask.sum(1)
        first = mask.long().argmax(1)
        col = torch.arange(S, device=dev)
        if not bool((mask == ((col >= first[:, None]) & (col < (first + self.count)[:, None]))).all()):
            raise ValueError("attention_mask must mark one contiguous run of tokens per row (padding on the left or right)")
        self.B, self.S, self.cfg = B, S, cfg
        self.gather = (col[None, :] + first[:, None]) % S  # aligned column j holds the caller's column gather[b, j]
        self.inverse = (col[None, :] - first[:, None]) % S
        self.real = col[None, :] < self.count[:, None]
        ids = input_ids.gather(1, self.gather)
        self.ids = torch.where(self.real, ids, torch.full_like(ids, max(cfg.pad_token_id, 0)))
        if layout.get("patches") is None:
            if bool((self.ids == cfg.patch_token_id).any()):
                raise ValueError("input_ids hold <|patch|> tokens: pass the processor's patches, patch_kind, positions, "
                                 "block_ids and modality with them")
            layout["patches"] = torch.zeros(0, max(cfg.patch_dim, cfg.tubelet_dim), device=dev)
            layout["patch_kind"] = torch.zeros(0, dtype=torch.uint8, device=dev)
        self.patches, self.patch_kind = layout["patches"].to(dev), layout["patch_kind"].to(dev)
        aligned = {name: self._aligned(layout.get(name), name, input_ids) for name in ("positions", "doc_ids", "block_ids",
                                                                                       "modality")}
        # the padding: one document after the row's last, positions counting from 0, no block
        pad_doc = aligned["doc_ids"].max() + 1
        self.doc_ids = torch.where(self.real, aligned["doc_ids"], pad_doc)
        self.block_ids = torch.where(self.real, aligned["block_ids"], -1)
        self.modality = torch.where(self.real, aligned["modality"], token_modality(cfg.pad_token_id)).to(torch.uint8)
        pad_pos = (col[None, :] - self.count[:, None]).clamp(min=0).to(aligned["positions"].dtype)
        self.positions = torch.where(self.real[:, None, :], aligned["positions"], pad_pos[:, None, :])

    def _aligned(self, value, name: str, input_ids):
        """A layout input in aligned columns. Omitted: text, one document, positions counting the
        row's tokens. Shorter than input_ids (generation without a cache): the caller's extra
        columns continue each row as generated text does (positions after the row's last, no
        block, the modality of the token id)."""
        B, S = self.B, self.S
        dev = input_ids.device
        col = torch.arange(S, device=dev)
        if value is None:
            defaults = {"positions": col.view(1, 1, S).expand(B, 3, S), "doc_ids": torch.zeros(B, S, dtype=torch.long, device=dev),
                        "block_ids": torch.full((B, S), -1, dtype=torch.long, device=dev),
                        "modality": token_modality(self.ids)}
            return defaults[name]
        value = value.to(dev)
        given = value.shape[-1]
        if given > S or given == 0 or value.shape[0] != B:
            raise ValueError(f"{name} has shape {tuple(value.shape)}; it must cover input_ids {(B, S)} (or its first columns)")
        if given < S:
            extra = torch.arange(1, S - given + 1, device=dev)
            new = {"positions": lambda: value[:, :, -1:].amax(1, keepdim=True) + extra.view(1, 1, -1).expand(B, 3, -1),
                   "doc_ids": lambda: value[:, -1:].expand(B, S - given),
                   "block_ids": lambda: torch.full((B, S - given), -1, device=dev),
                   "modality": lambda: token_modality(input_ids[:, given:])}[name]()
            value = torch.cat([value, new.to(value.dtype)], dim=-1)
        if name == "positions":
            return value.gather(2, self.gather[:, None, :].expand(B, 3, S))
        return value.gather(1, self.gather)

    def tensors(self) -> dict:
        """OmniModel.forward's inputs (labels apart)."""
        return {"input_ids": self.ids, "positions": self.positions, "doc_ids": self.doc_ids, "block_ids": self.block_ids,
                "modality": self.modality, "patches": self.patches, "patch_kind": self.patch_kind}

    def labels(self, labels):
        """omniloom's next-token targets from Hugging Face's labels, by the rule of omniloom's
        packed batches (data/batch.py): none across documents, at padding (masked, or the pad
        token of a packed row), or where the token or its target is a patch."""
        out = torch.full_like(self.ids, IGNORE_INDEX)
        if labels is None:
            return out
        lab = labels.to(self.ids.device).gather(1, self.gather)
        skip = ~self.real | (self.ids == self.cfg.pad_token_id)  # padding, masked or packed
        for m in VISUAL_MODALITIES:
            skip |= self.modality == m
        keep = (self.doc_ids[:, 1:] == self.doc_ids[:, :-1]) & ~skip[:, 1:] & ~skip[:, :-1]
        out[:, :-1] = torch.where(keep, lab[:, 1:], torch.full_like(lab[:, 1:], IGNORE_INDEX))
        return out

    def restore(self, x):
        """[B, S, ...] from aligned columns back to the caller's."""
        index = self.inverse.view(self.B, self.S, *([1] * (x.dim() - 2))).expand_as(x)
        return x.gather(1, index)

    def patch_rows(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each row's (patches, patch_kind): the batch's rows of them follow the <|patch|> tokens in
        row-major order."""
        counts = (self.ids == self.cfg.patch_token_id).sum(1).tolist()
        return list(zip(self.patches.split(counts), self.patch_kind.split(counts)))


class OmniloomCache(Cache):
    """generate()'s cache: omniloom's own CachedDecoder (model_kv_cache.py), which keeps each
    layer kind's rule. One CachedDecoder decodes a group of rows that share the prompt length and
    last position (what it batches); rows of other lengths decode in groups of their own, so
    every row computes what it computes alone. Greedy and sampling: beam search and assisted
    decoding reorder or crop a cache, which omniloom's does not do."""

    def __init__(self, model):
        try:
            super().__init__(layers=[])
        except TypeError:  # transformers 4.x
            super().__init__()
        self.model, self.groups, self.length = model, [], 0

    @property
    def started(self) -> bool:
        return bool(self.groups)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def prefill(self, rows: Rows) -> torch.Tensor:
        """Run the prompts, fill the caches, return the next-token logits [B, V] (fp32)."""
        parts = rows.patch_rows()
        groups: dict[tuple, list[int]] = {}
        for b in range(rows.B):
            n = int(rows.count[b])
            if n and bool((rows.doc_ids[b, :n] != rows.doc_ids[b, 0]).any()):
                raise ValueError("generate() continues one document per row: pass doc_ids of a single document (or none)")
            last = tuple(rows.positions[b, :, n - 1].tolist()) if n else ()
            groups.setdefault((n, last), []).append(b)
        logits = None
        for (n, _), members in groups.items():
            idx = torch.tensor(members, device=rows.ids.device)
            dec = CachedDecoder(self.model)
            out = dec.prefill(rows.ids[idx, :n], rows.positions[idx, :, :n], rows.modality[idx, :n],
                              rows.block_ids[idx, :n], torch.cat([parts[b][0] for b in members]),
                              torch.cat([parts[b][1] for b in members]))
            if logits is None:
                logits = out.new_empty(rows.B, out.shape[-1])
            logits[idx] = out
            self.groups.append((idx, dec))
        self.length = rows.S
        return logits

    def step(self, ids_B: torch.Tensor) -> torch.Tensor:
        """Append one token per row; the next-token logits [B, V]. A group's rows share one
        modality code (CachedDecoder.step takes one): generated tokens are text or special, which
        route the MoE alike."""
        logits = None
        for idx, dec in self.groups:
            tokens = ids_B[idx]
            out = dec.step(tokens, int(token_modality(int(tokens[0]))))
            if logits is None:
                logits = out.new_empty(ids_B.shape[0], out.shape[-1])
            logits[idx] = out
        self.length += 1
        return logits

    def _refuse(self, *args, **kwargs):
        raise NotImplementedError("OmniloomCache holds omniloom's KV cache, which is not reordered or cropped: "
                                  "generate with greedy decoding or sampling (num_beams=1, no assistant model)")

    reorder_cache = batch_repeat_interleave = batch_select_indices = crop = _refuse
