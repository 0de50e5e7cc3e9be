"""Foreign WebDataset shards as `omniloom data build` inputs (issue 38, item 1; docs/data-format.md
section 2, "WebDataset shards").

A tar written by another tool (img2dataset, video2dataset, `webdataset.TarWriter`) is read with
WebDataset's own conventions (`webdataset.tariterators`): regular members only, `__...__` meta
members skipped; a member's key is its path up to the first dot of its base name (a folder prefix
belongs to the key), its extension the rest, compared in lower case; consecutive members of one key
are one sample. Each sample is one document (`map_sample`, the mapping the in-place index reuses).

Uncompressed tars are scanned from their headers alone at discovery (`scan_tar`: each sample's
offset and length; no member data read) and a worker reads its sample by offset
(`read_sample_at`). Compressed tars (`.tar.gz`, `.tgz`, `.tar.zst`, `.tar.bz2`, `.tar.xz`) have
no offsets: discovery reads them front to back once for the sample list, and the build's main
process reads them front to back again, handing each sample's members to a worker
(`PayloadFiller`). Either way a member is read only when its header says it fits its limit
(images --max-image-bytes, videos --max-video-bytes, the rest --max-text-bytes; small unknown
members up to `SMALL_MEMBER` bytes), so a hostile header cannot size an allocation.

A remote shard (an http(s):// URL, a `pipe:` command; `is_remote`) is read like a compressed tar,
front to back through webdataset's `gopen` (the training stream's transport), twice: at discovery
and by the build's main process. Its name is the shard file name the URL's path or the command
names (`remote_name`): the unit's `rel` is that file name and its label that name's folder, as
for a local shard, so a URL's samples keep the keys a local copy of the same folder gives.
"""

from __future__ import annotations

import os
import tarfile
from collections import Counter
from dataclasses import dataclass

# The WebDataset rules (keys, member roles, limits, the members->document mapping) are the data
# root's (data/wds.py): the training stream applies the same ones to a shard read in place.
from omniloom.data.wds import (  # noqa: F401 - re-exported: the build's names for them
    CAPTION_EXTS, MAX_MEMBERS, SMALL_MEMBER, Members, ReadLimits, Reject, Unread, groups as _groups, map_sample,
    member_data, member_reader as _reader, member_role, read_sample_at, split_key,
)

from .textcorpus import open_input, split_compression
from .units import Unit, iter_lines
from .validate import parse_input_document


def is_tar_name(name: str) -> bool:
    """A foreign shard by its name: `.tar`, or a compressed tar (`.tar.gz`, `.tgz`, `.tar.zst`, ...)."""
    return split_compression(name)[0].lower().endswith(".tar")


REMOTE_PREFIXES = ("http://", "https://", "pipe:", "gs://", "s3://")


def is_remote(src: str) -> bool:
    """An http(s), gs, s3 URL or a `pipe:` command (read through webdataset's gopen), unless a
    local file of that name exists."""
    return src.startswith(REMOTE_PREFIXES) and not os.path.exists(src)


def remote_name(src: str) -> str:
    """The shard file a remote source names, as a '/'-path: a URL's path (no query), or for a
    `pipe:` command the last of its words that names a tar (a path or a URL). Raises ValueError,
    in one line naming what is supported, when that is not a WebDataset tar."""
    import posixpath
    import shlex
    from urllib.parse import urlsplit

    def path_of(word: str) -> str:
        return urlsplit(word).path if "://" in word else word

    supported = ("only WebDataset tar shards (.tar, .tar.gz, .tgz, .tar.zst, .tar.bz2, .tar.xz) are read from http(s):// URLs "
                 "and pipe: commands; download anything else and pass its path")
    if src.startswith("pipe:"):
        try:
            words = shlex.split(src[5:])
        except ValueError:
            words = src[5:].split()
        name = next((path_of(w) for w in reversed(words) if is_tar_name(path_of(w))), "")
        if not name:
            raise ValueError(f"source '{src}': the pipe: command names no tar shard (e.g. 'pipe:cat /data/x.tar'); {supported}")
    else:
        name = path_of(src)
        if not is_tar_name(name):
            raise ValueError(f"source '{src}' is not a tar shard: {supported}")
    return posixpath.normpath(name)


