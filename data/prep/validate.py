"""Validation of everything that is not pixels: text decoding, the document JSON schema, and media
references that must stay inside their source root (data prep, docs/data-format.md section 1).

Every check raises `Reject(code, reason)`: `code` is a short stable tag for counting, `reason` is a
sentence a person can act on. The ingest code turns these into lines of `rejects.jsonl`.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import unicodedata
from dataclasses import dataclass

from omniloom.data.manifest import DEFAULT_MAX_TEXT_BYTES
# Reject, loads_finite and the OBELICS rule are shared with the training stream (data/wds.py).
from omniloom.data.wds import Reject, loads_finite, parse_obelics  # noqa: F401 - re-exported

from .textenc import Detection, bom_encoding, detect_encoding, html_declared_encoding

SEGMENT_TYPES = ("text", "code", "image", "video")
MEDIA_TYPES = ("image", "video")


@dataclass(frozen=True, kw_only=True)
class TextPolicy:
    """How text bytes become a string.

    bad_utf8: "reject" (default: the file is probably not text, or mis-encoded) or "replace"
    (invalid sequences become U+FFFD). nul: "reject" (NUL bytes in prose or code almost always mean a
    binary file with a text extension) or "strip". A byte-order mark (UTF-8, UTF-16, UTF-32) picks
    the encoding and is removed; an HTML page's declared charset is honoured (see `textenc`); bytes
    that are valid UTF-8 are UTF-8. undeclared_encoding: what happens to bytes with neither that are
    not valid UTF-8: "detect" (default: `textenc.detect_encoding`, used only when confident) or
    "utf-8" (no guessing). The bad_utf8 policy then applies to whatever is still undecodable. Line
    endings and whitespace are kept byte for byte (code depends on them).
    """

    bad_utf8: str = "reject"
    nul: str = "reject"
    max_bytes: int = DEFAULT_MAX_TEXT_BYTES
    undeclared_encoding: str = "detect"

    def __post_init__(self):
        if self.bad_utf8 not in ("reject", "replace"):
            raise ValueError(f"bad_utf8 must be 'reject' or 'replace', got {self.bad_utf8!r}")
        if self.nul not in ("reject", "strip"):
            raise ValueError(f"nul must be 'reject' or 'strip', got {self.nul!r}")
        if self.undeclared_encoding not in ("detect", "utf-8"):
            raise ValueError(f"undeclared_encoding must be 'detect' or 'utf-8', got {self.undeclared_encoding!r}")


@dataclass(frozen=True)
class Decoded:
    """Text and where its encoding came from. `source`: "utf-8" (nothing declared, UTF-8 bytes, or
    UTF-8 with U+FFFD under --bad-utf8 replace), "bom", "declared" (an HTML page's charset) or
    "detected" (`detection` holds the measures)."""

    text: str
    codec: str
    source: str
    detection: Detection | None = None


def decode_text(data: bytes, policy: TextPolicy, *, what: str = "file", html: bool = False, strict_utf8: bool = False) -> str:
    """Decode `data` under `policy` (encoding chosen by `textenc`: a BOM, else for HTML the page's
    declared charset, else UTF-8, else a confident detection); raise Reject for empty, oversized,
    NUL-bearing or mis-encoded input. `strict_utf8` (JSON, which is UTF-8 by specification) skips
    detection."""
    return decode_bytes(data, policy, what=what, html=html, strict_utf8=strict_utf8).text


def decode_bytes(data: bytes, policy: TextPolicy, *, what: str = "file", html: bool = False, strict_utf8: bool = False) -> Decoded:
    """`decode_text`, returning a `Decoded` (text, codec, and whether it was declared or detected)."""
    if len(data) == 0:
        raise Reject("empty", f"zero-byte {what}")
    if len(data) > policy.max_bytes:
        raise Reject("too-large", f"{what} is {len(data)} bytes, above --max-text-bytes {policy.max_bytes}")
    how = "UTF-8, the default"
    bom = bom_encoding(data)
    declared = html_declared_encoding(data) if html and not bom else None
    source, detection = "utf-8", None
    if bom:
        codec, n = bom
        data = data[n:]
        how = "its byte-order mark"
        source = "bom"
    elif declared:
        codec, label = declared
        how = f"its declared charset {label!r}"
        source = "declared"
    else:
        codec = "utf-8"
    wide = codec.startswith(("utf-16", "utf-32"))  # NUL bytes are part of every character there
    if not wide and b"\x00" in data:
        if policy.nul == "reject":
            pos = data.index(b"\x00")
            raise Reject(
                "nul-bytes",
                f"{what} contains NUL bytes (first at byte {pos}); it is probably binary. "
                "Remove it, or pass --nul strip to drop NULs",
            )
        data = data.replace(b"\x00", b"")
    try:
        text = data.decode(codec)  # valid UTF-8 is decided here and never reaches the detector
    except UnicodeDecodeError as err:
        undeclared = source == "utf-8"
        if undeclared and policy.undeclared_encoding == "detect" and not strict_utf8:
            detection = detect_encoding(data, html=html)
        if detection is not None and detection.codec:
            codec, source = detection.codec, "detected"
            text = data.decode(codec)  # detect_encoding checked that the whole input decodes
        elif policy.bad_utf8 == "reject":
            where = f"byte {err.start}: {err.reason}"
            if undeclared and strict_utf8:
                raise Reject("bad-utf8", f"{what} is not valid UTF-8 ({where}); JSON is UTF-8 by specification, so it is never "
                             "guessed: re-encode it as UTF-8, or pass --bad-utf8 replace to keep it with U+FFFD replacements") from None
            if undeclared:
                declare = ", declare its charset (<meta charset>)," if html else ""
                why = (f"its encoding was not detected with confidence ({detection.why})" if detection is not None
                       else "--undeclared-encoding utf-8 guesses nothing")
                raise Reject(
                    "bad-utf8",
                    f"{what} is not valid UTF-8 ({where}), declares no other encoding, and {why}; "
                    f"re-encode it as UTF-8{declare} or pass --bad-utf8 replace to keep it with U+FFFD replacements",
                ) from None
            raise Reject(
                "bad-encoding",
                f"{what} is not valid {codec} (the encoding given by {how}; {where}); "
                "fix the file or its declaration, or pass --bad-utf8 replace to keep it with U+FFFD replacements",
            ) from None
        else:
            text = data.decode(codec, errors="replace")
    if wide and "\x00" in text:
        if policy.nul == "reject":
            raise Reject("nul-bytes", f"{what} contains NUL characters (first at character {text.index(chr(0))}); it is probably binary. "
                         "Remove it, or pass --nul strip to drop NULs")
        text = text.replace("\x00", "")
    if not text.strip():
        raise Reject("empty", f"{what} holds only whitespace")
    return Decoded(text, codec, source, detection if source == "detected" else None)


_SURROGATE = re.compile("[\ud800-\udfff]")


def printable(s: str) -> str:
    """`s` as valid Unicode for a JSON file. A file name that is not valid UTF-8 reaches Python
    with each undecodable byte as a lone surrogate (U+DC80-U+DCFF, PEP 383); it is written as
    the four characters `\\xNN` (Python's backslashreplace form, so `caf\\xe9.txt` names the
    Latin-1 file `caf<0xE9>.txt`). Any other lone surrogate (a JSON `\\ud800` escape) becomes U+FFFD."""
    if not _SURROGATE.search(s):
        return s
    return _SURROGATE.sub(lambda m: f"\\x{ord(m.group()) - 0xDC00:02x}" if 0xDC80 <= ord(m.group()) <= 0xDCFF else "\ufffd", s)


def json_safe(obj):
    """`obj` with every string (dict keys too) made `printable`, so it encodes as valid UTF-8, and
    every non-finite float as None, so it encodes as strict JSON (input JSON is already counted by
    `loads_finite`; this is the guard for values computed from media)."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {json_safe(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def check_unicode_text(text: str, policy: TextPolicy, *, what: str) -> str:
    """Text that arrived as JSON may hold lone surrogates (`\\ud800` escapes), which no UTF-8 file
    can hold: reject them under --bad-utf8 reject, replace them with U+FFFD under replace."""
    m = _SURROGATE.search(text)
    if not m:
        return text
    if policy.bad_utf8 == "reject":
        raise Reject(
            "bad-utf8",
            f"{what} holds a lone surrogate (\\u{ord(m.group()):04x} at character {m.start()}), which is not valid Unicode; "
            "fix the text, or pass --bad-utf8 replace to keep it with U+FFFD replacements",
        )
    return _SURROGATE.sub("\ufffd", text)


_WS = re.compile(r"\s+")


def normalize_for_dedup(text: str) -> str:
    """The text form exact-duplicate detection compares: NFC, whitespace runs collapsed, trimmed."""
    return _WS.sub(" ", unicodedata.normalize("NFC", text)).strip()


def segment_fingerprint(seg_type: str, payload: bytes | str) -> bytes:
    """Digest of one segment for duplicate detection: normalized prose, code exactly as written
    (its whitespace is meaning: two Python files that differ only in indentation are different
    programs), or the media bytes."""
    h = hashlib.blake2b(digest_size=16)
    h.update(seg_type.encode())
    h.update(b"\0")
    if isinstance(payload, str):
        text = normalize_for_dedup(payload) if seg_type == "text" else payload
        h.update(text.encode("utf-8", "surrogatepass"))
    else:
        h.update(payload)
    return h.digest()


def document_fingerprint(segment_digests: list[bytes]) -> str:
    """Two documents are exact duplicates when their segment sequences have the same digests."""
    h = hashlib.blake2b(digest_size=16)
    for d in segment_digests:
        h.update(d)
    return h.hexdigest()


_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def resolve_inside(root: str, base_dir: str, ref: str) -> str:
    """Resolve the media reference `ref` (relative to `base_dir`) to a real file path that lies
    inside `root`. Raises Reject for URLs, absolute paths, `..` escapes, symlinks that lead out of
    the root, symlink loops and missing files."""
    if not isinstance(ref, str) or not ref.strip():
        raise Reject("bad-ref", f"media reference {ref!r} is empty or not a string")
    if _SCHEME.match(ref) and not re.match(r"^[a-zA-Z]:[\\/]", ref):
        raise Reject(
            "remote-ref",
            f"media reference {ref!r} is a URL; pass --fetch-media to download http(s) media during the build, "
            "or download the media first and reference it by a path relative to the document",
        )
    if os.path.isabs(ref):
        raise Reject("bad-ref", f"media reference {ref!r} is absolute; use a path relative to the document")
    joined = os.path.normpath(os.path.join(base_dir, ref))
    # Lexical check first so a `..` escape is named as such, then the strict real-path check
    # catches symlinks that lead out and symlink loops.
    if not _inside(os.path.abspath(root), joined):
        raise Reject("escapes-root", f"media reference {ref!r} points outside the source root {root} (a '..' escape)")
    return real_file_inside(root, joined, what=f"media reference {ref!r}")


def real_file_inside(root: str, path: str, *, what: str) -> str:
    """Resolve symlinks in `path` strictly and check the result is a regular file inside `root`."""
    try:
        real = os.path.realpath(path, strict=True)
    except FileNotFoundError:
        raise Reject("missing", f"{what}: file {path} does not exist") from None
    except OSError as err:
        if err.errno == 40 or "symbolic links" in str(err):  # ELOOP
            raise Reject("symlink-loop", f"{what}: symlink loop at {path}; remove or fix the link") from None
        raise Reject("unreadable", f"{what}: cannot resolve {path}: {err.strerror or err}") from None
    if not _inside(os.path.realpath(root), real):
        raise Reject(
            "escapes-root",
            f"{what}: {path} resolves to {real}, outside the source root {root} (a symlink out); "
            "copy the file into the root or pass its folder as a SOURCE",
        )
    if not os.path.isfile(real):
        raise Reject("not-a-file", f"{what}: {path} is not a regular file")
    return real


def _inside(root: str, path: str) -> bool:
    try:
        return os.path.commonpath([root, os.path.abspath(path)]) == root
    except ValueError:  # different drives
        return False


# --- the document schema (docs/data-format.md section 1) and the OBELICS layout, as input JSONL ---------------------

_DOC_KEYS = {"schema", "segments", "meta", "id"}
_SEG_KEYS = {
    "text": {"type", "text"},
    "code": {"type", "text", "lang"},
    "image": {"type", "ref", "path"},
    "video": {"type", "ref", "path"},
}


def parse_input_document(obj) -> tuple[list[dict], dict]:
    """Check one JSONL record and return (segments, meta) in a uniform form: text/code segments as
    in docs/data-format.md section 1, media segments as `{"type": "image"|"video", "path": relative path}`.

    Accepts the omniloom schema (`{"schema": 1, "segments": [...], "meta": {...}}`, media by `ref`
    or `path`) and the OBELICS layout (parallel `texts` / `images` lists, exactly one non-null per
    position; extra keys go to meta)."""
    if not isinstance(obj, dict):
        raise Reject("schema", f"a JSONL line must hold a JSON object, got {type(obj).__name__}")
    if "segments" in obj:
        return _parse_omniloom(obj)
    if "texts" in obj and "images" in obj:
        return _parse_obelics(obj)
    if "text_list" in obj and "image_info" in obj:
        return parse_mmc4(obj)
    raise Reject(
        "schema",
        "unknown record layout: expected 'segments' (omniloom schema, docs/data-format.md), parallel "
        f"'texts' and 'images' lists (OBELICS) or 'text_list' and 'image_info' (MMC4); got keys {sorted(obj)[:8]}",
    )


def parse_mmc4(obj: dict) -> tuple[list[dict], dict]:
    """The MMC4 layout: sentences in `text_list`, images in `image_info` assigned to a sentence by
    `matched_text_index`. Each image goes before its sentence (OpenFlamingo's reading of MMC4),
    images of one sentence in `image_info` order; the sentences between two images are one text
    segment, joined by a space. An image is its `raw_url` (fetched with --fetch-media), else its
    `image_name` (a path relative to the JSONL file). Other keys, `image_info` included, go to meta."""
    texts, infos = obj["text_list"], obj["image_info"]
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts) or not isinstance(infos, list):
        raise Reject("schema", "MMC4 'text_list' must be a list of strings and 'image_info' a list")
    before: dict[int, list[str]] = {}
    for j, info in enumerate(infos):
        where = info.get("matched_text_index") if isinstance(info, dict) else None
        ref = (info.get("raw_url") or info.get("image_name")) if isinstance(info, dict) else None
        if not isinstance(where, int) or isinstance(where, bool) or not 0 <= where < len(texts):
            raise Reject("schema", f"MMC4 image_info[{j}] needs a matched_text_index within text_list (0..{len(texts) - 1})")
        if not isinstance(ref, str) or not ref:
            raise Reject("schema", f"MMC4 image_info[{j}] needs a raw_url (or image_name) string")
        before.setdefault(where, []).append(ref)
    segments, run = [], []
    for i, text in enumerate(texts):
        if i in before:
            if run:
                segments.append({"type": "text", "text": " ".join(run)})
                run = []
            segments += [{"type": "image", "path": ref} for ref in before[i]]
        run.append(text)
    if run:
        segments.append({"type": "text", "text": " ".join(run)})
    if not segments:
        raise Reject("schema", "MMC4 record has no sentences and no images")
    return segments, {k: v for k, v in obj.items() if k != "text_list"}


