"""`omniloom data index` on remote shards (issue 38): foreign WebDataset shards served over HTTP by
a local server, and read through a `pipe:` command, index to the samples and byte offsets a local
index finds and train on the same batches; a run on an index killed with SIGKILL and resumed
trains each document of the epoch exactly once (`logging.data_trace`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from omniloom.data.stream.loader import build_loader
from omniloom.pretrain.cli import main

wds = pytest.importorskip("webdataset")

_spec = importlib.util.spec_from_file_location("proctree", Path(__file__).resolve().parents[1] / "support" / "proctree.py")
_proctree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_proctree)


pytestmark = pytest.mark.usefixtures("no_proxy")


@pytest.fixture(scope="module")
def local_index(laion, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "idx"
    assert main(["-qq", "data", "index", str(laion / "laion" / "laion-{000000..000001}.tar"), "--out", str(out)]) == 0
    return out


def _same_index_and_batches(remote_idx: Path, local_idx: Path, tok: Path, loader_cfg, take_batches) -> None:
    """The remote index lists the local one's samples (keys, offsets, members) and sizes, and its
    loader gives the same batches, tensor for tensor."""
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (remote_idx, local_idx))
    assert [s["samples"] for s in a["shards"]] == [s["samples"] for s in b["shards"]]
    assert [s["bytes"] for s in a["shards"]] == [s["bytes"] for s in b["shards"]]
    assert [s["name"] for s in a["shards"]] == [s["name"] for s in b["shards"]] == ["laion-000000.tar", "laion-000001.tar"]
    assert a["totals"]["documents"] == 12
    x = take_batches(build_loader(loader_cfg(remote_idx, tok)), 6)
    y = take_batches(build_loader(loader_cfg(local_idx, tok)), 6)
    assert len(x) == len(y) == 6
    for p, q in zip(x, y):
        assert p.keys() == q.keys()
        for k in p:
            assert p[k].dtype == q[k].dtype and p[k].shape == q[k].shape and bool((p[k] == q[k]).all()), k
    assert any(bool((p["modality"] == 2).any()) for p in x)  # images made it through


def test_index_over_http_trains_on_the_same_batches_as_a_local_index(laion, server, local_index, tmp_path, loader_cfg, take_batches):
    base, requests = server
    requests.clear()  # the server is shared by the session's remote tests
    out = tmp_path / "idx"
    assert main(["-qq", "data", "index", f"{base}/laion/laion-{{000000..000001}}.tar", "--out", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert [s["url"] for s in man["shards"]] == [f"{base}/laion/laion-00000{i}.tar" for i in (0, 1)]
    assert {p for p, _ in requests} == {"/laion/laion-000000.tar", "/laion/laion-000001.tar"}
    before = len(requests)
    _same_index_and_batches(out, local_index, laion / "tok", loader_cfg, take_batches)
    assert len(requests) > before  # the batches were read over HTTP
    assert all(r is None for _, r in requests)  # whole streams, skipped forward by reading


def test_train_a_few_steps_on_an_http_index(laion, server, tmp_path, train_tiny):
    base, _ = server
    out = tmp_path / "idx"
    assert main(["-qq", "data", "index", f"{base}/laion/laion-{{000000..000001}}.tar", "--out", str(out)]) == 0
    run = tmp_path / "run"
    assert train_tiny(run, out, laion / "tok", "train.num_steps=3") == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2, 3]
    assert all(r.get("data/skipped_total", 0) == 0 for r in rows)


def test_index_through_a_pipe_command_trains_on_the_same_batches(laion, local_index, tmp_path, loader_cfg, take_batches):
    out = tmp_path / "idx"
    shards = laion / "laion"
    assert main(["-qq", "data", "index", f"pipe:cat {shards}/laion-{{000000..000001}}.tar", "--out", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert [s["url"] for s in man["shards"]] == [f"pipe:cat {shards}/laion-00000{i}.tar" for i in (0, 1)]
    _same_index_and_batches(out, local_index, laion / "tok", loader_cfg, take_batches)


_TINY = ["data.seq_len=128", "data.batch_size=1", "data.num_workers=0", "data.shuffle_buffer=4", "data.pack_buffer=4",
         "model.dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.rope_sections=[8,12,12]",
         "model.attention.window=64", "model.attention.block_size=16", "model.moe.expert_dim=64", "model.moe.dense_dim=128",
         "optim.warmup_steps=1", "train.eval_every=0", "checkpoint.every=2", "logging.every=1", "logging.trackers=[]",
         "logging.data_trace=true"]


def _train_argv(run: Path, idx: Path, tok: Path, steps: int, *extra: str) -> list[str]:
    return ["-m", "omniloom.pretrain.train", "--config", "tiny", "--run-dir", str(run), "--no-progress",
            f"data.sources=[{{path: {idx}}}]", f"data.tokenizer={tok}", *_TINY, f"train.num_steps={steps}", *extra]


def _trace(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "data_trace" / "rank00000.jsonl").read_text().splitlines()]


def test_a_run_on_an_index_killed_and_resumed_trains_each_document_of_the_epoch_once(laion, local_index, tmp_path):
    from omniloom.pretrain.checkpoint.manager import latest_checkpoint, step_of
    from omniloom.pretrain.rundir import read_metrics

    steps_total, tok = 16, laion / "tok"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    ref, run = tmp_path / "ref", tmp_path / "run"

    def steps():
        path = run / "metrics.jsonl"
        return [r["step"] for r in read_metrics(path) if "loss" in r] if path.exists() else []

    proc = subprocess.Popen([sys.executable, *_train_argv(run, local_index, tok, steps_total)], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and max(steps(), default=0) < 3:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        _proctree.kill_tree(proc.pid)  # no chance to save
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            _proctree.kill_tree(proc.pid)
    killed_at = max(steps())
    saved = step_of(latest_checkpoint(run / "checkpoints"))
    assert 2 <= saved <= killed_at < steps_total, (saved, killed_at)
    old = len(_trace(run))
    for path, extra in ((run, ["checkpoint.resume=auto"]), (ref, [])):
        done = subprocess.run([sys.executable, *_train_argv(path, local_index, tok, steps_total, *extra)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
    lines = _trace(run)
    resumed = [x for x in lines[:old] if x["step"] <= saved] + lines[old:]
    assert all(x["step"] > saved for x in lines[old:])
    # step for step, the killed and resumed run trained on what the uninterrupted one did
    assert [x["step"] for x in resumed] == list(range(1, steps_total + 1))
    assert resumed == _trace(ref)
    pieces = [(tuple(r), i) for x in resumed for r, i in x["pieces"]]
    assert any(r[1] == 0 for r, _ in pieces[sum(len(x["pieces"]) for x in resumed if x["step"] <= saved):]), \
        "the checkpoint was not in the middle of epoch 0"
    epoch0 = Counter(p for p in pieces if p[0][1] == 0)
    assert max(epoch0.values()) == 1, "a piece of epoch 0 was trained on twice"
    assert {r[2] for r, _ in epoch0} == set(range(12)), "a document of epoch 0 was never trained on"
    assert any(r[1] == 1 for r, _ in pieces), "the runs must get past epoch 0"