class RemoteStream:
    """A forward binary stream of a remote shard's (decompressed, by its name) bytes, through
    webdataset's gopen. Leaving it normally reads the transport to its end and checks how it
    ended (a command's or curl's exit status); leaving it early (an error, a generator closed)
    cuts the transport, and a cut command's SIGPIPE status is no error."""

    def __init__(self, url: str, name: str):
        from webdataset import gopen

        self.raw = gopen(url, "rb")
        comp = split_compression(name)[1]
        if comp == "zstd":
            import zstandard

            self.f = zstandard.ZstdDecompressor().stream_reader(self.raw, read_across_frames=True, closefd=False)
        elif comp:
            import bz2
            import gzip
            import lzma

            self.f = {"gzip": lambda r: gzip.GzipFile(fileobj=r, mode="rb"), "bz2": bz2.BZ2File, "xz": lzma.LZMAFile}[comp](self.raw)
        else:
            self.f = self.raw

    def __enter__(self):
        return self.f

    def __exit__(self, etype, value, tb):
        if etype is None:
            while self.raw.read(1 << 20):  # the end-of-archive blocks and padding: the transport ends cleanly
                pass
            self.raw.close()  # a failed command or download raises here
            return False
        try:
            self.raw.close()
        except Exception as err:  # noqa: BLE001 - the command's own status, if it failed rather than was cut
            if etype is not GeneratorExit and getattr(self.raw, "status", None) not in (-13, 141):
                raise err from value
        return False


def expand_sources(sources: list[str]) -> list[str]:
    """Sources with brace patterns (`shard-{000000..000099}.tar`, `{a,b}.tar`) expanded as
    WebDataset expands them, in order; a source that exists as written is never expanded."""
    import os

    out = []
    for src in sources:
        if "{" in src and not os.path.exists(src):
            from braceexpand import braceexpand

            out.extend(braceexpand(src))
        else:
            out.append(src)
    return out


@dataclass(frozen=True)
class FoundSample:
    """One sample found by `scan_tar`: key, 1-based ordinal in the tar, byte offset of its first
    header and length up to the next sample (0, 0 in a compressed tar), total member bytes."""

    key: str
    ordinal: int
    offset: int
    length: int
    size: int


def scan_tar(path: str, url: str = "") -> tuple[list[FoundSample], str]:
    """The samples of the tar at `path` from its headers (compressed, or remote at `url`: read
    front to back), and "" or what stopped the scan early (a corrupt or truncated tar, a transport
    that failed: the samples before it are kept)."""
    compressed = bool(url) or bool(split_compression(path)[1])
    found: list[FoundSample] = []
    try:
        with RemoteStream(url, path) if url else open_input(path) if compressed else open(path, "rb") as f:
            tf = tarfile.open(fileobj=f, mode="r|" if compressed else "r:")
            prev = None
            for key, start, end, members in _groups(tf, None):
                if prev is not None and not compressed:
                    found[-1] = FoundSample(prev.key, prev.ordinal, prev.offset, start - prev.offset, prev.size)
                prev = FoundSample(key, len(found) + 1, 0 if compressed else start, 0 if compressed else end - start,
                                   sum(s for _, _, s in members))
                found.append(prev)
    except Reject as rej:
        return found, rej.reason
    except Exception as err:  # noqa: BLE001 - tarfile, gzip, lzma and zstd errors alike: a corrupt input
        cur = getattr(err, "pending", None)
        # A header that breaks after a sample whose data ends inside the file: that sample is whole.
        if cur is not None and not compressed and cur[2] <= os.path.getsize(path):
            found.append(FoundSample(cur[0], len(found) + 1, cur[1], cur[2] - cur[1], sum(s for _, _, s in cur[3])))
        return found, f"{type(err).__name__}: {err}"
    return found, ""


def tar_units(source: str, root: str, rel: str, url: str = "") -> list:
    """Discovery: one `Unit` (kind "wds") per sample of the foreign shard `root/rel` (or of the
    remote shard `url`, named `rel`), plus a reject unit when the tar is corrupt or truncated part
    way (the samples before it are kept)."""
    found, problem = scan_tar(rel if url else os.path.join(root, rel), url)
    units, repeats = [], Counter()
    for smp in found:
        # A key that comes back later in the tar is another sample for WebDataset too: keep both.
        repeats[smp.key] += 1
        name = smp.key if repeats[smp.key] == 1 else f"{smp.key}~{repeats[smp.key]}"
        units.append(Unit(source=source, root=root, rel=rel, kind="wds", sample=name, line=smp.ordinal, offset=smp.offset,
                          length=smp.length or smp.size, url=url))
    if problem and url:  # a transport that failed (a download, a command) or a tar that breaks: told apart by its words
        units.append(Unit(source=source, root=root, rel=rel, url=url, kind="reject", code="corrupt-tar",
                          reason=f"reading the remote tar stopped after {len(found)} samples ({problem[:200]}); those were kept, "
                                 "the rest is lost: check that the URL or command prints the whole tar (it is read again by the "
                                 "build), or re-download or rewrite the shard"))
    elif problem:
        units.append(Unit(source=source, root=root, rel=rel, url=url, kind="reject", code="corrupt-tar",
                          reason=f"the tar stops parsing after {len(found)} samples ({problem[:200]}); those were kept, "
                                 "the rest is lost: re-download or rewrite the shard"))
    elif not found:
        units.append(Unit(source=source, root=root, rel=rel, url=url, kind="reject", code="empty",
                          reason="the tar holds no WebDataset samples (no regular member named KEY.EXT)"))
    return units


