"""Ingest for `omniloom data build`: discover inputs, and turn one input unit into one validated
document (docs/data-format.md section 1) with its media bytes, or into rejects.

Discovery is single-process and cheap (a directory walk, plus a parse of HTML pages and JSONL files
to learn which media they reference); it yields `Unit`s in a deterministic order. Processing a unit
(`process_unit`) is the expensive part (full image decodes, video demuxing) and runs in worker
processes; it is a pure function of the unit and the settings, which is what makes the output
independent of the worker count.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import posixpath
from collections import Counter
from dataclasses import replace

from .fetch import is_media_url, read_fetched
from .foreign import expand_sources, is_remote, is_tar_name, load_foreign_sample, member_data, remote_name, tar_units
from .html_doc import extract_html, local_refs
from .media import still_image_format, validate_still, validate_video
from .parquet import is_parquet_name, load_parquet_row, parquet_units
from .sniff import decide_animated, earlier_build_file, probe_media, shard_metadata_file
from .textcorpus import compressed_file_unit, is_jsonl_name, open_input, parse_record, read_bounded, split_compression
from .units import (
    CACHE_DIRS,
    CACHE_EXT,
    CODE_EXT,
    CODE_NAMES,
    HTML_EXT,
    IMAGE_EXT,
    JSONL_EXT,
    PROSE_EXT,
    VIDEO_EXT,
    IngestSettings,
    Unit,
    iter_lines,
)
from .validate import (
    Reject,
    TextPolicy,
    check_unicode_text,
    decode_bytes,
    decode_text,
    document_fingerprint,
    json_safe,
    loads_finite,
    parse_input_document,
    real_file_inside,
    resolve_inside,
    segment_fingerprint,
)

log = logging.getLogger(__name__)

# Note: ".ts" is TypeScript unless its head is an MPEG transport stream (see _looks_like_text).
_TS_PACKET = 188
_TS_SNIFF_PACKETS = 5
_TS_MIN_PACKETS = 3  # PAT, PMT and one packet of data: a file that holds fewer is not a transport stream
CAPTION_KEYS = ("caption", "text", "alt", "title", "description")
# rejects.jsonl codes whose input is not dropped: the line records what was done to it (its
# `action`), and the build summary lists them apart from the rejections.
NOTICE_CODES = ("encoding-detected", "non-finite-number")


# --- discovery -------------------------------------------------------------------------------


def discover(sources: list[str], *, exclude: list[str] = (), standalone_referenced: bool = False, max_text_bytes: int = 16 << 20,
             undeclared_encoding: str = "detect", include_hidden: bool = False, skipped: Counter | None = None,
             parquet_columns: tuple = ("", ())) -> list[Unit]:
    """Walk `sources` (folders, single files, or remote tar shards: http(s) URLs and pipe:
    commands, `foreign.is_remote`) into units in a deterministic order.

    Hidden files and folders (dot-names) and caches (`__pycache__` folders, `.pyc`/`.pyo` files)
    are skipped and counted in `skipped` ("hidden", "cache") unless `include_hidden`; the
    `exclude` paths (the build's own output) always are. `parquet_columns`: (--text-column,
    --image-column values) for parquet files. Symlinked folders are not followed (they
    are reported). Media files that an HTML page
    or JSONL record in the same source references are not also made standalone documents unless
    `standalone_referenced`. Memory stays bounded by `max_text_bytes` (--max-text-bytes): JSONL
    files are streamed in chunks, and a longer line or HTML page is never held whole here. HTML
    pages are decoded for their references as the build decodes them (`undeclared_encoding`, the
    --undeclared-encoding setting)."""
    excluded = {os.path.realpath(p) for p in exclude}
    units: list[Unit] = []
    skipped = Counter() if skipped is None else skipped

    def skip(name: str, folder: bool) -> bool:
        if include_hidden:
            return False
        kind = "hidden" if name.startswith(".") else "cache" if (name in CACHE_DIRS if folder else
                                                                 os.path.splitext(name)[1].lower() in CACHE_EXT) else ""
        if kind:
            skipped[kind] += 1
        return bool(kind)

    seen_real: dict[str, str] = {}
    labels = Counter()
    for source in expand_sources(sources):
        if is_remote(source):  # an http(s) URL or pipe: command: one tar shard, read front to back (foreign.py)
            name = remote_name(source)
            if source in seen_real:
                raise ValueError(f"source {source} is given twice; pass each source once")
            seen_real[source] = source
            base = posixpath.basename(posixpath.dirname(name)) or "root"  # as for a local shard: its folder's name
            labels[base] += 1
            label = base if labels[base] == 1 else f"{base}~{labels[base]}"
            units.extend(replace(u, label=label) for u in tar_units(source, "", posixpath.basename(name), url=source))
            continue
        if not os.path.exists(source) and not os.path.islink(source):
            raise FileNotFoundError(f"source {source} does not exist; pass folders or files to build from")
        real = os.path.realpath(source)
        if real in seen_real:
            raise ValueError(f"source {source} is given twice (also as {seen_real[real]}); pass each source once")
        seen_real[real] = source
        # Folder name (or a single file's parent folder name); a repeated name gets ~N so keys stay unique.
        base = os.path.basename(os.path.abspath(source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source)))) or "root"
        labels[base] += 1
        label = base if labels[base] == 1 else f"{base}~{labels[base]}"
        first = len(units)
        if os.path.isdir(source):
            root = os.path.abspath(source)
            files: list[str] = []
            for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
                if os.path.realpath(dirpath) in excluded:
                    dirnames[:] = []
                    continue
                keep = []
                for d in sorted(dirnames):
                    full = os.path.join(dirpath, d)
                    if skip(d, folder=True):
                        continue
                    if os.path.islink(full):
                        rel = os.path.relpath(full, root).replace(os.sep, "/")
                        units.append(Unit(source=source, root=root, rel=rel, kind="reject", code="symlinked-dir",
                                          reason="symlinked folder not followed (avoids loops and duplicates); pass its target as a SOURCE to include it"))
                    else:
                        keep.append(d)
                dirnames[:] = keep
                for f in sorted(filenames):
                    if skip(f, folder=False):
                        continue
                    files.append(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
        else:
            root = os.path.dirname(os.path.abspath(source))
            files = [os.path.basename(source)]
        units.extend(_units_for_files(source, root, sorted(files), standalone_referenced, max_text_bytes,
                                      undeclared_encoding, skipped, parquet_columns))
        units[first:] = [replace(u, label=label) for u in units[first:]]
    if describe_skipped(skipped):
        log.info("skipped %s (--include-hidden builds them)", describe_skipped(skipped))
    units.sort(key=lambda u: (u.source, u.rel, u.line))
    return units


def describe_skipped(skipped: Counter) -> str:
    """'N hidden and M cache files/folders (...)' for discover's `skipped` counts (the other
    skips, e.g. an earlier build's manifest, are `describe_other_skips`)."""
    parts = [f"{skipped[k]} {k}" for k in ("hidden", "cache") if skipped.get(k)]
    return f"{' and '.join(parts)} files/folders (names starting with '.', __pycache__, .pyc/.pyo)" if parts else ""


