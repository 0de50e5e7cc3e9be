"""Foreign WebDataset shards as `omniloom data build` inputs (issue 38, items 1 and 6): shards written
by the real `webdataset.TarWriter` in img2dataset's and video2dataset's layouts become one document
per sample; omniloom's reader finds the samples and bytes `webdataset.WebDataset` finds; the build
is deterministic, resumes after kill -9, and splits into parts that merge."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.prep.foreign import PayloadFiller, ReadLimits, map_sample, read_sample_at, scan_tar, split_key
from omniloom.data.prep.units import IngestSettings, Unit
from omniloom.data.manifest import iter_documents, read_rejects
from omniloom.data.prep.shards import build

wds = pytest.importorskip("webdataset")


def _image(fmt: str, seed: int, size=(40, 32)) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def _video(seed: int) -> bytes:
    from omniloom.tokenizers.testing import make_video_bytes

    return make_video_bytes(seconds=0.4 + 0.1 * seed, fps=10, width=32, height=32)


def write_img2dataset_shards(folder: Path) -> dict:
    """Three shards in img2dataset's layout (KEY.jpg/png/webp + KEY.txt + KEY.json, keys %09d) with
    a corrupt image, a sample without any caption and a key under a folder prefix; returns what
    each sample should become: {key: (ext, caption or None)} for the good ones, and the bad keys."""
    folder.mkdir(parents=True, exist_ok=True)
    expect, bad = {}, []
    exts = [("jpg", "JPEG"), ("png", "PNG"), ("webp", "WEBP")]
    n = 0
    for shard in range(3):
        with wds.TarWriter(str(folder / f"{shard:05d}.tar")) as w:
            for j in range(4):
                key = f"{n:09d}"
                ext, fmt = exts[n % 3]
                sample = {"__key__": key, ext: _image(fmt, n), "txt": f"a photo number {n}",
                          "json": {"url": f"https://example.com/{n}.{ext}", "key": key, "status": "success", "width": 40, "height": 32}}
                if shard == 1 and j == 1:
                    sample[ext] = b"\xff\xd8 this is not an image"
                    bad.append(key)
                elif shard == 1 and j == 2:
                    del sample["txt"]  # no caption at all: the image alone is the document
                    expect[key] = (ext, None)
                elif shard == 2 and j == 0:
                    sample["__key__"] = key = f"part-a/{key}"  # a folder prefix belongs to the key
                    expect[key] = (ext, f"a photo number {n}")
                else:
                    expect[key] = (ext, f"a photo number {n}")
                w.write(sample)
                n += 1
        # What img2dataset writes beside each shard: statistics and a parquet listing, not documents.
        (folder / f"{shard:05d}_stats.json").write_text(json.dumps({"count": 4, "successes": 4}))
    return {"expect": expect, "bad": bad}


def write_video2dataset_shard(path: Path, n: int = 3) -> dict:
    path.parent.mkdir(parents=True, exist_ok=True)
    expect = {}
    with wds.TarWriter(str(path)) as w:
        for i in range(n):
            key = f"{i:05d}"
            w.write({"__key__": key, "mp4": _video(i), "txt": f"a clip number {i}", "json": {"url": f"https://v/{i}", "duration": 0.5}})
            expect[key] = f"a clip number {i}"
    return expect


def _documents(out: Path) -> dict[str, tuple[dict, dict]]:
    """{meta.wds_key: (doc, members)} of a finished build."""
    return {doc["meta"]["wds_key"]: (doc, members) for _, doc, members in iter_documents(out)}


def _rejects(out: Path) -> list[dict]:
    return read_rejects(out)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("foreign")
    laion = write_img2dataset_shards(root / "laion")
    vids = write_video2dataset_shard(root / "webvid" / "00000.tar")
    return root, laion, vids


def test_img2dataset_shards_become_one_document_per_sample(shards, tmp_path):
    root, laion, _ = shards
    out = tmp_path / "out"
    s = build([str(root / "laion")], str(out), progress=False)
    docs = _documents(out)
    assert set(docs) == set(laion["expect"])
    for key, (ext, caption) in laion["expect"].items():
        doc, members = docs[key]
        kinds = [seg["type"] for seg in doc["segments"]]
        assert kinds == (["image", "text"] if caption else ["image"]), (key, kinds)
        ref = doc["segments"][0]["ref"]
        assert ref.endswith("." + ext)
        shard = int(key.rsplit("/", 1)[-1]) // 4
        with tarfile.open(root / "laion" / f"{shard:05d}.tar") as tf:
            assert members[ref] == tf.extractfile(f"{key}.{ext}").read()  # the original bytes
        if caption:
            assert doc["segments"][1]["text"] == caption
        assert doc["meta"]["json"]["url"].endswith(f".{ext}") and doc["meta"]["source"].startswith("laion/")
    # the corrupt image drops its sample, with the reason; the stats files are skipped and counted
    rej = [r for r in _rejects(out) if r["code"] != "duplicate"]
    assert [r["path"].rsplit("#", 1)[1] for r in rej] == laion["bad"] and rej[0]["action"] == "dropped-doc"
    assert s["skipped"]["shard-metadata"] == 3
    assert s["segments"]["image"] == len(laion["expect"]) and s["segments"]["video"] == 0


def test_video2dataset_shard_and_tar_gz_and_brace_pattern(shards, tmp_path):
    root, _, vids = shards
    out = tmp_path / "v"
    build([str(root / "webvid" / "00000.tar")], str(out), progress=False)
    docs = _documents(out)
    assert set(docs) == set(vids)
    for key, caption in vids.items():
        doc, members = docs[key]
        assert [seg["type"] for seg in doc["segments"]] == ["video", "text"] and doc["segments"][1]["text"] == caption
        assert doc["segments"][0]["ref"] == "vid0.mp4" and doc["meta"]["media"]["vid0.mp4"]["codec"] == "h264"
        assert doc["meta"]["json"]["duration"] == 0.5
    # The same shard gzipped is read front to back into the same documents.
    gz = tmp_path / "gz" / "00000.tar.gz"
    gz.parent.mkdir()
    gz.write_bytes(gzip.compress((root / "webvid" / "00000.tar").read_bytes()))
    out_gz = tmp_path / "vgz"
    build([str(gz)], str(out_gz), progress=False)
    strip = lambda d: {k: (json.dumps({**doc, "meta": {**doc["meta"], "source": ""}}), sorted((n, v) for n, v in m.items() if n != "doc.json")) for k, (doc, m) in d.items()}  # noqa: E731
    assert strip(_documents(out_gz)) == strip(docs)
    # A brace pattern names the three laion shards.
    out_b = tmp_path / "b"
    s = build([str(root / "laion" / "{00000..00002}.tar")], str(out_b), progress=False)
    assert s["units"] == 12 and s["documents"] == 11


def test_webdataset_and_omniloom_find_the_same_samples_and_bytes(shards, tmp_path):
    root, _, _ = shards
    paths = sorted((root / "laion").glob("*.tar")) + [root / "webvid" / "00000.tar"]
    limits = ReadLimits(image=1 << 30, video=1 << 30, text=1 << 30)
    for path in paths:
        theirs = [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"}
                  for s in wds.WebDataset(str(path), shardshuffle=False)]
        found, problem = scan_tar(str(path))
        assert problem == ""
        ours = []
        for smp in found:
            key, members = read_sample_at(str(path), smp.offset, limits)
            ours.append({"__key__": key, **dict(members)})
        assert ours == theirs, path
        # and front to back, as a compressed tar is read
        gz = tmp_path / (path.name + ".gz")
        gz.write_bytes(gzip.compress(path.read_bytes()))
        filler = PayloadFiller(IngestSettings())
        units = [Unit(source=str(gz), root=str(tmp_path), rel=gz.name, kind="wds", sample=s.key, line=s.ordinal) for s in scan_tar(str(gz))[0]]
        assert [{"__key__": u.payload[0], **dict(u.payload[1])} for u in filler.fill(units)] == theirs
        filler.close()
    assert split_key("a.b/c.D.JPG") == ("a.b/c", "d.jpg") and split_key(".hidden") == (None, None)


def test_mapping_rules(tmp_path):
    jpg = _image("JPEG", 1)
    # caption first, cls and a small text member into meta, an unknown binary member counted
    segs, meta, notes = map_sample("k", [("jpg", jpg), ("txt", b" hi "), ("cls", b"3"), ("id", b"x-17"), ("npy", b"\x93NUMPY\x00\xff")],
                                   caption_first=True)
    assert [s["type"] for s in segs] == ["text", "image"] and segs[0]["text"] == "hi"
    assert meta["cls"] == 3 and meta["id"] == "x-17" and meta["unmapped"] == ["npy"] and notes["unmapped:npy"] == 1
    # OBELICS json with its images as members: one interleaved document in the json's order
    obj = {"texts": ["Intro.", None, "Middle.", None], "images": [None, "https://a/1.jpg", None, "k.1.png"], "url": "u"}
    png = _image("PNG", 2)
    segs, meta, notes = map_sample("k", [("0.jpg", jpg), ("1.png", png), ("json", json.dumps(obj).encode())])
    assert [(s["type"], s.get("text") or s["path"]) for s in segs] == [("text", "Intro."), ("image", "k.0.jpg"), ("text", "Middle."), ("image", "k.1.png")]
    assert meta["json"] == {"url": "u"} and notes["obelics-sample"] == 1
    # an OBELICS json listing more images than the sample holds is refused with the reason
    obj["images"][2:] = [None, "x"]
    with pytest.raises(Exception, match="lists 2 images but the sample has 1"):
        map_sample("k", [("0.jpg", jpg), ("json", json.dumps(obj).encode())])


def test_foreign_builds_are_deterministic_and_parts_merge(shards, check_workers_and_parts):
    root, _, _ = shards
    check_workers_and_parts([root / "laion", root / "webvid"], shard_max_docs=4)


@pytest.mark.parametrize("compressed", [False, True])
def test_kill_9_and_resume_of_a_foreign_build_is_byte_identical(shards, tmp_path, compressed, check_kill_and_resume):
    root, _, _ = shards
    src = [root / "laion"]
    if compressed:  # .tar.gz: read front to back, and resumed by reading forward to the first unbuilt sample
        folder = tmp_path / "gz"
        folder.mkdir()
        for p in sorted((root / "laion").glob("*.tar")):
            (folder / (p.name + ".gz")).write_bytes(gzip.compress(p.read_bytes()))
        src = [folder]
    check_kill_and_resume(src)


def test_bad_tars_are_counted_rejects_not_crashes(tmp_path, capsys):
    from omniloom.data.cli import main

    src = tmp_path / "src"
    src.mkdir()
    with wds.TarWriter(str(src / "good.tar")) as w:
        for i in range(3):
            w.write({"__key__": f"{i:03d}", "png": _image("PNG", i), "txt": f"caption {i}"})
    data = (src / "good.tar").read_bytes()
    third = scan_tar(str(src / "good.tar"))[0][2].offset
    (src / "cut.tar").write_bytes(data[: third + 1024])  # truncated inside the third sample
    (src / "junk.tar.gz").write_bytes(b"\x1f\x8b\x08\x00 not really gzip")
    (src / "huge.tar").write_bytes(_tar_with_member("k.png", 10 << 20))
    assert main(["build", str(src), "--out", str(tmp_path / "out"), "--max-image-bytes", "1M", "--progress-seconds", "0"]) == 0
    rejects = _rejects(tmp_path / "out")
    codes = sorted(r["code"] for r in rejects)
    assert codes == ["corrupt-tar", "corrupt-tar", "duplicate", "duplicate", "too-large"], codes
    cut = next(r for r in rejects if r["path"].endswith("cut.tar"))
    assert "after 2 samples" in cut["reason"] and "re-download" in cut["reason"]
    docs = _documents(tmp_path / "out")
    assert len(docs) == 3  # good.tar's three; cut.tar's complete samples are duplicates of them


def _tar_with_member(name: str, size: int) -> bytes:
    """A tar whose one member's header declares `size` bytes; the data is zeros, never read by the build."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo(name)
        info.size = size
        tf.addfile(info, io.BytesIO(bytes(size)))
    return buf.getvalue()
