"""CPU threads per process (issue 15.1): cores shared among the processes of the machine and their
DataLoader workers, explicit settings win, one log line, DataLoader workers run one thread."""

from __future__ import annotations

import logging

import pytest
import torch

from omniloom.pretrain.runtime.threads import choose_threads, configure_threads, local_processes


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
    script.write_text("import json, os\nfrom omniloom.pretrain.runtime.threads import choose_threads\n"
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

    from omniloom.pretrain.train import loop as T
    from omniloom.pretrain.config.run import load_config

    seen = []
    monkeypatch.setattr(T, "make_accelerator", lambda cfg: (_ for _ in ()).throw(RuntimeError("stop")))
    monkeypatch.setattr(T, "configure_threads", lambda n, **kw: seen.append((n, kw["num_workers"], kw["tune"])))
    cfg = load_config("tiny", [f"train.run_dir={tmp_path}", "train.num_threads=3", "data.num_workers=2"])
    with pytest.raises(RuntimeError, match="stop"):
        T.Trainer(cfg, build_model=lambda c: None, build_loader=lambda *a: None)
    cfg.train.deterministic = True  # a run asked to be reproducible keeps one count from its first step
    with pytest.raises(RuntimeError, match="stop"):
        T.Trainer(cfg, build_model=lambda c: None, build_loader=lambda *a: None)
    assert seen == [(3, 2, True), (3, 2, False)]
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def test_dataloader_workers_run_one_thread(monkeypatch):
    """The stream's DataLoader gets a worker_init_fn that sets one torch thread. (torch 2.x also sets
    one in its workers; this pins that the loader asks for it, whatever the parent's count.)"""
    from omniloom.data.stream import loader as stream
    from omniloom.data.config import DataConfig

    built = []

    def fake_dataloader(dataset, **kwargs):
        built.append(kwargs)
        return iter(())

    monkeypatch.setattr(torch.utils.data, "DataLoader", fake_dataloader)
    from omniloom.data.stream import worker

    monkeypatch.setattr(worker, "_guard_worker", lambda: None)  # signal handlers belong in a worker only
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
    from omniloom.pretrain.runtime.threads import apply_wait_policy, wait_policy

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


class _FakeClock:
    """A clock whose units take `cost[threads]` seconds (the first unit at each count `warm` more)."""

    def __init__(self, cost: dict[int, float], warm: float = 100.0):
        self.cost, self.warm, self.now, self.threads, self.seen = cost, warm, 0.0, 0, set()
        self.sets: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.sets.append(n)

    def __call__(self) -> float:
        return self.now

    def work(self) -> None:
        self.now += self.cost[self.threads] + (0.0 if self.threads in self.seen else self.warm)
        self.seen.add(self.threads)


@pytest.mark.parametrize("cost, kept", [({1: 0.03, 2: 0.05}, 1), ({1: 0.05, 2: 0.03}, 2), ({1: 0.04, 2: 0.04}, 1)])
def test_tuner_keeps_the_count_that_ran_its_units_fastest(cost, kept, caplog):
    """Issue 28 item 1: on a quiet 2-core machine 1 thread beat 2 for small models, beside busy
    processes 2 beat 1; the command times its first units at each and keeps the faster (a tie
    keeps the fewer threads). The first unit at each count is a warm-up and not counted."""
    from omniloom.pretrain.runtime.threads import ThreadTuner

    clock = _FakeClock(cost, warm=100.0)  # each count's slow first unit must not count (nor settle it early)
    tuner = ThreadTuner([2, 1], trials=3, clock=clock, set_threads=clock.set_threads)
    with caplog.at_level(logging.INFO, logger="omniloom.threads"):
        for _ in range(8):  # (1 warm-up + 3 timed) x 2 counts
            assert tuner.chosen is None
            with tuner.unit():
                clock.work()
    assert tuner.chosen == kept and clock.threads == kept
    assert clock.sets == [1, 2, 1, 2, 1, 2, 1, 2, kept]  # in turn while timing, then the kept count
    assert [len(v) for v in tuner.times.values()] == [3, 3]
    lines = [r.getMessage() for r in caplog.records if r.name == "omniloom.threads"]
    assert len(lines) == 1 and f"kept {kept}" in lines[0] and "1 thread(s)" in lines[0], lines
    for _ in range(3):  # settled: the units run at the kept count, untimed
        with tuner.unit():
            clock.work()
    assert clock.sets[-1] == kept and len(clock.sets) == 9


def test_tuner_divides_by_the_work_of_each_unit():
    """Eval's units are documents of different lengths: time per token decides, not per document."""
    from omniloom.pretrain.runtime.threads import ThreadTuner

    now = [0.0]
    threads = [0]
    tuner = ThreadTuner([1, 2], trials=2, clock=lambda: now[0], set_threads=lambda n: threads.__setitem__(0, n))
    # 1 thread: 1 ms per token; 2 threads: 0.8 ms per token, but its documents are 4x longer
    for _ in range(3):
        for tokens in (100, 400):
            with tuner.unit(work=tokens):
                now[0] += tokens * (1e-3 if threads[0] == 1 else 0.8e-3)
    assert tuner.chosen == 2


def test_configure_tunes_only_a_count_nobody_chose(monkeypatch):
    from omniloom.pretrain.runtime import threads as T

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(T, "available_cores", lambda: 4)
    try:
        assert T.configure_threads(0, tune=True, quiet=True) == 4
        assert T._TUNER is not None and T._TUNER.candidates == [1, 4] and T._TUNER.chosen is None
        assert T.configure_threads(0, quiet=True) == 4 and T._TUNER is None  # tune not asked (the default)
        assert T.configure_threads(2, tune=True, quiet=True) == 2 and T._TUNER is None  # --threads 2
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        assert T.configure_threads(0, tune=True, quiet=True) == 3 and T._TUNER is None
        monkeypatch.delenv("OMP_NUM_THREADS")
        assert T.configure_threads(0, num_workers=3, tune=True, quiet=True) == 1 and T._TUNER is None  # nothing to compare
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # host threads are not a GPU run's step time
        assert T.configure_threads(0, tune=True, quiet=True) == 4 and T._TUNER is None
    finally:
        T._TUNER = None
        torch.set_num_threads(before)


def test_generate_chooses_its_thread_count_on_its_first_decode_steps(monkeypatch):
    """`omniloom generate` without --threads: the decode steps time 1 and 2 threads, keep one, and
    the tokens are those of a run at a fixed count."""
    from omniloom.pretrain.runtime import threads as T
    from omniloom.pretrain.bench.threads import tiny_text_prompt
    from omniloom.pretrain.inference.generate import generate

    model, prompt = tiny_text_prompt(16)
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(T, "available_cores", lambda: 2)
    try:
        T.configure_threads(1, quiet=True)
        fixed = generate(model, prompt, max_new_tokens=12, use_cache=True, eos_id=-1).ids
        T.configure_threads(0, tune=True, quiet=True)
        tuned = generate(model, prompt, max_new_tokens=12, use_cache=True, eos_id=-1).ids
        assert T._TUNER is not None and T._TUNER.chosen in (1, 2)
        assert torch.get_num_threads() == T._TUNER.chosen
        assert tuned == fixed
    finally:
        T._TUNER = None
        torch.set_num_threads(before)


def test_bench_threads_times_the_count_its_command_kept():
    """`omniloom bench threads`' worker starts as `omniloom generate` does (no --threads), lets it
    time its first decode steps and keep a count, then times that count beside --threads 1."""
    import json
    import subprocess
    import sys

    from omniloom.pretrain.runtime.threads import available_cores

    env = {k: v for k, v in __import__("os").environ.items() if k != "OMP_NUM_THREADS"}
    res = subprocess.run([sys.executable, "-m", "omniloom.pretrain.bench.threads", "--worker", "generate",
                          "--settings", "0,1", "--seconds", "0.2", "--rounds", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])["generate"]
    assert str(out["chosen"]) in out["values"] and "1" in out["values"]
    if available_cores() > 1:
        assert f"started at {available_cores()}" in out["reason"] and f"kept {out['chosen']}" in out["reason"], out["reason"]
        assert out["chosen"] in (1, available_cores())


def test_a_unit_inside_a_unit_is_timed_by_the_outer_one_and_a_closed_trainer_ends_the_timing(tmp_path, monkeypatch):
    """An eval forward inside a timed step (or generate inside eval) must not switch the count
    in the middle of the outer timing; a Trainer that ends stops the timing, so a later command
    in the same process is not switched between counts by a tuner it never asked for."""
    from omniloom.pretrain.runtime import threads as T

    clock = _FakeClock({1: 0.03, 2: 0.05}, warm=0.0)
    tuner = T.ThreadTuner([1, 2], trials=1, clock=clock, set_threads=clock.set_threads)
    with tuner.unit():
        with tuner.unit():
            clock.work()
    assert clock.sets == [1] and tuner.times == {1: [], 2: []}  # one warm-up unit at 1 thread, nothing else

    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("train_standin", (Path(__file__).resolve().parents[1] / "support" / "train_standin.py"))
    standin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(standin)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(T, "available_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        trainer = standin.standin_trainer(tmp_path, "train.num_steps=2", "checkpoint.every=0", "train.deterministic=false")
        assert T._TUNER is not None  # 2 steps: too few to settle
        trainer.fit()
        assert T._TUNER is None
    finally:
        standin.reset_accelerate()
        T._TUNER = None
        torch.set_num_threads(before)