def _units_for_files(source: str, root: str, files: list[str], standalone_referenced: bool, max_text_bytes: int,
                     undeclared_encoding: str = "detect", skipped: Counter | None = None, parquet_columns: tuple = ("", ())) -> list[Unit]:
    skipped = Counter() if skipped is None else skipped
    fileset = set(files)
    units: list[Unit] = []
    referenced: set[str] = set()
    sidecars: set[str] = set()
    media_units = []
    for rel in files:
        stem, ext = os.path.splitext(rel)
        ext = ext.lower()
        name = os.path.basename(rel)
        full = os.path.join(root, rel)
        if os.path.islink(full) or not os.path.isfile(full):
            # Links are resolved now so loops and escapes are reported before anything opens
            # them; FIFOs, sockets and devices are never opened (a FIFO would block the build).
            try:
                real_file_inside(root, full, what="input")
            except Reject as rej:
                units.append(Unit(source=source, root=root, rel=rel, kind="reject", code=rej.code, reason=rej.reason))
                continue
        sides = [stem + s for s in (".txt", ".json") if stem + s in fileset]
        comp = split_compression(rel)[1]
        if earlier_build_file(root, rel, fileset) or shard_metadata_file(rel, fileset):
            skipped["earlier-build" if name in ("manifest.json", "rejects.jsonl") else "shard-metadata"] += 1
        elif is_tar_name(rel):  # a WebDataset shard: one document per sample, never a video
            units.extend(tar_units(source, root, rel))
        elif is_parquet_name(rel):  # one document per row (parquet.py)
            units.extend(parquet_units(source, root, rel, *parquet_columns))
        elif is_jsonl_name(rel):
            line_units, refs = _jsonl_units(source, root, rel, max_text_bytes)
            units.extend(line_units)
            referenced |= refs
        elif comp:
            units.append(compressed_file_unit(source, root, rel))
        elif (ext in IMAGE_EXT or ext in VIDEO_EXT and not (ext == ".ts" and _looks_like_text(full))
              or sides and ext not in PROSE_EXT | JSONL_EXT | HTML_EXT | set(CODE_EXT) and (probed := probe_media(full))):
            # Media by name, or (with a caption beside it) by what PyAV finds in it: its caption stays its caption.
            kind = "image" if ext in IMAGE_EXT else "video"
            if not (ext in IMAGE_EXT or ext in VIDEO_EXT):
                kind = probed
                skipped["probed-" + kind] += 1
            media_units.append(Unit(source=source, root=root, rel=rel, kind=kind, sidecar=sides[0] if sides else "",
                                    meta_sidecar=sides[1] if len(sides) > 1 else ""))
        elif ext in HTML_EXT:
            units.append(Unit(source=source, root=root, rel=rel, kind="html"))
            referenced |= _html_refs(root, full, max_text_bytes, undeclared_encoding)
        elif name in CODE_NAMES:
            units.append(Unit(source=source, root=root, rel=rel, kind="code", lang=CODE_NAMES[name]))
        elif ext in PROSE_EXT:
            units.append(Unit(source=source, root=root, rel=rel, kind="text"))
        elif ext in CODE_EXT:
            units.append(Unit(source=source, root=root, rel=rel, kind="code", lang=CODE_EXT[ext]))
        else:
            units.append(Unit(source=source, root=root, rel=rel, kind="other"))
    unused_sidecars: set[str] = set()
    for u in media_units:
        if not standalone_referenced and _real(os.path.join(root, u.rel)) in referenced:
            # The page or record that shows this media carries its own text; the caption file is
            # reported rather than silently lost.
            unused_sidecars |= {u.sidecar, u.meta_sidecar} - {""}
            continue
        sidecars |= {u.sidecar, u.meta_sidecar}
        units.append(u)
    # Sidecars are captions, not documents of their own.
    units = [u for u in units if u.rel not in sidecars and u.rel not in unused_sidecars]
    for side in sorted(unused_sidecars - sidecars - {""}):
        units.append(Unit(source=source, root=root, rel=side, kind="reject", code="unused-caption",
                          reason="caption sidecar of a media file that an HTML page or JSONL record already "
                          "shows, so it is not a standalone document; pass --standalone-referenced to use it"))
    return units


