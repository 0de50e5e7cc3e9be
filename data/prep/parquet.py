"""Parquet files as `omniloom data build` inputs (issue 38, item 3; docs/data-format.md, "Parquet").

Parquet as `datasets` (`Dataset.to_parquet`) and the Hugging Face Hub write it: one document per
row. Which columns hold what (`plan_columns`) comes from the `huggingface` entry of the schema
metadata when the file has one (the `features` JSON that `datasets` writes: `Image`, `Video`,
`Sequence(Image())` / `List(Image())`, `ClassLabel` names), else from the Arrow types (a
`struct<bytes, path>` column is how `datasets` stores an `Image`), and the flags
(--text-column, --image-column) override both:

- `texts` + `images` list columns: the OBELICS layout, one interleaved document per row;
- else image columns (and lists of images) -> image segments in column order, and the text column
  (--text-column, else the first of `TEXT_NAMES` present) -> the caption, after the media (before
  with --caption-first); a text-only row is a text document, or code when its other columns name a
  programming language (The Stack: `lang`, `max_stars_repo_path`), as for `{"text"}` JSONL;
- every other scalar column -> the document's meta (ClassLabel ints as their names); columns that
  are neither (lists, structs, binary) are listed in `meta["parquet_unmapped"]` and counted.

Rows are read one row group at a time in the build's main process (`ParquetFiller`), which hands
each row to a worker as its unit's payload: memory is bounded by a row group, each row group is
decoded once, and a worker's result depends only on its row, so shards are byte-identical for any
--workers and a resumed build starts at the row group of its first unbuilt row. A parquet `Unit`
is `line` = 1-based row number in the file, `offset` = row group, `length` = row within the group.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
from collections import Counter
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

from .textcorpus import code_language
from .units import VIDEO_EXT, Unit
from .validate import Reject, check_unicode_text

log = logging.getLogger(__name__)

PARQUET_EXT = (".parquet", ".pq")
# The text column when no flag names one, in order of preference: FineWeb / C4 / Dolma use `text`,
# The Stack `content`, caption sets `caption`. Any other name needs --text-column: guessing among
# string columns would make a URL or a file name a caption.
TEXT_NAMES = ("text", "content", "caption", "txt")
INTERLEAVED = ("texts", "images")
# With --fetch-media (and no Image column or --image-column): a string column of one of these names
# (any case) holds each row's medium by URL (LAION `URL`, DataComp / COYO / CC3M `url`, WebVid
# `contentUrl`), a list of strings under one of URL_LISTS its media; video by the URL's extension.
URL_NAMES = ("url", "image_url", "img_url", "raw_url", "video_url", "contenturl")
URL_LISTS = ("images", "image_urls", "urls")
RESERVED_META = ("source", "media", "alts")  # keys the build writes itself: a column of that name goes to original_NAME


def is_parquet_name(name: str) -> bool:
    return name.lower().endswith(PARQUET_EXT)


@dataclass(frozen=True)
class Plan:
    """What each column of a parquet file becomes. `media`: (column, "image"|"video", is_list) in
    schema order; `text`: the text column or ""; `interleaved`: the texts/images layout; `meta`:
    scalar columns; `labels`: ClassLabel names by column; `unmapped`: columns used for nothing."""

    media: tuple = ()
    text: str = ""
    interleaved: bool = False
    meta: tuple = ()
    labels: dict = field(default_factory=dict)
    unmapped: tuple = ()

    @property
    def columns(self) -> list[str]:
        used = list(INTERLEAVED) if self.interleaved else [c for c, _, _ in self.media] + ([self.text] if self.text else [])
        return used + list(self.meta)


def hf_features(schema) -> dict | None:
    """The `features` dict `datasets` wrote into the schema metadata, or None."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if not raw:
        return None
    try:
        feats = json.loads(raw).get("info", {}).get("features")
    except (ValueError, AttributeError):
        return None
    return feats if isinstance(feats, dict) else None


def _feature_media(f) -> tuple[str, bool] | None:
    """("image"|"video", is_list) for an Image / Video feature or a Sequence / List of one."""
    if isinstance(f, list) and len(f) == 1:  # datasets' shorthand for a list feature: [Image()]
        inner = _feature_media(f[0])
        return (inner[0], True) if inner and not inner[1] else None
    if not isinstance(f, dict):
        return None
    kind = f.get("_type")
    if kind in ("Image", "Video"):
        return kind.lower(), False
    if kind in ("Sequence", "List", "LargeList"):
        inner = _feature_media(f.get("feature"))
        return (inner[0], True) if inner and not inner[1] else None
    return None


