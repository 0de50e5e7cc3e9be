"""Shard reading: resolve a source to its shards and manifest, read any sample by byte offset.

Every sample is addressed as (shard index, sample index) and read as the byte range
[offset_i, offset_{i+1}) of its tar (the manifest's offsets, docs/data-format.md section 1), so one corrupt or
truncated sample costs only itself, and a reader can start anywhere: exact resume re-reads what sat
in the buffers by these references instead of replaying an epoch.

Local shards are read with seek; remote shards (URLs, `pipe:` commands) are streamed through
webdataset's `gopen`, and a forward jump within the open stream is done by reading and discarding.

A shard is data, not code to trust: a sample is read only within its byte range (bounded by the
file's real size, so a manifest's offset never sizes an allocation), a member larger than the
build's limits (`ReadLimits`, from the manifest's build settings) or sparse (tar holes expand to
zeros in memory) is never read, and offsets out of order or a key that is not the manifest's skip
the sample: each is a counted `SampleError`, never a dead run (docs/data-format.md section 1).
"""

from __future__ import annotations

import bisect
import io
import json
import logging
import os
import re
import tarfile
import warnings
from dataclasses import dataclass, field

from omniloom.data.config import SourceConfig
from omniloom.data import wds
from omniloom.data.manifest import DOC_JSON_GROWTH, ReadLimits, member_refusal, parse_manifest, split_member

log = logging.getLogger(__name__)

_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


class SampleError(Exception):
    """A sample that cannot be used; `reason` is the counter it is skipped under."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class ShardInfo:
    """One tar of a shard set, with the byte offset of each sample's first header (-1: the
    manifest's entry was not an integer; that sample is skipped as `bad_offset`)."""

    url: str
    name: str
    offsets: list[int]
    keys: list[str]
    num_bytes: int = -1  # -1: unknown, read to the end of the stream for the last sample
    limits: ReadLimits = field(default_factory=ReadLimits)
    # A foreign WebDataset shard named by a `data index` (docs/data-format.md, "In place"): its
    # samples are mapped to documents as they are read (data/wds.py), and `members` (per sample,
    # "ext:size/ext:size" from the headers at index time) and `mtime_ns` tell a changed shard.
    foreign: bool = False
    members: list[str] | None = None
    mtime_ns: int = -1
    caption_first: bool = False
    _sorted: list[int] | None = field(default=None, repr=False, compare=False)

    def byte_range(self, i: int) -> tuple[int, int]:
        """[start, end) of sample i: from its offset to the next larger offset of the shard (end
        -1: to the end of the stream). Not the next entry's offset: a manifest that lists samples
        out of order then costs only the entries that lie, not their neighbours."""
        if self._sorted is None:
            self._sorted = sorted(set(o for o in self.offsets if o >= 0))
        start = self.offsets[i]
        j = bisect.bisect_right(self._sorted, start)
        return start, (self._sorted[j] if j < len(self._sorted) else self.num_bytes)

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
    """Brace patterns, then local globs (`shards/train-*.tar`, sorted)."""
    import glob

    import braceexpand

    out = []
    for url in braceexpand.braceexpand(pattern):
        if is_local(url) and glob.has_magic(url):
            out += sorted(glob.glob(_local_path(url))) or [url]  # no match: the missing-file error names it
        else:
            out.append(url)
    return out


