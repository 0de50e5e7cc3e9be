"""`omniloom data merge|inspect|stats|verify`, the part split, validators and CLI errors (issue 3)."""

from __future__ import annotations

import json
import os

import pytest

from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.data.prep.media import MediaLimits, validate_image, validate_video
from omniloom.data.prep.merge import merge
from omniloom.data.prep.shards import build, parse_part
from omniloom.data.prep.synth import make_good_corpus, make_image, make_video
from omniloom.data.prep.validate import Reject, TextPolicy, decode_text, parse_input_document, resolve_inside
from omniloom.pretrain.cli import main


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools") / "src"
    make_good_corpus(root, n_text=3, n_images=3, n_videos=2)
    return root


@pytest.fixture(scope="module")
def full(src, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "shards"
    build([str(src)], str(out), shard_max_docs=3, progress=False)
    return out


def _keys(out) -> list[str]:
    return sorted(s["key"] for sh in read_manifest(out)["shards"] for s in sh["samples"])


def test_parts_merge_into_the_full_dataset(src, full, tmp_path):
    parts = []
    for i in range(3):
        out = tmp_path / f"p{i}"
        build([str(src)], str(out), part=(i, 3), shard_max_docs=3, progress=False)
        assert all(sh["name"].startswith(f"data-p{i:04d}-") for sh in read_manifest(out)["shards"])
        parts.append(str(out))
    with pytest.raises(ValueError, match="missing"):
        merge(parts[:2], str(tmp_path / "bad"))
    res = merge(parts, str(tmp_path / "merged"))
    man = read_manifest(tmp_path / "merged")
    assert _keys(tmp_path / "merged") == _keys(full)
    assert [sh["name"] for sh in man["shards"]] == [f"data-{i:06d}.tar" for i in range(res["shards"])]
    assert man["totals"]["segments"] == read_manifest(full)["totals"]["segments"]
    assert main(["-q", "data", "verify", str(tmp_path / "merged")]) == 0
    with pytest.raises(ValueError, match="twice"):
        merge([parts[0], parts[0], parts[1], parts[2]], str(tmp_path / "dup"))
    # A refused move leaves every part whole: all checks run before the first shard moves.
    import shutil

    broken = tmp_path / "p2_broken"
    shutil.copytree(parts[2], broken)
    last = read_manifest(broken)["shards"][-1]["name"]
    with open(broken / last, "ab") as f:
        f.write(b"\0" * 512)
    before = {p: sorted(os.listdir(p)) for p in parts[:2]}
    with pytest.raises(ValueError, match="bytes but its manifest says"):
        merge([parts[0], parts[1], str(broken)], str(tmp_path / "moved"), mode="move")
    assert {p: sorted(os.listdir(p)) for p in parts[:2]} == before
    assert not list((tmp_path / "moved").glob("*.tar"))


def test_inspect_stats_verify(full, tmp_path, capsys):
    assert main(["data", "inspect", str(full), "--index", "0"]) == 0
    assert "== " in capsys.readouterr().out
    key = read_manifest(full)["shards"][-1]["samples"][-1]["key"]
    assert main(["data", "inspect", str(full), "--key", key]) == 0
    assert key in capsys.readouterr().out
    page = tmp_path / "view.html"
    assert main(["data", "inspect", str(full), "--html", str(page), "--count", "100"]) == 0
    text = page.read_text()
    assert "wrote" in capsys.readouterr().out
    assert text.count("<section>") == read_manifest(full)["totals"]["documents"]
    assert "data:image/jpeg;base64," in text and "frame strip" in text and "<pre><code>" in text
    assert main(["data", "stats", str(full), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["segments"]["video"] == read_manifest(full)["totals"]["segments"]["video"] >= 2
    assert st["image_width"]["count"] >= 3 and st["video_seconds"]["p50"] == pytest.approx(1.0, abs=0.2)
    assert main(["data", "stats", str(full)]) == 0
    assert "video_seconds" in capsys.readouterr().out
    assert main(["data", "verify", str(full)]) == 0
    assert "OK" in capsys.readouterr().out


def test_verify_finds_corruption(full, tmp_path, capsys):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(full, bad)
    man = read_manifest(bad)
    shard = bad / man["shards"][0]["name"]
    data = bytearray(shard.read_bytes())
    data[600] ^= 0xFF  # inside the first doc.json
    shard.write_bytes(bytes(data))
    (bad / "data-999999.tar").write_bytes(b"")
    assert main(["data", "verify", str(bad), "--no-media"]) == 1
    out = capsys.readouterr().out
    assert "sha256 mismatch" in out and "not listed" in out


def test_iter_sample_at_reads_exactly_one_sample(full):
    man = read_manifest(full)
    for sh in man["shards"]:
        for smp in sh["samples"]:
            key, members = iter_sample_at(full / sh["name"], smp["offset"])
            doc = json.loads(members["doc.json"])
            assert key == smp["key"] and list(members)[0] == "doc.json"
            assert {s["ref"] for s in doc["segments"] if "ref" in s} == set(members) - {"doc.json"}


def test_members_in_a_folder_group_by_key_in_every_reader(tmp_path):
    """`tar -C dir -cf x.tar .` names members `./KEY.doc.json`: the shard tools and the stream
    reader must both split them as WebDataset does (key `./KEY`), not at the first dot."""
    import io
    import tarfile

    from omniloom.data.manifest import iter_shard_samples
    from omniloom.data.stream.reader import index_shard

    path = tmp_path / "x.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for key in ("a", "b"):
            for suffix, data in (("doc.json", b'{"segments": []}'), ("img0.jpg", b"jpg")):
                info = tarfile.TarInfo(f"./{key}.{suffix}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    got = [(k, sorted(m)) for _, k, m in iter_shard_samples(path)]
    assert got == [("./a", ["doc.json", "img0.jpg"]), ("./b", ["doc.json", "img0.jpg"])]
    assert index_shard(str(path)).keys == ["./a", "./b"]
    offset = [o for o, _, _ in iter_shard_samples(path)][1]
    assert iter_sample_at(path, offset) == ("./b", {"doc.json": b'{"segments": []}', "img0.jpg": b"jpg"})


def test_iter_sample_at_reads_pax_shards_written_by_webdataset(tmp_path):
    """webdataset's TarWriter writes a pax header before every member (float mtime)."""
    import webdataset as wds

    from omniloom.data.stream.reader import index_shard

    path = str(tmp_path / "pax.tar")
    with wds.TarWriter(path) as w:
        for i in range(3):
            w.write({"__key__": f"k{i}", "doc.json": b'{"segments": []}', "img0.jpg": b"x" * i})
    info = index_shard(path)
    got = [iter_sample_at(path, off) for off in info.offsets]
    assert got == [(f"k{i}", {"doc.json": b'{"segments": []}', "img0.jpg": b"x" * i}) for i in range(3)]
    with pytest.raises(ValueError, match="no valid tar header"):
        iter_sample_at(path, info.offsets[1] + 100)


def test_cli_user_errors_exit_2(tmp_path, capsys):
    assert main(["data", "build", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["data", "build", str(tmp_path), "--out", str(tmp_path / "o"), "--part", "3/3"]) == 2
    assert main(["data", "inspect", str(tmp_path)]) == 2
    assert "not a finished shard directory" in capsys.readouterr().err
    assert parse_part("2/5") == (2, 5)


def test_text_policies():
    p = TextPolicy()
    assert decode_text(b"\xef\xbb\xbfhello\r\n", p) == "hello\r\n"  # BOM gone, line ends kept
    with pytest.raises(Reject, match="not valid UTF-8"):
        decode_text(b"caf\xe9", p)
    assert decode_text(b"caf\xe9", TextPolicy(bad_utf8="replace")) == "caf\ufffd"
    with pytest.raises(Reject) as err:
        decode_text(b"a\x00b", p)
    assert err.value.code == "nul-bytes"
    assert decode_text(b"a\x00b", TextPolicy(nul="strip")) == "ab"
    with pytest.raises(Reject, match="whitespace"):
        decode_text(b" \n\t", p)


def test_references_stay_inside_the_root(tmp_path):
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "a.png").write_bytes(b"x")
    assert resolve_inside(str(root), str(root / "sub"), "a.png") == os.path.realpath(root / "sub" / "a.png")
    for ref, code in [("../../x.png", "escapes-root"), ("/etc/passwd", "bad-ref"), ("https://x.org/a.png", "remote-ref"), ("b.png", "missing")]:
        with pytest.raises(Reject) as err:
            resolve_inside(str(root), str(root / "sub"), ref)
        assert err.value.code == code, ref
    os.symlink(tmp_path, root / "sub" / "out")
    with pytest.raises(Reject) as err:
        resolve_inside(str(root), str(root / "sub"), "out/root/sub/a.png/../../../../etc")
    assert err.value.code in ("escapes-root", "missing")


def test_schema_checks():
    segs, meta = parse_input_document({"texts": ["a", None], "images": [None, "x.png"], "url": "u"})
    assert segs == [{"type": "text", "text": "a"}, {"type": "image", "path": "x.png"}] and meta == {"url": "u"}
    for bad in ({"segments": []}, {"segments": [{"type": "code", "text": "x"}]}, {"texts": ["a"], "images": ["b"]},
                {"segments": [{"type": "text", "text": "x", "colour": 1}]}, {"foo": 1}):
        with pytest.raises(Reject):
            parse_input_document(bad)


def test_media_validators(tmp_path):
    lim = MediaLimits()
    info = validate_image(make_image(tmp_path / "a.tiff", size=(40, 30), mode="L").read_bytes(), lim)
    assert (info["format"], info["width"], info["height"]) == ("TIFF", 40, 30)
    with pytest.raises(Reject) as err:
        validate_image(make_image(tmp_path / "s.png", size=(8, 8)).read_bytes(), lim)
    assert err.value.code == "image-too-small"
    with pytest.raises(Reject) as err:
        validate_image(make_image(tmp_path / "b.png", size=(100, 100)).read_bytes(), MediaLimits(max_image_pixels=5000))
    assert err.value.code == "image-bomb"
    v = make_video(tmp_path / "v.avi", codec="mjpeg", frames=8, fps=8).read_bytes()
    assert validate_video(v, lim)["frames"] == 8
    with pytest.raises(Reject) as err:
        validate_video(v, MediaLimits(max_video_seconds=0.5))
    assert err.value.code == "video-duration"
    # A video with an audio track is still a video.
    assert validate_video(make_video(tmp_path / "av.mp4", audio=True).read_bytes(), lim)["codec"] == "mpeg4"


def test_stream_reader_reads_every_built_document(full):
    """Contract check with the stream side: its reader finds every document our manifest lists."""
    reader_mod = pytest.importorskip("omniloom.data.stream.reader")
    from omniloom.data.config import SourceConfig

    shard_set = reader_mod.resolve_source(SourceConfig(path=str(full)))
    reader = reader_mod.SampleReader(shard_set.shards)
    n = 0
    for si, shard in enumerate(shard_set.shards):
        for i in range(shard.num_samples):
            doc, media = reader.read_document(si, i)
            assert {s["ref"] for s in doc["segments"] if "ref" in s} == set(media)
            n += 1
    reader.close()
    assert n == read_manifest(full)["totals"]["documents"]


def test_sources_with_the_same_folder_name_get_distinct_keys(tmp_path):
    for side in ("a", "b"):
        (tmp_path / side / "data").mkdir(parents=True)
        (tmp_path / side / "data" / "x.txt").write_text(f"text from {side}")
    s = build([str(tmp_path / "a" / "data"), str(tmp_path / "b" / "data")], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 2 and len(set(_keys(tmp_path / "out"))) == 2
    with pytest.raises(ValueError, match="given twice"):
        build([str(tmp_path / "a"), str(tmp_path / "a") + "/"], str(tmp_path / "out2"), progress=False)


def test_fifo_and_unreadable_files_are_rejected_not_opened(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    os.mkfifo(src / "pipe.jsonl")  # opening it would block the build forever
    (src / "ok.txt").write_text("fine")
    locked = src / "locked.txt"
    locked.write_text("secret")
    locked.chmod(0)
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["rejects"].get("not-a-file") == 1
    if os.geteuid() != 0:  # root reads anything
        assert s["rejects"].get("unreadable") == 1


def test_stats_keeps_notices_apart_from_rejects_and_inspect_index_is_one_document(tmp_path, capsys):
    """Issue 28.10: `data stats` counted the notices about kept inputs (a NaN nulled) among the
    rejects, against the build's own summary; `data inspect --index 0 --html` wrote 20 documents
    where the README says one (the page of 20 stays for --html alone)."""
    src = tmp_path / "src"
    src.mkdir()
    lines = [json.dumps({"schema": 1, "segments": [{"type": "text", "text": f"document {i}"}]}) for i in range(22)]
    lines.append('{"schema": 1, "segments": [{"type": "text", "text": "kept"}], "meta": {"score": NaN}}')
    (src / "docs.jsonl").write_text("\n".join(lines) + "\n{not json\n")
    out = tmp_path / "out"
    assert main(["-q", "data", "build", str(src), "--out", str(out)]) == 0
    summary = capsys.readouterr().out
    assert "rejected: 1 (bad-json 1)" in summary and "notices: non-finite-number 1" in summary
    assert main(["data", "stats", str(out), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["rejects"] == {"total": 1, "by_code": {"bad-json": 1}}
    assert st["notices"] == {"total": 1, "by_code": {"non-finite-number": 1}}
    assert main(["data", "stats", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rejected at build: 1 (bad-json 1)" in text and "notices at build (inputs kept): 1 (non-finite-number 1)" in text
    for args, docs in ((["--index", "0"], 1), (["--index", "3", "--count", "2"], 2), ([], 20)):
        page = tmp_path / "page.html"
        assert main(["data", "inspect", str(out), *args, "--html", str(page)]) == 0
        assert page.read_text().count("<section>") == docs, args
    capsys.readouterr()
