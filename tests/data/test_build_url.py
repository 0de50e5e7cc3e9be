"""`omniloom data build` on remote WebDataset shards (issue 38, item 1): tars served over HTTP by a
local server and read through `pipe:` commands are read front to back through webdataset's `gopen`
(once at discovery, once by the build) and build to the same shard bytes as the same tars given by
local path (a URL's keys are those of a local copy in a folder of the same name); builds of one
URL are byte-identical at any worker count and as merged parts; a build killed with SIGKILL
resumes to the bytes of an unbroken one; anything but a tar is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniloom.data.prep.shards import build

wds = pytest.importorskip("webdataset")


pytestmark = pytest.mark.usefixtures("no_proxy")


def _shard_files(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.suffix == ".tar" or p.name == "rejects.jsonl"}


def _documents(out: Path) -> list[tuple[str, str, dict]]:
    """(meta.source, caption, members) of each document, in manifest order."""
    from omniloom.data.manifest import iter_documents

    return [(doc["meta"]["source"], next(s["text"] for s in doc["segments"] if s["type"] == "text"), members)
            for _, doc, members in iter_documents(out)]


def test_http_and_pipe_builds_match_the_local_build(laion, server, tmp_path):
    base, requests = server
    local = str(laion / "laion" / "laion-{000000..000001}.tar")
    build([local], str(tmp_path / "local"), progress=False, shard_max_docs=4)
    requests.clear()
    summary = build([f"{base}/laion/laion-{{000000..000001}}.tar"], str(tmp_path / "http"), progress=False, shard_max_docs=4)
    assert summary["documents"] == 12
    # Each shard fetched whole twice (discovery, then the build), from its start: no Range.
    assert sorted(requests) == sorted([(f"/laion/laion-{s:06d}.tar", None) for s in (0, 1)] * 2)
    pipes = [f"pipe:cat {laion / 'laion' / f'laion-{s:06d}.tar'}" for s in (0, 1)]
    build(pipes, str(tmp_path / "pipe"), progress=False, shard_max_docs=4)
    want = _shard_files(tmp_path / "local")
    assert len([n for n in want if n.endswith(".tar")]) == 3
    assert _shard_files(tmp_path / "http") == want
    assert _shard_files(tmp_path / "pipe") == want
    docs = _documents(tmp_path / "http")  # the keys a local copy in a folder laion/ gives, each tar its own label
    assert [src for src, _, _ in docs] == ([f"laion/laion-000000.tar#{n:09d}" for n in range(6)]
                                           + [f"laion~2/laion-000001.tar#{n:09d}" for n in range(6, 12)])
    assert [cap for _, cap, _ in docs] == [f"a photo number {n}" for n in range(12)]
    man = json.loads((tmp_path / "http" / "manifest.json").read_text())
    assert man["settings"]["sources"] == [f"{base}/laion/laion-{{000000..000001}}.tar"]  # not normalised to 'http:/'


def test_url_builds_are_deterministic_and_parts_merge(server, check_workers_and_parts):
    base, _ = server
    check_workers_and_parts([f"{base}/laion/laion-{{000000..000001}}.tar"], shard_max_docs=4)


def test_kill_9_and_resume_of_a_url_build_is_byte_identical(server, check_kill_and_resume):
    base, _ = server
    src = f"{base}/laion/laion-{{000000..000001}}.tar"
    check_kill_and_resume(src)


def test_non_tar_urls_and_pipes_are_refused_in_one_line(laion, server, tmp_path, capsys):
    from omniloom.data.cli import main

    base, _ = server
    for src, says in ((f"{base}/laion/docs.jsonl", "is not a tar shard"),
                      (f"pipe:cat {laion / 'laion' / 'docs.jsonl'}", "names no tar shard")):
        capsys.readouterr()
        assert main(["build", src, "--out", str(tmp_path / "x")]) != 0
        err = capsys.readouterr().err.strip()
        assert says in err and "only WebDataset tar shards" in err and len(err.splitlines()) == 1, err


def test_a_missing_url_is_a_counted_reject(server, tmp_path):
    base, _ = server
    summary = build([f"{base}/laion/laion-000009.tar"], str(tmp_path / "out"), progress=False)
    assert summary["documents"] == 0
    rejects = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["code"] for r in rejects] == ["corrupt-tar"] and rejects[0]["path"] == f"{base}/laion/laion-000009.tar"
