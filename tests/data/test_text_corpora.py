"""Text corpora as they ship (issue 38, item 4): `{"text": ...}` JSONL records (Dolma, RedPajama,
FineWeb), plain and compressed (.gz, .zst, .bz2, .xz), compressed plain text, code records; streamed
with memory bounded as plain JSONL is; bad compressed input is a counted reject."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
from pathlib import Path

import pytest

from omniloom.data.manifest import iter_documents
from omniloom.data.prep.shards import build
from omniloom.data.prep.textcorpus import parse_record

zstd = pytest.importorskip("zstandard")

RECORDS = [{"text": f"Document {i}: the quick brown fox, number {i}.", "id": f"doc-{i}", "url": f"https://example.com/{i}",
            "added": "2024-01-01", "source": "common-crawl"} for i in range(5)]
COMPRESS = {"": lambda b: b, ".gz": gzip.compress, ".zst": lambda b: zstd.ZstdCompressor().compress(b), ".bz2": bz2.compress,
            ".xz": lzma.compress}


def _jsonl(records) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def _docs(out: Path) -> list[dict]:
    return [doc for _, doc, _ in iter_documents(out)]


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst", ".bz2", ".xz"])
def test_text_records_plain_and_compressed(tmp_path, suffix):
    src = tmp_path / "src"
    src.mkdir()
    name = "web.json" + suffix if suffix else "web.jsonl"  # Dolma ships .json.gz, one record a line
    (src / name).write_bytes(COMPRESS[suffix](_jsonl(RECORDS)))
    out = tmp_path / "out"
    s = build([str(src)], str(out), progress=False)
    assert s["documents"] == 5 and s["rejects"] == {}, s
    docs = sorted(_docs(out), key=lambda d: d["meta"]["id"])
    for rec, doc in zip(RECORDS, docs):
        assert doc["segments"] == [{"type": "text", "text": rec["text"]}]
        assert doc["meta"]["url"] == rec["url"] and doc["meta"]["added"] == rec["added"]
        assert doc["meta"]["original_source"] == "common-crawl"  # the record's own source key, kept
        assert doc["meta"]["source"] == f"src/{name}:{RECORDS.index(rec) + 1}"


def test_compressed_builds_equal_the_plain_one_and_resume(tmp_path):
    outs = {}
    for suffix in ("", ".zst"):
        src = tmp_path / f"src{suffix}"
        src.mkdir()
        (src / ("c.jsonl" + suffix)).write_bytes(COMPRESS[suffix](_jsonl(RECORDS * 1 + [{"text": "x" * 50, "id": "dup"}])))
        outs[suffix] = tmp_path / f"out{suffix}"
        build([str(src)], str(outs[suffix]), shard_max_docs=2, progress=False)
    strip = lambda docs: [(d["segments"], {k: v for k, v in d["meta"].items() if k != "source"}) for d in docs]  # noqa: E731
    assert strip(_docs(outs[""])) == strip(_docs(outs[".zst"]))
    # a build stopped after its first shard resumes by reading the stream forward to its next line
    import omniloom.data.prep.shards as shards

    src, out = tmp_path / "src.zst", tmp_path / "again"
    real = shards._close_shard
    calls = []

    def stop_after_one(*a, **k):
        real(*a, **k)
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt

    shards._close_shard = stop_after_one
    try:
        with pytest.raises(KeyboardInterrupt):
            build([str(src)], str(out), shard_max_docs=2, progress=False)
    finally:
        shards._close_shard = real
    s = build([str(src)], str(out), shard_max_docs=2, progress=False)
    assert s["resumed"]
    for f in outs[".zst"].iterdir():
        assert (out / f.name).read_bytes() == f.read_bytes(), f.name


def test_text_field_code_records_and_natural_languages():
    segs, meta = parse_record({"content": "def f():\n    return 1\n", "lang": "Python", "max_stars_repo_path": "a/b.py"}, "content")
    assert segs == [{"type": "code", "lang": "python", "text": "def f():\n    return 1\n"}] and meta["lang"] == "Python"
    assert parse_record({"text": "int x;", "ext": "c"})[0][0]["lang"] == "c"
    assert parse_record({"text": "fn main() {}", "path": "src/main.rs"})[0][0]["lang"] == "rust"
    assert parse_record({"text": "Bonjour", "lang": "fr"})[0] == [{"type": "text", "text": "Bonjour"}]  # a natural language
    assert parse_record({"text": "Hello", "language": "en", "meta": {"x": 1}})[0][0]["type"] == "text"
    from omniloom.data.prep.validate import Reject

    with pytest.raises(Reject, match="--text-field"):
        parse_record({"body": "no text key"})
    with pytest.raises(Reject, match="must be a string"):
        parse_record({"text": ["a"]})
    # the omniloom and OBELICS layouts keep their meaning
    assert parse_record({"segments": [{"type": "text", "text": "a"}]})[0] == [{"type": "text", "text": "a"}]


def test_compressed_text_files_huge_lines_and_corrupt_streams(tmp_path):
    from omniloom.data.prep.units import IngestSettings
    from omniloom.data.prep.validate import TextPolicy

    src = tmp_path / "src"
    src.mkdir()
    (src / "essay.txt.gz").write_bytes(gzip.compress(b"An essay in a gzip file.\n"))
    (src / "tool.py.xz").write_bytes(lzma.compress(b"print('hi')\n"))
    big = _jsonl([{"text": "y" * 200_000}, {"text": "after the long line"}])
    (src / "big.jsonl.gz").write_bytes(gzip.compress(big))
    (src / "broken.jsonl.gz").write_bytes(gzip.compress(_jsonl(RECORDS))[:60])  # cut short
    (src / "blob.bin.gz").write_bytes(gzip.compress(b"\x00\x01"))
    out = tmp_path / "out"
    s = build([str(src)], str(out), progress=False, ingest=IngestSettings(text=TextPolicy(max_bytes=64 << 10)))
    docs = {d["meta"]["source"].split("/", 1)[1]: d for d in _docs(out)}
    assert docs["essay.txt.gz"]["segments"] == [{"type": "text", "text": "An essay in a gzip file.\n"}]
    assert docs["tool.py.xz"]["segments"][0]["lang"] == "python"
    assert docs["big.jsonl.gz:2"]["segments"][0]["text"] == "after the long line"
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_path = {r["path"].rsplit("/", 1)[1]: r for r in rejects}
    assert by_path["big.jsonl.gz:1"]["code"] == "too-large" and "without being loaded" in by_path["big.jsonl.gz:1"]["reason"]
    assert by_path["broken.jsonl.gz"]["code"] == "corrupt-compressed"
    assert by_path["blob.bin.gz"]["code"] == "unsupported" and "decompress" in by_path["blob.bin.gz"]["reason"]
    assert s["documents"] == 3


def test_shuffle_refuses_compressed_inputs_naming_the_fix(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(RECORDS)))
    with pytest.raises(ValueError, match="decompress them first"):
        build([str(src)], str(tmp_path / "out"), shuffle=3, progress=False)
