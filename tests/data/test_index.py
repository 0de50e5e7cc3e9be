"""`omniloom data index` (issue 38 item 2): foreign WebDataset shards, written with the real
`webdataset.TarWriter` in img2dataset's and video2dataset's layouts, trained on in place. The index
finds the samples and bytes webdataset finds; an indexed set gives the batches a `data build` copy
gives; exact and elastic resume; a compressed shard, a foreign folder without an index and a shard
changed after indexing are refused or skipped, each in its own words."""

from __future__ import annotations

import gzip
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.prep.index import format_index_summary, index_shards
from omniloom.data.stream.loader import WorkerStream, build_loader
from omniloom.data.stream.reader import SampleReader, _foreign_members, resolve_source
from omniloom.pretrain.cli import main

wds = pytest.importorskip("webdataset")


def _image(fmt: str, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (32, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


_WORDS = ("red green blue yellow cat dog horse bird river mountain city street night morning portrait painting "
          "sunset forest beach window garden kitchen bicycle train station market bridge castle flower").split()


def _caption(n: int) -> str:
    """A photo caption with enough varied words to train a small tokenizer on."""
    words = np.random.default_rng(n).choice(_WORDS, 24)
    return f"a photo number {n}: " + " ".join(words)


def write_laion(folder: Path, shards: int = 2, per: int = 5) -> list[str]:
    """img2dataset's layout: KEY.jpg/png + KEY.txt + KEY.json, one key under a folder prefix, one
    corrupt image and one sample without caption; returns the corrupt sample's key."""
    folder.mkdir(parents=True, exist_ok=True)
    bad, n = [], 0
    for s in range(shards):
        with wds.TarWriter(str(folder / f"{s:05d}.tar")) as w:
            for j in range(per):
                ext, fmt = (("jpg", "JPEG"), ("png", "PNG"))[n % 2]
                key = f"{n:09d}" if (s, j) != (1, 0) else f"part-a/{n:09d}"
                sample = {"__key__": key, ext: _image(fmt, n), "txt": _caption(n),
                          "json": {"url": f"https://example.com/{n}.{ext}", "key": key, "status": "success"}}
                if (s, j) == (1, 2):
                    sample[ext] = b"\xff\xd8 not an image"
                    bad.append(key)
                if (s, j) == (0, 3):
                    del sample["txt"]
                w.write(sample)
                n += 1
        (folder / f"{s:05d}_stats.json").write_text(json.dumps({"count": per}))
    return bad


def write_webvid(path: Path, n: int = 3) -> None:
    from omniloom.tokenizers.testing import make_video_bytes

    path.parent.mkdir(parents=True, exist_ok=True)
    with wds.TarWriter(str(path)) as w:
        for i in range(n):
            w.write({"__key__": f"{i:05d}", "mp4": make_video_bytes(seconds=0.4, fps=10, width=32, height=32),
                     "txt": f"a clip number {i}", "json": {"url": f"https://v/{i}", "duration": 0.4}})


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    bad = write_laion(root / "laion")
    write_webvid(root / "webvid" / "00000.tar")
    return root, bad


def test_index_finds_webdatasets_samples_with_the_same_bytes_member_by_member(data, tmp_path):
    root, _ = data
    s = index_shards([str(root / "laion"), str(root / "webvid")], str(tmp_path / "idx"))
    assert s["shards"] == 3 and s["documents"] == 13 and s["rejects"] == {}
    man = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert man["kind"] == "index" and man["shards"][0]["url"] == str(root / "laion" / "00000.tar")
    # img2dataset's NNNNN_stats.json beside each shard: skipped and counted, in the summary's words too
    assert s["skipped"] == man["skipped"] == {"shard-metadata": 2}
    assert "skipped: 2 shard-metadata" in format_index_summary(s)
    shards = resolve_source(SourceConfig(path=str(tmp_path / "idx"))).shards
    reader = SampleReader(shards)
    for i, shard in enumerate(shards):
        ref = list(wds.WebDataset(shard.url, shardshuffle=False, empty_check=False))
        assert [r["__key__"] for r in ref] == shard.keys
        for j, r in enumerate(ref):
            key, members = reader.read_raw(i, j, _foreign_members)
            assert key == r["__key__"]
            assert dict(members) == {k: v for k, v in r.items() if not k.startswith("__")}
    doc, media = reader.read_document(0, 0)
    assert [g["type"] for g in doc["segments"]] == ["image", "text"] and doc["segments"][1]["text"] == _caption(0)
    doc, media = reader.read_document(2, 1)
    assert [g["type"] for g in doc["segments"]] == ["video", "text"] and list(media) == ["vid0.mp4"]


@pytest.fixture(scope="module")
def built_and_indexed(data, tmp_path_factory):
    """The same shards as a `data build` copy (shard boundaries as the foreign ones) and as a
    validated index, and a tokenizer trained on the copy."""
    root, _ = data
    work = tmp_path_factory.mktemp("same")
    srcs = [str(root / "laion" / "00000.tar"), str(root / "laion" / "00001.tar")]  # 5 samples, then 4 and the corrupt one
    assert main(["-qq", "data", "index", *srcs, "--out", str(work / "idx"), "--validate"]) == 0
    assert main(["-qq", "data", "build", *srcs, "--out", str(work / "built"), "--shard-docs", "5"]) == 0
    idx, built = (json.loads((work / d / "manifest.json").read_text()) for d in ("idx", "built"))
    assert [s["num_samples"] for s in idx["shards"]] == [s["num_samples"] for s in built["shards"]] == [5, 4]
    assert [json.loads(x)["code"] for x in (work / "idx" / "rejects.jsonl").read_text().splitlines()] == ["corrupt-image"]
    assert main(["-qq", "tokenizer", "train", "--data", str(work / "built"), "--vocab-size", "360", "--out", str(work / "tok"),
                 "--threads", "1", "--image-patch-budget", "16", "--video-frame-budget", "4", "--video-patch-budget", "8"]) == 0
    return work


def test_indexed_set_gives_the_same_batches_as_a_build_copy(built_and_indexed, loader_cfg, take_batches):
    work = built_and_indexed
    a = take_batches(build_loader(loader_cfg(work / "idx", work / "tok")), 6)
    b = take_batches(build_loader(loader_cfg(work / "built", work / "tok")), 6)
    assert len(a) == len(b) == 6
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape and bool((x[k] == y[k]).all()), k
    assert any(bool((x["modality"] == 2).any()) for x in a)  # images made it through


def test_exact_and_elastic_resume_on_an_index(built_and_indexed, loader_cfg):
    work = built_and_indexed
    cfg = loader_cfg(work / "idx", work / "tok", num_workers=2)
    full = [b.digest() for b in _take(build_loader(cfg), 7)]
    first = build_loader(cfg)
    head = [b.digest() for b in _take(first, 3)]
    state = json.loads(json.dumps(first.state_dict()))
    resumed = build_loader(cfg)
    resumed.load_state_dict(state)
    assert head + [b.digest() for b in _take(resumed, 4)] == full
    # another worker count: the rest of the epoch redistributed, every sample still read
    other = build_loader(loader_cfg(work / "idx", work / "tok", num_workers=1))
    other.load_state_dict([state])
    assert len(_take(other, 3)) == 3 and other.resumed_from == (1, 2)


def _take(loader, n):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


def test_train_tiny_on_an_index_and_resume(built_and_indexed, tmp_path):
    work = built_and_indexed
    run = tmp_path / "run"
    argv = ["-qq", "train", "--no-progress", "--run-dir", str(run), "tiny", f"data.sources=[{{path: {work / 'idx'}}}]",
            f"data.tokenizer={work / 'tok'}", "data.seq_len=96", "data.batch_size=2", "data.num_workers=1",
            "model.dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.rope_sections=[4,6,6]",
            "model.attention.window=32", "model.moe.expert_dim=32", "model.moe.dense_dim=64", "model.attention.block_size=16",
            "optim.warmup_steps=1", "train.eval_every=0", "checkpoint.every=2", "logging.every=1"]
    assert main([*argv, "train.num_steps=2"]) == 0
    assert main([*argv, "train.num_steps=4", "checkpoint.resume=auto"]) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2, 3, 4]
    assert all(r.get("data/skipped_total", 0) == 0 for r in rows)


def test_compressed_shard_is_refused_naming_data_build(data, tmp_path):
    root, _ = data
    gz = tmp_path / "00000.tar.gz"
    gz.write_bytes(gzip.compress((root / "laion" / "00000.tar").read_bytes()))
    disguised = tmp_path / "disguised.tar"
    disguised.write_bytes(gz.read_bytes())
    for shard in (gz, disguised):
        with pytest.raises(ValueError, match=r"compressed.*omniloom data build") as err:
            index_shards([str(shard)], str(tmp_path / "idx"))
        assert "\n" not in str(err.value)


def test_foreign_shards_without_an_index_are_refused_at_start_naming_data_index(data, built_and_indexed, loader_cfg):
    root, _ = data
    work = built_and_indexed
    for path in (root / "laion", root / "laion" / "00000.tar", str(root / "laion" / "0000{0..1}.tar")):
        with pytest.raises(ValueError, match="omniloom data index") as err:
            build_loader(loader_cfg(path, work / "tok"))
        assert "\n" not in str(err.value)


def test_a_shard_changed_after_indexing_is_skipped_and_counted_not_misread(data, tmp_path):
    root, _ = data
    shutil.copytree(root / "laion", tmp_path / "laion")
    index_shards([str(tmp_path / "laion")], str(tmp_path / "idx"))
    shards = resolve_source(SourceConfig(path=str(tmp_path / "idx"))).shards
    # rewrite shard 1 with other captions (other sizes, same keys): every sample of it changed
    with wds.TarWriter(str(tmp_path / "laion" / "00001.tar")) as w:
        for key in shards[1].keys:
            w.write({"__key__": key, "jpg": _image("JPEG", 99), "txt": "something else entirely"})
    from omniloom.data.stream.stream_bench import SyntheticTokenizer

    def tok(doc, media):  # counts what is read; no decoding needed for this test
        for seg in doc["segments"]:
            assert seg.get("text", "").startswith("a photo") or seg["type"] != "text", "a changed sample was misread"
        return SyntheticTokenizer()({"segments": [s for s in doc["segments"] if s["type"] == "text"]}, {})

    sets = [resolve_source(SourceConfig(path=str(tmp_path / "idx")))]
    ws = WorkerStream(sets, DataConfig(seq_len=64, batch_size=1, shuffle_buffer=2, pack_buffer=2), tok, slot=0, num_slots=1,
                      pad_id=3, patch_dim=12)
    for _ in range(6):
        ws.next_batch()
    assert ws.skipped["changed_shard"] >= 5 and set(ws.skipped) <= {"changed_shard"}
