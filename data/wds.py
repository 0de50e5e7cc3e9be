"""Foreign WebDataset samples: the rules both `omniloom data build` (data/prep/foreign.py) and the
training stream (data/stream/reader.py, reading a `data index` in place) apply, kept here once so a
sample read in place is the same document a build copy of it holds (docs/data-format.md section 2,
"WebDataset shards", and "In place: `omniloom data index`").

- `split_key(name)`: WebDataset's (key, extension) of a member path.
- `member_role(ext)`: what a member becomes (image, video, caption, json, meta, doc, other).
- `ReadLimits` / `member_value`: the largest member read, by role, decided from its header.
- `groups(tarfile)`: the samples of a tar (runs of members of one key), header by header;
  `groups_of(plain_members(f, start, stop))` the same with the headers parsed directly (`NotPlain`
  where only tarfile reads them: the caller reads the bytes again with tarfile).
- `read_sample_at(path, offset, limits)`: one sample of a local uncompressed tar by offset.
- `map_sample(key, members)`: a sample's members -> (segments, meta, notes); pure.
- `document_from_sample(key, members)`: the (doc.json, media by ref) the stream trains on.

`Reject` (a counted, reasoned refusal), `loads_finite` and `parse_obelics` live here because the
mapping raises and uses them; data/prep/validate.py imports them from here.
"""

from __future__ import annotations

import json
import math
import re
import tarfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from .tarheaders import NotPlain, PlainHeader, plain_header

IMAGE_EXT = {".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm", ".xbm",
             ".sgi", ".ras", ".tga", ".ico", ".pcx", ".qoi", ".exr"}
VIDEO_EXT = {".mp4", ".m4v", ".webm", ".mkv", ".mov", ".avi", ".flv", ".ts", ".mpg", ".mpeg", ".ogv", ".3gp", ".wmv"}
# Containers FFmpeg reads whose names are not on ingest's list; a tar member is never probed.
EXTRA_VIDEO_EXT = {".3g2", ".m1v", ".m2v", ".ogg", ".asf", ".f4v", ".rm", ".rmvb", ".vob", ".mts", ".m2ts", ".mxf",
                   ".divx", ".dv", ".y4m", ".mjpeg", ".mjpg", ".h264", ".hevc", ".ivf", ".nut"}
CAPTION_EXTS = ("txt", "text", "caption")  # in order of preference: the first present is the caption
CAPTION_JSON_KEYS = ("caption", "text")  # a json member's caption when the sample has no caption member
SMALL_MEMBER = 4096  # an unknown member up to this size is read, and kept in meta when it is UTF-8 text
MAX_MEMBERS = 4096  # members of one sample beyond this are counted, never read (a tar of one key)
_KEY_RE = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_META_RE = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta
_SURROGATE = re.compile("[\ud800-\udfff]")


class Reject(Exception):
    """An input (or one segment of it) is not usable; `code` is a short tag, `reason` says why and
    what to do."""

    def __init__(self, code: str, reason: str):
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason


def loads_finite(text: str) -> tuple[object, int]:
    """`json.loads` that turns the non-standard NaN, Infinity and -Infinity (and numbers too large
    for a float, such as 1e999) into None, so every JSON we write is strict; returns (object,
    how many values were nulled) so the caller can count and log them."""
    nulled = 0

    def constant(_name):
        nonlocal nulled
        nulled += 1
        return None

    def number(s):
        nonlocal nulled
        v = float(s)
        if math.isfinite(v):
            return v
        nulled += 1
        return None

    return json.loads(text, parse_constant=constant, parse_float=number), nulled


def lone_surrogate(text: str):
    """The first lone surrogate of `text` (a JSON `\\ud800` escape no UTF-8 file can hold), or None."""
    return _SURROGATE.search(text)