def _is_media_struct(t) -> bool:
    """`struct<bytes: binary, path: string>`: how `datasets` stores an Image (and Video) value."""
    import pyarrow as pa

    return (pa.types.is_struct(t) and {t.field(i).name for i in range(t.num_fields)} == {"bytes", "path"}
            and (pa.types.is_binary(t.field("bytes").type) or pa.types.is_large_binary(t.field("bytes").type)))


def _is_list(t) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _is_string(t) -> bool:
    import pyarrow as pa

    return pa.types.is_string(t) or pa.types.is_large_string(t) or (pa.types.is_dictionary(t) and _is_string(t.value_type))


def _is_scalar(t) -> bool:
    import pyarrow as pa

    return (_is_string(t) or pa.types.is_boolean(t) or pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_null(t)
            or pa.types.is_temporal(t) or pa.types.is_decimal(t) or (pa.types.is_dictionary(t) and _is_scalar(t.value_type)))


def _image_like(t) -> bool:
    """A column --image-column may name: an Image struct, raw bytes, a path / URL string, or a list of those."""
    import pyarrow as pa

    if _is_list(t):
        t = t.value_type
    return _is_media_struct(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t) or _is_string(t)


def plan_columns(schema, text_column: str = "", image_columns: tuple = (), urls: bool = False) -> Plan:
    """The `Plan` for a file of this Arrow schema, or Reject("parquet-columns") whose reason says in
    one line which flag to pass. `urls` (--fetch-media): a URL column (`URL_NAMES`, `URL_LISTS`) is
    a media column (kind "url": image or video by the URL) when the file has no Image column."""
    names = list(schema.names)
    types = {n: schema.field(n).type for n in names}
    feats = hf_features(schema) or {}
    listing = ", ".join(f"{n} ({types[n]})" for n in names)[:400]
    for col in [text_column, *image_columns]:
        if col and col not in types:
            flag = "--text-column" if col == text_column else "--image-column"
            raise Reject("parquet-columns", f"{flag} {col}: this file has no such column (columns: {listing}); "
                                            "build files of another layout in a separate build")
    if text_column and not _is_string(types[text_column]):
        raise Reject("parquet-columns", f"--text-column {text_column} is {types[text_column]}, not a string column")
    for col in image_columns:
        if not _image_like(types[col]):
            raise Reject("parquet-columns", f"--image-column {col} is {types[col]}; an image column holds Image structs "
                                            "{bytes, path}, bytes, or paths, or lists of them")
    labels = {n: f["names"] for n, f in feats.items()
              if isinstance(f, dict) and f.get("_type") == "ClassLabel" and isinstance(f.get("names"), list)}
    if not text_column and not image_columns and all(n in types and _is_list(types[n]) for n in INTERLEAVED):
        rest = [n for n in names if n not in INTERLEAVED]
        return Plan(interleaved=True, meta=tuple(n for n in rest if _is_scalar(types[n])), labels=labels,
                    unmapped=tuple(n for n in rest if not _is_scalar(types[n])))
    media = []
    for n in names:
        if image_columns:
            found = ("image", _is_list(types[n])) if n in image_columns else None
        elif n in feats:
            found = _feature_media(feats[n])
        else:  # no metadata for this column: the Arrow type of datasets' Image is the evidence
            found = ("image", False) if _is_media_struct(types[n]) else ("image", True) if (
                _is_list(types[n]) and _is_media_struct(types[n].value_type)) else None
        if found:
            media.append((n, *found))
    if urls and not media and not image_columns:
        lower = {n.lower(): n for n in reversed(names)}
        col = next((lower[u] for u in URL_NAMES if u in lower and _is_string(types[lower[u]])), None)
        col = col or next((lower[u] for u in URL_LISTS if u in lower and _is_list(types[lower[u]])
                           and _is_string(types[lower[u]].value_type)), None)
        if col:
            media.append((col, "url", _is_list(types[col])))
    text = text_column or next((n for n in TEXT_NAMES if n in types and _is_string(types[n])), "")
    if not media and not text:
        strings = [n for n in names if _is_string(types[n])]
        raise Reject("parquet-columns", "cannot tell which column holds the text or the images (string columns: "
                                        f"{', '.join(strings)[:200] or 'none'}; no Image column): pass --text-column NAME "
                                        "and/or --image-column NAME")
    used = {c for c, _, _ in media} | {text}
    rest = [n for n in names if n not in used]
    return Plan(media=tuple(media), text=text, meta=tuple(n for n in rest if _is_scalar(types[n])), labels=labels,
                unmapped=tuple(n for n in rest if not _is_scalar(types[n])))


# --- discovery ----------------------------------------------------------------------------------


