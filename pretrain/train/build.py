"""The seams between the trainer and the other packages: build the model, the data loaders, and
read a model forward's output. Everything that depends on names in `omniloom.model`,
`omniloom.data` and `omniloom.tokenizers` lives here, so the loop in train.py stays generic.

Contracts (PackedBatch: docs/data-format.md section 5):
- model: `OmniModel(cfg.model)`; `forward(input_ids, labels, positions, doc_ids, block_ids,
  modality, patches, patch_kind)` -> output with `loss` and optional statistics (read by
  `read_output`); optional `update_router_biases(counts_LME)`, `flops_per_token(seq_len)`.
- data: a loader iterating PackedBatch (`.to(device)`) with `state_dict()/load_state_dict()` per
  rank covering its workers, optional `metrics()` dict.

Legend: M modalities (5), L layers, E experts.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Protocol

import torch

log = logging.getLogger(__name__)

NUM_MODALITIES = 5
IGNORE_INDEX = -100  # labels with no loss (docs/data-format.md section 5)
BATCH_FIELDS = ("input_ids", "labels", "positions", "doc_ids", "block_ids", "modality", "patches", "patch_kind")


class Loader(Protocol):
    def __iter__(self): ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


def resolve_model_config(cfg) -> Any:
    """Fill the model fields the tokenizer decides (docs/data-format.md section 5): `vocab_size`, `patch_token_id`
    (id of <|patch|>), `pad_token_id` (packing pad), `patch_dim` and `tubelet_dim`, from the tokenizer
    in `data.tokenizer` (loaded, so a tokenizer.model that does not match its recorded sha256 fails here).
    Returns a new RunConfig. A value set explicitly to something else is an error."""
    tok_dir = cfg.data.tokenizer
    if not tok_dir:
        if cfg.model.vocab_size <= 0:
            raise ValueError("model.vocab_size is 0 and data.tokenizer is empty: set data.tokenizer to a "
                             "folder made by `omniloom tokenizer train` (it fills the vocabulary size)")
        return cfg
    from omniloom.tokenizers.text import Tokenizer, find_meta_file

    try:
        path = find_meta_file(tok_dir)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"data.tokenizer={tok_dir}: {err}") from err
    info = Tokenizer.load(path).to_json()  # checks tokenizer.model against its recorded sha256
    specials = info.get("special_ids") or {}
    found = {"vocab_size": info.get("vocab_size"), "patch_token_id": specials.get("patch"),
             "pad_token_id": specials.get("pad"),
             "patch_dim": info.get("patch_dim"), "tubelet_dim": info.get("tubelet_dim")}
    defaults = {f.name: f.default for f in dataclasses.fields(cfg.model)}
    updates: dict[str, Any] = {}
    for name, value in found.items():
        if value is None or name not in defaults:
            continue
        current = getattr(cfg.model, name)
        if current not in (defaults[name], int(value)) and name in ("vocab_size", "patch_token_id", "pad_token_id"):
            raise ValueError(f"model.{name}={current} but {path} says {value}; drop the override "
                             "(the tokenizer decides it)")
        if current != int(value) and current != defaults[name]:
            log.warning("model.%s=%s replaced by %s from %s", name, current, value, path)
        updates[name] = int(value)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **updates))


def build_model(cfg, expert_range: tuple[int, int] | None = None) -> torch.nn.Module:
    """The real model, on CPU in fp32 (the trainer moves and wraps it); with `expert_range`,
    only those routed experts of every MoE layer (a rank's expert-parallel shard)."""
    from omniloom.model import OmniModel

    return OmniModel(cfg.model, expert_range=expert_range)


def build_loader(cfg, split: str, rank: int, world_size: int) -> Loader | None:
    """The data stream for `split` on this rank: 'train' is endless; 'eval' is a finite pass of
    `train.eval_steps` batches over `data.eval_sources` (None when there are none)."""
    from omniloom.data.stream.loader import build_loader as stream_loader

    if split == "eval":
        if not cfg.data.eval_sources:
            return None
        return stream_loader(cfg.data, rank=rank, world_size=world_size, split="eval",
                             max_batches=cfg.train.eval_steps)
    # the stream counts batches; its source schedules (data.text_first_steps, a source's
    # start_step / end_step) are in training steps of grad_accum_steps batches each
    return stream_loader(cfg.data, rank=rank, world_size=world_size, split="train",
                         pin_memory=torch.cuda.is_available(), batches_per_step=cfg.train.grad_accum_steps)


def forward(model: torch.nn.Module, batch, layout=None) -> Any:
    """Call the model on a PackedBatch's fields (keyword arguments, docs/data-format.md section 5), with the
    host-side attention layout when there is one (OmniModel.batch_layout)."""
    fields = {name: getattr(batch, name) for name in BATCH_FIELDS}
    return model(**fields) if layout is None else model(**fields, layout=layout)


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
    router_z_loss: torch.Tensor
    ce_sum_M: torch.Tensor
    count_M: torch.Tensor
    out_norm: torch.Tensor
    expert_counts_LME: torch.Tensor | None
    indexer_loss: torch.Tensor | None = None  # the B layers' selector statistics, when the model computed them
    indexer_kl: torch.Tensor | None = None  # [nB]
    block_coverage: torch.Tensor | None = None  # [nB]


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
        aux_loss=scalar("aux_loss"),
        router_z_loss=scalar("router_z_loss"),
        ce_sum_M=vec("ce_sum_by_modality"),
        count_M=vec("tokens_by_modality"),
        out_norm=scalar("output_rms"),
        expert_counts_LME=None if counts is None else counts.detach().float(),
    )
    for name in ("indexer_loss", "indexer_kl", "block_coverage"):
        v = _first(out, (name,))
        if v is not None:
            setattr(stats, name, v.detach().float())
    return loss, stats


def split_loss(out, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token part, per-batch part) of `loss`, both with gradient. The per-batch part is the
    MoE auxiliary and router z-losses (means over every routed token, present or not) and the
    attention indexer's KL loss (a mean over sampled query blocks); the rest
    (CE and z-loss, means over the tokens with a label) is what the trainer re-weights so that a
    step's loss is the mean over every labelled token of the global batch, not a mean of means."""
    other = loss.new_zeros(())
    for name in ("aux_loss", "router_z_loss", "indexer_loss"):
        v = _first(out, (name,))
        if v is not None:
            other = other + v.reshape(())
    return loss - other, other


def num_targets(batch) -> int:
    """Tokens of a PackedBatch that carry a loss (label != -100)."""
    return int((batch.labels != IGNORE_INDEX).sum())


def model_flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    fn = getattr(model, "flops_per_token", None)
    return float(fn(seq_len)) if callable(fn) else 0.0


def model_visual_flops(model: torch.nn.Module, layout) -> float:
    """Training FLOPs the model spends on a batch beyond flops_per_token x tokens (a vision
    encoder's, from the batch's host-side layout: OmniModel.visual_flops); 0 for other models."""
    fn = getattr(model, "visual_flops", None)
    return float(fn(layout)) if callable(fn) else 0.0


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
