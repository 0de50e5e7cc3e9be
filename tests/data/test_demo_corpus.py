"""The demo corpus: deterministic, offline, captions that describe the pixels."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from omniloom.data.prep.demo_corpus import COLORS, DemoCorpusSettings, write_demo_corpus

SMALL = DemoCorpusSettings(num_images=12, num_videos=4, num_heldout_images=3, num_heldout_videos=2, num_interleaved=2)


def _tree(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_deterministic_and_complete(tmp_path):
    counts = write_demo_corpus(tmp_path / "a", SMALL)
    write_demo_corpus(tmp_path / "b", SMALL)
    assert _tree(tmp_path / "a") == _tree(tmp_path / "b")
    assert counts["images"] == 12 and counts["videos"] == 4 and counts["heldout_images"] == 3
    assert counts["stdlib_files"] > 10 and counts["doc_topics"] > 10
    for rel in ("train/shapes.jsonl", "train/motion.jsonl", "train/interleaved.jsonl", "heldout/shapes.jsonl"):
        assert (tmp_path / "a" / rel).is_file()


def test_refuses_non_empty_output(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "f").write_text("keep me")
    with pytest.raises(ValueError, match="not empty"):
        write_demo_corpus(tmp_path / "x", SMALL)


def test_caption_colour_matches_pixels(tmp_path):
    write_demo_corpus(tmp_path / "c", SMALL)
    root = tmp_path / "c" / "train"
    for line in (root / "shapes.jsonl").read_text().splitlines():
        doc = json.loads(line)
        assert [s["type"] for s in doc["segments"]] == ["image", "text"]  # visual first, caption after
        caption = doc["segments"][1]["text"]
        colour = next(c for c in COLORS if f" {c} " in caption)
        pixels = np.asarray(Image.open(root / doc["segments"][0]["ref"]).convert("RGB")).reshape(-1, 3).astype(int)
        dist = np.abs(pixels - np.array(COLORS[colour])).sum(1)
        assert (dist < 30).sum() > 20, caption


def test_motion_clip_moves_in_caption_direction(tmp_path):
    import av

    write_demo_corpus(tmp_path / "m", SMALL)
    root = tmp_path / "m" / "train"
    for line in (root / "motion.jsonl").read_text().splitlines():
        doc = json.loads(line)
        caption = doc["segments"][1]["text"]
        with av.open(str(root / doc["segments"][0]["ref"])) as c:
            frames = [f.to_ndarray(format="rgb24").astype(int) for f in c.decode(video=0)]
        assert len(frames) == SMALL.video_frames

        def centroid(fr):
            ys, xs = np.nonzero(np.abs(fr - np.array([24, 24, 28])).sum(-1) > 60)
            return xs.mean(), ys.mean()

        (x0, y0), (x1, y1) = centroid(frames[0]), centroid(frames[-1])
        direction = caption.split(" moves ")[1].rstrip(".")
        moved = {"left": x0 - x1, "right": x1 - x0, "up": y0 - y1, "down": y1 - y0}[direction]
        assert moved > 10, (caption, x0, x1, y0, y1)


def test_no_training_image_or_clip_repeats_a_held_out_one_or_another(tmp_path):
    # the shapes sit on a pixel grid, so identical draws happen (35 of 200 held-out images were
    # byte-identical to training images at 6,000 training images before the check): the held-out
    # score would partly measure memory
    import hashlib

    settings = DemoCorpusSettings(image_size=24, num_images=400, num_videos=30, num_heldout_images=60,
                                  num_heldout_videos=20, num_interleaved=20, video_frames=4)
    write_demo_corpus(tmp_path / "d", settings)
    digests = {}
    for part in ("train", "heldout"):
        for path in sorted((tmp_path / "d" / part).rglob("*")):
            if path.suffix in (".png", ".mp4") and "photos" not in path.parts:
                digests.setdefault(hashlib.sha256(path.read_bytes()).hexdigest(), []).append(f"{part}/{path.name}")
    assert sum(len(v) for v in digests.values()) == 400 + 30 + 60 + 20 + 2 * 20
    assert all(len(v) == 1 for v in digests.values()), [v for v in digests.values() if len(v) > 1][:3]