class PayloadFiller:
    """Hands each unit of a compressed input (a `.tar.gz` sample, a `.jsonl.gz` line) its bytes,
    read front to back in the build's main process: units arrive in input order, so each file is
    decompressed once (a request behind the current position reopens it). Uncompressed units pass
    through unchanged: their worker reads them by offset."""

    def __init__(self, settings):
        self.limits = ReadLimits.of(settings)
        self.max_line = settings.text.max_bytes
        self.path, self.pos, self.it = None, 0, None

    def fill(self, units: list) -> list:
        from dataclasses import replace

        return [replace(u, payload=self._get(u)) if _streamed(u) else u for u in units]

    def _get(self, unit):
        path = unit.url or os.path.join(unit.root, unit.rel)
        if self.path != path or unit.line <= self.pos:
            self.close()
            self.path, self.pos = path, 0
            self.it = self._open(unit.kind, path, unit.rel if unit.url else "")
        try:
            for pos, value in self.it:
                self.pos = pos
                if pos == unit.line:
                    return value
                if pos > unit.line:
                    break
        except Reject as rej:
            self.close()
            return rej
        except Exception as err:  # noqa: BLE001 - tarfile, gzip, lzma and zstd errors alike
            self.close()
            return Reject("corrupt-compressed", f"{unit.url or unit.rel} stops decompressing or parsing before this item ({type(err).__name__}: {err}); re-download it")
        self.close()
        return Reject("missing", f"{unit.url or unit.rel} no longer holds item {unit.line}: it changed since the build started; rerun with --overwrite")

    def _open(self, kind: str, path: str, remote_name: str = ""):
        """A generator of (item number, payload) over the file (a remote shard when `remote_name`:
        `path` is its URL), closing it when done or closed."""
        if kind == "jsonl":

            with open_input(path) as f:
                for n, _, _, raw in iter_lines(f, self.max_line):
                    yield n, raw if raw is not None else Reject("too-large", f"line {n} is above --max-text-bytes {self.max_line}")
            return
        read = _reader(self.limits)
        with RemoteStream(path, remote_name) if remote_name else open_input(path) as f:
            tf = tarfile.open(fileobj=f, mode="r|")
            for n, (key, _, _, members) in enumerate(_groups(tf, lambda ti, ext: read(ti, ext, tf)), start=1):
                yield n, (key, [(e, v) for e, v, _ in members])

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
        self.path, self.pos, self.it = None, 0, None


def _streamed(unit) -> bool:
    return unit.kind in ("wds", "jsonl") and (bool(unit.url) or bool(split_compression(unit.rel)[1]))


def load_foreign_sample(unit, st, notes: Counter, meta: dict, decode) -> tuple[list[dict], dict]:
    """The worker's side of a "wds" unit: its members (the payload the main process read for a
    compressed tar, else read here by offset), mapped by `map_sample`. Captions are decoded under
    the build's text policy by `decode(bytes, what, meta)`, which records their encoding in meta."""
    import os

    from .validate import check_unicode_text, real_file_inside

    if unit.payload is not None:
        key, members = unit.payload
    else:
        real = real_file_inside(unit.root, os.path.join(unit.root, unit.rel), what="tar shard")
        key, members = read_sample_at(real, unit.offset, ReadLimits.of(st))
    prov: dict = {}
    segments, sample_meta, sample_notes = map_sample(key, members, caption_first=st.caption_first, parse_document=parse_input_document,
                                                     decode=lambda data, what: decode(data, what, prov))
    notes.update(sample_notes)
    for i, seg in enumerate(segments):
        if seg["type"] in ("text", "code"):
            seg["text"] = check_unicode_text(seg["text"], st.text, what=f"sample {key} segment {i}")
    meta.update(sample_meta)
    meta.update(prov)
    return segments, meta
