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

import math
import warnings
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class SourceConfig:
    """One shard set: a directory with manifest.json, a brace pattern, or any URL/`pipe:` spec
    webdataset accepts; `weight` is its mixture weight (share of documents drawn)."""

    path: str
    weight: float = 1.0
    name: str = ""
    # Where the manifest lives when it cannot be found beside the shards (pipe: specs, buckets).
    manifest: str = ""

    def __post_init__(self) -> None:
        if not self.path and not self.manifest:
            raise ValueError("a data source needs `path` (shard directory, brace pattern, URL or pipe: spec)")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise ValueError(f"source '{self.path}': weight must be a positive number, got {self.weight}")

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
