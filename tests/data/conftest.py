"""Fixtures of the data tests."""

from __future__ import annotations

import subprocess
import sys

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
