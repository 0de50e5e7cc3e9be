"""Acceptance tests for `omniloom data build` (issue 3): every good input lands in shards that stock
webdataset and `tar -tf` read, every bad input is in rejects.jsonl with its reason, output is the
same for 1 and 2 workers, and a build killed with SIGKILL resumes to byte-identical output."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from omniloom.data.prep.units import IngestSettings
from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.data.prep.shards import build
from omniloom.data.prep.synth import make_bad_corpus, make_good_corpus

OMNILOOM = shutil.which("omniloom") or str(Path(sys.executable).with_name("omniloom"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus") / "src"
    good = make_good_corpus(root, n_text=4, n_images=8, n_videos=4)
    bad = make_bad_corpus(root)
    return root, good, bad


@pytest.fixture(scope="module")
def built(corpus, tmp_path_factory):
    root, _, _ = corpus
    out = tmp_path_factory.mktemp("out") / "shards"
    summary = build([str(root)], str(out), shard_max_docs=4, progress=False)
    return out, summary


def _docs(out: Path) -> dict[str, tuple[dict, dict]]:
    man = read_manifest(out)
    docs = {}
    for shard in man["shards"]:
        for smp in shard["samples"]:
            key, members = iter_sample_at(out / shard["name"], smp["offset"])
            assert key == smp["key"]
            docs[key] = (json.loads(members["doc.json"]), members)
    return docs


def test_every_good_input_is_in_the_shards(corpus, built):
    _, good, _ = corpus
    out, summary = built
    by_source = {}
    for doc, members in _docs(out).values():
        by_source[doc["meta"]["source"].split("/", 1)[1]] = (doc, members)
    for kind in ("text", "code", "image", "video", "html"):
        for rel in good[kind]:
            assert rel in by_source, f"{kind} input {rel} missing from shards"
    for rel in good["jsonl"]:
        assert rel in by_source, f"JSONL record {rel} missing"
    # Each image/video doc holds its decoded-and-validated media and its sidecar caption.
    doc, members = by_source["images/pic000.jpg"]
    assert doc["segments"][0] == {"type": "image", "ref": "img0.jpg"} and doc["segments"][1]["text"] == "caption for picture 0"
    assert members["img0.jpg"] == (corpus[0] / "images/pic000.jpg").read_bytes()
    doc, _ = by_source["images/pic001.png"]
    assert doc["segments"][1]["text"] == "json caption 1" and doc["meta"]["sidecar"]["license"] == "CC0"
    doc, members = by_source["videos/clip001.mkv"]
    assert doc["meta"]["media"]["vid0.mkv"]["codec"] == "vp9" and doc["meta"]["media"]["vid0.mkv"]["duration"] == pytest.approx(1.0, abs=0.2)
    # HTML: text blocks and images interleaved in page order; script/style dropped.
    doc, members = by_source["web/page.html"]
    kinds = [s["type"] for s in doc["segments"]]
    assert kinds == ["text", "image", "text", "image", "text"]
    assert "var x" not in json.dumps(doc) and "First paragraph with spaces." in doc["segments"][0]["text"]
    assert doc["meta"]["title"] == "T"
    # JSONL: omniloom schema (image, code, video) and OBELICS layout.
    doc, members = by_source["jsonl/docs.jsonl:1"]
    assert [s["type"] for s in doc["segments"]] == ["text", "image", "code", "video"] and set(members) == {"doc.json", "img0.png", "vid0.mp4"}
    doc, _ = by_source["jsonl/docs.jsonl:2"]
    assert [s["type"] for s in doc["segments"]] == ["text", "image", "text"]
    # Media referenced by HTML/JSONL are not standalone documents too.
    assert "web/media/a.png" not in by_source and "jsonl/img/j1.png" not in by_source
    # Sidecar captions are not standalone text documents.
    assert "images/pic000.txt" not in by_source
    code_docs = [d for d, _ in by_source.values() if d["segments"][0]["type"] == "code"]
    assert {d["segments"][0]["lang"] for d in code_docs} >= {"python", "rust", "go", "c", "javascript", "shell", "sql", "yaml"}


def test_every_bad_input_is_rejected_with_a_reason(corpus, built):
    root, _, bad = corpus
    out, summary = built
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    by_path = {}
    for r in rejects:
        assert r["reason"] and r["path"] and r["code"]
        assert r["path"].startswith(str(root) + "/")
        rel = r["path"][len(str(root)) + 1 :]  # "bad/x.png" or "bad/docs.jsonl:3"
        by_path.setdefault(rel, []).append(r["code"])
    for rel, code in bad.items():
        assert rel in by_path, f"bad input {rel} is not in rejects.jsonl"
        assert code in by_path[rel], f"{rel}: expected {code}, got {by_path[rel]}"
    # The JSONL line with a valid record in the bad file still made it.
    docs = _docs(out)
    assert any(d["meta"]["source"].endswith("bad/docs.jsonl:1") for d, _ in docs.values())
    # The summary counts match the file.
    assert sum(summary["rejects"].values()) == len(rejects)


def test_shards_read_with_stock_webdataset_and_tar(built):
    import webdataset as wds

    out, summary = built
    man = read_manifest(out)
    urls = [str(out / s["name"]) for s in man["shards"]]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(samples) == man["totals"]["documents"] == summary["documents"]
    assert all("doc.json" in s for s in samples)
    assert all(s["num_samples"] <= 4 for s in man["shards"]) and len(man["shards"]) > 2
    if shutil.which("tar"):
        listing = subprocess.run(["tar", "-tf", urls[0]], capture_output=True, text=True, check=True).stdout.split()
        assert listing[0].endswith(".doc.json") and len(listing) >= man["shards"][0]["num_samples"]
    with tarfile.open(urls[0]) as tf:
        m = tf.getmembers()[0]
        assert (m.mtime, m.uid, m.gid, m.mode) == (0, 0, 0, 0o644)
    assert man["totals"]["segments"]["video"] >= 4 and man["totals"]["media_bytes"]["image"] > 0


def test_workers_1_and_2_agree_byte_for_byte(corpus, tmp_path):
    root, _, _ = corpus
    a = build([str(root)], str(tmp_path / "w1"), workers=1, shard_max_docs=3, progress=False)
    b = build([str(root)], str(tmp_path / "w2"), workers=2, shard_max_docs=3, progress=False)
    assert a["documents"] == b["documents"]
    for name in sorted(os.listdir(tmp_path / "w1")):
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name
    assert sorted(os.listdir(tmp_path / "w1")) == sorted(os.listdir(tmp_path / "w2"))


def test_shuffle_writes_the_same_documents_in_a_seeded_order(corpus, tmp_path):
    """--shuffle SEED: the documents of the input-order build, in an order that mixes the kinds
    (the inputs come grouped by folder), the same for any --workers and recorded in the manifest;
    another seed gives another order."""
    root, _, _ = corpus
    plain = build([str(root)], str(tmp_path / "plain"), shard_max_docs=3, progress=False)
    runs = {(seed, workers): build([str(root)], str(tmp_path / f"s{seed}w{workers}"), shard_max_docs=3, progress=False,
                                   workers=workers, shuffle=seed) for seed, workers in ((7, 1), (7, 2), (8, 1))}
    assert all(r["documents"] == plain["documents"] for r in runs.values())

    def order(name):
        man = read_manifest(tmp_path / name)
        return [smp["key"] for shard in man["shards"] for smp in shard["samples"]], man["settings"]

    keys, settings = order("plain")
    shuffled, shuffled_settings = order("s7w1")
    assert "shuffle" not in settings and shuffled_settings["shuffle"] == 7
    assert sorted(shuffled) == sorted(keys) and shuffled != keys
    assert order("s7w2")[0] == shuffled and order("s8w1")[0] not in (shuffled, keys)
    for name in os.listdir(tmp_path / "s7w1"):  # byte for byte, as without --shuffle
        assert (tmp_path / "s7w1" / name).read_bytes() == (tmp_path / "s7w2" / name).read_bytes(), name
    kind = {key: doc["segments"][0]["type"] for key, (doc, _) in _docs(tmp_path / "plain").items()}
    half = len(keys) // 2
    grouped = [len({kind[k] for k in part}) for part in (keys[:half], keys[half:])]
    mixed = [len({kind[k] for k in part}) for part in (shuffled[:half], shuffled[half:])]
    assert min(mixed) > 1 and sum(mixed) > sum(grouped), (grouped, mixed)  # each rank's half sees more kinds


def test_size_bound_and_duplicates(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"t{i}.txt").write_text(("word " * 300) + str(i))
    (src / "dup.md").write_text(("word " * 300) + "0")  # same text as t0 after normalization
    (src / "dup2.txt").write_text("  " + ("word  " * 300) + "0\n")
    s = build([str(src)], str(tmp_path / "out"), shard_max_bytes=64 * 1024, shard_max_docs=1000, progress=False)
    man = read_manifest(tmp_path / "out")
    assert s["documents"] == 6 and s["rejects"] == {"duplicate": 2}
    assert all(sh["bytes"] <= 64 * 1024 for sh in man["shards"])
    assert s["shards"] == len(man["shards"])
    rej = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert all("exact duplicate of document" in r["reason"] for r in rej)
    # Code is compared exactly: indentation changes the program, so neither copy is a duplicate.
    code = tmp_path / "code"
    code.mkdir()
    (code / "a.py").write_text("if x:\n    f()\ng()\n")
    (code / "b.py").write_text("if x:\n    f()\n    g()\n")
    (code / "c.py").write_text("if x:\n    f()\ng()\n")
    s = build([str(code)], str(tmp_path / "code_out"), progress=False)
    assert s["documents"] == 2 and s["rejects"] == {"duplicate": 1}


def test_caption_of_media_shown_by_a_page_is_reported_not_lost(tmp_path):
    """A sidecar caption belongs to a standalone media document; when the media is only shown by an
    HTML page the caption has no home: it must be a counted reject, or, with
    --standalone-referenced, the caption of that standalone document."""
    from omniloom.data.prep.synth import make_image

    src = tmp_path / "src"
    make_image(src / "a.png", size=(32, 32))
    (src / "a.txt").write_text("a caption nobody would see")
    make_image(src / "b.png", size=(32, 32), seed=1)
    (src / "b.txt").write_text("caption of a standalone picture")
    (src / "page.html").write_text("<p>Look:</p><img src='a.png'><p>done</p>")
    s = build([str(src)], str(tmp_path / "out"), progress=False)
    assert s["documents"] == 2 and s["rejects"] == {"unused-caption": 1}
    rej = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert rej[0]["path"].endswith("a.txt") and "--standalone-referenced" in rej[0]["reason"]
    s = build([str(src)], str(tmp_path / "out2"), standalone_referenced=True, progress=False)
    texts = [seg.get("text") for d, _ in _docs(tmp_path / "out2").values() for seg in d["segments"]]
    assert s["documents"] == 3 and not s["rejects"] and "a caption nobody would see" in texts


def test_drop_doc_policy_and_rerun_is_a_no_op(corpus, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "docs.jsonl").write_text(json.dumps({"schema": 1, "segments": [{"type": "text", "text": "hi"}, {"type": "image", "path": "nope.png"}]}) + "\n")
    s = build([str(src)], str(tmp_path / "a"), progress=False)
    assert s["documents"] == 1 and s["rejects"] == {"missing": 1}
    s = build([str(src)], str(tmp_path / "b"), progress=False, ingest=IngestSettings(on_bad_media="drop-doc"))
    assert s["documents"] == 0 and s["rejects"] == {"missing": 1}
    again = build([str(src)], str(tmp_path / "a"), progress=False)
    assert again["already"]
    with pytest.raises(ValueError, match="different settings"):
        build([str(src)], str(tmp_path / "a"), progress=False, shard_max_docs=7)
    (src / "new.txt").write_text("a new input")
    with pytest.raises(ValueError, match="inputs changed"):
        build([str(src)], str(tmp_path / "a"), progress=False)
    assert build([str(src)], str(tmp_path / "a"), progress=False, overwrite=True)["documents"] == 2


@pytest.mark.parametrize("extra", [(), ("--shuffle", "7")])
def test_kill_9_and_resume_is_byte_identical(corpus, tmp_path, extra, start_build, kill_build):
    root, _, _ = corpus
    clean = tmp_path / "clean"
    p = start_build(root, clean, *extra)
    assert p.wait(timeout=120) == 0, p.stderr.read().decode()
    out = tmp_path / "killed"
    for _ in range(2):  # kill twice: once in the first run, once in a resumed run
        kill_build(root, out, *extra)
        assert any(f.name.endswith(".tar.tmp") for f in out.iterdir())
    done_before = {f.name: f.stat().st_mtime_ns for f in out.iterdir() if f.name.endswith(".tar")}
    p = start_build(root, out, *extra)
    assert p.wait(timeout=120) == 0, p.stderr.read().decode()
    assert "(resumed)" in p.stdout.read().decode()
    for name, mtime in done_before.items():  # completed shards were not rewritten
        assert (out / name).stat().st_mtime_ns == mtime, name
    assert sorted(os.listdir(out)) == sorted(os.listdir(clean))
    for name in os.listdir(clean):
        assert (out / name).read_bytes() == (clean / name).read_bytes(), name


@pytest.mark.skipif(__import__("multiprocessing").get_start_method() != "fork", reason="the crash stand-in reaches workers by fork")
def test_a_crashing_input_becomes_a_reject_not_a_dead_build(tmp_path, monkeypatch):
    import omniloom.data.prep.shards as shards

    src = tmp_path / "src"
    src.mkdir()
    for i in range(12):
        (src / f"t{i:02d}.txt").write_text(f"document {i}")
    real = shards.process_unit

    def crashy(unit, settings):
        if unit.rel == "t05.txt":
            os.kill(os.getpid(), signal.SIGKILL)  # what a decoder segfault or the OOM killer does
        return real(unit, settings)

    monkeypatch.setattr(shards, "process_unit", crashy)
    s = build([str(src)], str(tmp_path / "out"), workers=2, shard_max_docs=4, progress=False)
    assert s["documents"] == 11 and s["rejects"] == {"worker-crash": 1}
    rej = json.loads((tmp_path / "out" / "rejects.jsonl").read_text())
    assert rej["path"].endswith("t05.txt") and "killed the worker" in rej["reason"]


def test_caches_and_hidden_folders_are_skipped_and_counted_unless_asked(tmp_path, capsys):
    """Issue 28.5: a source tree's __pycache__ (.pyc files, each a 'PyAV cannot open it' reject) and
    hidden folders are skipped by default, counted in the summary; --include-hidden builds them."""
    from omniloom.pretrain.cli import main

    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / ".git").mkdir()
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"\xa7\r\r\n" + bytes(60))
    (src / "pkg" / "legacy.pyc").write_bytes(b"\x03\xf3\r\n" + bytes(60))
    (src / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    summary = build([str(src)], str(tmp_path / "out"), progress=False)
    assert summary["documents"] == 1 and summary["rejects"] == {} and summary["skipped"] == {"hidden": 1, "cache": 2}
    assert main(["-q", "data", "build", str(src), "--out", str(tmp_path / "out2")]) == 0
    assert "skipped: 1 hidden and 2 cache files/folders" in capsys.readouterr().out
    every = build([str(src)], str(tmp_path / "all"), progress=False, include_hidden=True)
    assert every["units"] == 4 and every["skipped"] == {} and read_manifest(tmp_path / "all")["settings"]["include_hidden"]
    assert "include_hidden" not in read_manifest(tmp_path / "out")["settings"]  # a default build resumes as before


def test_a_build_without_a_terminal_logs_progress_lines(tmp_path, caplog):
    """Issue 28.5: with output to a log file or a pipe, `data build` printed one line at the start and
    nothing until the summary; it now logs a progress line every --progress-seconds."""
    import logging

    src = tmp_path / "src"
    src.mkdir()
    for i in range(5):
        (src / f"doc{i}.txt").write_text(f"document number {i} with some words\n")
    with caplog.at_level(logging.INFO, logger="omniloom.data.prep.shards"):
        build([str(src)], str(tmp_path / "out"), progress=True, progress_seconds=1e-9)  # stderr is not a terminal here
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("build: ")]
    assert len(lines) == 5 and lines[-1].startswith("build: 5/5 inputs (100%), 5 documents,") and "docs/s" in lines[-1]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="omniloom.data.prep.shards"):
        build([str(src)], str(tmp_path / "quiet"), progress=False, progress_seconds=1e-9)
    assert not [r for r in caplog.records if r.getMessage().startswith("build: ")]