def _parse_omniloom(obj: dict) -> tuple[list[dict], dict]:
    extra = set(obj) - _DOC_KEYS
    if extra:
        raise Reject("schema", f"unknown top-level keys {sorted(extra)}; allowed: {sorted(_DOC_KEYS)}")
    if obj.get("schema", 1) != 1:
        raise Reject("schema", f"schema version {obj.get('schema')!r} is not supported (only 1)")
    segs_in = obj["segments"]
    if not isinstance(segs_in, list) or not segs_in:
        raise Reject("schema", "'segments' must be a non-empty list")
    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise Reject("schema", f"'meta' must be an object, got {type(meta).__name__}")
    meta = dict(meta)
    if "id" in obj:
        meta.setdefault("id", obj["id"])
    segments = []
    for i, seg in enumerate(segs_in):
        if not isinstance(seg, dict):
            raise Reject("schema", f"segment {i} must be an object, got {type(seg).__name__}")
        kind = seg.get("type")
        if kind not in SEGMENT_TYPES:
            raise Reject("schema", f"segment {i} has type {kind!r}; allowed: {list(SEGMENT_TYPES)}")
        extra = set(seg) - _SEG_KEYS[kind]
        if extra:
            raise Reject("schema", f"segment {i} ({kind}) has unknown keys {sorted(extra)}; allowed: {sorted(_SEG_KEYS[kind])}")
        if kind in ("text", "code"):
            if not isinstance(seg.get("text"), str):
                raise Reject("schema", f"segment {i} ({kind}) needs a string 'text'")
            if kind == "code" and not (isinstance(seg.get("lang"), str) and seg["lang"]):
                raise Reject("schema", f"segment {i} (code) needs a non-empty string 'lang'")
            segments.append(dict(seg))
        else:
            ref = seg.get("path", seg.get("ref"))
            if not isinstance(ref, str) or not ref:
                raise Reject("schema", f"segment {i} ({kind}) needs a string 'path' (or 'ref') to a media file")
            segments.append({"type": kind, "path": ref})
    return segments, meta


