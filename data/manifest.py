"""The shard manifest (docs/data-format.md section 1) and random access to samples: shared by data prep (writer), the
stream reader and the tokenizer trainer.

Public helpers:
- `read_manifest(dir) -> dict`: load and check `DIR/manifest.json` (`parse_manifest` for text).
- `check_manifest(man, where)`: the one structural check every reader of a manifest gets (both
  functions above call it): the keys a reader navigates by, their types, and shard paths that stay
  inside the shard folder.
- `iter_documents(dir)`, `read_rejects(dir)`: a finished build read back.
- `iter_sample_at(tar_path, offset) -> (key, {member_suffix: bytes})`: read the one sample whose
  first member's 512-byte tar header starts at `offset`.
- `iter_shard_samples(tar_path) -> iterator of (offset, key, {suffix: bytes})`: read a shard
  front to back, grouping members into samples.
- `ReadLimits` / `member_refusal(tarinfo, suffix, limits)`: the build's size limits as a reader
  applies them, and whether a member may be read at all (decided from its header).
- `write_json_atomic(path, obj)`: temp file + fsync + rename, so no reader sees half a manifest.
"""

from __future__ import annotations

import json
import os
import re
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

FORMAT = "omniloom-shards"
VERSION = 1
MANIFEST = "manifest.json"
REJECTS = "rejects.jsonl"


def read_manifest(directory: str | os.PathLike) -> dict:
    """Load `directory/manifest.json` and check its format and version. Raises FileNotFoundError
    (no manifest: the build is unfinished or the path is wrong) or ValueError (not ours)."""
    path = os.path.join(os.fspath(directory), MANIFEST)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path} not found: {directory} is not a finished shard directory "
            "(run `omniloom data build ... --out DIR` to make one, or rerun it to finish)"
        )
    with open(path, encoding="utf-8") as f:
        return parse_manifest(f.read(), path)


def parse_manifest(text: str, where: str) -> dict:
    """A manifest's JSON text (read from `where`, a path or URL) as a dict, after checking its
    format and version; ValueError otherwise. Shared by the shard tools and the stream reader."""
    try:
        man = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{where} is not valid JSON ({err}); rebuild the shards with `omniloom data build`") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise ValueError(f"{where} is not an omniloom shard manifest (format {man.get('format') if isinstance(man, dict) else None!r})")
    if man.get("version") != VERSION:
        raise ValueError(f"{where} has manifest version {man.get('version')}; this omniloom reads version {VERSION}")
    return check_manifest(man, where)


_SCHEME_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # a URL or pipe: command (data/stream/reader.py reads them)
_REBUILD = "rebuild it with `omniloom data build` (or `omniloom data index` for an index)"


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _escapes(path: str) -> bool:
    """Whether a relative shard path climbs out of the folder it is relative to (`../x.tar`,
    `a/../../x.tar`), judged from the text alone: a shard the build wrote beside the manifest and
    then replaced by a link (to a larger disk) is still read."""
    depth = 0
    for part in path.replace("\\", "/").split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                return True
        elif part not in ("", "."):
            depth += 1
    return False


def shard_path_refusal(path, *, index: bool) -> str | None:
    """Why the shard path `path` of a manifest entry may not be read, or None. A `data build`
    manifest names each shard by its file name in the manifest's folder (docs/data-format.md): an
    absolute path or a name whose `../` leaves the folder would have `train`, `eval` and
    `data verify` read a file the build never wrote. An index (`data index`) names shards where
    they lie: an absolute path or a URL (http(s)://, pipe: ...) is what it writes; a relative one
    is relative to the index's folder and may not leave it either."""
    if not isinstance(path, str) or not path:
        return "is not a non-empty string"
    if "\x00" in path:
        return "holds a NUL byte"
    if index and (os.path.isabs(path) or _SCHEME_RE.match(path)):
        return None
    how = "an index names a shard by its absolute path or URL" if index else "a build names its shards by file name"
    if os.path.isabs(path):
        return f"is an absolute path, outside the shard folder ({how})"
    if _escapes(path):
        return f"points outside the {'index' if index else 'shard'} folder ({how})"
    return None


