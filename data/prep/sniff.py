"""Deciding what an input is by looking at it, not only at its name (issue 38, item 5: no silent
misreads). Each decision is counted by the caller and shown in the build summary.

- `earlier_build_file`: a `manifest.json` / `rejects.jsonl` that an earlier `omniloom data build`
  wrote into a folder now given as a source is the build's bookkeeping, not a document.
- `shard_metadata_file`: img2dataset and video2dataset write `NNNNN_stats.json` and `NNNNN.parquet`
  beside each `NNNNN.tar`: statistics and a listing of the same samples, not documents.
- `probe_media`: a file whose extension is on no list but which PyAV opens with a video stream is a
  video (its caption sidecar stays its caption), whatever it is called (`.3g2`, `.vob`, `.m2ts`).
- `animated_as_video`: an animated GIF, APNG or WebP is a video: GIF and APNG bytes are kept as they
  are (FFmpeg decodes both), an animated WebP, which FFmpeg cannot decode, is re-encoded losslessly
  as APNG with its frame durations.
"""

from __future__ import annotations

import io
import json
import os
import re

from .media import MediaLimits, validate_video
from .validate import Reject

_REJECT_KEYS = {"path", "code", "reason", "action"}
SKIP_WHY = {"earlier-build": "an earlier omniloom build's manifest.json / rejects.jsonl",
            "shard-metadata": "img2dataset/video2dataset NNNNN_stats.json / NNNNN.parquet beside NNNNN.tar"}


def describe_other_skips(skipped) -> str:
    """The summary's words for the discovery skips this module decides (counts in `skipped`)."""
    return ", ".join(f"{skipped[k]} {k} ({why})" for k, why in SKIP_WHY.items() if skipped.get(k))


def earlier_build_file(root: str, rel: str, fileset: set[str]) -> bool:
    """Whether `rel` is the manifest or reject list of an earlier omniloom build: a `manifest.json`
    whose `format` is omniloom's, or a `rejects.jsonl` beside such a manifest or whose first line is
    a reject record."""
    name = os.path.basename(rel)
    full = os.path.join(root, rel)
    if name == "manifest.json":
        return _is_omniloom_manifest(full)
    if name == "rejects.jsonl":
        sibling = rel[: -len(name)] + "manifest.json"
        if sibling in fileset and _is_omniloom_manifest(os.path.join(root, sibling)):
            return True
        try:
            with open(full, "rb") as f:
                first = f.readline(1 << 16)
            rec = json.loads(first) if first.strip() else None
        except (OSError, ValueError):
            return False
        return isinstance(rec, dict) and _REJECT_KEYS <= set(rec)
    return False


def _is_omniloom_manifest(path: str) -> bool:
    # The writer puts "format" first (manifest.write_json_atomic keeps key order): the head decides,
    # so a manifest listing a million samples is never parsed here.
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return re.match(rb'\s*\{\s*"format"\s*:\s*"omniloom-shards"', head) is not None


def shard_metadata_file(rel: str, fileset: set[str]) -> bool:
    """img2dataset / video2dataset bookkeeping beside a shard: `STEM_stats.json` or `STEM.parquet`
    next to `STEM.tar`."""
    low = rel.lower()
    if low.endswith("_stats.json"):
        return rel[: -len("_stats.json")] + ".tar" in fileset
    if low.endswith(".parquet"):
        return rel[: -len(".parquet")] + ".tar" in fileset
    return False


def probe_media(path: str) -> str:
    """"video" when PyAV opens the file with a video stream that is not a single still image
    ("image" then), else "" (audio only, not media, unreadable). Reads the container header only."""
    import av

    from .media import _is_image_pipe

    try:
        with av.open(path, mode="r") as c:
            if not c.streams.video:
                return ""
            return "image" if _is_image_pipe(c.format.name) else "video"
    except Exception:  # noqa: BLE001 - FFmpeg raises many error types for files that are not media
        return ""


def animated_as_video(data: bytes, info: dict, limits: MediaLimits) -> tuple[bytes, dict]:
    """(bytes, video info) for an animated image `validate_image` measured as `info` (frames > 1):
    GIF and APNG as they are, animated WebP re-encoded losslessly as APNG. `info` of the video
    gains `animated_from` (the image format) and, when re-encoded, `original_bytes`. Raises
    Reject when FFmpeg cannot read the result as a video (the caller keeps the image then)."""
    fmt = info.get("format")
    if fmt == "WEBP":
        out = _webp_to_apng(data, limits)
        vinfo = validate_video(out, limits)
        vinfo.update(animated_from="webp", original_bytes=len(data))
        return out, vinfo
    vinfo = validate_video(data, limits)
    vinfo["animated_from"] = str(fmt).lower()
    return data, vinfo


def _webp_to_apng(data: bytes, limits: MediaLimits) -> bytes:
    from PIL import Image, ImageSequence

    with Image.open(io.BytesIO(data)) as img:
        frames, durations = [], []
        for frame in ImageSequence.Iterator(img):
            frames.append(frame.convert("RGBA"))
            durations.append(max(1, int(frame.info.get("duration", 100) or 100)))
            if len(frames) > limits.max_image_frames:
                raise Reject("image-frames", f"animated image has more than {limits.max_image_frames} frames")
    buf = io.BytesIO()
    frames[0].save(buf, format="PNG", save_all=True, append_images=frames[1:], duration=durations, loop=0)
    return buf.getvalue()


def decide_animated(data: bytes, info: dict, st, notes) -> tuple[bytes, dict, str]:
    """(bytes, info, "video" or "image") for an animated image: a video (`animated_as_video`), or
    kept as the image it is (training reads its first frame) under --animated-images first-frame
    or when FFmpeg cannot read it as a video. The decision is counted in `notes`."""
    if st.animated == "video":
        try:
            vdata, vinfo = animated_as_video(data, info, st.limits)
            notes["animated-image-video"] += 1
            return vdata, vinfo, "video"
        except Reject:
            notes["animated-image-kept-image"] += 1
            return data, info, "image"
    notes["animated-image-first-frame"] += 1
    return data, info, "image"
