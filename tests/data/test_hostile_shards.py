"""Shards that lie or attack, as training reads them (issue 27 items 12-15): members past the
build's limits or sparse, doc.json nested past the recursion limit, manifests whose offsets lie,
and sources that are not tar shards. Each bad sample is skipped and counted; a bad source is one
line at start."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tracemalloc
import warnings
from collections import Counter

import pytest

from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.stream.reader import ReadLimits, SampleError, SampleReader, resolve_source
from omniloom.data.stream.loader import build_loader
from omniloom.data.stream.stream_bench import SyntheticTokenizer, synthetic_documents, write_shards

TOK = SyntheticTokenizer()
_HOLE = 512 << 20  # a sparse member's size once its holes are zeros: what tarfile would allocate


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A clean shard set: 2 shards of 8 documents."""
    return write_shards(str(tmp_path_factory.mktemp("good") / "s"), synthetic_documents(16, seed=3, mean_text=60, max_grid=4),
                        name="s", docs_per_shard=8)


def _manifest(folder) -> dict:
    with open(os.path.join(folder, "manifest.json")) as f:
        return json.load(f)


def _write_manifest(folder, man: dict) -> None:
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(man, f)


def _member(tf: tarfile.TarFile, name: str, data: bytes, *, pax: dict | None = None) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
    if pax:
        info.pax_headers = pax
    tf.addfile(info, io.BytesIO(data))


def _hostile_shard(folder, samples: list[list[tuple]], *, settings: dict | None = None) -> str:
    """One shard + manifest from raw samples: each a list of (suffix, data, pax headers or None)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "h-000000.tar")
    entries = []
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i, members in enumerate(samples):
            key = f"h{i:04d}"
            entries.append({"key": key, "offset": tf.offset})
            for suffix, data, pax in members:
                _member(tf, f"{key}.{suffix}", data, pax=pax)
    raw = open(path, "rb").read()
    man = {"format": "omniloom-shards", "version": 1, "name": "h", "settings": settings or {},
           "totals": {"documents": len(entries), "segments": {}},
           "shards": [{"name": "h-000000.tar", "num_samples": len(entries), "bytes": len(raw),
                       "sha256": hashlib.sha256(raw).hexdigest(), "samples": entries}]}
    _write_manifest(folder, man)
    return folder


def _doc(ref: str | None = None) -> bytes:
    segs = [{"type": "text", "text": "plain words for the loom"}]
    if ref:
        segs.append({"type": "image", "ref": ref})
    return json.dumps({"schema": 1, "segments": segs}).encode()


def _image() -> bytes:
    return b"SYNIMG" + bytes((1, 2, 2)) + b"x" * 40


def _sparse_pax(name: str, real_size: int) -> dict:
    """PAX headers of a GNU sparse (format 0.1) member: `real_size` bytes, all a hole but the last 16."""
    return {"GNU.sparse.map": f"{real_size - 16},16", "GNU.sparse.size": str(real_size), "GNU.sparse.name": name}


def _read_all(folder) -> dict:
    """Read every sample of a one-shard set: {index: (doc, media) or the skip reason}."""
    shards = resolve_source(SourceConfig(path=str(folder))).shards
    reader = SampleReader(shards)
    out = {}
    try:
        for i in range(shards[0].num_samples):
            try:
                out[i] = reader.read_document(0, i)
            except SampleError as err:
                out[i] = err.reason
    finally:
        reader.close()
    return out


def _read_all_measured(folder) -> tuple[dict, int]:
    """_read_all, and the peak of Python's allocations while it ran (bytes)."""
    tracemalloc.start()
    try:
        got = _read_all(folder)
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _epoch_skips(folder, **kw) -> dict:
    """Stream a full epoch and more through the real loader: it must not raise; the skip counters."""
    cfg = DataConfig(sources=[SourceConfig(path=str(folder))], seq_len=64, batch_size=2, num_workers=0,
                     shuffle_buffer=2, pack_buffer=2, seed=1, **kw)
    loader = build_loader(cfg, TOK, patch_dim=TOK.tubelet_dim)
    for n, _ in enumerate(loader):
        if loader.epochs()[str(folder)] >= 1 or n > 200:
            break
    assert loader.epochs()[str(folder)] >= 1, "the pass must cover every sample"
    return loader.skipped()