def parquet_units(source: str, root: str, rel: str, text_column: str = "", image_columns: tuple = (), urls: bool = False) -> list[Unit]:
    """Discovery: one unit per row of `root/rel` from the footer alone (no data read), or one reject
    unit when the file is not parquet or its columns cannot be mapped (logged with what to pass)."""
    import pyarrow.parquet as pq

    path = os.path.join(root, rel)
    try:
        md = pq.ParquetFile(path).metadata
        plan_columns(md.schema.to_arrow_schema(), text_column, tuple(image_columns), urls)
    except Reject as rej:
        log.warning("%s: %s", path, rej.reason)
        return [Unit(source=source, root=root, rel=rel, kind="reject", code=rej.code, reason=rej.reason)]
    except Exception as err:  # noqa: BLE001 - ArrowInvalid, OSError: not parquet, truncated, unreadable
        return [Unit(source=source, root=root, rel=rel, kind="reject", code="corrupt-parquet",
                     reason=f"not a readable parquet file ({type(err).__name__}: {str(err)[:200]}); re-download or rewrite it")]
    units, row = [], 0
    for g in range(md.num_row_groups):
        for j in range(md.row_group(g).num_rows):
            row += 1
            units.append(Unit(source=source, root=root, rel=rel, kind="parquet", line=row, offset=g, length=j))
    if not units:
        units.append(Unit(source=source, root=root, rel=rel, kind="reject", code="empty", reason="the parquet file holds no rows"))
    return units


# --- reading rows -------------------------------------------------------------------------------


def read_row_group(path: str, group: int, text_column: str = "", image_columns: tuple = (), urls: bool = False) -> tuple[Plan | None, list]:
    """(plan, [row dict or Reject]) for row group `group` of `path`; (None, Reject) when the file or
    the group cannot be read. Only the planned columns are read."""
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
        plan = plan_columns(pf.schema_arrow, text_column, tuple(image_columns), urls)
        table = pf.read_row_group(group, columns=plan.columns)
    except Reject as rej:
        return None, rej
    except Exception as err:  # noqa: BLE001 - pyarrow's errors on a corrupt or changed file
        return None, Reject("corrupt-parquet", f"row group {group} does not read ({type(err).__name__}: {str(err)[:200]}); "
                                               "re-download or rewrite the file")
    try:
        return plan, table.to_pylist()
    except Exception:  # noqa: BLE001 - e.g. a string that is not UTF-8: find the rows, keep the others
        rows = []
        for i in range(table.num_rows):
            try:
                rows.append(table.slice(i, 1).to_pylist()[0])
            except Exception as err:  # noqa: BLE001
                rows.append(Reject("bad-utf8" if isinstance(err, UnicodeDecodeError) else "corrupt-parquet",
                                   f"the row does not convert ({type(err).__name__}: {str(err)[:200]}); fix or rewrite the file"))
        return plan, rows


class ParquetFiller:
    """Hands each parquet unit its row (as `(plan, row)`), reading one row group at a time in the
    main process; every other unit goes to `inner` (foreign.PayloadFiller). Units arrive in input
    order (the build refuses --shuffle for parquet), so each row group is read once."""

    def __init__(self, settings, inner):
        self.inner = inner
        self.columns = (settings.text_column, tuple(settings.image_columns), settings.fetch_media)
        self.where, self.plan, self.rows = None, None, []

    def fill(self, units: list) -> list:
        units = self.inner.fill(units)
        return [replace(u, payload=self._get(u)) if u.kind == "parquet" else u for u in units]

    def _get(self, unit: Unit):
        where = (os.path.join(unit.root, unit.rel), unit.offset)
        if where != self.where:
            self.rows = []  # the previous group is dropped before the next is read: one group in memory
            self.where = where
            self.plan, self.rows = read_row_group(*where, *self.columns)
        if isinstance(self.rows, Reject):
            return self.rows
        if unit.length >= len(self.rows):
            return Reject("missing", f"row group {unit.offset} no longer holds row {unit.length}: the file changed since the "
                                     "build started; rerun with --overwrite")
        row = self.rows[unit.length]
        return row if isinstance(row, Reject) else (self.plan, row)

    def close(self) -> None:
        self.where, self.plan, self.rows = None, None, []
        self.inner.close()


# --- one row -> one document --------------------------------------------------------------------


def _meta_value(v, notes: Counter):
    """A column value as strict JSON: NaN/Infinity -> null (counted), dates as ISO 8601, decimals as strings."""
    if isinstance(v, float) and not math.isfinite(v):
        notes["parquet-non-finite-nulled"] += 1
        return None
    if isinstance(v, (datetime.date, datetime.time)):  # datetime.datetime is a date
        return v.isoformat()
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(v)  # decimals, durations, intervals: exact as text, and strict JSON whatever pyarrow returns


