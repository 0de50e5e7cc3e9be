"""Fixtures of the data tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest


@pytest.fixture
def start_build():
    """Start `data build SOURCES --out OUT --shard-docs 2 EXTRA...` in a subprocess of its own session
    (so a test can kill -9 it mid-build), through the data commands' own entry point: the same
    handlers as `omniloom data build`, without the start-up cost of importing every package's CLI."""

    def start(src, out, *extra, env=None) -> subprocess.Popen:
        sources = [src] if isinstance(src, (str, bytes)) or hasattr(src, "__fspath__") else list(src)
        return subprocess.Popen([sys.executable, "-m", "omniloom.data.cli", "build", *map(str, sources), "--out", str(out),
                                 "--shard-docs", "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)

    return start


@pytest.fixture
def kill_build(start_build):
    """Start a build slowed down between shards (OMNILOOM_TEST_BUILD_PAUSE) and kill -9 its whole
    process group once its journal holds `shards` more shards' lines than before and a shard is being
    written; the folder is left as the kill left it (no manifest, a `.tar.tmp`)."""

    def kill(src, out, *extra, shards: int = 2) -> None:
        journal = out / ".build-journal.jsonl"
        before = len(journal.read_text().splitlines()) if journal.exists() else 0
        p = start_build(src, out, *extra, env={**os.environ, "OMNILOOM_TEST_BUILD_PAUSE": "0.15"})
        deadline = time.time() + 60
        while time.time() < deadline:
            if (journal.exists() and len(journal.read_text().splitlines()) >= before + shards
                    and any(f.suffix == ".tmp" for f in out.iterdir())):
                break
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        assert not (out / "manifest.json").exists()

    return kill


def assert_same_files(a, b) -> None:
    """Two folders hold the same file names with the same bytes."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture
def check_workers_and_parts(tmp_path):
    """Build `src` at 1 and 2 workers (byte-identical) and as --part 0/2 + 1/2 merged (the same
    documents, by sample key); returns the 1-worker folder."""

    def check(src, **build_kw):
        from omniloom.data.cli import main
        from omniloom.data.manifest import iter_documents
        from omniloom.data.prep.shards import build

        a, b = tmp_path / "w1", tmp_path / "w2"
        build([str(x) for x in src], str(a), progress=False, workers=1, **build_kw)
        build([str(x) for x in src], str(b), progress=False, workers=2, **build_kw)
        assert_same_files(a, b)
        parts = [tmp_path / f"part{i}" for i in range(2)]
        for i, part in enumerate(parts):
            build([str(x) for x in src], str(part), part=(i, 2), progress=False, **build_kw)
        assert main(["merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 0
        assert {k for k, _, _ in iter_documents(tmp_path / "merged")} == {k for k, _, _ in iter_documents(a)}
        return a

    return check
