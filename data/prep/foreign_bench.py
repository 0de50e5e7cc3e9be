"""`omniloom bench data --foreign`: `data build` throughput on foreign inputs against their own
libraries in the same run (issue 38).

Two inputs are generated: WebDataset shards in img2dataset's layout (KEY.jpg + KEY.txt + KEY.json,
written with `webdataset.TarWriter`) and a `.jsonl.zst` text corpus (`{"text", "id", "url"}`
records). Each is read by its own library alone as the reference: `webdataset.WebDataset(...)
.decode("rgb8")` (every image decoded, as the build decodes every image to validate it) and
`zstandard` + `json.loads` per line; then built with `data build`. The figures are docs/s and the
build's share of the reference speed. The build does more than the reference (validation, dedup,
writing shards), so the ratio is the price of those, measured.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time


def make_foreign_inputs(root: str, *, samples: int, records: int, image_size: int, shard_samples: int = 100) -> dict:
    """Write the benchmark's shards under root/wds and its corpus as root/text/corpus.jsonl.zst."""
    import numpy as np
    import webdataset as wds
    import zstandard
    from PIL import Image

    rng = np.random.default_rng(0)
    wds_dir = os.path.join(root, "wds")
    os.makedirs(wds_dir, exist_ok=True)
    shards = []
    h = image_size * 3 // 4
    base = rng.integers(0, 255, (h, image_size, 3), dtype=np.uint8)
    for s in range(0, samples, shard_samples):
        path = os.path.join(wds_dir, f"{s // shard_samples:05d}.tar")
        shards.append(path)
        with wds.TarWriter(path) as w:
            for i in range(s, min(samples, s + shard_samples)):
                pixels = np.roll(base, i * 7, axis=1)  # a different image per sample, so dedup keeps them all
                pixels[:8, :8] = i % 256
                buf = io.BytesIO()
                Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
                w.write({"__key__": f"{i:09d}", "jpg": buf.getvalue(), "txt": f"a generated photo number {i}",
                         "json": {"url": f"https://example.com/{i}.jpg", "key": f"{i:09d}", "status": "success"}})
    text_dir = os.path.join(root, "text")
    os.makedirs(text_dir, exist_ok=True)
    corpus = os.path.join(text_dir, "corpus.jsonl.zst")
    words = ["data", "model", "token", "shard", "image", "video", "caption", "corpus", "train", "loss"]
    lines = []
    for i in range(records):
        text = " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(120)) + f" (record {i})"
        lines.append(json.dumps({"text": text, "id": f"r{i}", "url": f"https://example.com/t/{i}"}))
    with open(corpus, "wb") as f:
        f.write(zstandard.ZstdCompressor(level=3).compress(("\n".join(lines) + "\n").encode()))
    return {"shards": shards, "wds_dir": wds_dir, "corpus": corpus, "text_dir": text_dir}


def _reference_wds(shards: list[str]) -> tuple[int, float]:
    import webdataset as wds

    t = time.perf_counter()
    n = sum(1 for _ in wds.WebDataset(shards, shardshuffle=False).decode("rgb8"))
    return n, time.perf_counter() - t


def _reference_zst(path: str) -> tuple[int, float]:
    import zstandard

    t = time.perf_counter()
    n = 0
    with open(path, "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
        for line in io.TextIOWrapper(r, encoding="utf-8"):
            if line.strip():
                json.loads(line)
                n += 1
    return n, time.perf_counter() - t


def run_foreign_bench(*, samples: int = 600, records: int = 20000, image_size: int = 256, workers: int = 1,
                      keep: str | None = None) -> str:
    """Generate the inputs, time the references and the builds, and return the report as text."""
    from .build_bench import compare_builds

    base = keep or tempfile.mkdtemp(prefix="omniloom-bench-foreign-")
    try:
        shutil.rmtree(os.path.join(base, "in"), ignore_errors=True)
        t0 = time.perf_counter()
        inputs = make_foreign_inputs(os.path.join(base, "in"), samples=samples, records=records, image_size=image_size)
        gen_s = time.perf_counter() - t0
        cases = [("WebDataset shards (jpg+txt+json)", "WebDataset rgb8", _reference_wds(inputs["shards"]), inputs["wds_dir"]),
                 (".jsonl.zst text corpus", "zstandard+json", _reference_zst(inputs["corpus"]), inputs["text_dir"])]
        return compare_builds(base, cases, workers=workers,
                              inputs=f"inputs: {samples} samples ({image_size}px JPEG) in {len(inputs['shards'])} shards, "
                              f"{records} text records; generated in {gen_s:.1f}s")
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
