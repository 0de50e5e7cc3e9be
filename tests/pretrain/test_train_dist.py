"""Multi-process and signal tests: `accelerate launch` with the shipped 2-process CPU config (gloo),
exact resume after SIGKILL, SIGTERM -> checkpoint + exit 0. The model and stream are the tiny
stand-ins of tests/support/train_standin.py (2 DataLoader workers per rank)."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from omniloom.pretrain.checkpoint.manager import latest_checkpoint, list_checkpoints
from omniloom.pretrain.config.run import presets_dir
from omniloom.pretrain.rundir import read_metrics

_spec = importlib.util.spec_from_file_location("proctree", (Path(__file__).resolve().parents[1] / "support" / "proctree.py"))
_proctree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_proctree)
kill_tree = _proctree.kill_tree

STANDIN = (Path(__file__).resolve().parents[1] / "support" / "train_standin.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")
CPU_2PROC = presets_dir() / "accelerate" / "cpu_2proc.yaml"
COMMON = ["train.num_steps=12", "checkpoint.every=4", "checkpoint.keep_last=5", "data.num_workers=2"]
# What DDP's reducer prints on every rank when train.find_unused_parameters=true finds nothing unused
# (it costs an autograd traversal each step; the default is false)
DDP_UNUSED_WARNING = "find_unused_parameters=True was specified in DDP constructor"


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _launch_cmd(out: Path, *extra: str) -> list[str]:
    return [str(ACCELERATE), "launch", "--config_file", str(CPU_2PROC), "--main_process_port", str(_proctree.free_port()),
            str(STANDIN), "--out", str(out), *extra]


def _run(cmd, timeout=240):
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def _losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; after a resume the re-run steps overwrite the killed run's lines."""
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reference")
    proc = _run(_launch_cmd(out, *COMMON))
    (out / "launch_output.txt").write_text(proc.stdout + proc.stderr)
    return out