def test_a_sparse_member_is_skipped_unread_and_memory_stays_bounded(tmp_path):
    """Item 12: a 30 KB shard whose sparse member is 512 MiB of holes: tarfile would hand back the
    whole 512 MiB; the reader refuses it from its header (the build writes no sparse member)."""
    folder = _hostile_shard(tmp_path / "h", [
        [("doc.json", _doc("img0.jpg"), None), ("img0.jpg", _image(), None)],
        [("doc.json", _doc("img0.jpg"), None), ("img0.jpg", b"\0" * 16, _sparse_pax("h0001.img0.jpg", _HOLE))],
        [("doc.json", _doc(), None)],
    ])
    assert os.path.getsize(os.path.join(folder, "h-000000.tar")) < 64 << 10
    got, peak = _read_all_measured(folder)
    assert got[1] == "sparse_member" and isinstance(got[0], tuple) and isinstance(got[2], tuple), got
    assert peak < 16 << 20, f"reading a 30 KB shard peaked at {peak / 2**20:.0f} MiB"
    # `data verify`, which the skip's message points to, names it without reading it either
    from omniloom.data.prep.inspect import verify

    tracemalloc.start()
    try:
        problems, _ = verify(str(folder), media=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert any("h0001" in p and "sparse file" in p for p in problems), problems
    assert peak < 16 << 20, f"verifying a 30 KB shard peaked at {peak / 2**20:.0f} MiB"


def test_members_past_the_builds_limits_are_skipped_unread(tmp_path):
    """Item 12: the manifest's build settings (--max-image-bytes 100 here) bound what training
    reads; a header forging a 1 TiB size in a small shard is refused from the header too."""
    forged = io.BytesIO()
    with tarfile.open(fileobj=forged, mode="w", format=tarfile.PAX_FORMAT) as tf:
        _member(tf, "h0002.doc.json", _doc(), pax={"size": str(1 << 40)})
    folder = _hostile_shard(tmp_path / "h", [
        [("doc.json", _doc("img0.jpg"), None), ("img0.jpg", _image(), None)],  # 49 bytes: within 100
        [("doc.json", _doc("img0.jpg"), None), ("img0.jpg", _image() + b"y" * 200, None)],  # 249 bytes
        [("doc.json", _doc(), None)],
    ], settings={"text": {"max_bytes": 1 << 20}, "limits": {"max_image_bytes": 100}})
    shards = resolve_source(SourceConfig(path=str(folder))).shards
    assert shards[0].limits == ReadLimits(doc_json_bytes=8 << 20, image_bytes=100, video_bytes=ReadLimits().video_bytes)
    got = _read_all(folder)
    assert isinstance(got[0], tuple) and got[1] == "oversize_member" and isinstance(got[2], tuple), got
    # the third sample's doc.json header claims 1 TiB (a pax size record), in a shard of a few KB
    man = _manifest(folder)
    path = os.path.join(folder, "h-000000.tar")
    raw = open(path, "rb").read()
    start = man["shards"][0]["samples"][2]["offset"]
    with open(path, "wb") as f:
        f.write(raw[:start] + forged.getvalue())
    man["shards"][0]["bytes"] = os.path.getsize(path)
    _write_manifest(folder, man)
    assert _read_all(folder)[2] == "oversize_member"


def test_a_real_oversize_member_is_refused_from_its_header_before_its_data_is_read(tmp_path):
    """Review of item 12: the sample's whole byte range was read into memory, then parsed; a real
    (not sparse) member past the limit cost its full size before it was refused."""
    big = os.urandom(24 << 20)
    folder = _hostile_shard(tmp_path / "h", [
        [("doc.json", _doc("img0.jpg"), None), ("img0.jpg", big, None)],
        [("doc.json", _doc(), None)],
    ], settings={"text": {"max_bytes": 1 << 20}, "limits": {"max_image_bytes": 1 << 20}})
    del big
    got, peak = _read_all_measured(folder)
    assert got[0] == "oversize_member" and isinstance(got[1], tuple), got
    assert peak < 4 << 20, f"reading a shard with a refused 24 MiB member peaked at {peak / 2**20:.1f} MiB"


def test_a_deeply_nested_doc_json_is_skipped_and_counted(tmp_path):
    """Item 13: 100,000 nested lists (200 KB) raise RecursionError in json.loads."""
    deep = b"[" * 100_000 + b"]" * 100_000
    folder = _hostile_shard(tmp_path / "h", [[("doc.json", _doc(), None)], [("doc.json", deep, None)],
                                             [("doc.json", b'{"schema": 1, "segments": [{"type": "image", "ref": ["x"]}]}', None)],
                                             [("doc.json", _doc(), None)]])
    assert _read_all(folder)[1] == "bad_doc_json"
    skips = _epoch_skips(folder)
    assert skips.get("bad_doc_json", 0) >= 1 and skips.get("missing_media", 0) >= 1, skips


def _lie(good, tmp_path, name: str, edit) -> str:
    folder = str(tmp_path / name)
    shutil.copytree(good, folder)
    man = _manifest(folder)
    edit(man["shards"])
    _write_manifest(folder, man)
    return folder


def _swap(shards):
    s = shards[0]["samples"]
    s[2]["offset"], s[5]["offset"] = s[5]["offset"], s[2]["offset"]


def _reorder(shards):
    s = shards[0]["samples"]
    s[1], s[4] = s[4], s[1]


def _foreign(shards):
    shards[0]["samples"].insert(3, dict(shards[1]["samples"][6]))
    shards[0]["num_samples"] += 1


def _far(shards):
    shards[0]["samples"][4]["offset"] = 1e12


def _huge_size(shards):
    shards[1]["bytes"] = 1e12


def _not_numbers(shards):
    shards[0]["samples"][2]["offset"] = "0"
    shards[0]["samples"][3] = ["?"]


@pytest.mark.parametrize("edit,reasons,lost", [
    (_swap, {"manifest_mismatch"}, 2),
    (_reorder, set(), 0),  # whole (key, offset) entries out of order: every sample still reads
    (_foreign, {"manifest_mismatch", "corrupt_tar", "missing_media", "bad_offset"}, 2),  # it, and the sample it lands in
    (_far, {"bad_offset"}, 1),
    (_huge_size, set(), 0),  # the last sample reads to the file's real end
    (_not_numbers, {"bad_offset"}, 2),
], ids=["swapped", "reordered", "from-another-shard", "offset-1e12", "bytes-1e12", "not-numbers"])
def test_a_manifest_that_lies_costs_only_the_samples_it_lies_about(good, tmp_path, edit, reasons, lost):
    """Item 14: the lies raised ValueError or MemoryError; now each bad sample is one counted skip
    and every sample the manifest places rightly is still read."""
    folder = _lie(good, tmp_path, edit.__name__.strip("_"), edit)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _read_all(folder)
    bad = {i: r for i, r in got.items() if isinstance(r, str)}
    assert set(bad.values()) <= reasons and 0 < len(bad) <= lost if lost else not bad, bad
    skips = _epoch_skips(folder)
    assert set(skips) == set(bad.values()), skips


@pytest.mark.parametrize("kind", ["text", "gzip", "folder"])
def test_a_source_that_is_not_a_tar_shard_is_one_line_naming_it(good, tmp_path, capsys, kind):
    """Item 15: /etc/passwd or a .tar.gz as data.sources: one line naming it, exit 2."""
    import gzip

    from omniloom.pretrain.cli import main
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    if kind == "text":
        src = tmp_path / "passwd"
        src.write_text("root:x:0:0:root:/root:/bin/bash\n" * 40)
        expect = "is not a tar shard"
    elif kind == "gzip":
        src = tmp_path / "s-000000.tar.gz"
        src.write_bytes(gzip.compress(open(os.path.join(good, "s-000000.tar"), "rb").read()))
        expect = "is gzip-compressed"
    else:
        src = tmp_path / "empty"
        src.mkdir()
        expect = "no manifest.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "indexing by a full read" warning before the refusal
        with pytest.raises((ValueError, FileNotFoundError), match=expect):
            resolve_source(SourceConfig(path=str(src)))
    if kind == "folder":
        return  # a folder was already refused in one line; the CLI path is the same
    make_tiny_tokenizer(tmp_path / "tok")
    try:
        code = main(["-qq", "train", "--run-dir", str(tmp_path / "run"), "tiny", f"data.sources=[{{path: {src}}}]",
                     f"data.tokenizer={tmp_path / 'tok'}", "train.num_steps=1"])
    finally:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and str(src) in err and expect in err, err


def test_tokenizer_training_reads_the_same_hostile_doc_json_without_dying(tmp_path):
    """`omniloom tokenizer train` reads only doc.json members, with its own reader
    (tokenizers/corpus.py, which may not import data/): a deep or sparse doc.json is a counted
    bad_doc_json there too, not a RecursionError or half a GiB of zeros."""
    from pathlib import Path

    from omniloom.tokenizers.corpus import iter_shard_docs

    folder = _hostile_shard(tmp_path / "h", [
        [("doc.json", _doc(), None)],
        [("doc.json", b"[" * 100_000 + b"]" * 100_000, None)],
        [("doc.json", b"{}" + b" " * 14, _sparse_pax("h0002.doc.json", _HOLE))],
        [("doc.json", _doc(), None)],
    ])
    stats = Counter()
    tracemalloc.start()
    try:
        keys = [k for k, _ in iter_shard_docs([Path(folder) / "h-000000.tar"], stats)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert keys == ["h0000", "h0003"] and stats["bad_doc_json"] == 2, (keys, stats)
    assert peak < 16 << 20, f"reading a 30 KB shard peaked at {peak / 2**20:.0f} MiB"
