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
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .textcorpus import open_input, split_compression
from .units import IMAGE_EXT, VIDEO_EXT, Unit, iter_lines
from .validate import Reject, loads_finite, parse_input_document

# Containers FFmpeg reads whose names are not on ingest's list; a tar member is never probed.
EXTRA_VIDEO_EXT = {".3g2", ".m1v", ".m2v", ".ogg", ".asf", ".f4v", ".rm", ".rmvb", ".vob", ".mts", ".m2ts", ".mxf",
                   ".divx", ".dv", ".y4m", ".mjpeg", ".mjpg", ".h264", ".hevc", ".ivf", ".nut"}
CAPTION_EXTS = ("txt", "text", "caption")  # in order of preference: the first present is the caption
CAPTION_JSON_KEYS = ("caption", "text")  # a json member's caption when the sample has no caption member
SMALL_MEMBER = 4096  # an unknown member up to this size is read, and kept in meta when it is UTF-8 text
MAX_MEMBERS = 4096  # members of one sample beyond this are counted, never read (a tar of one key)
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta


def is_tar_name(name: str) -> bool:
    """A foreign shard by its name: `.tar`, or a compressed tar (`.tar.gz`, `.tgz`, `.tar.zst`, ...)."""
    return split_compression(name)[0].lower().endswith(".tar")


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


def split_key(name: str) -> tuple[str | None, str | None]:
    """WebDataset's (key, extension) of a member path, the extension in lower case; (None, None)
    for a name WebDataset skips (no dot in its base name, or one that starts with a dot)."""
    m = _KEY_RE.match(name)
    return (m.group(1), m.group(2).lower()) if m else (None, None)


def member_role(ext: str) -> str:
    """What a member becomes, by its extension's last part: "doc" (an omniloom doc.json), "image",
    "video", "caption", "json", "meta" (cls) or "other"."""
    if ext == "doc.json":
        return "doc"
    last = "." + ext.rsplit(".", 1)[-1]
    if last in IMAGE_EXT:
        return "image"
    if last in VIDEO_EXT or last in EXTRA_VIDEO_EXT:
        return "video"
    if last[1:] in CAPTION_EXTS:
        return "caption"
    if last == ".json":
        return "json"
    return "meta" if last in (".cls", ".cls2") else "other"


@dataclass(frozen=True)
class Unread:
    """A member that was not read: `why` is "too-large" (its header is past its limit), "sparse"
    (tarfile would expand its holes in memory), "other" (an unknown member above SMALL_MEMBER) or
    "too-many" (past MAX_MEMBERS in one sample)."""

    size: int
    why: str


@dataclass(frozen=True)
class ReadLimits:
    """Largest member read, by role (the build's --max-image-bytes, --max-video-bytes, --max-text-bytes)."""

    image: int
    video: int
    text: int

    @classmethod
    def of(cls, settings) -> "ReadLimits":
        return cls(image=settings.limits.max_image_bytes, video=settings.limits.max_video_bytes, text=settings.text.max_bytes)

    def for_ext(self, ext: str) -> int:
        role = member_role(ext)
        return {"image": self.image, "video": self.video, "other": SMALL_MEMBER}.get(role, self.text)


Members = list[tuple[str, "bytes | Unread"]]  # (extension, bytes or Unread) in tar order


@dataclass(frozen=True)
class FoundSample:
    """One sample found by `scan_tar`: key, 1-based ordinal in the tar, byte offset of its first
    header and length up to the next sample (0, 0 in a compressed tar), total member bytes."""

    key: str
    ordinal: int
    offset: int
    length: int
    size: int