def _int_or(value, fallback: int) -> int:
    """An integer from a manifest (an integral float such as 1e3 too), else `fallback`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value in (float("inf"), float("-inf")):
        return fallback
    return int(value) if int(value) == value else fallback


def _samples(entry: dict) -> tuple[list[int], list[str]]:
    """(offsets, keys) of a manifest shard entry; an entry that is not {key, offset} reads as key
    "" at offset -1, skipped at read time like any other lie of the manifest."""
    offsets, keys = [], []
    for s in entry.get("samples") or []:
        s = s if isinstance(s, dict) else {}
        offsets.append(_int_or(s.get("offset"), -1))
        keys.append(str(s.get("key", "")))
    return offsets, keys


def _shards_from_manifest(manifest: dict, base: str, urls: list[str] | None, where: str) -> list[ShardInfo]:
    entries = manifest["shards"]  # a list of {name, samples, ...} entries whose paths stay inside (check_manifest)
    limits = ReadLimits.from_settings(manifest.get("settings"))
    index = manifest.get("kind") == "index"
    settings = manifest.get("settings") if isinstance(manifest.get("settings"), dict) else {}
    by_name = {e["name"]: e for e in entries}
    shards = []
    if index:  # the shards stay where they were indexed: an absolute path or URL, or one relative to the index
        pairs = [(_index_url(base, e), e) for e in entries]
    elif urls is None:
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
        offsets, keys = _samples(e)
        shards.append(ShardInfo(url=url, name=e["name"], offsets=offsets, keys=keys,
                                num_bytes=max(_int_or(e.get("bytes"), -1), -1), limits=limits))
        if index:
            shards[-1].foreign, shards[-1].members = True, _signatures(e)
            shards[-1].mtime_ns, shards[-1].caption_first = _int_or(e.get("mtime_ns"), -1), settings.get("caption_first") is True
    return shards


def _index_url(base: str, entry: dict) -> str:
    url = entry.get("url")
    if not isinstance(url, str) or not url:
        url = entry["name"]
    return url if (_SCHEME_RE.match(url) and not os.path.exists(url)) or os.path.isabs(url) else _join(base, url)


def signature(members) -> str:
    """A sample's members as "ext:size/ext:size" in tar order: what `data index` saw in its headers
    and what the reader compares the headers it reads with (a changed shard)."""
    return "/".join(f"{ext}:{size}" for ext, size in members)


def _signatures(entry: dict) -> list[str]:
    out = []
    for s in entry.get("samples") or []:
        members = s.get("members") if isinstance(s, dict) else None
        ok = isinstance(members, list) and all(isinstance(m, list) and len(m) == 2 for m in members)
        out.append(signature(members) if ok else "")
    return out


def index_shard(url: str) -> ShardInfo:
    """Index a shard without a manifest: one streaming pass recording each sample's offset."""
    offsets, keys = [], []
    try:
        with _open_stream(url, 0) as f, tarfile.open(fileobj=f, mode="r|") as tf:
            for member in tf:
                key = split_member(member.name)[0]
                if not keys or keys[-1] != key:
                    keys.append(key)
                    offsets.append(member.offset)
    except (tarfile.TarError, EOFError, ValueError, OverflowError, SampleError) as err:
        if not keys:
            raise ValueError(f"'{url}' is not a readable tar shard ({err}); point data.sources at a folder made by "
                             "`omniloom data build`") from None
        # a truncated or damaged tail: the samples before it still count; reading the last one says what is wrong
        warnings.warn(f"shard '{url}' is damaged after {len(keys)} samples ({err}); indexed those", stacklevel=3)
    return ShardInfo(url=url, name=os.path.basename(url), offsets=offsets, keys=keys)


_COMPRESSED = ((b"\x1f\x8b", "gzip", "gunzip"), (b"\x28\xb5\x2f\xfd", "zstd", "zstd -d"), (b"BZh", "bzip2", "bunzip2"),
               (b"\xfd7zXZ\x00", "xz", "unxz"))


def _check_tar(url: str, source: str) -> None:
    """Refuse, at start and in one line, a shard given by path that is not an uncompressed tar (a
    .tar.gz, a text file): samples are read by byte offset, which a compressed stream has not."""
    fix = "point data.sources at a folder made by `omniloom data build`"
    if not is_local(url):
        name = url.split("?")[0].lower()
        if not url.startswith("pipe:") and name.endswith((".gz", ".tgz", ".zst", ".bz2", ".xz")):
            raise ValueError(f"source '{source}': '{url}' is a compressed tar; omniloom reads uncompressed tar shards "
                             f"by byte offset: decompress it, or {fix}")
        return
    path = _local_path(url)
    if os.path.isdir(path):
        raise ValueError(f"source '{source}': '{url}' is a folder without manifest.json, not a tar shard; {fix}")
    with open(path, "rb") as f:
        head = f.read(tarfile.BLOCKSIZE)
    for magic, kind, tool in _COMPRESSED:
        if head.startswith(magic):
            raise ValueError(f"source '{source}': '{url}' is {kind}-compressed; omniloom reads uncompressed tar shards by "
                             f"byte offset: decompress it ({tool}), or {fix}")
    try:
        tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape")
    except (tarfile.EmptyHeaderError, tarfile.EOFHeaderError):
        return  # an empty tar: resolve_source says it has zero samples
    except tarfile.HeaderError as err:
        raise ValueError(f"source '{source}': '{url}' is not a tar shard ({err}); {fix}") from None


