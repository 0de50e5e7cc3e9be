"""What discovery hands a worker: the input kinds by file name, one input `Unit`, the `IngestSettings`
workers share, and the chunked line reader JSONL inputs are read with. Every input reader (ingest,
foreign, textcorpus) imports these from here, so none of them imports another's module."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass, field

from omniloom.data.wds import IMAGE_EXT, VIDEO_EXT  # noqa: F401 - one list, shared with the stream

from .media import MediaLimits
from .validate import (
    TextPolicy,
)

PROSE_EXT = {".txt", ".md", ".markdown", ".rst", ".text"}


HTML_EXT = {".html", ".htm", ".xhtml"}


JSONL_EXT = {".jsonl", ".ndjson"}


CODE_EXT = {
    ".py": "python", ".pyi": "python", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".cxx": "cpp",
    ".hpp": "cpp", ".hh": "cpp", ".hxx": "cpp", ".cu": "cuda", ".rs": "rust", ".go": "go", ".java": "java",
    ".kt": "kotlin", ".scala": "scala", ".js": "javascript", ".mjs": "javascript", ".cjs": "javascript",
    ".jsx": "javascript", ".ts": "typescript", ".tsx": "typescript", ".sh": "shell", ".bash": "shell",
    ".zsh": "shell", ".sql": "sql", ".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml",
    ".rb": "ruby", ".php": "php", ".cs": "csharp", ".swift": "swift", ".lua": "lua", ".r": "r", ".jl": "julia",
    ".hs": "haskell", ".ml": "ocaml", ".css": "css", ".proto": "protobuf", ".cmake": "cmake",
}


CODE_NAMES = {"Makefile": "makefile", "Dockerfile": "dockerfile", "CMakeLists.txt": "cmake"}


# Caches a walk skips like hidden names (discover: include_hidden): compiled Python is never a document.
CACHE_DIRS = {"__pycache__"}


CACHE_EXT = {".pyc", ".pyo"}


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One input that becomes at most one document. `kind` is text, code, image, video, html,
    jsonl (one line), parquet (one row: parquet.py), wds (a tar sample), other (unknown extension: tried as a video) or reject (found bad during
    discovery)."""

    source: str  # the SOURCE argument as given
    root: str  # absolute root the unit's media must stay inside
    rel: str  # path relative to root, '/'-separated
    kind: str
    lang: str = ""
    sidecar: str = ""
    line: int = 0
    offset: int = 0
    length: int = 0
    code: str = ""
    reason: str = ""
    label: str = ""  # the source's name in `meta.source` and keys: its folder name, made unique
    sample: str = ""  # kind wds: the sample's WebDataset key in the tar `rel` (line: its ordinal)
    meta_sidecar: str = ""  # a STEM.json beside a medium whose caption is STEM.txt: its meta
    url: str = ""  # a remote shard (http(s) URL, pipe: command; foreign.is_remote): read through gopen, root ""
    payload: object = field(default=None, compare=False, repr=False)  # a compressed input's bytes (foreign.PayloadFiller)
    fetched: object = field(default=None, compare=False, repr=False)  # --fetch-media: {url: answer} (fetch.FetchFiller)

    @property
    def _where(self) -> str:
        return f"#{self.sample}" if self.sample else (f":{self.line}" if self.line else "")

    @property
    def uid(self) -> str:
        return f"{self.label}/{self.rel}{self._where}"

    @property
    def display(self) -> str:
        """The path as a person finds it: the SOURCE as given joined with the relative path (a
        remote shard: its URL or pipe: command)."""
        if self.url:
            return self.url + self._where
        base = self.source if os.path.isdir(self.source) else os.path.dirname(self.source)
        return os.path.join(base, self.rel) + self._where

    @property
    def key(self) -> str:
        """Sample key: stable digest of the unit's identity (no dots; unique across parts)."""
        return hashlib.sha1(self.uid.encode("utf-8", "surrogatepass")).hexdigest()[:20]


@dataclass(frozen=True, kw_only=True)
class IngestSettings:
    """What a worker needs to process units (picklable)."""

    text: TextPolicy = field(default_factory=TextPolicy)
    limits: MediaLimits = field(default_factory=MediaLimits)
    on_bad_media: str = "drop-segment"
    caption_first: bool = False  # a sidecar or tar-member caption before its media instead of after
    animated: str = "video"  # an animated GIF/APNG/WebP: a video document, or "first-frame": an image
    text_field: str = "text"  # the text of a text-corpus JSONL record (textcorpus.parse_record)
    text_column: str = ""  # parquet: the text column ("": from the file, parquet.plan_columns)
    image_columns: tuple[str, ...] = ()  # parquet: the image columns (empty: from the file)
    fetch_media: bool = False  # --fetch-media: parquet url columns are media (parquet.plan_columns); the build's settings record it

    def __post_init__(self):
        if self.on_bad_media not in ("drop-segment", "drop-doc"):
            raise ValueError(f"--on-bad-media must be drop-segment or drop-doc, got {self.on_bad_media!r}")
        if self.animated not in ("video", "first-frame"):
            raise ValueError(f"--animated-images must be video or first-frame, got {self.animated!r}")

    def to_dict(self) -> dict:
        extra = {k: v for k, v, d in (("caption_first", self.caption_first, False), ("animated", self.animated, "video"),
                                      ("text_field", self.text_field, "text"), ("text_column", self.text_column, ""),
                                      ("image_columns", list(self.image_columns), [])) if v != d}  # absent by default: older builds resume
        return {"text": asdict(self.text), "limits": asdict(self.limits), "on_bad_media": self.on_bad_media, **extra}


_CHUNK = 1 << 20


def iter_lines(f, limit: int):
    """Yield (line number, byte offset, byte length, raw bytes or None) for each line of the binary
    file `f`, reading it in chunks. A line longer than `limit` bytes (its newline included) yields
    None instead of its bytes, and is never held whole: memory stays at a chunk plus `limit`."""
    lineno, start, length, buf, too_long = 1, 0, 0, bytearray(), False
    while True:
        chunk = f.read(_CHUNK)
        if not chunk:
            break
        pos = 0
        while pos < len(chunk):
            nl = chunk.find(b"\n", pos)
            end = len(chunk) if nl < 0 else nl + 1
            length += end - pos
            if not too_long:
                buf += chunk[pos:end]
                if len(buf) > limit:
                    too_long, buf = True, bytearray()
            pos = end
            if nl >= 0:
                yield lineno, start, length, None if too_long else bytes(buf)
                lineno, start, length, buf, too_long = lineno + 1, start + length, 0, bytearray(), False
    if length:
        yield lineno, start, length, None if too_long else bytes(buf)
