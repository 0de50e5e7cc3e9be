"""Data-stream configuration (DESIGN 2.3). First version written with the foundation; the
stream issue owns and extends it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class SourceConfig:
    """One shard set: a directory with manifest.json, a brace pattern, or any URL/`pipe:` spec
    webdataset accepts; `weight` is its mixture weight."""

    path: str
    weight: float = 1.0
    name: str = ""


@dataclass(kw_only=True)
class DataConfig:
    sources: list[SourceConfig] = field(default_factory=list)
    eval_sources: list[SourceConfig] = field(default_factory=list)
    tokenizer: str = ""
    seq_len: int = 1024
    batch_size: int = 8
    num_workers: int = 2
    shuffle_buffer: int = 256
    pack_buffer: int = 64
    seed: int = 0