def parse_obelics(obj: dict) -> tuple[list[dict], dict]:
    """The OBELICS layout (parallel `texts` / `images`, exactly one non-null per position) as
    segments (`{"type": "image", "path": entry}`) and the record's other keys as meta."""
    texts, images = obj["texts"], obj["images"]
    if not isinstance(texts, list) or not isinstance(images, list):
        raise Reject("schema", "OBELICS 'texts' and 'images' must be lists")
    if len(texts) != len(images):
        raise Reject("schema", f"OBELICS 'texts' ({len(texts)}) and 'images' ({len(images)}) differ in length")
    segments = []
    for i, (t, im) in enumerate(zip(texts, images)):
        if (t is None) == (im is None):
            raise Reject("schema", f"OBELICS position {i} must have exactly one of text and image non-null")
        if t is not None:
            if not isinstance(t, str):
                raise Reject("schema", f"OBELICS texts[{i}] must be a string")
            segments.append({"type": "text", "text": t})
        else:
            if not isinstance(im, str):
                raise Reject("schema", f"OBELICS images[{i}] must be a path string")
            segments.append({"type": "image", "path": im})
    if not segments:
        raise Reject("schema", "OBELICS record has no positions")
    meta = {k: v for k, v in obj.items() if k not in ("texts", "images")}
    return segments, meta


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
        """From the build's IngestSettings (or anything with its `limits` and `text` fields)."""
        return cls(image=settings.limits.max_image_bytes, video=settings.limits.max_video_bytes, text=settings.text.max_bytes)

    def for_ext(self, ext: str) -> int:
        role = member_role(ext)
        return {"image": self.image, "video": self.video, "other": SMALL_MEMBER}.get(role, self.text)


Members = list[tuple[str, "bytes | Unread"]]  # (extension, bytes or Unread) in tar order


def member_value(ti: tarfile.TarInfo, ext: str, limits: ReadLimits, read: Callable[[], bytes]) -> "bytes | Unread":
    """A member's bytes, or `Unread` when its header alone says it must not be read (sparse, or
    past its role's limit): a hostile header never sizes an allocation. `read()` reads the data."""
    if ti.issparse():
        return Unread(ti.size, "sparse")
    if ti.size > limits.for_ext(ext):
        return Unread(ti.size, "other" if member_role(ext) == "other" else "too-large")
    data = read()
    if len(data) != ti.size:
        raise Reject("truncated-tar", f"member {ti.name} holds {len(data)} of its {ti.size} bytes: the shard is truncated; re-download it")
    return data


def wds_members(tf: tarfile.TarFile) -> Iterator[tarfile.TarInfo]:
    """The members WebDataset reads (regular files, `__...__` meta members skipped), without
    tarfile keeping a list of them all (a shard may hold millions)."""
    while True:
        ti = tf.next()
        tf.members = []
        if ti is None:
            return
        if not ti.isreg() or ("/" not in ti.name and ti.name.startswith("__") and ti.name.endswith("__")) or _META_RE.match(ti.name):
            continue
        yield ti


def groups(tf: tarfile.TarFile, read: Callable[[tarfile.TarInfo, str], "bytes | Unread"] | None):
    """Yield [key, offset of the first header, end of the last member's data, [(ext, value, size)]]
    for each run of consecutive members of one key. `read` gives a member's value (None: headers
    only); it is called only after the key is known to continue the current sample, so the member
    after a sample is never read. An error carries the sample being read as `err.pending`."""
    return groups_of(wds_members(tf), read)


def groups_of(members: Iterator, read: Callable[[tarfile.TarInfo, str], "bytes | Unread"] | None):
    """`groups` over any iterator of members that WebDataset reads (`wds_members` of a tarfile, or
    `plain_members`: headers parsed directly)."""
    cur = None
    while True:
        try:
            ti = next(members)
        except StopIteration:
            break
        except Exception as err:
            err.pending = cur  # the sample being read when the tar broke: a caller keeps it when its data is all there
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


# --- headers parsed directly (data/tarheaders.py) ---------------------------------------------