def _index_hint(what: str) -> str:
    return (f"index them in place with `omniloom data index {what} --out INDEX` and set data.sources to INDEX "
            f"(or copy them into omniloom shards with `omniloom data build {what} --out DIR`)")


def _refuse_foreign_folder(path: str) -> None:
    """A folder of WebDataset shards without a manifest (an img2dataset output): refused at start,
    naming `data index`, instead of an epoch of `missing_doc_json` skips."""
    local = _local_path(path)
    tars = sorted(n for n in os.listdir(local) if n.lower().endswith((".tar", ".tar.gz", ".tgz", ".tar.zst", ".tar.bz2", ".tar.xz")))
    if tars:
        raise ValueError(f"source '{path}' holds {len(tars)} WebDataset shard(s) (e.g. {tars[0]}) but no omniloom manifest; "
                         + _index_hint(path))


def _refuse_foreign_shard(url: str, source: str) -> None:
    """A shard with no manifest whose first sample has no `doc.json` is a foreign WebDataset shard:
    refused at start, naming `data index` (reading its first sample's headers decides it)."""
    suffixes, key = set(), None
    try:
        with _open_stream(url, 0) as f, tarfile.open(fileobj=f, mode="r|") as tf:
            for member in tf:
                k, ext = wds.split_key(member.name)
                if k is None or not member.isreg():
                    continue
                if key is not None and k != key:
                    break
                key = k
                suffixes.add(ext)
    except (tarfile.TarError, EOFError, ValueError, OverflowError, OSError, SampleError):
        return  # unreadable: index_shard says what is wrong with it
    if key is not None and "doc.json" not in suffixes:
        raise ValueError(f"source '{source}': '{url}' is a WebDataset shard not written by `omniloom data build` (its first "
                         f"sample {key!r} has {', '.join(sorted(suffixes))[:120]} and no doc.json); " + _index_hint(source))


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
                _refuse_foreign_folder(path)
                raise FileNotFoundError(f"source '{path}' has no manifest.json; build it with `omniloom data build`")
        elif path.endswith(".json"):
            manifest_url = path
        else:
            urls = _expand(path)
            missing = [u for u in urls if is_local(u) and not os.path.exists(_local_path(u))]
            if missing:  # before any "no manifest" warning: the path itself is wrong
                what = "no such folder or shard file" if len(urls) == 1 else f"{len(missing)} of {len(urls)} shards do not exist, e.g. '{missing[0]}'"
                raise FileNotFoundError(f"source '{path}': {what}; point data.sources at a folder made by `omniloom data build`")
            for url in urls:
                _check_tar(url, path)
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
        _refuse_foreign_shard(urls[0], path)
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


