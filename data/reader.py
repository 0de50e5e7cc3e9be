"""Shard reading: resolve a source to its shards and manifest, read any sample by byte offset.

Every sample is addressed as (shard index, sample index) and read as the byte range
[offset_i, offset_{i+1}) of its tar (the manifest's offsets, docs/data-format.md section 1), so one corrupt or
truncated sample costs only itself, and a reader can start anywhere: exact resume re-reads what sat
in the buffers by these references instead of replaying an epoch.

Local shards are read with seek; remote shards (URLs, `pipe:` commands) are streamed through
webdataset's `gopen`, and a forward jump within the open stream is done by reading and discarding.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import tarfile
import warnings
from dataclasses import dataclass, field

from .config import SourceConfig
from .manifest import parse_manifest, split_member

log = logging.getLogger(__name__)

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


class SampleError(Exception):
    """A sample that cannot be used; `reason` is the counter it is skipped under."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class ShardInfo:
    """One tar of a shard set, with the byte offset of each sample's first header."""

    url: str
    name: str
    offsets: list[int]
    keys: list[str]
    num_bytes: int = -1  # -1: unknown, read to the end of the stream for the last sample

    @property
    def num_samples(self) -> int:
        return len(self.offsets)


@dataclass
class ShardSet:
    """A resolved source: its shards (manifest order) and mixture weight."""

    label: str
    weight: float
    shards: list[ShardInfo] = field(default_factory=list)

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)


def is_local(url: str) -> bool:
    """True for plain paths and file: URLs (seekable); False for http(s), gs, s3, pipe: ..."""
    return url.startswith("file:") or not _SCHEME_RE.match(url) or os.path.exists(url)


def _local_path(url: str) -> str:
    return url[len("file:"):] if url.startswith("file:") else url


def _read_text(url: str) -> str:
    if is_local(url):
        with open(_local_path(url), encoding="utf-8") as f:
            return f.read()
    from webdataset import gopen

    with gopen(url, "rb") as f:
        return f.read().decode("utf-8")


def _join(base: str, name: str) -> str:
    if is_local(base):
        return os.path.join(_local_path(base), name)
    return base.rstrip("/") + "/" + name


def _dirname(url: str) -> str:
    return os.path.dirname(_local_path(url)) if is_local(url) else url.rsplit("/", 1)[0]


def _expand(pattern: str) -> list[str]:
    import braceexpand

    return list(braceexpand.braceexpand(pattern))


def _shards_from_manifest(manifest: dict, base: str, urls: list[str] | None, where: str) -> list[ShardInfo]:
    entries = manifest.get("shards") or []
    by_name = {e["name"]: e for e in entries}
    shards = []
    if urls is None:
        pairs = [(_join(base, e["name"]), e) for e in entries]
    else:
        # Shards named by a pattern or pipe: command: match each URL to its manifest entry by the
        # shard file name it contains (a pipe: command carries it inside the command line).
        pairs = []
        for url in urls:
            entry = by_name.get(url.rsplit("/", 1)[-1])  # the usual case, without a scan of every name
            if entry is None:
                hits = [n for n in by_name if n in url]
                if not hits:
                    raise ValueError(f"shard '{url}' is not listed in {where}; rebuild the manifest or fix the pattern")
                entry = by_name[max(hits, key=len)]
            pairs.append((url, entry))
    for url, e in pairs:
        samples = e.get("samples") or []
        shards.append(ShardInfo(url=url, name=e["name"], offsets=[int(s["offset"]) for s in samples],
                                keys=[str(s["key"]) for s in samples], num_bytes=int(e.get("bytes", -1))))
    return shards


def index_shard(url: str) -> ShardInfo:
    """Index a shard without a manifest: one streaming pass recording each sample's offset."""
    offsets, keys = [], []
    with _open_stream(url, 0) as f, tarfile.open(fileobj=f, mode="r|") as tf:
        for member in tf:
            key = split_member(member.name)[0]
            if not keys or keys[-1] != key:
                keys.append(key)
                offsets.append(member.offset)
    return ShardInfo(url=url, name=os.path.basename(url), offsets=offsets, keys=keys)