def _media_segment(value, kind: str, name: str) -> dict | None:
    """One media segment for a column value, None for a null. A value with bytes carries them
    (`_data`, validated later like a local file); a path-only value is a reference read as local
    media are (relative to the parquet file, inside its SOURCE), and a URL is a counted reject
    (`remote-ref`) unless the build fetches it (--fetch-media). Kind "url" (a URL column): a video
    when the URL's path names a video file, else an image."""
    if value is None:
        return None
    if kind == "url":
        ext = os.path.splitext(urlsplit(value).path if isinstance(value, str) else "")[1].lower()
        kind = "video" if ext in VIDEO_EXT else "image"
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, bytearray)):
        data, path = bytes(value), None
    else:
        data, path = None, value
    if data is not None:
        return {"type": kind, "path": path if isinstance(path, str) and path else name, "_data": bytes(data)}
    if isinstance(path, str) and path:
        return {"type": kind, "path": path}
    return None  # {bytes: null, path: null} is how datasets writes a null Image


def map_row(plan: Plan, row: dict, *, caption_first: bool = False, where: str = "row") -> tuple[list[dict], dict, Counter]:
    """Map one row to (segments, meta, notes) by `plan` (the rules in the module docstring). Pure: no I/O."""
    notes: Counter = Counter()
    meta = {}
    for col in plan.meta:
        v = row.get(col)
        if col in plan.labels and isinstance(v, int) and 0 <= v < len(plan.labels[col]):
            v = plan.labels[col][v]
        meta[f"original_{col}" if col in RESERVED_META else col] = _meta_value(v, notes)
    if plan.unmapped:
        meta["parquet_unmapped"] = list(plan.unmapped)
        for col in plan.unmapped:
            notes[f"unmapped:{col}"] += 1
    if plan.interleaved:
        texts, images = row.get("texts"), row.get("images")
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images):
            raise Reject("schema", f"{where}: 'texts' and 'images' must be lists of one length (OBELICS layout)")
        segments = []
        for i, (t, im) in enumerate(zip(texts, images)):
            seg = _media_segment(im, "image", f"images[{i}]")
            if (t is None) == (seg is None):
                raise Reject("schema", f"{where}: position {i} must have exactly one of texts[{i}] and images[{i}] non-null (OBELICS layout)")
            segments.append({"type": "text", "text": t} if seg is None else seg)
        notes["parquet-interleaved"] += 1
        return segments, meta, notes
    media = []
    for col, kind, is_list in plan.media:
        values = row.get(col)
        values = (values or []) if is_list else [values]
        for i, v in enumerate(values):
            seg = _media_segment(v, kind, f"{col}[{i}]" if is_list else col)
            if seg is None:
                notes[f"parquet-null-{kind}"] += 1
                continue
            if not is_list:
                seg["_standalone"] = True  # a pair's medium is its point: a bad one drops the row, as for a tar sample
            media.append(seg)
    text = row.get(plan.text) if plan.text else None
    segments = list(media)
    if isinstance(text, str):
        if media:
            segments.insert(0, {"type": "text", "text": text}) if caption_first else segments.append({"type": "text", "text": text})
        else:
            lang = code_language(meta)  # The Stack: a lang / path column makes the row code
            segments.append({"type": "code", "lang": lang, "text": text} if lang else {"type": "text", "text": text})
    elif plan.media and not plan.text:
        notes["parquet-no-text-column"] += 1  # images without captions: counted so a missed caption column shows
    if not segments:
        raise Reject("empty", f"{where} has no text and no media (all null)")
    return segments, meta, notes


def load_parquet_row(unit: Unit, st, notes: Counter, meta: dict) -> tuple[list[dict], dict]:
    """The worker's side of a parquet unit: its row (the payload the main process read, or read
    here when it has none), mapped by `map_row`, text checked under the build's text policy."""
    payload = unit.payload
    if payload is None:  # never in a build (ParquetFiller fills every unit); kept so a unit alone still works
        plan, rows = read_row_group(os.path.join(unit.root, unit.rel), unit.offset, st.text_column, tuple(st.image_columns), st.fetch_media)
        payload = rows if isinstance(rows, Reject) else rows[unit.length] if unit.length < len(rows) else Reject(
            "missing", "the row is gone: the file changed since discovery; rerun with --overwrite")
        if isinstance(payload, Reject):
            raise payload
        payload = (plan, payload)
    plan, row = payload
    segments, row_meta, row_notes = map_row(plan, row, caption_first=st.caption_first, where=f"row {unit.line}")
    notes.update(row_notes)
    for i, seg in enumerate(segments):
        if seg["type"] in ("text", "code"):
            if len(seg["text"]) > st.text.max_bytes // 4 and len(seg["text"].encode("utf-8", "surrogatepass")) > st.text.max_bytes:
                raise Reject("too-large", f"row {unit.line} segment {i}: the text is above --max-text-bytes {st.text.max_bytes}")
            seg["text"] = check_unicode_text(seg["text"], st.text, what=f"row {unit.line} segment {i}")
    meta.update(row_meta)
    return segments, meta
