"""The seams between the trainer and the other packages: build the model, the data loaders, and
read a model forward's output. Everything that depends on names in `omniloom.model`,
`omniloom.data` and `omniloom.tokenizers` lives here, so the loop in train.py stays generic.

Contracts (DESIGN 2.3, 2.4):
- model: `OmniModel(cfg.model)`; `forward(input_ids, labels, positions, doc_ids, block_ids,
  modality, patches, patch_kind)` -> output with `loss` and optional statistics (read by
  `read_output`); optional `update_router_biases(counts_LME)`, `flops_per_token(seq_len)`.
- data: a loader iterating PackedBatch (`.to(device)`) with `state_dict()/load_state_dict()` per
  rank covering its workers, optional `metrics()` dict.

Legend: M modalities (5), L layers, E experts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

NUM_MODALITIES = 5
BATCH_FIELDS = ("input_ids", "labels", "positions", "doc_ids", "block_ids", "modality", "patches", "patch_kind")


class Loader(Protocol):
    def __iter__(self): ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def resolve_model_config(cfg) -> Any:
    """Fill `model.vocab_size` (and `model.patch_token_id` when the model config has it) from
    `DATA.tokenizer/tokenizer.json`. Returns a new RunConfig; explicit non-zero values must agree."""
    tok_dir = cfg.data.tokenizer
    if not tok_dir:
        if cfg.model.vocab_size <= 0:
            raise ValueError("model.vocab_size is 0 and data.tokenizer is empty: set data.tokenizer to a "
                             "folder made by `omniloom tokenizer train` (it fills the vocabulary size)")
        return cfg
    path = Path(tok_dir) / "tokenizer.json"
    if not path.exists():
        raise FileNotFoundError(f"data.tokenizer={tok_dir}: no tokenizer.json there; train one with "
                                "`omniloom tokenizer train`")
    info = json.loads(path.read_text())
    vocab = int(info.get("vocab_size") or 0)
    specials = info.get("special_ids") or info.get("specials") or {}
    updates: dict[str, Any] = {}
    if vocab:
        if cfg.model.vocab_size and cfg.model.vocab_size != vocab:
            raise ValueError(f"model.vocab_size={cfg.model.vocab_size} but {path} says {vocab}; drop the override")
        updates["vocab_size"] = vocab
    names = {f.name for f in dataclasses.fields(cfg.model)}
    patch_id = info.get("patch_token_id", specials.get("<|patch|>") if isinstance(specials, dict) else None)
    if "patch_token_id" in names and patch_id is not None:
        updates["patch_token_id"] = int(patch_id)
    model_cfg = dataclasses.replace(cfg.model, **updates)
    return dataclasses.replace(cfg, model=model_cfg)


def build_model(cfg) -> torch.nn.Module:
    """The real model, on CPU in fp32 (the trainer moves and wraps it)."""
    try:
        from omniloom.model import OmniModel
    except ImportError as err:
        raise ValueError("omniloom.model.OmniModel is not available in this install; "
                         "update the checkout (the model package provides it)") from err
    return OmniModel(cfg.model)


def build_loader(cfg, split: str, rank: int, world_size: int) -> Loader | None:
    """The data stream for `split` ('train' or 'eval') on this rank, or None for 'eval' when
    `data.eval_sources` is empty."""
    sources = cfg.data.sources if split == "train" else cfg.data.eval_sources
    if not sources:
        if split == "train":
            raise ValueError("data.sources is empty: point it at shards made by `omniloom data build`, "
                             "e.g. data.sources='[{path: shards/train}]'")
        return None
    try:
        from omniloom.data import stream
        from omniloom.tokenizers import Tokenizer
    except ImportError as err:
        raise ValueError("the data stream (omniloom.data.stream) or the tokenizer is not available in "
                         "this install; update the checkout") from err
    tokenizer = Tokenizer.load(cfg.data.tokenizer)
    data_cfg = cfg.data if split == "train" else dataclasses.replace(cfg.data, sources=list(cfg.data.eval_sources))
    kwargs = {}
    if split == "eval":
        kwargs = _eval_kwargs(stream.build_loader)
    return stream.build_loader(data_cfg, tokenizer, rank, world_size, **kwargs)


def _eval_kwargs(fn) -> dict:
    """Held-out data is read once, in order, without shuffling, where the stream supports it."""
    import inspect

    params = inspect.signature(fn).parameters
    out = {}
    for name, value in (("shuffle", False), ("loop", False), ("infinite", False), ("split", "eval")):
        if name in params:
            out[name] = value
    return out


def forward(model: torch.nn.Module, batch) -> Any:
    """Call the model on a PackedBatch's fields (keyword arguments, DESIGN 2.3)."""
    return model(**{name: getattr(batch, name) for name in BATCH_FIELDS})


def _first(out, names: tuple[str, ...]):
    for name in names:
        value = out.get(name) if isinstance(out, dict) else getattr(out, name, None)
        if value is not None:
            return value
    return None


@dataclasses.dataclass
class StepStats:
    """What the trainer reads from one forward, detached. Missing statistics are zeros."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    z_loss: torch.Tensor
    aux_loss: torch.Tensor
    ce_sum_M: torch.Tensor
    count_M: torch.Tensor
    out_norm: torch.Tensor
    expert_counts_LME: torch.Tensor | None


def read_output(out) -> tuple[torch.Tensor, StepStats]:
    """Return (loss to backpropagate, detached statistics) from a model output."""
    loss = _first(out, ("loss",))
    if loss is None:
        raise TypeError(f"the model output {type(out).__name__} has no `loss`; the trainer needs one")
    zero = torch.zeros((), device=loss.device, dtype=torch.float32)

    def scalar(*names):
        v = _first(out, names)
        return zero if v is None else v.detach().float().reshape(())

    def vec(*names):
        v = _first(out, names)
        return torch.zeros(NUM_MODALITIES, device=loss.device) if v is None else v.detach().float().reshape(-1)

    counts = _first(out, ("expert_counts", "expert_counts_LME"))
    stats = StepStats(
        loss=loss.detach().float(),
        ce_loss=scalar("ce_loss"),
        z_loss=scalar("z_loss"),
        aux_loss=scalar("aux_loss", "moe_aux_loss"),
        ce_sum_M=vec("ce_sum_per_modality", "ce_sum_M", "modality_ce_sum", "ce_sums"),
        count_M=vec("count_per_modality", "count_M", "modality_count", "ce_counts", "token_count_M"),
        out_norm=scalar("final_norm", "output_norm", "final_hidden_norm", "out_norm"),
        expert_counts_LME=None if counts is None else counts.detach().float(),
    )
    return loss, stats


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    fn = getattr(model, "flops_per_token", None)
    return float(fn(seq_len)) if callable(fn) else 0.0


def loader_metrics(loader) -> dict[str, float]:
    """The stream's own counters (skipped samples, padding, ...) under `data/`."""
    fn = getattr(loader, "metrics", None)
    if not callable(fn):
        return {}
    try:
        values = fn()
    except Exception as err:  # counters are diagnostics; never stop training for them
        log.debug("loader metrics unavailable: %s", err)
        return {}
    return {f"data/{k}": float(v) for k, v in (values or {}).items() if isinstance(v, (int, float))}