def resolve_source(source: SourceConfig) -> ShardSet:
    """Resolve a SourceConfig to its shards and per-sample offsets.

    Raises ValueError (FileNotFoundError for missing local files) when the manifest or a shard is
    missing or when the set has zero samples: those are errors at start, not skips.
    """
    path, where = source.path, source.manifest or source.path
    urls: list[str] | None = None
    manifest_url = source.manifest
    if not manifest_url:
        if is_local(path) and os.path.isdir(_local_path(path)):
            manifest_url = _join(path, "manifest.json")
            if not os.path.exists(manifest_url):
                raise FileNotFoundError(f"source '{path}' has no manifest.json; build it with `omniloom data build`")
        elif path.endswith(".json"):
            manifest_url = path
        else:
            urls = _expand(path)
            missing = [u for u in urls if is_local(u) and not os.path.exists(_local_path(u))]
            if missing:  # before any "no manifest" warning: the path itself is wrong
                what = "no such folder or shard file" if len(urls) == 1 else f"{len(missing)} of {len(urls)} shards do not exist, e.g. '{missing[0]}'"
                raise FileNotFoundError(f"source '{path}': {what}; point data.sources at a folder made by `omniloom data build`")
            beside = _join(_dirname(urls[0]), "manifest.json")
            if is_local(beside):
                manifest_url = beside if os.path.exists(beside) else ""
            elif not urls[0].startswith("pipe:"):
                try:  # an object-store URL: the manifest usually sits beside the shards
                    _read_text(beside)
                    manifest_url = beside
                except Exception:
                    manifest_url = ""
    elif path:
        urls = _expand(path)
    if manifest_url:
        if is_local(manifest_url) and not os.path.exists(_local_path(manifest_url)):
            raise FileNotFoundError(f"manifest '{manifest_url}' not found (source '{source.label}')")
        manifest = parse_manifest(_read_text(manifest_url), manifest_url)
        shards = _shards_from_manifest(manifest, _dirname(manifest_url), urls, manifest_url)
    else:
        assert urls is not None
        warnings.warn(f"source '{path}': no manifest found; indexing {len(urls)} shard(s) by a full read "
                      "(pass `manifest:` to skip this)", stacklevel=2)
        shards = [index_shard(u) for u in urls]
    for shard in shards:
        if is_local(shard.url) and not os.path.exists(_local_path(shard.url)):
            raise FileNotFoundError(f"shard '{shard.url}' listed for source '{source.label}' does not exist; "
                                    "restore it or rebuild the shard set")
    result = ShardSet(label=source.label, weight=source.weight, shards=shards)
    if result.num_samples == 0:
        raise ValueError(f"source '{source.label}' ({where}) has zero samples; remove it or rebuild it")
    return result


def _open_stream(url: str, offset: int):
    if is_local(url):
        f = open(_local_path(url), "rb")
        f.seek(offset)
        return f
    from webdataset import gopen

    f = gopen(url, "rb")
    _discard(f, offset)
    return f


def _discard(f, count: int) -> None:
    while count > 0:
        chunk = f.read(min(count, 1 << 20))
        if not chunk:
            raise SampleError("truncated_shard", "stream ended while skipping to a sample offset")
        count -= len(chunk)


class SampleReader:
    """Reads samples by (shard, index); keeps one stream open so sequential reads cost no seek."""

    def __init__(self, shards: list[ShardInfo]):
        self.shards = shards
        self._url: str | None = None
        self._f = None
        self._pos = 0

    def close(self) -> None:
        if self._f is not None:
            try:
                self._f.close()
            except Exception:  # a pipe: command that already died: nothing left to release
                pass
        self._f, self._url = None, None

    def _stream_at(self, url: str, offset: int):
        if self._f is not None and self._url == url:
            if is_local(url):
                if self._pos != offset:
                    self._f.seek(offset)
                self._pos = offset
                return self._f
            if self._pos <= offset:
                _discard(self._f, offset - self._pos)
                self._pos = offset
                return self._f
        self.close()
        self._f, self._url, self._pos = _open_stream(url, offset), url, offset
        return self._f

    def read_raw(self, shard_idx: int, sample_idx: int) -> dict[str, bytes]:
        """The sample's members by suffix (`doc.json`, `img0.jpg`, ...). Raises SampleError."""
        shard = self.shards[shard_idx]
        start = shard.offsets[sample_idx]
        end = shard.offsets[sample_idx + 1] if sample_idx + 1 < shard.num_samples else shard.num_bytes
        try:
            f = self._stream_at(shard.url, start)
            data = f.read(end - start) if end >= 0 else f.read()
        except SampleError:
            self.close()
            raise
        except OSError as err:
            self.close()
            raise SampleError("unreadable_shard", f"{shard.url}: {err}") from err
        self._pos += len(data)
        if end >= 0 and len(data) < end - start:
            self.close()
            raise SampleError("truncated_shard", f"{shard.url}: sample {sample_idx} cut short")
        members: dict[str, bytes] = {}
        key = shard.keys[sample_idx]
        try:
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
                for member in tf:
                    mkey, suffix = split_member(member.name)
                    if mkey != key:
                        break  # end-of-archive padding or the next sample: ours is complete
                    if member.isfile():
                        members[suffix] = tf.extractfile(member).read()
        except (tarfile.TarError, EOFError) as err:
            raise SampleError("corrupt_tar", f"{shard.url}: sample {sample_idx} ({key}): {err}") from err
        return members

    def read_document(self, shard_idx: int, sample_idx: int) -> tuple[dict, dict[str, bytes]]:
        """(doc_json, media bytes by ref) for one sample; raises SampleError with a skip reason."""
        members = self.read_raw(shard_idx, sample_idx)
        raw = members.pop("doc.json", None)
        if raw is None:
            raise SampleError("missing_doc_json", f"sample {self.shards[shard_idx].keys[sample_idx]} has no doc.json")
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SampleError("bad_doc_json", f"{self.shards[shard_idx].keys[sample_idx]}: {err}") from err
        if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list) or not doc["segments"]:
            raise SampleError("bad_doc_json", f"{self.shards[shard_idx].keys[sample_idx]}: no segments list")
        for seg in doc["segments"]:
            ref = seg.get("ref") if isinstance(seg, dict) else None
            if ref is not None and ref not in members:
                raise SampleError("missing_media", f"{self.shards[shard_idx].keys[sample_idx]}: no member '{ref}'")
        return doc, members
