"""Parquet as `omniloom data build` input (issue 38, item 3): files written by the real `datasets`
writer (an `Image` column with captions, a `Sequence(Image())` column, text-only FineWeb / The Stack
layouts, OBELICS texts/images) become one document per row, read one row group at a time; the
build keeps its promises (rejects with reasons, byte-identical for any --workers, kill -9 and
resume, --part and merge) and its shards train."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.manifest import iter_documents, read_rejects
from omniloom.data.prep.parquet import plan_columns
from omniloom.data.prep.shards import build
from omniloom.data.prep.units import IngestSettings

datasets = pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _image(seed: int, fmt: str = "PNG", size=(40, 32)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _write(rows: dict, path: Path, casts: dict, batch_size: int) -> None:
    """Write with datasets itself: Dataset.from_dict(...).cast_column(...).to_parquet(...)
    (batch_size is the row group size)."""
    ds = datasets.Dataset.from_dict(rows)
    for col, feature in casts.items():
        ds = ds.cast_column(col, feature)
    path.parent.mkdir(parents=True, exist_ok=True)
    ds.to_parquet(str(path), batch_size=batch_size)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from datasets import ClassLabel, Image, Sequence, Value

    root = tmp_path_factory.mktemp("parquet")
    # A folder of two files, row groups of 3: 10 image-caption rows, one corrupt image, one by URL.
    images = [{"bytes": _image(i, "JPEG" if i % 2 else "PNG"), "path": f"photo{i}.jpg"} for i in range(10)]
    images[4] = {"bytes": b"\x89PNG\r\n\x1a\nnot really a png", "path": "broken.png"}
    images[7] = {"bytes": None, "path": "https://example.com/far.jpg"}
    _write({"image": images, "caption": [f"photo number {i}" for i in range(10)], "width": list(range(10)),
            "label": [i % 2 for i in range(10)]}, root / "pairs" / "a.parquet",
           {"image": Image(), "label": ClassLabel(names=["cat", "dog"])}, batch_size=3)
    _write({"image": [{"bytes": _image(100 + i), "path": None} for i in range(3)], "caption": ["b0", "b1", "b2"]},
           root / "pairs" / "b.parquet", {"image": Image()}, batch_size=2)
    # A list of images per row, and a row whose list is empty (a text document then).
    _write({"images": [[{"bytes": _image(200), "path": None}, {"bytes": _image(201), "path": None}], [], [{"bytes": _image(202), "path": None}]],
            "text": ["two images", "no image", "one image"]}, root / "lists" / "l.parquet", {"images": Sequence(Image())}, batch_size=2)
    # Text only: FineWeb (text + scalars) and The Stack (content + lang): prose and code.
    _write({"text": [f"web page {i} about parquet" for i in range(5)], "id": [f"id{i}" for i in range(5)],
            "url": [f"https://example.com/{i}" for i in range(5)], "language": ["en"] * 5, "score": [0.5, float("nan"), 1, 2, 3]},
           root / "text" / "fineweb.parquet", {}, batch_size=2)
    _write({"content": ["def f():\n    return 1\n", "fn main() {}\n"], "lang": ["Python", "Rust"],
            "max_stars_repo_path": ["a/f.py", "b/main.rs"]}, root / "text" / "stack.parquet", {}, batch_size=1)
    # OBELICS as parquet: parallel texts / images lists.
    _write({"texts": [["Intro", None, "After the picture"]], "images": [[None, {"bytes": _image(300), "path": None}, None]],
            "url": ["https://example.com/doc"]}, root / "obelics" / "o.parquet",
           {"texts": Sequence(Value("string")), "images": Sequence(Image())}, batch_size=1)
    return root, images


def _documents(out: Path) -> dict[str, tuple[dict, dict]]:
    """{meta.source: (doc, members)} of a finished build."""
    return {doc["meta"]["source"]: (doc, members) for _, doc, members in iter_documents(out)}


def _rejects(out: Path) -> list[dict]:
    return read_rejects(out)


def test_image_column_with_captions_one_document_per_row(corpus, tmp_path):
    root, images = corpus
    assert pq.ParquetFile(root / "pairs" / "a.parquet").metadata.num_row_groups == 4  # read one group at a time
    out = tmp_path / "out"
    s = build([str(root / "pairs")], str(out), progress=False)
    docs = _documents(out)
    want = {f"pairs/a.parquet:{i + 1}" for i in range(10) if i not in (4, 7)} | {f"pairs/b.parquet:{i + 1}" for i in range(3)}
    assert set(docs) == want
    doc, members = docs["pairs/a.parquet:2"]
    assert [seg["type"] for seg in doc["segments"]] == ["image", "text"] and doc["segments"][1]["text"] == "photo number 1"
    assert members[doc["segments"][0]["ref"]] == images[1]["bytes"]  # the original bytes
    assert doc["meta"]["width"] == 1 and doc["meta"]["label"] == "dog"  # scalars to meta; ClassLabel by its name
    rej = {r["path"].rsplit("/", 1)[1]: r for r in _rejects(out)}
    assert set(rej) == {"a.parquet:5", "a.parquet:8"}
    assert rej["a.parquet:5"]["action"] == "dropped-doc" and rej["a.parquet:5"]["code"] != "error"
    assert rej["a.parquet:8"]["code"] == "remote-ref" and "https://example.com/far.jpg" in rej["a.parquet:8"]["reason"]
    assert s["segments"]["image"] == 11 and s["documents"] == 11


def test_lists_of_images_text_code_and_interleaved(corpus, tmp_path):
    root, _ = corpus
    out = tmp_path / "out"
    s = build([str(root / "lists"), str(root / "text"), str(root / "obelics")], str(out), progress=False)
    docs = _documents(out)
    kinds = {k: [seg["type"] for seg in d["segments"]] for k, (d, _) in docs.items()}
    assert kinds["lists/l.parquet:1"] == ["image", "image", "text"]
    assert kinds["lists/l.parquet:2"] == ["text"] and kinds["lists/l.parquet:3"] == ["image", "text"]
    assert all(kinds[f"text/fineweb.parquet:{i}"] == ["text"] for i in range(1, 6))
    fw = docs["text/fineweb.parquet:2"][0]
    assert fw["meta"]["url"] == "https://example.com/1" and fw["meta"]["score"] is None  # NaN -> null, counted
    code = docs["text/stack.parquet:1"][0]["segments"][0]
    assert code == {"type": "code", "lang": "python", "text": "def f():\n    return 1\n"}
    assert docs["text/stack.parquet:2"][0]["segments"][0]["lang"] == "rust"
    assert kinds["obelics/o.parquet:1"] == ["text", "image", "text"]
    assert s["notes"]["parquet-non-finite-nulled"] == 1 and s["notes"]["parquet-interleaved"] == 1


def test_columns_chosen_by_flags_when_the_file_cannot_tell(tmp_path, capsys):
    from omniloom.data.cli import main

    # pyarrow alone: no huggingface metadata, images as plain bytes, the caption under an unusual name
    table = pa.table({"jpg": [_image(400 + i, "JPEG") for i in range(3)], "sentence": ["x0", "x1", "x2"], "key": ["k0", "k1", "k2"]})
    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(table, src / "t.parquet", row_group_size=2)
    with pytest.raises(Exception, match=r"pass --text-column NAME and/or --image-column NAME"):
        plan_columns(table.schema)
    assert main(["build", str(src), "--out", str(tmp_path / "no")]) == 2  # nothing built; the reason is in rejects.jsonl
    rej = _rejects(tmp_path / "no")
    assert [r["code"] for r in rej] == ["parquet-columns"] and "--text-column" in rej[0]["reason"]
    assert main(["build", str(src), "--out", str(tmp_path / "yes"), "--text-column", "sentence", "--image-column", "jpg"]) == 0
    docs = _documents(tmp_path / "yes")
    assert [d["segments"][1]["text"] for d, _ in docs.values()] == ["x0", "x1", "x2"]
    assert all(d["meta"]["key"] == f"k{i}" for i, (d, _) in enumerate(docs.values()))
    # a flag naming a missing column says so; a file that is not parquet is a counted reject
    (src / "t.parquet").write_bytes(b"PAR1 not really")
    assert main(["build", str(src), "--out", str(tmp_path / "bad")]) == 2
    assert _rejects(tmp_path / "bad")[0]["code"] == "corrupt-parquet"
    capsys.readouterr()


def test_parquet_builds_are_deterministic_and_parts_merge(corpus, check_workers_and_parts):
    root, _ = corpus
    check_workers_and_parts([root / "pairs", root / "lists", root / "text"], shard_max_docs=4)


def test_kill_9_and_resume_of_a_parquet_build_is_byte_identical(corpus, check_kill_and_resume):
    root, _ = corpus
    check_kill_and_resume([root / "pairs", root / "text"], first=("--workers", "2"))  # resumed at 1 worker: the same bytes


def test_a_parquet_build_trains(corpus, tmp_path, train_tiny):
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    root, _ = corpus
    shards = tmp_path / "shards"
    build([str(root / "pairs"), str(root / "lists"), str(root / "text")], str(shards), progress=False)
    make_tiny_tokenizer(tmp_path / "tok")
    assert train_tiny(tmp_path / "run", shards, tmp_path / "tok") == 0
    from omniloom.pretrain.rundir import METRICS, read_metrics

    rows = [r for r in read_metrics(tmp_path / "run" / METRICS) if "loss" in r]
    assert rows and all(np.isfinite(r["loss"]) for r in rows)


def test_path_only_images_are_read_beside_the_file_and_caption_first(tmp_path):
    src = tmp_path / "src"
    (src / "imgs").mkdir(parents=True)
    (src / "imgs" / "a.png").write_bytes(_image(500))
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    table = pa.table({"image": pa.array([{"bytes": None, "path": "imgs/a.png"}, {"bytes": None, "path": None}], struct),
                      "caption": ["local file", "null image"]})
    pq.write_table(table, src / "t.parquet")
    out = tmp_path / "out"
    s = build([str(src)], str(out), progress=False, ingest=IngestSettings(caption_first=True))
    docs = _documents(out)
    doc, members = docs["src/t.parquet:1"]
    assert [seg["type"] for seg in doc["segments"]] == ["text", "image"] and members[doc["segments"][1]["ref"]] == _image(500)
    assert [seg["type"] for seg in docs["src/t.parquet:2"][0]["segments"]] == ["text"]  # a null image: counted, caption kept
    assert s["notes"]["parquet-null-image"] == 1


def test_parquet_bench_prints_figures():
    from omniloom.data.prep.parquet_bench import run_parquet_bench

    report = run_parquet_bench(rows=12, text_rows=40, image_size=64)
    assert "pyarrow + PIL rgb" in report and report.count("x\n") + report.endswith("x") >= 2 and "documents of" not in report


def test_shuffle_is_refused_for_parquet_in_one_line(corpus, tmp_path):
    root, _ = corpus
    with pytest.raises(ValueError, match=r"parquet files \(a.parquet and 1 more\) are read a row group at a time: build them without --shuffle"):
        build([str(root / "pairs")], str(tmp_path / "out"), progress=False, shuffle=1)