def check_manifest(man: dict, where: str) -> dict:
    """`man` (a parsed manifest whose format and version are checked) after checking what every
    reader navigates by, so that `train`, `eval`, `data verify`, `data stats` and `data inspect`
    refuse a malformed manifest alike, in one line naming the file and the key (ValueError),
    instead of a KeyError or TypeError in one of them. Checked: `kind` and `name` strings; `shards` a list of
    objects, each with a `name` (and for an index, a `url`) that stays inside the shard folder
    (`shard_path_refusal`), a `samples` list and numbers where counts go; `totals`, `rejects` and
    `settings` objects. What a sample entry holds is not checked here: a lying offset or key costs
    only its sample (a counted skip while training, a problem line in `data verify`)."""
    def refuse(key: str, what: str):
        raise ValueError(f"{where}: {key} {what}; {_REBUILD}")

    for key in ("kind", "name"):
        if key in man and not isinstance(man[key], str):
            refuse(f"'{key}'", f"is {man[key]!r}, not a string")
    index = man.get("kind") == "index"
    shards = man.get("shards")
    if not isinstance(shards, list):
        refuse("'shards'", "is missing" if shards is None else f"is a {type(shards).__name__}, not a list of shard entries")
    for i, entry in enumerate(shards):
        at = f"shards[{i}]"
        if not isinstance(entry, dict):
            refuse(at, f"is a {type(entry).__name__}, not an object with name and samples")
        name = entry.get("name")
        if not isinstance(name, str) or not name:
            refuse(f"{at}.name", "is missing" if name is None else f"is {name!r}, not a file name")
        url = entry.get("url") if index else None
        path_key, path = (f"{at}.url", url) if index and url is not None else (f"{at}.name", name)
        why = shard_path_refusal(path, index=index)
        if why:
            refuse(f"{path_key} {path!r}", why)
        samples = entry.get("samples", [])
        if not isinstance(samples, list):
            refuse(f"{at}.samples", f"is a {type(samples).__name__}, not a list")
        for key in ("num_samples", "bytes", "mtime_ns"):
            if key in entry and not _number(entry[key]):
                refuse(f"{at}.{key}", f"is {entry[key]!r}, not a number")
        if "sha256" in entry and not isinstance(entry["sha256"], str):
            refuse(f"{at}.sha256", f"is {entry['sha256']!r}, not a string")
    for key in ("totals", "rejects", "settings"):
        if key in man and not isinstance(man[key], dict):
            refuse(f"'{key}'", f"is a {type(man[key]).__name__}, not an object")
    totals = man.get("totals") or {}
    if "documents" in totals and not _number(totals["documents"]):
        refuse("totals.documents", f"is {totals['documents']!r}, not a number")
    for key, counts in (("totals.segments", totals.get("segments")), ("totals.media_bytes", totals.get("media_bytes")),
                        ("rejects.by_code", (man.get("rejects") or {}).get("by_code"))):
        if counts is not None and not (isinstance(counts, dict) and all(_number(v) for v in counts.values())):
            refuse(key, f"is {str(counts)[:80]}, not an object of counts")
    return man


# The build's default limits (its --max-text-bytes, --max-image-bytes, --max-video-bytes): defined
# here, where builds and readers both find them (data/prep's TextPolicy and MediaLimits default to them).
DEFAULT_MAX_TEXT_BYTES = 16 << 20
DEFAULT_MAX_IMAGE_BYTES = 64 << 20
DEFAULT_MAX_VIDEO_BYTES = 1 << 30
DOC_JSON_GROWTH = 8  # a doc.json holds one input's text, which JSON escaping grows up to 6x (\u0001), and its meta


