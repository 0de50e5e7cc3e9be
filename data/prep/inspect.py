"""Looking at shards: `omniloom data inspect` (text or a self-contained HTML page), `data stats`
(per-modality counts, bytes, size and duration distributions) and `data verify` (checksums, every
sample listed at its offset, every document valid and its media decodable)."""

from __future__ import annotations

import base64
import hashlib
import html
import io
import json
import os
from collections import Counter

from omniloom.data.manifest import ReadLimits, Refused, iter_sample_at, iter_shard_samples, read_manifest, sample_entry, sample_index

from .validate import check_output_document

# --- inspect -----------------------------------------------------------------------------------


def read_built_manifest(directory: str, command: str) -> dict:
    """The checked manifest (`read_manifest`) of a folder `omniloom data build` wrote; an index
    (`omniloom data index`) is refused in one line: its shards lie elsewhere and hold no doc.json."""
    man = read_manifest(directory)
    if man.get("kind") == "index":
        raise ValueError(f"{os.path.join(directory, 'manifest.json')}: kind {man['kind']!r} (`omniloom data index`): "
                         f"`omniloom data {command}` reads a folder made by `omniloom data build`; the index's summary "
                         "came from `data index` (run it again, with --validate, to check its shards)")
    return man


def select_samples(directory: str, *, key: str | None = None, index: int = 0, count: int = 1) -> list[tuple[str, dict, dict]]:
    """Return [(key, doc, members)] for the sample with `key`, or `count` samples from `index`
    (manifest order)."""
    man = read_built_manifest(directory, "inspect")
    flat = sample_index(man)
    if not flat:
        raise ValueError(f"{directory} holds no documents")
    if key is not None:
        hits = [i for i, (_, k, _) in enumerate(flat) if k == key]
        if not hits:
            raise ValueError(f"no document with key {key!r} in {directory}; `omniloom data inspect {directory} --index 0` shows one")
        picks = hits[:1]
    else:
        if not 0 <= index < len(flat):
            raise ValueError(f"--index {index} is out of range: {directory} holds {len(flat)} documents (0..{len(flat) - 1})")
        picks = range(index, min(len(flat), index + max(1, count)))
    out = []
    for i in picks:
        shard, k, offset = flat[i]
        got_key, members = iter_sample_at(os.path.join(directory, shard), offset)
        if got_key != k:
            raise ValueError(f"{shard} at byte {offset} holds {got_key}, not {k}: the manifest does not match; run `omniloom data verify`")
        out.append((k, json.loads(members["doc.json"]), members))
    return out


def render_text(key: str, doc: dict, members: dict, *, width: int = 400) -> str:
    """A plain-text view of one document for the terminal."""
    lines = [f"== {key}  ({doc.get('meta', {}).get('source', '?')})"]
    media = doc.get("meta", {}).get("media", {})
    for i, seg in enumerate(doc["segments"]):
        t = seg["type"]
        if t in ("text", "code"):
            body = seg["text"] if len(seg["text"]) <= width else seg["text"][:width] + f"... [{len(seg['text'])} chars]"
            lines.append(f"[{i}] {t}{'(' + seg['lang'] + ')' if t == 'code' else ''}: {body}")
        else:
            info = media.get(seg["ref"], {})
            desc = ", ".join(f"{k}={v}" for k, v in info.items() if k in ("width", "height", "duration", "codec", "format"))
            lines.append(f"[{i}] {t}: {seg['ref']} ({len(members.get(seg['ref'], b''))} bytes; {desc})")
    return "\n".join(lines)


_MIME = {"jpg": "image/jpeg", "png": "image/png", "webp": "image/webp", "gif": "image/gif", "bmp": "image/bmp", "tiff": "image/tiff"}


