"""No silent misreads (issue 38, item 5). Each test here failed on main before the issue's fix
(checked with main's data/ at 2649550): a tar became one video; a sidecar .json became a code
document; an earlier build's manifest.json became a code document; videos whose extension is on no
list lost their caption; an animated GIF was a one-frame image; a build whose every image was
dropped exited 0. Each decision is counted in the build summary."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.cli import main
from omniloom.data.manifest import iter_documents
from omniloom.data.prep.shards import build


def _image(fmt: str, seed: int = 0, size=(40, 32)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def _animated(fmt: str, frames: int = 6) -> bytes:
    from PIL import Image

    imgs = [Image.fromarray(np.full((32, 32, 3), 30 * i, np.uint8)) for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, format=fmt, save_all=True, append_images=imgs[1:], duration=100, loop=0)
    return buf.getvalue()


def _video(fmt: str, codec: str, rate: int = 10) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        s = out.add_stream(codec, rate=rate)
        s.width, s.height, s.pix_fmt = 32, 32, "yuv420p"
        for i in range(6):
            for p in s.encode(av.VideoFrame.from_ndarray(np.full((32, 32, 3), 30 * i, np.uint8), format="rgb24")):
                out.mux(p)
        for p in s.encode():
            out.mux(p)
    return buf.getvalue()


def _docs(out: Path) -> dict[str, dict]:
    return {doc["meta"]["source"].split("/", 1)[1]: doc for _, doc, _ in iter_documents(out)}


def _build(capsys, *args) -> tuple[int, str, str]:
    rc = main(["build", *map(str, args), "--progress-seconds", "0"])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_a_tar_is_never_a_video(tmp_path, capsys):
    import webdataset as wds

    shard = tmp_path / "laion-000000.tar"
    with wds.TarWriter(str(shard)) as w:
        for i in range(3):
            w.write({"__key__": f"{i:09d}", "jpg": _image("JPEG", i), "txt": f"caption {i}", "json": {"url": f"u{i}"}})
    rc, out, _ = _build(capsys, shard, "--out", tmp_path / "out")
    assert rc == 0
    docs = _docs(tmp_path / "out")
    assert len(docs) == 3 and all([s["type"] for s in d["segments"]] == ["image", "text"] for d in docs.values()), docs
    assert "video 0" in out and "image 3" in out


def test_a_zero_byte_caption_member_is_no_caption_not_a_dropped_sample(tmp_path, capsys):
    """img2dataset writes `KEY.txt` of zero bytes for a row whose caption is null (`str(caption) if
    caption is not None else ""`). Before this fix the build dropped the whole sample (`empty`,
    dropped-doc) and training on an index skipped it (`bad_sample`): every uncaptioned image of
    such a set was lost. Now the image is a document alone, as without a txt member, and counted."""
    import webdataset as wds

    from omniloom.data.config import SourceConfig
    from omniloom.data.prep.index import index_shards
    from omniloom.data.stream.reader import SampleReader, resolve_source

    shard = tmp_path / "00000.tar"
    with wds.TarWriter(str(shard)) as w:
        w.write({"__key__": "000000", "jpg": _image("JPEG", 0), "txt": "a caption", "json": {"caption": "a caption"}})
        w.write({"__key__": "000001", "jpg": _image("JPEG", 1), "txt": "", "json": {"caption": None}})
    rc, out, _ = _build(capsys, shard, "--out", tmp_path / "out")
    assert rc == 0 and "empty-caption-member 1" in out, out
    docs = {d["meta"]["wds_key"]: d for d in _docs(tmp_path / "out").values()}
    assert [s["type"] for s in docs["000001"]["segments"]] == ["image"]
    assert [s["type"] for s in docs["000000"]["segments"]] == ["image", "text"]
    assert not (tmp_path / "out" / "rejects.jsonl").read_text().strip()
    # read in place: the same image-only document, not a bad_sample skip
    index_shards([str(shard)], str(tmp_path / "idx"))
    shards = resolve_source(SourceConfig(path=str(tmp_path / "idx"))).shards
    doc, media = SampleReader(shards).read_document(0, shards[0].keys.index("000001"))
    assert doc["segments"] == [{"type": "image", "ref": "img0.jpg"}] and media["img0.jpg"] == _image("JPEG", 1)


def test_a_sidecar_json_beside_a_medium_is_its_meta_not_a_code_document(tmp_path, capsys):
    src = tmp_path / "src" / "00000"  # an untarred img2dataset folder
    src.mkdir(parents=True)
    for i in range(2):
        (src / f"00000000{i}.jpg").write_bytes(_image("JPEG", i))
        (src / f"00000000{i}.txt").write_text(f"a caption {i}")
        (src / f"00000000{i}.json").write_text(json.dumps({"url": f"https://x/{i}.jpg", "status": "success"}))
    rc, out, _ = _build(capsys, tmp_path / "src", "--out", tmp_path / "out")
    assert rc == 0
    docs = _docs(tmp_path / "out")
    assert sorted(docs) == ["00000/000000000.jpg", "00000/000000001.jpg"], sorted(docs)
    doc = docs["00000/000000001.jpg"]
    assert doc["segments"][1] == {"type": "text", "text": "a caption 1"} and doc["meta"]["sidecar"]["url"] == "https://x/1.jpg"
    assert "code 0" in out and "sidecar-json-meta 2" in out
    # a broken STEM.json costs only the meta: the caption and the image stay, the problem is a reject line
    (src / "000000001.json").write_text("{not json")
    rc, out, _ = _build(capsys, tmp_path / "src", "--out", tmp_path / "out2")
    doc = _docs(tmp_path / "out2")["00000/000000001.jpg"]
    assert rc == 0 and doc["segments"][1] == {"type": "text", "text": "a caption 1"} and "sidecar" not in doc["meta"]
    rej = [json.loads(line) for line in (tmp_path / "out2" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["code"], r["action"], r["ref"]) for r in rej] == [("bad-json", "dropped-meta", "00000/000000001.json")]


def test_an_earlier_builds_manifest_and_rejects_are_skipped_and_counted(tmp_path, capsys):
    first = tmp_path / "first"
    first.mkdir()
    (first / "a.txt").write_text("the first build's document")
    (first / "b.bin").write_bytes(b"\x00junk")  # one reject, so rejects.jsonl has a line
    src = tmp_path / "src"
    src.mkdir()
    build([str(first)], str(src / "built"), progress=False)
    (src / "notes.txt").write_text("a new document")
    rc, out, _ = _build(capsys, src, "--out", tmp_path / "out")
    assert rc == 0
    docs = _docs(tmp_path / "out")
    assert not any(k.endswith(("manifest.json", "rejects.jsonl")) for k in docs), sorted(docs)
    assert "2 earlier-build" in out
    # the earlier build's shard is read back as the documents it holds
    back = [d for k, d in docs.items() if k.startswith("built/")]
    assert [d["segments"] for d in back] == [[{"type": "text", "text": "the first build's document"}]]


VIDEOS = {  # extension -> (muxer, codec, frame rate): containers PyAV reads whose names were on no list
    "3g2": ("3g2", "mpeg4", 10), "m1v": ("mpeg1video", "mpeg1video", 25), "ogg": ("ogg", "libvpx", 10), "asf": ("asf", "wmv2", 10),
    "f4v": ("f4v", "libx264", 10), "rm": ("rm", "rv10", 10), "vob": ("vob", "mpeg2video", 10), "mts": ("mpegts", "mpeg2video", 10),
    "m2ts": ("mpegts", "mpeg2video", 10),
}


def test_every_video_pyav_opens_keeps_its_caption_whatever_its_extension(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for ext, (fmt, codec, rate) in VIDEOS.items():
        (src / f"clip_{ext}.{ext}").write_bytes(_video(fmt, codec, rate))
        (src / f"clip_{ext}.txt").write_text(f"a clip in {ext}")
    rc, out, _ = _build(capsys, src, "--out", tmp_path / "out")
    assert rc == 0
    docs = _docs(tmp_path / "out")
    assert sorted(docs) == sorted(f"clip_{e}.{e}" for e in VIDEOS), sorted(docs)  # no caption left as a text document
    for ext in VIDEOS:
        assert docs[f"clip_{ext}.{ext}"]["segments"][1] == {"type": "text", "text": f"a clip in {ext}"}, ext
    assert f"video {len(VIDEOS)}" in out and "text 9" in out


def test_animated_images_become_videos_and_a_flag_keeps_the_first_frame(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "spin.gif").write_bytes(_animated("GIF"))
    (src / "spin.png").write_bytes(_animated("PNG"))
    (src / "spin.webp").write_bytes(_animated("WEBP"))
    (src / "still.gif").write_bytes(_image("GIF"))
    rc, out, _ = _build(capsys, src, "--out", tmp_path / "out")
    assert rc == 0
    docs = _docs(tmp_path / "out")
    for name, container in (("spin.gif", "gif"), ("spin.png", "apng"), ("spin.webp", "apng")):
        seg = docs[name]["segments"][0]
        assert seg["type"] == "video", name
        info = docs[name]["meta"]["media"][seg["ref"]]
        assert info["frames"] == 6 and info["container"] == container and info["animated_from"] == name.split(".")[1]
    assert docs["still.gif"]["segments"][0]["type"] == "image"
    assert "animated-image-video 3" in out
    rc, out, _ = _build(capsys, src, "--out", tmp_path / "first", "--animated-images", "first-frame")
    assert rc == 0 and all(d["segments"][0]["type"] == "image" for d in _docs(tmp_path / "first").values())
    assert "animated-image-first-frame 3" in out


def test_a_build_that_drops_every_image_says_so_last_and_fails(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(2):
        (src / f"p{i}.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg " + bytes([i]))
        (src / f"p{i}.txt").write_text(f"caption {i}")
    (src / "readme.txt").write_text("some prose that is kept")
    rc, out, err = _build(capsys, src, "--out", tmp_path / "out")
    assert rc == 3, (out, err)
    assert "every image reference was dropped" in err.strip().splitlines()[-1] and "--allow-dropped-media" in err
    rc, out, err = _build(capsys, src, "--out", tmp_path / "out2", "--allow-dropped-media")
    assert rc == 0 and "every image reference was dropped" in out.strip().splitlines()[-1]


@pytest.mark.parametrize("probe", ["m2ts"])
def test_a_probed_video_is_counted(tmp_path, capsys, probe):
    src = tmp_path / "src"
    src.mkdir()
    fmt, codec, rate = VIDEOS[probe]
    (src / f"v.{probe}").write_bytes(_video(fmt, codec, rate))
    (src / "v.txt").write_text("caption")
    rc, out, _ = _build(capsys, src, "--out", tmp_path / "out")
    assert rc == 0 and "probed-video 1" in out