@dataclass(frozen=True, kw_only=True)
class ReadLimits:
    """The largest tar member a reader accepts, by kind: what `omniloom data build` lets into a
    shard (its --max-text-bytes, --max-image-bytes and --max-video-bytes, as the manifest's
    `settings` record them; the build's defaults when a manifest has none). A member past its
    limit is skipped unread (`oversize_member`), so a hostile header cannot size an allocation."""

    doc_json_bytes: int = DOC_JSON_GROWTH * DEFAULT_MAX_TEXT_BYTES
    image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    video_bytes: int = DEFAULT_MAX_VIDEO_BYTES

    @classmethod
    def from_settings(cls, settings) -> "ReadLimits":
        """The limits of a build from its manifest's `settings` (missing or malformed values: the defaults)."""
        settings = settings if isinstance(settings, dict) else {}
        text, media = settings.get("text"), settings.get("limits")
        text, media = (text if isinstance(text, dict) else {}), (media if isinstance(media, dict) else {})
        default = cls()

        def size(value, fallback: int, scale: int = 1) -> int:
            ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
            return value * scale if ok else fallback

        return cls(doc_json_bytes=size(text.get("max_bytes"), default.doc_json_bytes, DOC_JSON_GROWTH),
                   image_bytes=size(media.get("max_image_bytes"), default.image_bytes),
                   video_bytes=size(media.get("max_video_bytes"), default.video_bytes))

    def for_member(self, suffix: str) -> tuple[int, str]:
        """(limit in bytes, the build option behind it) of the member `KEY.<suffix>`; the build
        names media `img<i>.<ext>` and `vid<i>.<ext>`; another member gets the largest limit."""
        if suffix == "doc.json":
            return self.doc_json_bytes, f"{DOC_JSON_GROWTH} x --max-text-bytes"
        if suffix.startswith("img"):
            return self.image_bytes, "--max-image-bytes"
        if suffix.startswith("vid"):
            return self.video_bytes, "--max-video-bytes"
        return max(self.doc_json_bytes, self.image_bytes, self.video_bytes), "the largest of the build's limits"


def member_refusal(info: tarfile.TarInfo, suffix: str, limits: ReadLimits) -> tuple[str, str] | None:
    """(skip reason, message) when the member `KEY.<suffix>` must not be read, from its header
    alone: sparse (tarfile fills the holes with zeros in memory: a 30 KB shard can hold 3 GiB),
    or larger than the build lets into a shard. None when it may be read."""
    if info.issparse():
        return "sparse_member", (f"member {suffix!r} is a sparse file ({info.size} bytes once its holes are filled); "
                                 "`omniloom data build` writes none: the shard was made elsewhere; left unread")
    limit, option = limits.for_member(suffix)
    if info.size > limit:
        return "oversize_member", f"member {suffix!r} is {info.size} bytes, above the build's limit of {limit} ({option}); left unread"
    return None