_parse_obelics = parse_obelics  # the OBELICS rule is the data root's (data/wds.py)


def check_output_document(doc, member_suffixes: set[str]) -> list[str]:
    """Problems with a doc.json read back from a shard (used by verify); empty when it is valid."""
    problems = []
    if not isinstance(doc, dict) or doc.get("schema") != 1 or not isinstance(doc.get("segments"), list):
        return ["doc.json is not {'schema': 1, 'segments': [...], 'meta': {...}}"]
    if not isinstance(doc.get("meta", {}), dict):
        problems.append("meta is not an object")
    refs = set()
    for i, seg in enumerate(doc["segments"]):
        kind = seg.get("type") if isinstance(seg, dict) else None
        if kind not in SEGMENT_TYPES:
            problems.append(f"segment {i} has bad type {kind!r}")
        elif kind in MEDIA_TYPES:
            ref = seg.get("ref")
            if ref not in member_suffixes:
                problems.append(f"segment {i} refers to {ref!r}, which is not a member of the sample")
            refs.add(ref)
        elif not isinstance(seg.get("text"), str):
            problems.append(f"segment {i} ({kind}) has no text")
    extra = member_suffixes - refs - {"doc.json"}
    if extra:
        problems.append(f"members not referenced by any segment: {sorted(extra)}")
    return problems
