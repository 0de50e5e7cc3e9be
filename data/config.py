"""Data-stream configuration (docs/data-format.md section 5): shard sets with mixture weights, packing and loader sizes.

A source names one shard set. How `path` / `manifest` are resolved (see data/stream/reader.py):

- a local directory holding `manifest.json` (what `omniloom data build` writes);
- a path or URL ending in `.json`: the manifest itself; shards are looked up beside it;
- anything else is a shard spec webdataset accepts: a brace pattern (`/d/x-{000000..000009}.tar`),
  a local glob (`/d/x-*.tar`),
  an `http(s)://`, `gs://`, `s3://` URL, or a `pipe:` command. The manifest is taken from
  `manifest` when set, else from `manifest.json` beside the first shard when that exists, else the
  shards are indexed by one streaming pass at start (slow for remote data; a warning says so).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field
from typing import Literal


# The segment types of a document (docs/data-format.md section 1), as `SourceConfig.modalities` names them.
SEGMENT_TYPES = ("text", "code", "image", "video")
# What a text-first start trains on before its switch step.
TEXT_FIRST_MODALITIES = ["text", "code"]


@dataclass(kw_only=True)
class SourceConfig:
    """One shard set: a directory with manifest.json, a brace pattern, or any URL/`pipe:` spec
    webdataset accepts; `weight` is its mixture weight (share of documents drawn)."""

    path: str
    weight: float = 1.0
    name: str = ""
    # Where the manifest lives when it cannot be found beside the shards (pipe: specs, buckets).
    manifest: str = ""
    # A schedule (training sources only; README "Schedules and a text-first start"): drawn from
    # training step `start_step` on, and before `end_step` (0: to the end). At a step, the weights
    # renormalize over the sources active then.
    start_step: int = 0
    end_step: int = 0
    # Only documents whose every segment is of these types ("text", "code", "image", "video");
    # the others are skipped, counted as skipped/outside_modalities. Empty: every document.
    modalities: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.path and not self.manifest:
            raise ValueError("a data source needs `path` (shard directory, brace pattern, URL or pipe: spec)")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"source '{self.path}': weight must be a positive number, got {self.weight}")
        if self.start_step < 0 or self.end_step < 0:
            raise ValueError(f"source '{self.label}': start_step and end_step must be >= 0 (end_step 0: no end), "
                             f"got {self.start_step} and {self.end_step}")
        if self.end_step and self.end_step <= self.start_step:
            raise ValueError(f"source '{self.label}': end_step={self.end_step} must be past start_step={self.start_step} "
                             "(or 0 for no end)")
        unknown = sorted(set(self.modalities) - set(SEGMENT_TYPES))
        if unknown:
            raise ValueError(f"source '{self.label}': modalities {unknown} are not segment types; use any of "
                             f"{list(SEGMENT_TYPES)} (empty: every document)")

    @property
    def scheduled(self) -> bool:
        """Whether the source has a schedule or a modality filter (it then enters the data fingerprint)."""
        return bool(self.start_step or self.end_step or self.modalities)

    def active_at(self, step: int) -> bool:
        return self.start_step <= step and (not self.end_step or step < self.end_step)

    @classmethod
    def list_from_text(cls, text: str) -> list[dict]:
        """`data.sources=TEXT` as a list of sources of weight 1: one path, or several separated by
        commas (outside `{...}` brace patterns); a local glob (`shards/*`) names each folder it
        matches as a source, while a glob of shard files stays one source (`shards/train-*.tar`)."""
        import glob as globmod
        import os

        parts, depth, start = [], 0, 0
        for i, ch in enumerate(text):
            depth += (ch == "{") - (ch == "}")
            if ch == "," and depth == 0:
                parts.append(text[start:i])
                start = i + 1
        parts.append(text[start:])
        out = []
        for part in (p.strip() for p in parts):
            if not part:
                continue
            if "://" not in part and not part.startswith("pipe:") and globmod.has_magic(part.replace("{", "").replace("}", "")):
                matches = sorted(globmod.glob(os.path.expanduser(part)))
                if not matches:
                    raise ValueError(f"'{part}' matches nothing")
                folders = [m for m in matches if os.path.isdir(m)]
                if folders and len(folders) == len(matches):
                    out += [{"path": m} for m in folders]
                    continue
            out.append({"path": part})
        if not out:
            raise ValueError("no source given: name a shard folder, e.g. data.sources=shards/train")
        return out

    @property
    def label(self) -> str:
        """The name used in metrics and error messages."""
        return self.name or self.path or self.manifest


def check_schedule(sources: list[SourceConfig], what: str = "data.sources") -> None:
    """Refuse a schedule that leaves some training step without any active source."""
    points = sorted({0, *(s.end_step for s in sources if s.end_step)})
    for step in points:
        if not any(s.active_at(step) for s in sources):
            starts = sorted({s.start_step for s in sources if s.start_step > step})
            raise ValueError(f"{what}: no source is active at training step {step} (each source is drawn from its "
                             f"start_step to its end_step); {'the next starts at step ' + str(starts[0]) if starts else 'none starts later'}: "
                             "give one source start_step <= that step or a later end_step")


def text_first_sources(sources: list[SourceConfig], steps: int) -> list[SourceConfig]:
    """`data.text_first_steps=N` written out: each source becomes a text-and-code-only copy drawn
    before step N (its documents with an image or video skipped) and the source itself from N on,
    at its own weight both times. The copy ends at N so that, after the switch, text is not drawn
    twice over (the mix is then exactly the configured one)."""
    out = []
    for s in sources:
        if s.scheduled:
            raise ValueError(f"data.text_first_steps={steps} writes the schedule of every source, but source "
                             f"'{s.label}' has its own (start_step, end_step or modalities): set one or the other")
        out.append(dataclasses.replace(s, name=f"{s.label} [text+code]", modalities=list(TEXT_FIRST_MODALITIES),
                                       end_step=steps))
        out.append(dataclasses.replace(s, start_step=steps))
    return out


# The smallest `data.doc_cache_mb` that is not 0 (off): 1 KiB, which holds about one document's
# bookkeeping (data/stream/doc_cache.py); less rounds to a budget of no bytes at all.
MIN_DOC_CACHE_MB = 1 / 1024


@dataclass(kw_only=True)
class DataConfig:
    """The data stream of one run. Counts are per rank; buffers are per DataLoader worker."""

    sources: list[SourceConfig] = field(default_factory=list)
    eval_sources: list[SourceConfig] = field(default_factory=list)
    tokenizer: str = ""  # directory written by `omniloom tokenizer train`
    seq_len: int = 1024
    batch_size: int = 8  # rows of seq_len per rank per step
    num_workers: int = 2  # DataLoader workers per rank; 0 runs the pipeline in the main process
    prefetch_factor: int = 2  # batches each worker keeps ready
    # Raw samples (document JSON + encoded media bytes, not decoded pixels) held for shuffling.
    shuffle_buffer: int = 256
    # Tokenized document pieces the best-fit packer chooses from; larger packs tighter.
    pack_buffer: int = 64
    seed: int = 0
    # Storage dtype of PackedBatch.patches. float16 halves host memory and host->device traffic;
    # normalized pixels lose nothing that matters at that precision.
    patch_dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    # A document with an undecodable image/video: "skip" it whole (counted by reason), or "drop"
    # just that segment and keep the rest (counted as tokenizer/dropped_<reason>).
    media_errors: Literal["skip", "drop"] = "skip"
    # MB of tokenized documents each training loader worker keeps, so that a document drawn again
    # in a later epoch is neither re-read nor re-decoded (data/stream/doc_cache.py); 0 = off. Worth it for
    # small corpora read for many epochs (the demo); the batches are identical either way.
    doc_cache_mb: float = 0.0
    # A text-first start (the "bolt vision on later" recipe): before this training step only the
    # text and code documents of every source are drawn, from it on the full mix; 0: off. It
    # expands to a schedule per source (`train_sources`; SourceConfig.start_step / end_step /
    # modalities), which may also be written by hand instead.
    text_first_steps: int = 0

    def train_sources(self) -> list[SourceConfig]:
        """The training sources as drawn: `sources`, with `text_first_steps` written out."""
        if self.text_first_steps:
            return text_first_sources(self.sources, self.text_first_steps)
        return list(self.sources)

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "shuffle_buffer", "pack_buffer", "prefetch_factor"):
            if getattr(self, name) < 1:
                raise ValueError(f"data.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq_len < 8:
            raise ValueError(f"data.seq_len={self.seq_len} is too short to hold a document (use >= 8)")
        if not (self.doc_cache_mb >= 0 and math.isfinite(self.doc_cache_mb)):
            raise ValueError(f"data.doc_cache_mb must be >= 0 (0 turns the cache off), got {self.doc_cache_mb}")
        if 0 < self.doc_cache_mb < MIN_DOC_CACHE_MB:
            # a budget that rounds to 0 bytes failed inside each loader worker, with its traceback
            raise ValueError(f"data.doc_cache_mb={self.doc_cache_mb:g} is below the smallest cache, 1 KiB "
                             f"({MIN_DOC_CACHE_MB} MB) per loader worker; use 0 to turn the cache off, or a budget of at least that")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if self.text_first_steps < 0:
            raise ValueError(f"data.text_first_steps must be >= 0 (0: off), got {self.text_first_steps}")
        if self.sources:
            check_schedule(self.train_sources())
        for s in self.eval_sources:
            if s.start_step or s.end_step:
                raise ValueError(f"data.eval_sources: source '{s.label}' has a start_step or end_step; an evaluation "
                                 "has no training steps (modalities may filter it)")


def check_visual_budget(seq_len: int, *, max_image_patches: int = 0, max_video_patches: int = 0) -> list[str]:
    """Warn when the tokenizer's largest image or video block cannot fit one row.

    A visual block is `<|image|> <|patch|>*N <|/image|>`, so it needs N + 2 tokens in a row (a
    longer document is split around the block, see data/packing.split_document); blocks that do
    not fit are skipped (and counted) by the stream. Returns the warning messages (also emitted
    with `warnings.warn`).
    """
    messages = []
    for kind, budget in (("image", max_image_patches), ("video", max_video_patches)):
        if budget and budget + 2 > seq_len:
            messages.append(
                f"data.seq_len={seq_len} cannot hold the largest {kind} block ({budget} patches + tags): "
                f"such {kind}s will be skipped; raise seq_len to >= {budget + 2} or lower the tokenizer's "
                f"{kind} patch budget"
            )
    for msg in messages:
        warnings.warn(msg, stacklevel=2)
    return messages