def plain_members(f, start: int, stop: int) -> Iterator[PlainHeader]:
    """The members WebDataset reads (as `wds_members` filters them) of bytes [start, stop) of the
    seekable binary file `f` (`stop` at most its size, as the reader bounds a window), headers
    parsed directly (`tarheaders.plain_header`). Raises NotPlain where only tarfile can say what the bytes
    hold: read them again with tarfile."""
    pos = start
    while True:
        found = plain_header(f, pos, start, stop)
        if found is None:
            return
        ti, reg, pos = found
        name = ti.name
        if not reg or ("/" not in name and name.startswith("__") and name.endswith("__")) or _META_RE.match(name):
            continue
        yield ti


def plain_reader(f, limits: ReadLimits):
    """`read(ti, ext)` for `groups_of(plain_members(f, ...))`: `member_value` reading from `f`."""
    def data(ti: PlainHeader) -> bytes:
        f.seek(ti.offset_data)
        out = f.read(ti.size)
        if len(out) != ti.size:  # the file shrank under us: let tarfile say what it holds now
            raise NotPlain("short read")
        return out
    return lambda ti, ext: member_value(ti, ext, limits, lambda: data(ti))


def member_reader(limits: ReadLimits):
    """`read(ti, ext, tf)` for `groups`: `member_value` with tarfile's own reader."""
    def read(ti: tarfile.TarInfo, ext: str, tf: tarfile.TarFile):
        return member_value(ti, ext, limits, lambda: tf.extractfile(ti).read())
    return read


def read_sample_at(path: str, offset: int, limits: ReadLimits) -> tuple[str, Members]:
    """(key, members) of the sample whose first header is at `offset` of the uncompressed tar `path`."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            tf = tarfile.open(fileobj=f, mode="r:")  # headers from the current position on
            read = member_reader(limits)
            for key, _, _, members in groups(tf, lambda ti, ext: read(ti, ext, tf)):
                return key, [(e, v) for e, v, _ in members]
    except (tarfile.TarError, EOFError) as err:
        cur = getattr(err, "pending", None)
        if cur is not None:  # the tar breaks after this sample, whose members were all read whole
            return cur[0], [(e, v) for e, v, _ in cur[3]]
        raise Reject("corrupt-tar", f"the tar does not parse at byte {offset} ({err}); re-download or rewrite the shard") from None
    except OSError as err:
        raise Reject("unreadable", f"cannot read {path}: {err.strerror or err}; fix its permissions") from None
    raise Reject("corrupt-tar", f"no sample at byte {offset}: the shard changed since the build started; rerun with --overwrite")


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
               decode: Callable[[bytes, str], str] = _utf8,
               parse_document: Callable[[object], tuple[list[dict], dict]] | None = None) -> tuple[list[dict], dict, Counter]:
    """Map one WebDataset sample to a document: (segments, meta, notes). Pure: no I/O.

    `members` are (extension, bytes or `Unread`) in tar order, extensions in lower case as
    `split_key` gives them. Rules (docs/data-format.md, "WebDataset shards"), by the extension's
    last part (`member_role`):
    - image and video extensions -> image / video segments in member order, as
      `{"type", "path": "KEY.EXT", "_data": bytes or Unread}` (validated later like local files);
    - `txt`, `text`, `caption` -> the caption, a text segment after the media (before them with
      `caption_first`); a second caption member goes to meta under its extension; a zero-byte
      caption member is as none (img2dataset's null caption; note `empty-caption-member`);
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
    its text policy). `parse_document` checks an omniloom `doc.json` (the build's schema check);
    without it such a sample is refused (`omniloom-sample`): an omniloom shard has its own manifest."""
    notes: Counter = Counter()
    meta: dict = {"wds_key": key}
    exts = [e for e, _ in members]
    dup = sorted(e for e, n in Counter(exts).items() if n > 1) if len(set(exts)) != len(exts) else None
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
        if parse_document is None:
            raise Reject("omniloom-sample", f"sample {key} is a sample of an omniloom build (doc.json): train on that "
                                            "build's folder, whose manifest.json lists it")
        return _omniloom_sample(key, by_ext, meta, notes, parse_document)
    obelics = json_obj if isinstance(json_obj, dict) and "texts" in json_obj and "images" in json_obj else None
    if obelics is not None:
        return _obelics_sample(key, obelics, media, meta, notes, decode)

    captions = [e for c in CAPTION_EXTS for e, _ in members if e == c] or [e for e, _ in members if member_role(e) == "caption"]
    # img2dataset writes `KEY.txt` of zero bytes for a row whose caption is null: no caption, the
    # medium still a document (as without a caption member), never a sample dropped as empty.
    empty = [e for e in captions if by_ext[e] == b""]
    if empty:
        notes["empty-caption-member"] += len(empty)
        captions = [e for e in captions if e not in empty]
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


def _omniloom_sample(key: str, by_ext: dict, meta: dict, notes: Counter, parse_input_document):
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
    texts, images = obj["texts"], obj["images"]
    # Entries may be URLs or null placeholders; validate's parser wants strings, so check the
    # parallel-list rules on a copy whose image entries are their positions.
    probe = {"texts": texts, "images": [None if im is None else str(i) for i, im in enumerate(images)] if isinstance(images, list) else images}
    segs, _ = parse_obelics(probe)
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




# --- in place: the document the stream trains on ------------------------------------------------

_UTF8_BOM = b"\xef\xbb\xbf"


def decode_caption(data: bytes, what: str) -> str:
    """A caption member as the build decodes one under its default text policy, for UTF-8 bytes:
    a UTF-8 byte-order mark removed, a zero-byte caption or one holding NUL bytes refused. Bytes
    that are not UTF-8 are refused too (`bad-utf8`): the build would detect their encoding, which
    needs data/prep's detector; such captions are rare in WebDataset shards (writers write UTF-8)."""
    if not data:
        raise Reject("empty", f"zero-byte {what}")
    if data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM):]
    if b"\x00" in data:
        raise Reject("nul-bytes", f"{what} contains NUL bytes (first at byte {data.index(0)}); it is probably binary")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise Reject("bad-utf8", f"{what} is not valid UTF-8 (byte {err.start}); `omniloom data build` detects other "
                                 "encodings: build a copy of this shard, or re-encode the caption") from None