def _members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members WebDataset reads, without tarfile keeping a list of them all (a shard may hold
    millions)."""
    while True:
        ti = tf.next()
        tf.members = []
        if ti is None:
            return
        if not ti.isreg() or ("/" not in ti.name and ti.name.startswith("__") and ti.name.endswith("__")) or _META_RE.match(ti.name):
            continue
        yield ti


def _groups(tf: tarfile.TarFile, read: Callable[[tarfile.TarInfo, str], "bytes | Unread"] | None):
    """Yield (key, offset of the first header, end of the last member's data, [(ext, value, size)])
    for each run of consecutive members of one key. `read` gives a member's value; it is called
    only after the key is known to continue the current sample, so the member after a sample is
    never read."""
    cur = None
    members = _members(tf)
    while True:
        try:
            ti = next(members)
        except StopIteration:
            break
        except Exception as err:
            err.pending = cur  # the sample being read when the tar broke: scan_tar keeps it when its data is all there
            raise
        key, ext = split_key(ti.name)
        if key is None:
            continue
        if cur is not None and key != cur[0]:
            yield cur
            cur = None
        if cur is None:
            cur = [key, ti.offset, 0, []]
        end = ti.offset_data + ti.size
        cur[2] = end + (-end) % tarfile.BLOCKSIZE
        if len(cur[3]) >= MAX_MEMBERS:
            value = Unread(ti.size, "too-many")
        else:
            value = read(ti, ext) if read is not None else None
        cur[3].append((ext, value, ti.size))
    if cur is not None:
        yield cur


def scan_tar(path: str) -> tuple[list[FoundSample], str]:
    """The samples of the tar at `path` from its headers (compressed: read front to back), and ""
    or what stopped the scan early (a corrupt or truncated tar: the samples before it are kept)."""
    compressed = bool(split_compression(path)[1])
    found: list[FoundSample] = []
    try:
        with open_input(path) if compressed else open(path, "rb") as f:
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


def tar_units(source: str, root: str, rel: str) -> list:
    """Discovery: one `Unit` (kind "wds") per sample of the foreign shard `root/rel`, plus a
    reject unit when the tar is corrupt or truncated part way (the samples before it are kept)."""
    import os


    found, problem = scan_tar(os.path.join(root, rel))
    units, repeats = [], Counter()
    for smp in found:
        # A key that comes back later in the tar is another sample for WebDataset too: keep both.
        repeats[smp.key] += 1
        name = smp.key if repeats[smp.key] == 1 else f"{smp.key}~{repeats[smp.key]}"
        units.append(Unit(source=source, root=root, rel=rel, kind="wds", sample=name, line=smp.ordinal, offset=smp.offset,
                          length=smp.length or smp.size))
    if problem:
        units.append(Unit(source=source, root=root, rel=rel, kind="reject", code="corrupt-tar",
                          reason=f"the tar stops parsing after {len(found)} samples ({problem[:200]}); those were kept, "
                                 "the rest is lost: re-download or rewrite the shard"))
    elif not found:
        units.append(Unit(source=source, root=root, rel=rel, kind="reject", code="empty",
                          reason="the tar holds no WebDataset samples (no regular member named KEY.EXT)"))
    return units


def _reader(limits: ReadLimits):
    def read(ti: tarfile.TarInfo, ext: str, tf: tarfile.TarFile):
        if ti.issparse():
            return Unread(ti.size, "sparse")
        limit = limits.for_ext(ext)
        if ti.size > limit:
            return Unread(ti.size, "other" if member_role(ext) == "other" else "too-large")
        data = tf.extractfile(ti).read()
        if len(data) != ti.size:
            raise Reject("truncated-tar", f"member {ti.name} holds {len(data)} of its {ti.size} bytes: the shard is truncated; re-download it")
        return data
    return read


def read_sample_at(path: str, offset: int, limits: ReadLimits) -> tuple[str, Members]:
    """(key, members) of the sample whose first header is at `offset` of the uncompressed tar `path`."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            tf = tarfile.open(fileobj=f, mode="r:")  # headers from the current position on
            read = _reader(limits)
            for key, _, _, members in _groups(tf, lambda ti, ext: read(ti, ext, tf)):
                return key, [(e, v) for e, v, _ in members]
    except (tarfile.TarError, EOFError) as err:
        cur = getattr(err, "pending", None)
        if cur is not None:  # the tar breaks after this sample, whose members were all read whole
            return cur[0], [(e, v) for e, v, _ in cur[3]]
        raise Reject("corrupt-tar", f"the tar does not parse at byte {offset} ({err}); re-download or rewrite the shard") from None
    except OSError as err:
        raise Reject("unreadable", f"cannot read {path}: {err.strerror or err}; fix its permissions") from None
    raise Reject("corrupt-tar", f"no sample at byte {offset}: the shard changed since the build started; rerun with --overwrite")


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
        import os

        path = os.path.join(unit.root, unit.rel)
        if self.path != path or unit.line <= self.pos:
            self.close()
            self.path, self.pos = path, 0
            self.it = self._open(unit.kind, path)
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
            return Reject("corrupt-compressed", f"{unit.rel} stops decompressing or parsing before this item ({type(err).__name__}: {err}); re-download it")
        self.close()
        return Reject("missing", f"{unit.rel} no longer holds item {unit.line}: it changed since the build started; rerun with --overwrite")

    def _open(self, kind: str, path: str):
        """A generator of (item number, payload) over the file, closing it when done or closed."""
        if kind == "jsonl":

            with open_input(path) as f:
                for n, _, _, raw in iter_lines(f, self.max_line):
                    yield n, raw if raw is not None else Reject("too-large", f"line {n} is above --max-text-bytes {self.max_line}")
            return
        read = _reader(self.limits)
        with open_input(path) as f:
            tf = tarfile.open(fileobj=f, mode="r|")
            for n, (key, _, _, members) in enumerate(_groups(tf, lambda ti, ext: read(ti, ext, tf)), start=1):
                yield n, (key, [(e, v) for e, v, _ in members])

    def close(self) -> None:
        if self.it is not None:
            self.it.close()
        self.path, self.pos, self.it = None, 0, None


def _streamed(unit) -> bool:
    return unit.kind in ("wds", "jsonl") and bool(split_compression(unit.rel)[1])


def member_data(seg: dict, limit: int, flag: str) -> bytes:
    """The bytes of a media segment mapped from a tar member, or Reject when it was not read or is past `limit`."""
    data = seg["_data"]
    if isinstance(data, Unread):
        if data.why == "sparse":
            raise Reject("sparse-member", f"{seg['path']} is a sparse tar member; rewrite the shard without sparse files")
        if data.why == "too-many":
            raise Reject("too-many-members", f"{seg['path']} comes after {MAX_MEMBERS} members of one sample; not read")
        raise Reject("too-large", f"{seg['path']} is {data.size} bytes, above {flag} {limit}")
    if len(data) > limit:
        raise Reject("too-large", f"{seg['path']} is {len(data)} bytes, above {flag} {limit}")
    return data


# --- the mapping --------------------------------------------------------------------------------


def _utf8(data: bytes, what: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Reject("bad-utf8", f"{what} is not valid UTF-8 (byte {err.start}); re-encode it") from None


def map_sample(key: str, members: Members, *, caption_first: bool = False,
               decode: Callable[[bytes, str], str] = _utf8) -> tuple[list[dict], dict, Counter]:
    """Map one WebDataset sample to a document: (segments, meta, notes). Pure: no I/O.

    `members` are (extension, bytes or `Unread`) in tar order, extensions in lower case as
    `split_key` gives them. Rules (docs/data-format.md, "WebDataset shards"), by the extension's
    last part (`member_role`):
    - image and video extensions -> image / video segments in member order, as
      `{"type", "path": "KEY.EXT", "_data": bytes or Unread}` (validated later like local files);
    - `txt`, `text`, `caption` -> the caption, a text segment after the media (before them with
      `caption_first`); a second caption member goes to meta under its extension;
    - `json` -> `meta["json"]` (parsed; NaN/Infinity nulled), and the caption from its `caption` /
      `text` key when the sample has no caption member (note `caption-from-json`); a json in the
      OBELICS layout (`texts` / `images`) makes the sample one interleaved document: each non-null
      `images` entry takes the image member it names (its extension, `KEY.EXT` or base name) or
      else the next unused one in member order (note `obelics-sample`);
    - `doc.json` -> the sample is an omniloom document: its segments, media refs naming members;
    - `cls` -> `meta["cls"]` (an int when it reads as one); other members up to SMALL_MEMBER bytes
      that are UTF-8 text -> `meta[EXT]`; anything else is not used: its extension is listed in
      `meta["unmapped"]` and counted as note `unmapped:EXT`.
    Notes count each decision (a Counter). Raises Reject for a sample that cannot be a document
    (a repeated extension, an OBELICS json that does not match its members, nothing usable).
    `decode(bytes, what) -> str` decodes caption text (strict UTF-8 by default; the build passes
    its text policy)."""
    notes: Counter = Counter()
    meta: dict = {"wds_key": key}
    seen = Counter(e for e, _ in members)
    dup = sorted(e for e, n in seen.items() if n > 1)
    if dup:
        raise Reject("duplicate-member", f"sample {key} has several members with extension {dup[0]!r} (WebDataset refuses "
                                         "such a sample too); rewrite the shard with one member per extension")
    by_ext = dict(members)
    media = [(e, v) for e, v in members if member_role(e) in ("image", "video")]
    unmapped = []
    json_obj = None
    for ext, value in members:
        role = member_role(ext)
        if role == "json" and isinstance(value, bytes):
            try:
                json_obj, nulled = loads_finite(_utf8(value, f"{key}.{ext}"))
                if nulled:
                    notes["json-non-finite-nulled"] += 1
            except (Reject, json.JSONDecodeError, RecursionError):
                notes["bad-json-member"] += 1
                json_obj = None
                continue
            meta["json" if ext == "json" else ext] = json_obj
        elif role == "meta" and isinstance(value, bytes):
            text = value.decode("utf-8", "replace").strip()
            meta[ext] = int(text) if re.fullmatch(r"-?\d{1,18}", text) else text
        elif role == "other":
            if isinstance(value, bytes):
                try:
                    meta[ext] = value.decode("utf-8").strip()
                    notes["meta-member"] += 1
                    continue
                except UnicodeDecodeError:
                    pass
            unmapped.append(ext)
            notes[f"unmapped:{ext}"] += 1
        elif role in ("caption", "json", "meta") and isinstance(value, Unread):
            notes[f"too-large-{role}"] += 1
    if unmapped:
        meta["unmapped"] = unmapped

    if "doc.json" in by_ext:
        return _omniloom_sample(key, by_ext, meta, notes)
    obelics = json_obj if isinstance(json_obj, dict) and "texts" in json_obj and "images" in json_obj else None
    if obelics is not None:
        return _obelics_sample(key, obelics, media, meta, notes, decode)

    captions = [e for c in CAPTION_EXTS for e, _ in members if e == c] or [e for e, _ in members if member_role(e) == "caption"]
    caption = ""
    for i, ext in enumerate(captions):
        value = by_ext[ext]
        if not isinstance(value, bytes):
            continue
        text = decode(value, f"caption member {key}.{ext}").strip()
        if i == 0:
            caption = text
        else:
            meta[ext] = text
    if not captions and isinstance(json_obj, dict):
        caption = next((json_obj[k].strip() for k in CAPTION_JSON_KEYS if isinstance(json_obj.get(k), str) and json_obj[k].strip()), "")
        if caption:
            notes["caption-from-json"] += 1
    # `_standalone`: a pair's medium is its point, so a bad one drops the sample (a caption alone
    # is not kept), as for a local image and its sidecar
    segments = [{"type": member_role(e), "path": f"{key}.{e}", "_data": v, "_standalone": True} for e, v in media]
    if caption:
        segments.insert(0, {"type": "text", "text": caption}) if caption_first else segments.append({"type": "text", "text": caption})
    if not segments:
        raise Reject("empty", f"sample {key} has no image, video or caption member (members: {', '.join(e for e, _ in members)[:200]}); "
                              "nothing to train on")
    return segments, meta, notes


def _omniloom_sample(key: str, by_ext: dict, meta: dict, notes: Counter):
    """A sample of an omniloom shard (`KEY.doc.json` + its media): the document it holds."""
    raw = by_ext["doc.json"]
    if not isinstance(raw, bytes):
        raise Reject("too-large", f"{key}.doc.json is above --max-text-bytes; not read")
    try:
        obj, _ = loads_finite(_utf8(raw, f"{key}.doc.json"))
    except json.JSONDecodeError as err:
        raise Reject("bad-json", f"{key}.doc.json is not valid JSON ({err.msg})") from None
    segments, doc_meta = parse_input_document(obj)
    out = []
    for seg in segments:
        if seg["type"] in ("image", "video"):
            ref = seg["path"]
            if ref not in by_ext:
                raise Reject("missing", f"{key}.doc.json refers to {ref!r}, which is not a member of the sample")
            seg = {"type": seg["type"], "path": f"{key}.{ref}", "_data": by_ext[ref]}
        out.append(seg)
    doc_meta = dict(doc_meta)
    if "source" in doc_meta:
        doc_meta["original_source"] = doc_meta.pop("source")
    doc_meta.pop("media", None)  # measured again when the media are validated
    notes["omniloom-sample"] += 1
    return out, {**doc_meta, "wds_key": key, **({"unmapped": meta["unmapped"]} if "unmapped" in meta else {})}, notes


def _obelics_sample(key: str, obj: dict, media: list, meta: dict, notes: Counter, decode):
    """An OBELICS-layout json with its images as members: one interleaved document."""
    from .validate import _parse_obelics

    texts, images = obj["texts"], obj["images"]
    # Entries may be URLs or null placeholders; validate's parser wants strings, so check the
    # parallel-list rules on a copy whose image entries are their positions.
    probe = {"texts": texts, "images": [None if im is None else str(i) for i, im in enumerate(images)] if isinstance(images, list) else images}
    segs, _ = _parse_obelics(probe)
    images_in = [(e, v) for e, v in media if member_role(e) == "image"]
    names = {}
    for e, v in images_in:
        names.setdefault(e, e)
        names.setdefault(f"{key}.{e}", e)
        names.setdefault(f"{key}.{e}".rsplit("/", 1)[-1], e)
    used: list[str] = []
    out = []
    for seg in segs:
        if seg["type"] == "text":
            out.append(seg)
            continue
        entry = images[int(seg["path"])]
        ext = names.get(entry) if isinstance(entry, str) else None
        if ext is None or ext in used:
            ext = next((e for e, _ in images_in if e not in used), None)
        if ext is None:
            n = sum(im is not None for im in images)
            raise Reject("obelics-mismatch", f"sample {key}: its json lists {n} images but the sample has {len(images_in)} image "
                                             "members; write one member per image (KEY.0.jpg, KEY.1.jpg, ...)")
        used.append(ext)
        out.append({"type": "image", "path": f"{key}.{ext}", "_data": dict(media)[ext]})
    left = [e for e, _ in media if e not in used]
    if left:
        notes["obelics-unreferenced-media"] += len(left)
        meta["unreferenced_media"] = left
    meta["json"] = {k: v for k, v in obj.items() if k not in ("texts", "images")}
    notes["obelics-sample"] += 1
    return out, meta, notes


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
    segments, sample_meta, sample_notes = map_sample(key, members, caption_first=st.caption_first,
                                                     decode=lambda data, what: decode(data, what, prov))
    notes.update(sample_notes)
    for i, seg in enumerate(segments):
        if seg["type"] in ("text", "code"):
            seg["text"] = check_unicode_text(seg["text"], st.text, what=f"sample {key} segment {i}")
    meta.update(sample_meta)
    meta.update(prov)
    return segments, meta
