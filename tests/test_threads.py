"""CPU threads per process (issue 15.1): cores shared among the processes of the machine and their
DataLoader workers, explicit settings win, one log line, DataLoader workers run one thread."""

from __future__ import annotations

import logging

import pytest
import torch

from omniloom.pretrain.threads import choose_threads, configure_threads, local_processes


def test_one_process_leaves_a_core_per_worker():
    assert choose_threads(0, num_workers=2, env={}, cores=2).threads == 1  # the tiny preset on 2 cores
    assert choose_threads(0, num_workers=2, env={}, cores=16).threads == 14
    assert choose_threads(0, num_workers=0, env={}, cores=8).threads == 8


def test_processes_on_the_machine_share_the_cores():
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert local_processes(env) == 2
    assert choose_threads(0, num_workers=0, env=env, cores=16).threads == 8
    assert choose_threads(0, num_workers=2, env=env, cores=16).threads == 6
    assert choose_threads(0, num_workers=2, env=env, cores=2).threads == 1  # never below one
    assert choose_threads(0, env={"LOCAL_WORLD_SIZE": "8"}, cores=4).threads == 1


def test_explicit_choices_win():
    c = choose_threads(3, num_workers=2, env={"OMP_NUM_THREADS": "5", "LOCAL_WORLD_SIZE": "2"}, cores=2)
    assert (c.threads, c.reason) == (3, "set by train.num_threads")
    c = choose_threads(0, num_workers=2, env={"OMP_NUM_THREADS": "5"}, cores=2)
    assert (c.threads, c.reason) == (5, "set by OMP_NUM_THREADS")
    # accelerate launch / torchrun export OMP_NUM_THREADS=1 to every rank by default: not a choice
    launched = {"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "2"}
    assert choose_threads(0, num_workers=0, env=launched, cores=16).threads == 8
    assert choose_threads(0, num_workers=0, env={**launched, "OMP_NUM_THREADS": "3"}, cores=16).threads == 3
    assert choose_threads(0, num_workers=0, env={"OMP_NUM_THREADS": "1"}, cores=16).threads == 1
    with pytest.raises(ValueError, match="train.num_threads must be >= 0"):
        choose_threads(-1, env={})


def test_accelerate_one_process_launchers_default_is_not_taken_for_a_choice(tmp_path):
    """accelerate launch --num_processes 1 (its simple launcher, no LOCAL_WORLD_SIZE) also puts
    OMP_NUM_THREADS=1 into the process when nobody set it: that was logged as 'set by
    OMP_NUM_THREADS' and pinned one thread. Checked against the real launcher's environment."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text("import json, os\nfrom omniloom.pretrain.threads import choose_threads\n"
                      "c = choose_threads(0, num_workers=0, cores=4)\n"
                      "print(json.dumps([os.environ.get('OMP_NUM_THREADS'), c.threads, c.reason]))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOCAL_WORLD_SIZE")}
    res = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines",
                          "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    omp, threads, reason = json.loads(res.stdout.strip().splitlines()[-1])
    assert omp == "1"  # what accelerate exports; if a version stops doing so, the check below still holds
    assert threads == 4 and reason.startswith("4 core(s) / 1 process(es)"), reason


def test_configure_sets_torch_and_logs_one_line(monkeypatch, caplog):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        with caplog.at_level(logging.INFO, logger="omniloom.threads"):
            assert configure_threads(1, num_workers=2) == 1
        assert torch.get_num_threads() == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "omniloom.threads"]
        assert len(lines) == 1 and "torch threads per process: 1" in lines[0] and "train.num_threads" in lines[0]
    finally:
        torch.set_num_threads(before)


def test_trainer_applies_train_num_threads(tmp_path, monkeypatch):
    """The Trainer (omniloom train and accelerate launch alike) sets the count before building."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from omniloom.pretrain import train as T
    from omniloom.pretrain.config import load_config

    seen = []
    monkeypatch.setattr(T, "make_accelerator", lambda cfg: (_ for _ in ()).throw(RuntimeError("stop")))
    monkeypatch.setattr(T, "configure_threads", lambda n, **kw: seen.append((n, kw["num_workers"])))
    cfg = load_config("tiny", [f"train.run_dir={tmp_path}", "train.num_threads=3", "data.num_workers=2"])
    with pytest.raises(RuntimeError, match="stop"):
        T.Trainer(cfg, build_model=lambda c: None, build_loader=lambda *a: None)
    assert seen == [(3, 2)]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def test_dataloader_workers_run_one_thread(monkeypatch):
    """The stream's DataLoader gets a worker_init_fn that sets one torch thread. (torch 2.x also sets
    one in its workers; this pins that the loader asks for it, whatever the parent's count.)"""
    from omniloom.data import stream
    from omniloom.data.config import DataConfig

    built = []

    def fake_dataloader(dataset, **kwargs):
        built.append(kwargs)
        return iter(())

    monkeypatch.setattr(torch.utils.data, "DataLoader", fake_dataloader)
    monkeypatch.setattr(stream, "_guard_worker", lambda: None)  # signal handlers belong in a worker only
    loader = stream.StreamLoader([], DataConfig(num_workers=2), lambda doc, media: None, rank=0, world_size=1,
                                 pad_id=0, patch_dim=24)
    assert list(loader) == [] and len(built) == 1 and built[0]["num_workers"] == 2
    init = built[0].get("worker_init_fn")
    assert init is not None, "the loader's workers get no worker_init_fn"
    before = torch.get_num_threads()
    torch.set_num_threads(3)  # what a worker inherits from a parent running 3 threads
    try:
        init(0)
        in_worker = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert in_worker == 1


def test_waiting_threads_sleep_unless_the_user_chose_how_they_wait():
    """Issue 28.1: OMP_WAIT_POLICY=PASSIVE by default; any wait setting of the user's is left alone."""
    from omniloom.pretrain.threads import apply_wait_policy, wait_policy

    env = {}
    assert apply_wait_policy(env) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert wait_policy(env) == "OMP_WAIT_POLICY=PASSIVE"
    for var, value in (("OMP_WAIT_POLICY", "ACTIVE"), ("GOMP_SPINCOUNT", "300000"), ("KMP_BLOCKTIME", "200")):
        env = {var: value}
        assert not apply_wait_policy(env) and env == {var: value}
    assert "spin, then sleep" in wait_policy({})


def test_omniloom_processes_load_openmp_with_sleeping_threads():
    """The policy reaches OpenMP itself: `python -m omniloom.pretrain.train` (what accelerate launch
    and omniloom launch run; the `omniloom` command comes through the same package) loads torch's
    libgomp with a spin count of 0 (libgomp's own default spins 300,000 rounds). Not a timing test."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    res = subprocess.run([sys.executable, "-m", "omniloom.pretrain.train", "--help"], env={**env, "OMP_DISPLAY_ENV": "VERBOSE"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    if "GOMP_SPINCOUNT" not in res.stderr:
        pytest.skip("this torch's OpenMP runtime is not libgomp (no GOMP_SPINCOUNT in OMP_DISPLAY_ENV)")
    assert "GOMP_SPINCOUNT = '0'" in res.stderr and "OMP_WAIT_POLICY = 'PASSIVE'" in res.stderr, res.stderr