def test_two_process_cpu_launch_world_size_and_identical_parameters(reference_run):
    results = [json.loads((reference_run / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world_size"] for r in results] == [2, 2]
    assert all(r["step"] == 12 and r["bias_updates"] == 12 for r in results)
    p0 = torch.load(reference_run / "params_rank0.pt", weights_only=True)
    p1 = torch.load(reference_run / "params_rank1.pt", weights_only=True)
    assert p0.keys() == p1.keys()
    for name in p0:
        assert torch.equal(p0[name], p1[name]), name
    ckpt = latest_checkpoint(reference_run / "checkpoints")
    assert ckpt.name == "step_00000012"
    assert sorted(p.name for p in ckpt.glob("data_rank*.pt")) == ["data_rank00000.pt", "data_rank00001.pt"]
    losses = _losses(reference_run)
    assert sorted(losses) == list(range(1, 13)) and losses[12] < losses[1]
    output = (reference_run / "launch_output.txt").read_text()
    assert DDP_UNUSED_WARNING not in output, output[-3000:]


def test_sigkill_mid_training_then_resume_auto_matches_uninterrupted_run(reference_run, tmp_path):
    out = tmp_path / "killed"
    out.mkdir()
    proc = subprocess.Popen(_launch_cmd(out, "--sleep", "0.25", *COMMON), env=_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            steps = _losses(out) if (out / "metrics.jsonl").exists() else {}
            if steps and max(steps) >= 6:
                break
            if proc.poll() is not None:
                pytest.fail("the run ended before it could be killed")
            time.sleep(0.05)
        kill_tree(proc.pid)  # the launcher, both ranks and their workers, no chance to clean up
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    killed_at = max(_losses(out))
    assert 6 <= killed_at < 12
    resumed_from = latest_checkpoint(out / "checkpoints")
    # the periodic checkpoints (every 4 steps), or the one a rank saves when it sees its launcher
    # die (pretrain/runtime/lifeline.py) before its own SIGKILL arrives
    assert resumed_from is not None
    step = int(resumed_from.name.split("_")[1])
    assert step in (4, 8) or 6 <= step <= killed_at, resumed_from.name

    _run(_launch_cmd(out, *COMMON, "checkpoint.resume=auto"))
    ref, got = _losses(reference_run), _losses(out)
    assert sorted(got) == list(range(1, 13))
    assert got == ref  # bit-identical losses at every step, before and after the kill
    steps = [r["step"] for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    assert steps == list(range(1, 13))  # the killed run's rows after its checkpoint were dropped
    p_ref = torch.load(reference_run / "params_rank0.pt", weights_only=True)
    p_got = torch.load(out / "params_rank1.pt", weights_only=True)
    for name in p_ref:
        assert torch.equal(p_ref[name], p_got[name]), name
    assert not list((out / "checkpoints").glob(".tmp-*"))


def test_sigterm_saves_a_complete_checkpoint_and_exits_0(tmp_path):
    proc = subprocess.Popen([sys.executable, str(STANDIN), "--out", str(tmp_path), "--sleep", "0.1",
                             "train.num_steps=10000", "checkpoint.every=0"],
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and not (
                (tmp_path / "metrics.jsonl").exists() and _losses(tmp_path) and max(_losses(tmp_path)) >= 3):
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    result = json.loads((tmp_path / "result_rank0.json").read_text())
    assert result["stopped_by"] == "signal"
    ckpts = list_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in ckpts] == [f"step_{result['step']:08d}"]
    assert max(_losses(tmp_path)) == result["step"]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """torchrun/SLURM may deliver the signal to one rank first: the stop flag is all-reduced, so both
    ranks finish the same step, write one complete checkpoint together and exit 0."""
    proc = subprocess.Popen(_launch_cmd(tmp_path, "--sleep", "0.1", "train.num_steps=10000", "checkpoint.every=0"),
                            env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and not (
                (tmp_path / "metrics.jsonl").exists() and max(_losses(tmp_path), default=0) >= 3):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        os.kill(int((tmp_path / "pid_rank1").read_text()), signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert proc.returncode == 0, output[-3000:]
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["stopped_by"] for r in results] == ["signal", "signal"]
    assert results[0]["step"] == results[1]["step"]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [f"step_{results[0]['step']:08d}"]
    assert DDP_UNUSED_WARNING not in output, output[-3000:]


_GRAD_CHECK = '''
import copy, importlib.util, json, sys, torch
spec = importlib.util.spec_from_file_location("standin", sys.argv[1]); standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standin)
from omniloom.pretrain.config import load_config
from omniloom.pretrain.train import Trainer
cfg = load_config(None, standin.base_overrides(sys.argv[2]) + ["data.num_workers=0", "train.grad_accum_steps=2",
                                                               "optim.grad_clip=0", "checkpoint.every=0"])
trainer = Trainer(cfg, build_model=standin.standin_builders(num_workers=0)[0],
                  build_loader=standin.standin_builders(num_workers=0)[1], progress=False)
def batches(rank):
    out = [standin.make_batch(3, rank, i, 4, 16) for i in range(2)]
    if rank == 1:
        out[0].labels[:, 3:] = -100  # rank 1 sees few labels: 12 and 64 against rank 0's 64 and 64
    return out
rank = trainer.acc.process_index
trainer.train_iter = iter(batches(rank))
ref = copy.deepcopy(trainer.acc.unwrap_model(trainer.model))
vec, _ = trainer._train_step()
if rank == 0:
    fields = ("input_ids", "labels", "positions", "doc_ids", "block_ids", "modality")
    every = batches(0) + batches(1)
    out = ref(**{f: torch.cat([getattr(b, f) for b in every]) for f in fields},
              patches=every[0].patches, patch_kind=every[0].patch_kind)
    out.loss.backward()
    got = dict(trainer.acc.unwrap_model(trainer.model).named_parameters())
    err = max(float((got[n].grad - p.grad).abs().max() / p.grad.abs().max()) for n, p in ref.named_parameters())
    json.dump({"err": err, "loss": trainer._unpack(vec)["loss"], "want": out.loss.item()}, open(sys.argv[2] + "/grad.json", "w"))
'''


def test_two_process_gradient_is_the_mean_over_every_label_of_the_global_batch(tmp_path):
    script = tmp_path / "grad_check.py"
    script.write_text(_GRAD_CHECK)
    _run([str(ACCELERATE), "launch", "--config_file", str(CPU_2PROC), "--main_process_port", str(_proctree.free_port()),
          str(script), str(STANDIN), str(tmp_path)])
    res = json.loads((tmp_path / "grad.json").read_text())
    assert res["err"] < 1e-4, res
    assert abs(res["loss"] - res["want"]) < 1e-4 * res["want"], res