def _looks_like_text(path: str) -> bool:
    """A `.ts` file is TypeScript (code) unless it is an MPEG transport stream. Text that decodes
    as UTF-8 wins; otherwise it is a transport stream only if it holds at least `_TS_MIN_PACKETS`
    188-byte packets and the 0x47 sync byte starts every packet of its head (up to
    `_TS_SNIFF_PACKETS`; one byte alone is a `G`, as in `GLOBAL = 1;`). Anything else is code,
    decoded under the usual rules (a legacy encoding is detected or the file is rejected)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_TS_PACKET * _TS_SNIFF_PACKETS)
    except OSError:
        return False
    if b"\x00" not in head:
        try:
            head.decode("utf-8")
            return True
        except UnicodeDecodeError as err:
            if err.start >= len(head) - 3 and err.reason == "unexpected end of data":
                return True  # a multi-byte character cut by the sniff window
    packets = len(head) // _TS_PACKET
    if packets < _TS_MIN_PACKETS:
        return True
    return not all(head[i * _TS_PACKET] == 0x47 for i in range(packets))


def _real(path: str) -> str:
    try:
        return os.path.realpath(path, strict=True)
    except OSError:
        return ""


def _html_refs(root: str, full: str, limit: int, undeclared_encoding: str = "detect") -> set[str]:
    try:
        if os.path.getsize(full) > limit:
            return set()  # the page is rejected as too-large when processed; never read it whole
        with open(full, "rb") as f:
            data = f.read(limit + 1)
        # The build's encoding rules, so the references match what it reads (bad bytes replaced: a
        # page the build rejects still keeps its media from becoming standalone documents).
        policy = TextPolicy(bad_utf8="replace", nul="strip", max_bytes=len(data) + 1, undeclared_encoding=undeclared_encoding)
        text = decode_text(data, policy, what="HTML page", html=True)
        segments, _ = extract_html(text)
    except Exception:  # noqa: BLE001 - the unit itself reports the problem when processed
        return set()
    base = os.path.dirname(full)
    return {_real(os.path.join(base, r)) for r in local_refs(segments) if not r.startswith("data:")} - {""}


def _jsonl_units(source: str, root: str, rel: str, limit: int) -> tuple[list[Unit], set[str]]:
    full = os.path.join(root, rel)
    units, refs = [], set()
    base = os.path.dirname(full)
    try:
        f = open_input(full)
    except (OSError, Reject) as err:
        why = err.reason if isinstance(err, Reject) else err.strerror
        return [Unit(source=source, root=root, rel=rel, kind="reject", code="unreadable", reason=f"cannot open JSONL file: {why}")], refs
    with f:
        lines = iter_lines(f, limit)
        while True:
            try:
                lineno, offset, length, raw = next(lines)
            except StopIteration:
                break
            except Exception as err:  # noqa: BLE001 - gzip, lzma, zstd errors: the lines before are kept
                units.append(Unit(source=source, root=root, rel=rel, kind="reject", code="corrupt-compressed",
                                  reason=f"stops decompressing after {len(units)} lines ({type(err).__name__}: {err}); re-download it"))
                break
            if raw is None:
                units.append(Unit(source=source, root=root, rel=rel, kind="reject", line=lineno, offset=offset, length=length, code="too-large",
                                  reason=f"JSONL line {lineno} is {length} bytes, above --max-text-bytes {limit}; it was skipped without being loaded"))
            elif raw.strip():
                units.append(Unit(source=source, root=root, rel=rel, kind="jsonl", line=lineno, offset=offset, length=length))
                try:
                    segments, _ = parse_input_document(json.loads(raw))
                    refs |= {_real(os.path.join(base, r)) for r in local_refs(segments)}
                except Exception:  # noqa: BLE001 - reported when the line is processed
                    pass
    return units, refs - {""}


# --- processing one unit ---------------------------------------------------------------------


def process_unit(unit: Unit, settings: IngestSettings) -> dict:
    """Turn `unit` into {"key", "doc" (dict or None), "members" [(suffix, bytes)], "fingerprint",
    "rejects" [dict], "stats"}. Never raises for bad input: every problem becomes a reject."""
    out = {"key": unit.key, "doc": None, "members": [], "fingerprint": "", "rejects": [], "stats": {}, "notes": Counter()}
    try:
        if unit.kind == "reject":
            raise Reject(unit.code, unit.reason)
        if isinstance(unit.payload, Reject):  # a compressed input that could not be read this far
            raise unit.payload
        segments, meta = _load_unit(unit, settings, out["rejects"], out["notes"])
        _finish(unit, segments, meta, settings, out)
    except Reject as rej:
        out["doc"], out["members"] = None, []
        out["rejects"].append(_reject(unit, rej, action="dropped-doc"))
    except Exception as err:  # noqa: BLE001 - a bug or an exotic file must not kill the build
        log.debug("unexpected error on %s", unit.display, exc_info=True)
        out["doc"], out["members"] = None, []
        out["rejects"].append(_reject(unit, Reject("error", f"unexpected {type(err).__name__}: {err}"), action="dropped-doc"))
    # File names that are not UTF-8 (and stray surrogates in JSON input) are escaped here, in the
    # worker, so every JSON the build writes is valid UTF-8 (see validate.printable).
    out["doc"] = json_safe(out["doc"])
    out["rejects"] = json_safe(out["rejects"])
    out["notes"] = dict(out["notes"])
    return out


def _reject(unit: Unit, rej: Reject, *, action: str, segment: int | None = None, ref: str | None = None) -> dict:
    rec = {"path": unit.display, "code": rej.code, "reason": rej.reason, "action": action}
    if segment is not None:
        rec["segment"] = segment
    if ref is not None:
        rec["ref"] = ref
    return rec


def _read_checked(unit: Unit, rel_or_path: str, *, limit: int, what: str) -> bytes:
    real = real_file_inside(unit.root, os.path.join(unit.root, rel_or_path), what=what)
    if split_compression(real)[1]:
        return read_bounded(real, limit, what=what)  # decompressed, never more than limit + 1 bytes held
    size = os.path.getsize(real)
    if size > limit:
        raise Reject("too-large", f"{what} is {size} bytes, above the limit {limit}")
    return _read_file(real, what)


def _read_file(path: str, what: str, offset: int = 0, length: int = -1) -> bytes:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    except OSError as err:
        raise Reject("unreadable", f"{what}: cannot read {path}: {err.strerror or err}; fix its permissions") from None


def _load_unit(unit: Unit, st: IngestSettings, rejects: list, notes: Counter) -> tuple[list[dict], dict]:
    meta: dict = {"source": unit.uid}
    k = unit.kind
    if k == "wds":
        return load_foreign_sample(unit, st, notes, meta, lambda data, what, m: _decode(
            unit, data, st, rejects, m, what=what, ref=unit.sample, prefix="caption_"))
    if k == "parquet":
        return load_parquet_row(unit, st, notes, meta)
    if k in ("text", "code"):
        data = _read_checked(unit, unit.rel, limit=st.text.max_bytes, what=f"{k} file")
        text = _decode(unit, data, st, rejects, meta, what=f"{k} file")
        seg = {"type": "text", "text": text} if k == "text" else {"type": "code", "lang": unit.lang, "text": text}
        return [seg], meta
    if k in ("image", "video", "other"):
        real = real_file_inside(unit.root, os.path.join(unit.root, unit.rel), what=f"{k} file")
        kind = "image" if k == "image" else "video"
        segments = [{"type": kind, "path": unit.rel, "_abs": real, "_standalone": True}]
        if unit.sidecar:
            try:
                caption, side_meta = _read_sidecar(unit, st, rejects, meta)
                meta["caption_source"] = unit.sidecar
                if side_meta:
                    meta["sidecar"] = side_meta
                if caption:
                    segments.insert(0 if st.caption_first else len(segments), {"type": "text", "text": caption})
            except Reject as rej:
                rejects.append(_reject(unit, rej, action="dropped-caption", ref=unit.sidecar))
        if unit.meta_sidecar:  # STEM.txt is the caption and STEM.json the meta, never a code document
            try:
                meta["sidecar"] = _read_sidecar(replace(unit, sidecar=unit.meta_sidecar), st, rejects, meta)[1]
                notes["sidecar-json-meta"] += 1
            except Reject as rej:
                rejects.append(_reject(unit, rej, action="dropped-meta", ref=unit.meta_sidecar))
        return segments, meta
    if k == "html":
        data = _read_checked(unit, unit.rel, limit=st.text.max_bytes, what="HTML page")
        text = _decode(unit, data, st, rejects, meta, what="HTML page", html=True)
        segments, page_meta = extract_html(text)
        meta.update(page_meta)
        return segments, meta
    if k == "jsonl":
        real = real_file_inside(unit.root, os.path.join(unit.root, unit.rel), what="JSONL file")
        if unit.length > st.text.max_bytes:  # discovery rejects these; a file grown since is caught here
            raise Reject("too-large", f"JSONL line {unit.line} is {unit.length} bytes, above --max-text-bytes {st.text.max_bytes}")
        raw = unit.payload if unit.payload is not None else _read_file(real, "JSONL file", unit.offset, unit.length)
        line = decode_text(raw, st.text, what=f"JSONL line {unit.line}", strict_utf8=True)  # JSON is UTF-8
        try:
            obj, nulled = loads_finite(line)
        except json.JSONDecodeError as err:
            raise Reject("bad-json", f"line {unit.line} is not valid JSON ({err.msg} at column {err.colno}); fix or remove the line") from None
        if nulled:
            rejects.append(_reject(unit, _nonfinite(nulled, f"line {unit.line}"), action="nulled-values"))
        segments, rec_meta = parse_record(obj, st.text_field)
        for i, seg in enumerate(segments):
            if seg["type"] in ("text", "code"):
                seg["text"] = check_unicode_text(seg["text"], st.text, what=f"line {unit.line} segment {i}")
        meta.update({k2: v for k2, v in rec_meta.items() if k2 != "source"})
        if "source" in rec_meta:
            meta["original_source"] = rec_meta["source"]
        return segments, meta
    raise AssertionError(f"unknown unit kind {k}")


def _decode(unit: Unit, data: bytes, st: IngestSettings, rejects: list, meta: dict, *, what: str, html: bool = False,
            ref: str | None = None, prefix: str = "") -> str:
    """Decode a text/code file, HTML page or caption under the text policy. Provenance goes to
    `meta`: `{prefix}encoding` (the Python codec) and `{prefix}encoding_source` ("bom", "declared"
    or "detected") whenever the text was not UTF-8. A detected encoding is also a counted
    `encoding-detected` line in rejects.jsonl (action `decoded`), so guesses are visible."""
    d = decode_bytes(data, st.text, what=what, html=html)
    if d.codec != "utf-8":
        meta[prefix + "encoding"] = d.codec
        meta[prefix + "encoding_source"] = d.source
    if d.source == "detected":
        declare = ", or declare its charset," if html else ""
        rejects.append(_reject(unit, Reject(
            "encoding-detected",
            f"{what} has no byte-order mark{' or declared charset' if html else ''} and is not valid UTF-8; decoded as {d.codec} by "
            f"detection ({d.detection.describe()}). Convert it to UTF-8{declare} to make this certain, or pass "
            "--undeclared-encoding utf-8 to reject such files",
        ), action="decoded", ref=ref))
    return d.text


def _nonfinite(n: int, where: str) -> Reject:
    return Reject("non-finite-number", f"{where} holds {n} NaN/Infinity value(s), which strict JSON has no form for; "
                  "written as null, the rest of the document kept")


def _read_sidecar(unit: Unit, st: IngestSettings, rejects: list, meta: dict) -> tuple[str, dict]:
    data = _read_checked(unit, unit.sidecar, limit=st.text.max_bytes, what="caption sidecar")
    if unit.sidecar.endswith(".txt"):
        return _decode(unit, data, st, rejects, meta, what="caption sidecar", ref=unit.sidecar, prefix="caption_").strip(), {}
    text = decode_text(data, st.text, what="caption sidecar", strict_utf8=True)  # JSON is UTF-8
    try:
        obj, nulled = loads_finite(text)
    except json.JSONDecodeError as err:
        raise Reject("bad-json", f"caption sidecar {unit.sidecar} is not valid JSON ({err.msg})") from None
    if nulled:
        rejects.append(_reject(unit, _nonfinite(nulled, f"caption sidecar {unit.sidecar}"), action="nulled-values", ref=unit.sidecar))
    if not isinstance(obj, dict):
        raise Reject("schema", f"caption sidecar {unit.sidecar} must hold a JSON object")
    caption = next((obj[k] for k in CAPTION_KEYS if isinstance(obj.get(k), str) and obj[k].strip()), "")
    return caption.strip(), obj


def _load_media(unit: Unit, seg: dict, st: IngestSettings) -> bytes:
    kind = seg["type"]
    limit = st.limits.max_image_bytes if kind == "image" else st.limits.max_video_bytes
    path = seg["path"]
    if "_data" in seg:  # a tar member, read by foreign.py within its limit
        return member_data(seg, limit, "--max-image-bytes" if kind == "image" else "--max-video-bytes")
    if unit.fetched is not None and is_media_url(path):  # --fetch-media: the body the main process fetched (fetch.py)
        return read_fetched(unit, path, kind, limit, "--max-image-bytes" if kind == "image" else "--max-video-bytes")
    if path.startswith("data:"):
        head, _, payload = path.partition(",")
        if not head.endswith(";base64"):
            raise Reject("bad-ref", "data: URI media must be base64-encoded")
        try:
            return base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError) as err:
            raise Reject("bad-ref", f"data: URI does not decode as base64 ({err})") from None
    if "_abs" in seg:
        real = seg["_abs"]
    else:
        base = os.path.dirname(os.path.join(unit.root, unit.rel))
        real = resolve_inside(unit.root, base, path)
    size = os.path.getsize(real)
    if size > limit:
        which = "--max-image-bytes" if kind == "image" else "--max-video-bytes"
        raise Reject("too-large", f"{kind} {path} is {size} bytes, above {which} {limit}")
    return _read_file(real, f"{kind} {path}")


def _finish(unit: Unit, segments: list[dict], meta: dict, st: IngestSettings, out: dict) -> None:
    """Load and validate media, name members, build doc.json, fingerprint, stats."""
    final, members, digests = [], [], []
    media_meta: dict = {}
    counters = {"image": 0, "video": 0}
    alts = {}
    stats = {"segments": {"text": 0, "code": 0, "image": 0, "video": 0}, "media_bytes": {"image": 0, "video": 0}}
    for i, seg in enumerate(segments):
        kind = seg["type"]
        if kind in ("text", "code"):
            if not seg["text"].strip():
                continue
            final.append(seg)
            digests.append(segment_fingerprint(kind, seg["text"]))
            continue
        out["notes"][f"media-refs:{kind}"] += 1  # against the kept count: a kind with every reference dropped is reported
        try:
            data = _load_media(unit, seg, st)
            if kind == "video" and still_image_format(data) is not None:
                kind = "image"  # a still image is an image whichever decoder reads it, never a one-frame video
            if kind == "image":
                data, info = validate_still(data, st.limits)  # PNG bytes for a still PIL cannot read
                if info.get("frames", 1) > 1:
                    data, info, kind = decide_animated(data, info, st, out["notes"])
            else:
                info = validate_video(data, st.limits)
        except Reject as rej:
            if seg.get("_standalone"):
                if unit.kind == "other" and rej.code == "not-a-video":
                    out["notes"][f"media-refs:{seg['type']}"] -= 1  # not media at all: an unsupported file
                    ext = os.path.splitext(unit.rel)[1] or "(none)"
                    raise Reject("unsupported", f"unsupported file type {ext}: not prose, code, image, HTML or JSONL, and PyAV cannot open it as a video") from None
                raise
            if st.on_bad_media == "drop-doc":
                raise Reject(rej.code, f"segment {i} ({kind} {seg['path'][:120]}): {rej.reason}; document dropped (--on-bad-media drop-doc)") from None
            out["rejects"].append(_reject(unit, rej, action="dropped-segment", segment=i, ref=seg["path"][:300]))
            continue
        src_ext = os.path.splitext(seg["path"])[1].lower().lstrip(".")
        ext = info.pop("ext")
        if kind == "video" and src_ext and src_ext.isalnum() and not seg["path"].startswith("data:") and "animated_from" not in info:
            ext = src_ext  # keep the original container's name (webm stays webm)
        ref = f"{'img' if kind == 'image' else 'vid'}{counters[kind]}.{ext}"
        counters[kind] += 1
        final.append({"type": kind, "ref": ref})
        members.append((ref, data))
        info["bytes"] = len(data)
        if unit.fetched is not None and is_media_url(seg["path"]):
            info["url"] = seg["path"]  # where a fetched medium came from
        media_meta[ref] = info
        if seg.get("alt"):
            alts[ref] = seg["alt"]
        digests.append(segment_fingerprint(kind, data))
        stats["media_bytes"][kind] += len(data)
    if not final:
        raise Reject("empty", "document has no usable segments left (all text empty or all media bad)")
    for s in final:
        stats["segments"][s["type"]] += 1
    if media_meta:
        meta["media"] = media_meta
    if alts:
        meta["alts"] = alts
    out["doc"] = {"schema": 1, "segments": final, "meta": meta}
    out["members"] = members
    out["fingerprint"] = document_fingerprint(digests)
    out["stats"] = stats