def render_html(docs: list[tuple[str, dict, dict]], *, title: str = "omniloom shards") -> str:
    """A self-contained HTML page (media inlined as data: URIs) showing each document in order:
    text, code, images, and a strip of frames per video."""
    from PIL import Image

    from .media import video_frame_strip

    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>", html.escape(title), "</title><style>",
        "body{font-family:sans-serif;max-width:60em;margin:2em auto}section{border:1px solid #ccc;margin:1em 0;padding:1em}",
        "pre{background:#f6f6f6;padding:.5em;overflow:auto}img{max-width:100%;image-rendering:auto}",
        ".strip img{height:96px;margin-right:2px}.meta{color:#666;font-size:smaller}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
    ]
    for key, doc, members in docs:
        meta = doc.get("meta", {})
        parts.append(f"<section><h2>{html.escape(key)}</h2><div class='meta'>{html.escape(json.dumps(meta, ensure_ascii=False)[:2000])}</div>")
        for seg in doc["segments"]:
            t = seg["type"]
            if t == "text":
                parts.append("<p>" + html.escape(seg["text"]).replace("\n", "<br>") + "</p>")
            elif t == "code":
                parts.append(f"<div class='meta'>{html.escape(seg['lang'])}</div><pre><code>{html.escape(seg['text'])}</code></pre>")
            elif t == "image":
                data = members.get(seg["ref"], b"")
                ext = seg["ref"].rsplit(".", 1)[-1]
                if ext not in ("jpg", "png", "webp", "gif"):  # bmp, tiff, ppm, sgi, ...: not every browser shows them
                    data, ext = _to_png(Image.open(io.BytesIO(data))), "png"
                parts.append(f"<figure><img alt='{html.escape(seg['ref'])}' src='data:{_MIME.get(ext, 'image/png')};base64,{base64.b64encode(data).decode()}'>"
                             f"<figcaption class='meta'>{html.escape(seg['ref'])}</figcaption></figure>")
            else:
                try:
                    frames = video_frame_strip(members.get(seg["ref"], b""))
                    imgs = "".join(f"<img src='data:image/png;base64,{base64.b64encode(_to_png(f)).decode()}'>" for f in frames)
                except Exception as err:  # noqa: BLE001 - show the problem instead of failing the page
                    imgs = f"<em>cannot decode frames: {html.escape(str(err))}</em>"
                parts.append(f"<figure class='strip'>{imgs}<figcaption class='meta'>{html.escape(seg['ref'])} (frame strip)</figcaption></figure>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "".join(parts)


def _to_png(img) -> bytes:
    buf = io.BytesIO()
    img.convert("RGBA" if img.mode in ("RGBA", "LA", "P") else "RGB").save(buf, format="PNG")
    return buf.getvalue()


# --- stats -------------------------------------------------------------------------------------


def _dist(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    v = sorted(values)

    def q(p):
        return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]

    return {"count": len(v), "min": v[0], "p10": q(0.1), "p50": q(0.5), "p90": q(0.9), "max": v[-1], "mean": sum(v) / len(v)}


def compute_stats(directory: str, *, progress: bool = False) -> dict:
    """Scan every doc.json (media data is skipped, not read) and summarize the dataset."""
    man = read_built_manifest(directory, "stats")
    seg_counts, seg_bytes, langs = Counter(), Counter(), Counter()
    img_w, img_h, img_mp, vid_dur, vid_frames, text_chars, segs_per_doc = [], [], [], [], [], [], []
    docs = 0
    shards = man["shards"]
    bar = _bar(len(shards), progress, "stats")
    for shard in shards:
        for _, _, members in iter_shard_samples(os.path.join(directory, shard["name"]), only=("doc.json",)):
            doc = json.loads(members["doc.json"])
            docs += 1
            segs_per_doc.append(len(doc["segments"]))
            media = doc.get("meta", {}).get("media", {})
            chars = 0
            for seg in doc["segments"]:
                t = seg["type"]
                seg_counts[t] += 1
                if t in ("text", "code"):
                    chars += len(seg["text"])
                    seg_bytes[t] += len(seg["text"].encode("utf-8", "surrogatepass"))
                    if t == "code":
                        langs[seg["lang"]] += 1
                else:
                    info = media.get(seg["ref"], {})
                    seg_bytes[t] += info.get("bytes", 0)
                    if t == "image" and "width" in info:
                        img_w.append(info["width"])
                        img_h.append(info["height"])
                        img_mp.append(info["width"] * info["height"] / 1e6)
                    elif t == "video" and "duration" in info:
                        vid_dur.append(info["duration"])
                        vid_frames.append(info.get("frames", 0))
            text_chars.append(chars)
        bar.update(1)
    bar.close()
    return {
        "directory": directory,
        "shards": len(shards),
        "documents": docs,
        "shard_bytes": sum(s.get("bytes") or 0 for s in shards),
        "segments": {t: seg_counts.get(t, 0) for t in ("text", "code", "image", "video")},
        "bytes": {t: seg_bytes.get(t, 0) for t in ("text", "code", "image", "video")},
        "code_languages": dict(langs.most_common()),
        "segments_per_doc": _dist(segs_per_doc),
        "chars_per_doc": _dist(text_chars),
        "image_width": _dist(img_w),
        "image_height": _dist(img_h),
        "image_megapixels": _dist(img_mp),
        "video_seconds": _dist(vid_dur),
        "video_frames": _dist(vid_frames),
        **_rejects_and_notices(man.get("rejects") or {}),
    }


def _rejects_and_notices(rejects: dict) -> dict:
    """The manifest's reject counts split as the build's summary splits them: rejections, and
    notices about inputs that were kept (encoding-detected, non-finite-number)."""
    from .ingest import NOTICE_CODES

    by_code = rejects.get("by_code") or {}
    rej = {k: v for k, v in by_code.items() if k not in NOTICE_CODES}
    notes = {k: v for k, v in by_code.items() if k in NOTICE_CODES}
    return {"rejects": {"total": sum(rej.values()), "by_code": rej}, "notices": {"total": sum(notes.values()), "by_code": notes}}


def format_stats(st: dict) -> str:
    """Human-readable rendering of compute_stats()."""
    lines = [f"{st['directory']}: {st['documents']} documents in {st['shards']} shards, {st['shard_bytes'] / 1e6:.2f} MB"]
    lines.append(f"{'modality':<10}{'segments':>10}{'bytes':>16}")
    for t in ("text", "code", "image", "video"):
        lines.append(f"{t:<10}{st['segments'][t]:>10}{st['bytes'][t]:>16,}")
    if st["code_languages"]:
        lines.append("code languages: " + ", ".join(f"{k} {v}" for k, v in st["code_languages"].items()))
    for name in ("segments_per_doc", "chars_per_doc", "image_width", "image_height", "image_megapixels", "video_seconds", "video_frames"):
        d = st[name]
        if d["count"]:
            lines.append(f"{name:<18} n={d['count']:<7} min {d['min']:.4g}  p10 {d['p10']:.4g}  p50 {d['p50']:.4g}  p90 {d['p90']:.4g}  max {d['max']:.4g}  mean {d['mean']:.4g}")
    for label, key in (("rejected at build", "rejects"), ("notices at build (inputs kept)", "notices")):
        counts = st.get(key) or {}
        if counts.get("total"):
            lines.append(f"{label}: {counts['total']} (" + ", ".join(f"{k} {v}" for k, v in counts["by_code"].items()) + ")")
    return "\n".join(lines)


# --- verify ------------------------------------------------------------------------------------


def verify(directory: str, *, media: bool = True, progress: bool = False, max_problems: int = 1000) -> tuple[list[str], dict]:
    """Check a shard directory; return (problems, counts). Checks each shard's size and sha256,
    that the tar lists exactly the manifest's samples at their offsets with doc.json first, that
    each doc.json is valid and names only present members, that media decode (unless `media` is
    False), that the totals add up, and that no stray shard is left unlisted."""
    from .media import MediaLimits, validate_image, validate_video
    from .validate import Reject

    man = read_built_manifest(directory, "verify")
    limits = ReadLimits.from_settings(man.get("settings"))  # what training reads; nothing larger or sparse is read here either
    loose = MediaLimits(max_image_pixels=1 << 40, min_image_side=1, max_image_aspect=1e9, max_image_bytes=1 << 40,
                        max_image_frames=1 << 30, max_video_seconds=1e12, min_video_side=1, max_video_side=1 << 30, max_video_bytes=1 << 40)
    problems: list[str] = []
    counts = Counter()
    seg_totals = Counter()

    def problem(msg):
        if len(problems) < max_problems:
            problems.append(msg)
        counts["problems"] += 1

    listed = {s["name"] for s in man["shards"]}
    name = man.get("name", "")
    for f in sorted(os.listdir(directory)):
        if f.endswith(".tar") and f not in listed and f.startswith(name):
            problem(f"{f}: shard file is not listed in manifest.json")
    bar = _bar(len(man["shards"]), progress, "verify")
    for shard in man["shards"]:
        path = os.path.join(directory, shard["name"])
        bar.update(1)
        if not os.path.isfile(path):
            problem(f"{shard['name']}: missing")
            continue
        size = os.path.getsize(path)
        if size != shard.get("bytes"):
            problem(f"{shard['name']}: {size} bytes, manifest says {shard.get('bytes', 'nothing (no bytes)')}")
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        if "sha256" not in shard:
            problem(f"{shard['name']}: the manifest has no sha256 for it")
        elif h.hexdigest() != shard["sha256"]:
            problem(f"{shard['name']}: sha256 mismatch (file changed or corrupt)")
        expected = [sample_entry(s)[::-1] for s in shard.get("samples", [])]
        for i in [i for i, (offset, key) in enumerate(expected) if offset < 0 or not key]:
            problem(f"{shard['name']}: samples[{i}] has no key or no byte offset: {str(shard['samples'][i])[:80]}")
        got = []
        try:
            for offset, key, members in iter_shard_samples(path, limits=limits):
                got.append((offset, key))
                counts["documents"] += 1
                where = f"{shard['name']}:{key}"
                if next(iter(members)) != "doc.json":
                    problem(f"{where}: doc.json is not the first member")
                suffixes = set(members)
                for suffix in [k for k, v in members.items() if isinstance(v, Refused)]:
                    refused = members.pop(suffix)
                    problem(f"{where}: {refused.message} (training skips the sample: {refused.reason})")
                try:
                    doc = json.loads(members["doc.json"])
                except (KeyError, json.JSONDecodeError, RecursionError) as err:
                    problem(f"{where}: doc.json missing or invalid ({err})")
                    continue
                for p in check_output_document(doc, suffixes):
                    problem(f"{where}: {p}")
                for seg in doc.get("segments", []):
                    seg_totals[seg.get("type")] += 1
                    if media and seg.get("type") in ("image", "video") and seg.get("ref") in members:
                        try:
                            (validate_image if seg["type"] == "image" else validate_video)(members[seg["ref"]], loose)
                            counts["media_decoded"] += 1
                        except Reject as rej:
                            problem(f"{where}: {seg['ref']} does not decode: {rej.reason}")
        except Exception as err:  # noqa: BLE001 - a broken tar is a finding, not a crash
            problem(f"{shard['name']}: tar cannot be read ({err})")
            continue
        if got != expected:
            missing = len(set(expected) - set(got))
            extra = len(set(got) - set(expected))
            problem(f"{shard['name']}: samples differ from the manifest ({missing} listed but not found at their offset, {extra} unlisted)")
        if len(got) != shard.get("num_samples"):
            problem(f"{shard['name']}: {len(got)} samples, manifest says num_samples={shard.get('num_samples', 'nothing')}")
    bar.close()
    totals = man.get("totals") or {}
    if counts["documents"] != totals.get("documents"):
        problem(f"totals.documents is {totals.get('documents', 'missing')} but the shards hold {counts['documents']}")
    segments = totals.get("segments") or {}
    for t in ("text", "code", "image", "video"):
        if seg_totals.get(t, 0) != segments.get(t, 0):
            problem(f"totals.segments.{t} is {segments.get(t, 0)} but the shards hold {seg_totals.get(t, 0)}")
    if not counts["documents"] and not totals.get("documents"):
        problem("the set is empty: the manifest lists no documents (nothing to train on)")
    counts["shards"] = len(man["shards"])
    return problems, dict(counts)


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _bar(total: int, enabled: bool, desc: str):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="shard", desc=desc)
