"""glibc allocator policy for CPU runs (pretrain/runtime/malloc.py): with `keep`, a large tensor freed and
allocated again is not page-faulted in again; the Trainer applies it on CPU unless told not to."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

_PROBE = """
import json, resource, sys, torch
from omniloom.pretrain.runtime.malloc import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def touch():
    t = torch.empty(16 * 2**20)  # 64 MiB: past glibc's mmap threshold
    t.fill_(1.0)
    del t
# the first reallocations grow the heap (an aligned block does not fit the slightly smaller hole
# the last one left) until the freed holes merge; a training loop is past that after a few steps
for _ in range(16):
    touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    touch()
print(json.dumps(dict(kept=kept, faults=resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallopt is glibc's")
def test_keep_reuses_freed_memory_without_page_faults():
    default, keep = _faults("default"), _faults("keep")
    assert keep["kept"] is True
    pages = 4 * 64 * 2**20 // 4096
    if not _thp_always():  # with transparent huge pages for every mapping, a fault maps 2 MiB
        assert default["faults"] > pages // 2  # each reallocation faults its pages in again
    assert keep["faults"] < pages // 20  # freed memory stayed in the process


def _thp_always() -> bool:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.parametrize("mode, calls", [("keep", 1), ("default", 0)])
def test_trainer_applies_cpu_malloc_on_cpu(tmp_path, monkeypatch, mode, calls):
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from omniloom.pretrain.runtime import malloc
    from omniloom.pretrain.train import loop as T
    from omniloom.pretrain.config.run import load_config

    seen = []
    monkeypatch.setattr(malloc, "keep_freed_memory", lambda: seen.append(1) or True)
    monkeypatch.setattr(T, "set_deterministic", lambda *a: (_ for _ in ()).throw(RuntimeError("stop")))
    cfg = load_config("tiny", [f"train.run_dir={tmp_path}", f"train.cpu_malloc={mode}"])
    try:
        with pytest.raises(RuntimeError, match="stop"):
            T.Trainer(cfg, build_model=lambda c: None, build_loader=lambda *a: None)
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    assert len(seen) == calls
