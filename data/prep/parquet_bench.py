"""`omniloom bench data --parquet`: `data build` throughput on parquet against reading the same
rows with pyarrow alone, in the same run (issue 38).

Two files are generated with pyarrow, in the layout `datasets` writes (the `huggingface` features
metadata, `Image` as `struct<bytes, path>`): image-caption rows (JPEG, a caption, an id) and
FineWeb-like text rows (`text`, `id`, `url`). The reference reads each file row group by row group
with pyarrow (`ParquetFile.read_row_group(...).to_pylist()`) and, for the images, decodes every
image to RGB with PIL, as the build decodes every image to validate it. The figures are docs/s and
the build's share of the reference speed; the build does more (validation, dedup, writing shards),
so the ratio is the price of those, measured.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import time


def make_parquet_inputs(root: str, *, rows: int, text_rows: int, image_size: int, row_group: int = 100) -> dict:
    """Write root/images/pairs.parquet and root/text/fineweb.parquet; return their paths."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(0)
    h = image_size * 3 // 4
    base = rng.integers(0, 255, (h, image_size, 3), dtype=np.uint8)
    images = []
    for i in range(rows):
        pixels = np.roll(base, i * 7, axis=1)  # a different image per row, so dedup keeps them all
        pixels[:8, :8] = i % 256
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
        images.append({"bytes": buf.getvalue(), "path": f"{i:09d}.jpg"})
    feats = {"image": {"_type": "Image"}, "caption": {"dtype": "string", "_type": "Value"}, "id": {"dtype": "int64", "_type": "Value"}}
    table = pa.table({"image": pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
                      "caption": [f"a generated photo number {i}" for i in range(rows)], "id": list(range(rows))})
    table = table.replace_schema_metadata({"huggingface": json.dumps({"info": {"features": feats}})})
    img_dir, text_dir = os.path.join(root, "images"), os.path.join(root, "text")
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(text_dir, exist_ok=True)
    pairs = os.path.join(img_dir, "pairs.parquet")
    pq.write_table(table, pairs, row_group_size=row_group)
    words = ["data", "model", "token", "shard", "image", "video", "caption", "corpus", "train", "loss"]
    texts = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(120)) + f" (record {i})" for i in range(text_rows)]
    text = pa.table({"text": texts, "id": [f"r{i}" for i in range(text_rows)], "url": [f"https://example.com/t/{i}" for i in range(text_rows)]})
    fineweb = os.path.join(text_dir, "fineweb.parquet")
    pq.write_table(text, fineweb, row_group_size=row_group * 10)
    return {"pairs": pairs, "fineweb": fineweb, "img_dir": img_dir, "text_dir": text_dir}


def _reference(path: str, decode: bool) -> tuple[int, float]:
    """Rows/s of pyarrow alone, row group by row group; `decode`: every image decoded to RGB with PIL."""
    import pyarrow.parquet as pq
    from PIL import Image

    t = time.perf_counter()
    n = 0
    pf = pq.ParquetFile(path)
    for g in range(pf.metadata.num_row_groups):
        for row in pf.read_row_group(g).to_pylist():
            if decode:
                with Image.open(io.BytesIO(row["image"]["bytes"])) as im:
                    im.convert("RGB")
            n += 1
    return n, time.perf_counter() - t


def run_parquet_bench(*, rows: int = 600, text_rows: int = 20000, image_size: int = 256, workers: int = 1, keep: str | None = None) -> str:
    """Generate the inputs, time the references and the builds, and return the report as text."""
    from .build_bench import compare_builds

    base = keep or tempfile.mkdtemp(prefix="omniloom-bench-parquet-")
    try:
        shutil.rmtree(os.path.join(base, "in"), ignore_errors=True)
        t0 = time.perf_counter()
        inputs = make_parquet_inputs(os.path.join(base, "in"), rows=rows, text_rows=text_rows, image_size=image_size)
        gen_s = time.perf_counter() - t0
        cases = [("parquet Image + caption", "pyarrow + PIL rgb", _reference(inputs["pairs"], True), inputs["img_dir"]),
                 ("parquet text (FineWeb layout)", "pyarrow to_pylist", _reference(inputs["fineweb"], False), inputs["text_dir"])]
        return compare_builds(base, cases, workers=workers,
                              inputs=f"inputs: {rows} image rows ({image_size}px JPEG, row groups of 100), {text_rows} text rows; "
                              f"generated in {gen_s:.1f}s")
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)