def document_from_sample(key: str, members: Members, *, limits: ReadLimits, caption_first: bool = False,
                         source: str = "") -> tuple[dict, dict[str, bytes]]:
    """The (doc.json, media by ref) of a foreign sample read in place: `map_sample`'s segments with
    the build's document rules (data/prep/ingest.py: `_finish`): empty text dropped, a text with a
    lone surrogate refused, a pair's unreadable medium refusing the sample and an OBELICS image
    dropping its segment, media named `img<i>.<ext>` / `vid<i>.<ext>` in order. Media are not
    decoded here: the tokenizer decodes them (an `omniloom data index --validate` already left
    out what the build would reject). Raises Reject."""
    segments, meta, _ = map_sample(key, members, caption_first=caption_first, decode=decode_caption)
    final, media = [], {}
    counters = {"image": 0, "video": 0}
    for i, seg in enumerate(segments):
        kind = seg["type"]
        if kind in ("text", "code"):
            m = lone_surrogate(seg["text"])
            if m:
                raise Reject("bad-utf8", f"sample {key} segment {i} holds a lone surrogate (\\u{ord(m.group()):04x})")
            if seg["text"].strip():
                final.append(seg)
            continue
        limit, flag = (limits.image, "--max-image-bytes") if kind == "image" else (limits.video, "--max-video-bytes")
        try:
            data = member_data(seg, limit, flag)
        except Reject:
            if seg.get("_standalone"):
                raise
            continue  # an OBELICS image: the build drops the segment (--on-bad-media drop-segment)
        ext = seg["path"].rsplit(".", 1)[-1]
        ref = f"{'img' if kind == 'image' else 'vid'}{counters[kind]}.{ext}"
        counters[kind] += 1
        final.append({"type": kind, "ref": ref})
        media[ref] = data
    if not final:
        raise Reject("empty", f"sample {key} has no usable segments (all text empty or all media unread)")
    if source:
        meta["source"] = source
    return {"schema": 1, "segments": final, "meta": meta}, media