class _Window(io.RawIOBase):
    """Bytes [start, stop) of the open stream `f` (stop -1: to its end) as a file for tarfile, so
    a sample's headers are read before its members' data: a member refused from its header is
    seeked over (a local file) or read through in small chunks and dropped (a stream, which
    tarfile's streaming mode skips forward by reading), never held whole in memory."""

    def __init__(self, f, start: int, stop: int, seekable: bool):
        super().__init__()
        self.f, self.start, self.stop, self._seekable = f, start, stop, seekable
        self.pos = start  # absolute position of `f`
        self.short = False  # the stream ended before `stop`

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self._seekable

    def read(self, n: int | None = -1) -> bytes:
        """Up to `n` bytes (all that is left when n < 0), straight from `f`: tarfile reads every
        header and member through here, and RawIOBase's own read() would copy each twice more."""
        left = -1 if self.stop < 0 else self.stop - self.pos
        want = left if n is None or n < 0 else (n if left < 0 else min(n, left))
        if want == 0:
            return b""
        data = self.f.read(want)
        self.pos += len(data)
        if 0 < want and len(data) < want:
            self.short = self.stop >= 0
        return data

    def readinto(self, buf) -> int:
        data = self.read(len(buf))
        buf[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("seek")
        base = {io.SEEK_SET: self.start, io.SEEK_CUR: self.pos, io.SEEK_END: self.stop}[whence]
        self.pos = max(self.start, base + offset)
        self.f.seek(self.pos)
        return self.pos - self.start

    def tell(self) -> int:
        return self.pos - self.start


def _members(fileobj, key: str, limits: ReadLimits, where: str, *, stream: bool = False) -> dict[str, bytes]:
    """The members of sample `key` at the start of `fileobj`, each checked against `limits` from
    its header before its data is read (tarfile would expand a sparse member's holes, or read a
    forged size). `stream`: a file that cannot seek (tarfile's streaming mode)."""
    if isinstance(fileobj, (bytes, bytearray)):
        fileobj = io.BytesIO(fileobj)
    members: dict[str, bytes] = {}
    first = True
    with tarfile.open(fileobj=fileobj, mode="r|" if stream else "r:") as tf:
        for member in tf:
            mkey, suffix = split_member(member.name)
            if mkey != key:
                if first:
                    raise SampleError("manifest_mismatch", f"{where}: the tar holds {mkey!r} at the manifest's offset of "
                                                           f"{key!r}; run `omniloom data verify` and rebuild the manifest")
                break  # end-of-archive padding or the next sample: ours is complete
            first = False
            refused = member_refusal(member, suffix, limits)
            if refused is not None:
                raise SampleError(refused[0], f"{where}: {refused[1]}")
            if member.isfile():
                members[suffix] = tf.extractfile(member).read()
    return members


# A foreign sample the mapping refuses, by the reader's reasons where one fits (docs/data-format.md)
_REJECT_REASONS = {"too-large": "oversize_member", "sparse-member": "sparse_member", "too-many-members": "oversize_member",
                   "truncated-tar": "truncated_shard", "corrupt-tar": "corrupt_tar"}


def _wds_limits(limits: ReadLimits) -> wds.ReadLimits:
    """The mapping's per-role limits from the index's settings: a caption, json or meta member may be
    as large as the build's --max-text-bytes."""
    return wds.ReadLimits(image=limits.image_bytes, video=limits.video_bytes, text=limits.doc_json_bytes // DOC_JSON_GROWTH)


def _foreign_members(fileobj, shard: ShardInfo, i: int, where: str, stream: bool) -> tuple[str, wds.Members]:
    """(key, members) of the foreign sample at the start of `fileobj`, read with WebDataset's rules
    (data/wds.py: `groups`, `member_value`: a member past its role's limit, or sparse, is never read)
    and checked against the index: another key there is `manifest_mismatch`, other member names
    or sizes `changed_shard`."""
    key = shard.keys[i]
    limits = _wds_limits(shard.limits)
    try:
        found = _plain_first_group(fileobj, limits) if isinstance(fileobj, _Window) and not stream else wds.NotPlain
        if found is wds.NotPlain:  # a remote stream, or a tar only tarfile reads: tarfile, from the window's start
            tf = tarfile.open(fileobj=fileobj, mode="r|" if stream else "r:")
            read = wds.member_reader(limits)
            found = next(wds.groups(tf, lambda ti, ext: read(ti, ext, tf)), None)
    except wds.Reject as rej:
        raise SampleError(_REJECT_REASONS.get(rej.code, "corrupt_tar"), f"{where}: {rej.reason}") from None
    except (tarfile.TarError, EOFError) as err:
        found = getattr(err, "pending", None)  # the tar breaks after this sample, whose members were read whole
        if found is None:
            raise
    if found is None:
        raise SampleError("manifest_mismatch", f"{where}: no sample at the index's offset; the shard changed since "
                                               "`omniloom data index`: index it again")
    got, _, _, members = found
    if got != key:
        raise SampleError("manifest_mismatch", f"{where}: the tar holds {got!r} at the index's offset of {key!r}; "
                                               "the shard changed since `omniloom data index`: index it again")
    seen = signature((e, size) for e, _, size in members)
    if shard.members and shard.members[i] != seen:
        raise SampleError("changed_shard", f"{where}: its members are now {seen[:200]!r}, {shard.members[i][:200]!r} when "
                                           "indexed: the shard changed since `omniloom data index`; index it again")
    return got, [(e, v) for e, v, _ in members]


def _plain_first_group(window: _Window, limits: wds.ReadLimits):
    """The first sample of a local window with its headers parsed directly (data/wds.py:
    `plain_members`), or `wds.NotPlain` (the window rewound) where tarfile must read it."""
    f = window.f
    try:
        found = next(wds.groups_of(wds.plain_members(f, window.start, window.stop), wds.plain_reader(f, limits)), None)
    except wds.NotPlain:
        window.seek(0)
        return wds.NotPlain
    window.pos = f.tell()
    return found


# Read-ahead of a local foreign shard: the samples after the one asked for, read in one run while
# the reading code is warm (interleaved with image decoding, each read cost 2.5x what it costs in a
# run: the decoder evicts the interpreter's working set). Bounded by samples and by the index's
# byte ranges, so a sample larger than READ_AHEAD_BYTES is never read early.
READ_AHEAD_SAMPLES = 32
READ_AHEAD_BYTES = 4 << 20


class SampleReader:
    """Reads samples by (shard, index); keeps one stream open so sequential reads cost no seek."""

    def __init__(self, shards: list[ShardInfo]):
        self.shards = shards
        self._url: str | None = None
        self._f = None
        self._pos = 0
        self._mtime_warned: set[int] = set()
        # (shard, sample) -> (doc, media) or the SampleError its read raised; the shard's
        # (size, mtime_ns) when they were read (a shard changed since is read again)
        self._ahead: dict[tuple[int, int], object] = {}
        self._ahead_stat: tuple[int, int] | None = None

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

    def read_raw(self, shard_idx: int, sample_idx: int, parse=None):
        """The sample's members by suffix (`doc.json`, `img0.jpg`, ...); with `parse`, what
        `parse(window, shard, sample_idx, where, stream)` makes of the sample's byte range instead (a
        foreign sample: `_foreign_members`). Raises SampleError."""
        parse = parse or (lambda fileobj, shard, i, where, stream: _members(fileobj, shard.keys[i], shard.limits, where, stream=stream))
        shard = self.shards[shard_idx]
        key = shard.keys[sample_idx]
        start, end = shard.byte_range(sample_idx)
        if start < 0 or 0 <= end <= start:
            where = "no byte offset" if start < 0 else f"byte {start}, past the shard's {end} bytes"
            raise SampleError("bad_offset", f"{shard.url}: the manifest gives sample {sample_idx} ({key}) {where}; "
                                            "run `omniloom data verify` and rebuild the manifest")
        local, window, short = is_local(shard.url), None, False
        try:
            f = self._stream_at(shard.url, start)
            # a local file bounds the range by its real size, so a manifest's offset never sizes a read
            stop = min(end, os.fstat(f.fileno()).st_size) if local and end >= 0 else (
                os.fstat(f.fileno()).st_size if local else end)
            window = _Window(f, start, stop, seekable=local)
            short = local and end >= 0 and stop < end
            try:
                if shard.foreign and local:
                    self._check_unchanged(shard_idx, f)
                members = parse(window, shard, sample_idx, f"{shard.url}: sample {sample_idx} ({key})", not local)
            finally:
                self._pos = window.pos
            short = short or window.short
        except SampleError:
            self.close()
            raise
        except (tarfile.TarError, EOFError, ValueError, OverflowError) as err:  # tarfile's pax/sparse parsers raise ValueError
            self.close()
            if short or (window is not None and window.short):  # a shard that ends before the manifest says it does, inside this sample
                raise SampleError("truncated_shard", f"{shard.url}: sample {sample_idx} ({key}) is cut short: the shard ends "
                                                     f"before byte {end}, where the manifest says it ends") from err
            raise SampleError("corrupt_tar", f"{shard.url}: sample {sample_idx} ({key}): {err}") from err
        except OSError as err:
            self.close()
            raise SampleError("unreadable_shard", f"{shard.url}: {err}") from err
        if short:
            self.close()
        return members

    def _check_unchanged(self, shard_idx: int, f) -> None:
        """A foreign shard whose size is not the indexed one changed since `data index`: every
        sample of it is skipped (`changed_shard`) rather than misread. Its mtime alone differing
        (a copy, a touch) is not a change: each sample's headers are still compared with the
        index's (`_foreign_members`)."""
        shard = self.shards[shard_idx]
        st = os.fstat(f.fileno())
        if shard.num_bytes >= 0 and st.st_size != shard.num_bytes:
            raise SampleError("changed_shard", f"{shard.url} is {st.st_size} bytes, {shard.num_bytes} when it was indexed: "
                                               "it changed since `omniloom data index`; index it again")
        if shard.mtime_ns >= 0 and st.st_mtime_ns != shard.mtime_ns and shard_idx not in self._mtime_warned:
            self._mtime_warned.add(shard_idx)
            log.warning("%s was modified since `omniloom data index` (same size): each sample's headers are checked "
                        "against the index; re-index it if its contents changed", shard.url)

    def read_document(self, shard_idx: int, sample_idx: int) -> tuple[dict, dict[str, bytes]]:
        """(doc_json, media bytes by ref) for one sample; raises SampleError with a skip reason.
        A local foreign shard's next samples are read ahead (`READ_AHEAD_SAMPLES`): each gives, when
        asked for, exactly what reading it then would (its document, or its SampleError)."""
        if self._ahead:
            got = self._ahead.pop((shard_idx, sample_idx), None)
            if got is not None and self._ahead_stat == self._shard_stat(shard_idx):
                if isinstance(got, SampleError):
                    raise got
                return got
            self._ahead.clear()
        doc = self._read_document(shard_idx, sample_idx)
        shard = self.shards[shard_idx]
        if shard.foreign and is_local(shard.url):
            self._read_ahead(shard_idx, sample_idx)
        return doc

    def shard_identity(self, shard_idx: int) -> tuple[int, int, int, int] | None:
        """(size, mtime_ns, inode, device) of a local shard as the next read would see it (the open
        file when it is this shard's, else the path), so that a shard rewritten or replaced since
        tells itself apart; None for a remote one (a URL or `pipe:`, which has none without
        reading it) or one that cannot be stat'ed (its read says why)."""
        st = self._stat(shard_idx) if is_local(self.shards[shard_idx].url) else None
        return None if st is None else (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)

    def _stat(self, shard_idx: int) -> os.stat_result | None:
        url = self.shards[shard_idx].url
        try:
            return os.fstat(self._f.fileno()) if self._f is not None and self._url == url else os.stat(_local_path(url))
        except (OSError, ValueError):
            return None

    def _shard_stat(self, shard_idx: int) -> tuple[int, int] | None:
        st = self._stat(shard_idx)
        return None if st is None else (st.st_size, st.st_mtime_ns)

    def _read_ahead(self, shard_idx: int, sample_idx: int) -> None:
        shard = self.shards[shard_idx]
        self._ahead_stat = self._shard_stat(shard_idx)
        if self._ahead_stat is None:
            return
        budget = READ_AHEAD_BYTES
        for j in range(sample_idx + 1, min(shard.num_samples, sample_idx + 1 + READ_AHEAD_SAMPLES)):
            start, end = shard.byte_range(j)
            if start < 0 or end <= start or end - start > budget:
                return  # unknown or too large: read when asked for
            budget -= end - start
            try:
                self._ahead[(shard_idx, j)] = self._read_document(shard_idx, j)
            except SampleError as err:
                self._ahead[(shard_idx, j)] = err
            except Exception:  # noqa: BLE001 - not a skip: raised when the sample is asked for, not here
                return
        if self._shard_stat(shard_idx) != self._ahead_stat:  # changed while it was read: read each again when asked
            self._ahead.clear()

    def _read_document(self, shard_idx: int, sample_idx: int) -> tuple[dict, dict[str, bytes]]:
        shard = self.shards[shard_idx]
        if shard.foreign:
            key, members = self.read_raw(shard_idx, sample_idx, _foreign_members)
            try:
                return wds.document_from_sample(key, members, limits=_wds_limits(shard.limits), caption_first=shard.caption_first,
                                                source=f"{shard.name}#{key}")
            except wds.Reject as rej:
                raise SampleError(_REJECT_REASONS.get(rej.code, "bad_sample"), f"{shard.url}: sample {key}: {rej.reason}") from None
        members = self.read_raw(shard_idx, sample_idx)
        raw = members.pop("doc.json", None)
        if raw is None:
            raise SampleError("missing_doc_json", f"sample {self.shards[shard_idx].keys[sample_idx]} has no doc.json")
        try:
            doc = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise SampleError("bad_doc_json", f"{self.shards[shard_idx].keys[sample_idx]}: {err}") from err
        except RecursionError:  # a hostile doc.json of a few KB nested past Python's recursion limit
            raise SampleError("bad_doc_json", f"{self.shards[shard_idx].keys[sample_idx]}: doc.json is nested too deeply "
                                              "to parse (no document the build writes is)") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list) or not doc["segments"]:
            raise SampleError("bad_doc_json", f"{self.shards[shard_idx].keys[sample_idx]}: no segments list")
        for seg in doc["segments"]:
            ref = seg.get("ref") if isinstance(seg, dict) else None
            if ref is not None and (not isinstance(ref, str) or ref not in members):
                raise SampleError("missing_media", f"{self.shards[shard_idx].keys[sample_idx]}: no member '{ref}'")
        return doc, members