def write_json_atomic(path: str | os.PathLike, obj, *, indent: int | None = 1) -> None:
    """Write JSON so a crash leaves either the old file or the complete new one."""
    path = os.fspath(path)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        # dumps, not dump: the same text, but dump streams through the pure-Python encoder
        f.write(json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False))
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(directory: str) -> None:
    """Make a rename durable (POSIX: the directory entry lives in the directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def split_member(name: str) -> tuple[str, str]:
    """`KEY.img0.jpg` -> ("KEY", "img0.jpg"): WebDataset's rule, the key ends at the first dot of
    the file name; a folder part stays in the key (`./d/KEY.doc.json` -> ("./d/KEY", "doc.json"))."""
    directory, base = os.path.split(name)
    key, _, suffix = base.partition(".")
    return (os.path.join(directory, key) if directory else key), suffix


def iter_sample_at(tar_path: str | os.PathLike, offset: int) -> tuple[str, dict[str, bytes]]:
    """Read the sample whose first member's header starts at byte `offset` of `tar_path` (the
    `offset` a manifest lists). Returns (key, {member_suffix: bytes}), e.g.
    ("3f2a...", {"doc.json": b"...", "img0.jpg": b"..."}). tarfile parses the headers, so pax and
    GNU long-name headers (webdataset's TarWriter writes pax) are read like plain ones."""
    members: dict[str, bytes] = {}
    key = None
    if offset < 0:
        raise ValueError(f"{tar_path}: the manifest gives a sample no byte offset; run `omniloom data verify`")
    with open(tar_path, "rb") as f:
        f.seek(offset)
        try:
            with tarfile.open(fileobj=f, mode="r|") as tf:
                for info in tf:
                    k, suffix = split_member(info.name)
                    if key is None:
                        key = k
                    elif k != key:
                        break
                    members[suffix] = tf.extractfile(info).read() if info.isfile() else b""
        except (tarfile.TarError, EOFError) as err:
            if key is None:
                raise ValueError(f"{tar_path}: no valid tar header at byte {offset} ({err})") from None
            raise ValueError(f"{tar_path}: sample {key} at byte {offset} is truncated or corrupt ({err})") from None
    if key is None:
        raise ValueError(f"{tar_path}: no sample at byte {offset}")
    return key, members


def iter_documents(directory: str | os.PathLike) -> Iterator[tuple[str, dict, dict[str, bytes]]]:
    """(key, doc.json as a dict, {member_suffix: bytes}) of every sample of a built folder, in
    manifest order: a build read back whole (tests, notebooks; `omniloom data inspect` shows one)."""
    for shard in read_manifest(directory)["shards"]:
        for smp in shard.get("samples", []):
            key, members = iter_sample_at(os.path.join(directory, shard["name"]), sample_entry(smp)[1])
            yield key, json.loads(members["doc.json"]), members


def read_rejects(directory: str | os.PathLike) -> list[dict]:
    """The lines of a build's rejects.jsonl (none when the file is absent)."""
    path = os.path.join(directory, REJECTS)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@dataclass(frozen=True)
class Refused:
    """A member `iter_shard_samples(limits=...)` left unread, and why (`member_refusal`)."""

    reason: str
    message: str


def iter_shard_samples(tar_path: str | os.PathLike, *, only: tuple[str, ...] | None = None,
                       limits: ReadLimits | None = None) -> Iterator[tuple[int, str, dict[str, bytes | Refused | None]]]:
    """Yield (offset, key, {suffix: bytes}) for every sample of a shard in file order. With `only`,
    read only those members' data; the others map to None (skipped, never read). With `limits`,
    a member that `member_refusal` refuses maps to a `Refused` and is never read."""
    with tarfile.open(tar_path, "r:") as tf:
        cur_key, cur_off, cur = None, 0, {}
        for info in tf:
            k, suffix = split_member(info.name)
            if k != cur_key:
                if cur_key is not None:
                    yield cur_off, cur_key, cur
                cur_key, cur_off, cur = k, info.offset, {}
            refused = member_refusal(info, suffix, limits) if limits is not None else None
            if refused is not None:
                cur[suffix] = Refused(*refused)
            elif only is None or suffix in only:
                cur[suffix] = tf.extractfile(info).read() if info.isfile() else b""
            else:
                cur[suffix] = None
        if cur_key is not None:
            yield cur_off, cur_key, cur


def sample_entry(smp) -> tuple[str, int]:
    """(key, offset) of a manifest's sample entry; ("", -1) for what is not there or not of its type
    (`check_manifest` leaves sample entries to the reader: a lie costs only its sample)."""
    smp = smp if isinstance(smp, dict) else {}
    key, offset = smp.get("key"), smp.get("offset")
    ok = isinstance(offset, int) and not isinstance(offset, bool) and offset >= 0
    return (key if isinstance(key, str) else ""), (offset if ok else -1)


def sample_index(manifest: dict) -> list[tuple[str, str, int]]:
    """Flat (shard name, key, offset) for every sample, in manifest order (`sample_entry`)."""
    return [(s["name"], *sample_entry(smp)) for s in manifest["shards"] for smp in s.get("samples", [])]
