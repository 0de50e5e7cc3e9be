"""Runs and checkpoints on a real cluster (issue 27 items 1-11): ranks stop with their launcher,
one run per run folder, a folder holding a run needs --resume or --overwrite, step memory is
checked before setup, config values are range-checked with their real source, checkpoint files
carry checksums verified on resume and export, damaged files and data states are refused in one
line, linked step_N folders are not followed, a full disk is said as such, and another model
shape names the tensor. The multi-process ones (launcher SIGKILL, a tiny filesystem) are slow."""

from __future__ import annotations

import errno
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from omniloom.pretrain.checkpoint import manager as ckpt_mod
from omniloom.pretrain import console
from omniloom.pretrain.checkpoint import integrity
from omniloom.pretrain.config.run import load_config

_spec = importlib.util.spec_from_file_location("train_standin", (Path(__file__).resolve().parents[1] / "support" / "train_standin.py"))
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    standin.reset_accelerate()


_reset = standin.reset_accelerate
_trainer = standin.standin_trainer


def _trained(run_dir, steps=2, every=1, keep_last=3):
    _trainer(run_dir, f"train.num_steps={steps}", f"checkpoint.every={every}", f"checkpoint.keep_last={keep_last}").fit()
    _reset()
    return ckpt_mod.list_checkpoints(Path(run_dir) / "checkpoints")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("OMNILOOM_LAUNCHED", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    return env


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# ---- item 1: a rank stops when its launcher dies ------------------------------------------------
_ORPHAN = textwrap.dedent('''
    import os, signal, sys, time
    from pathlib import Path
    out = Path(sys.argv[1])
    def stop(signum, frame):
        if os.environ.get("IGNORE_STOP"):
            out.joinpath("ignored").write_text("1")
            return
        out.joinpath("stopped").write_text(signal.Signals(signum).name)
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    from omniloom.pretrain.runtime.lifeline import arm_if_launched
    line = arm_if_launched()
    out.joinpath("armed").write_text(str(os.getpid()))
    while True:
        time.sleep(0.1)
''')
_LAUNCHER = textwrap.dedent('''
    import os, subprocess, sys, time
    env = dict(os.environ, OMNILOOM_LAUNCHED="1")
    subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]], env=env, start_new_session=True)  # as torchrun does
    time.sleep(3600)
''')


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("ignores_stop", [False, True])
def test_a_launched_process_stops_when_its_launcher_is_killed(tmp_path, ignores_stop):
    """The rank (in a session of its own, as torchrun starts it) gets SIGTERM the moment its
    launcher is SIGKILLed; one that does not stop is killed after OMNILOOM_ORPHAN_TIMEOUT."""
    (tmp_path / "rank.py").write_text(_ORPHAN)
    (tmp_path / "launcher.py").write_text(_LAUNCHER)
    env = dict(_env(), OMNILOOM_ORPHAN_TIMEOUT="2", **({"IGNORE_STOP": "1"} if ignores_stop else {}))
    launcher = subprocess.Popen([sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "rank.py"), str(tmp_path)],
                                env=env, start_new_session=True)
    try:
        _wait_for(lambda: (tmp_path / "armed").exists(), 60, "the rank to start")
        rank = int((tmp_path / "armed").read_text())
        launcher.kill()
        launcher.wait()
        _wait_for(lambda: not _alive(rank), 60, "the orphaned rank to end")
    finally:
        if launcher.poll() is None:
            launcher.kill()
        if (tmp_path / "armed").exists() and _alive(int((tmp_path / "armed").read_text())):
            os.kill(int((tmp_path / "armed").read_text()), signal.SIGKILL)
    if ignores_stop:
        assert (tmp_path / "ignored").exists() and not (tmp_path / "stopped").exists()  # the deadline ended it
    else:
        assert (tmp_path / "stopped").read_text() == "SIGTERM"


def test_lifeline_is_armed_only_under_a_launcher(monkeypatch):
    from omniloom.pretrain.runtime import lifeline

    monkeypatch.setattr(lifeline, "_armed", [])
    monkeypatch.delenv("OMNILOOM_LAUNCHED", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert lifeline.arm_if_launched() is None


@pytest.mark.slow
def _proctree():
    spec = importlib.util.spec_from_file_location("proctree", (Path(__file__).resolve().parents[1] / "support" / "proctree.py"))
    proctree = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(proctree)
    return proctree


def _launch_standin(out, proctree, *args: str) -> list[str]:
    """`omniloom launch` of two stand-in ranks (tests/support/train_standin.py) writing into `out`."""
    from omniloom.pretrain.config.run import presets_dir

    return [sys.executable, "-m", "omniloom.pretrain.cli", "launch", "--config_file",
            str(presets_dir() / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", str(proctree.free_port()),
            str((Path(__file__).resolve().parents[1] / "support" / "train_standin.py")), "--out", str(out), *args]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_of_omniloom_launch_stops_every_rank_and_they_save(tmp_path):
    """Before: `kill -9` of `omniloom launch` left both ranks training as orphans (torchrun gives each
    rank its own session). Now both stop at the same step, save a checkpoint together and exit;
    while they ran, only rank 0 held the run folder's lock."""
    from omniloom.pretrain.rundir import read_metrics

    proctree = _proctree()
    out = tmp_path / "run"
    out.mkdir()
    cmd = _launch_standin(out, proctree, "--sleep", "0.1", "train.num_steps=100000", "checkpoint.every=0")
    log_file = open(tmp_path / "launch.log", "w")
    launcher = subprocess.Popen(cmd, env=_env(), start_new_session=True, stdout=log_file, stderr=subprocess.STDOUT)
    ranks: list[int] = []
    try:
        def started():
            assert launcher.poll() is None, (tmp_path / "launch.log").read_text()[-3000:]
            rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
            return len([r for r in rows if "loss" in r]) >= 3 and all((out / f"pid_rank{r}").exists() for r in (0, 1))

        _wait_for(started, 300, "three steps of the two ranks")
        ranks = [int((out / f"pid_rank{r}").read_text()) for r in (0, 1)]
        holder = (out / ".omniloom.lock").read_text()
        assert f"pid {ranks[0]} " in holder and f"pid {ranks[1]} " not in holder, holder
        # a second launch into the live run (a requeue, say): one line naming the holder, exit 2
        second = subprocess.run(cmd[:7] + [str(proctree.free_port())] + cmd[8:] + ["checkpoint.resume=auto"],
                                env=_env(), capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.strip().splitlines() == [second.stderr.strip()], second.stderr[-3000:]  # one line
        assert second.stderr.startswith(f"omniloom train: error: {out} is in use by another running omniloom train in "
                                        f"{out} (pid {ranks[0]} "), second.stderr[-3000:]
        launcher.kill()  # SIGKILL: the launcher cannot forward anything
        launcher.wait()
        _wait_for(lambda: not any(_alive(p) for p in ranks), 120, "both orphaned ranks to end")
    finally:
        for pid in ranks:
            if _alive(pid):
                proctree.kill_tree(pid)
        if launcher.poll() is None:
            proctree.kill_tree(launcher.pid)
        log_file.close()
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["stopped_by"] for r in results] == ["signal", "signal"], (tmp_path / "launch.log").read_text()[-3000:]
    assert results[0]["step"] == results[1]["step"] >= 3
    assert [p.name for p in ckpt_mod.list_checkpoints(out / "checkpoints")] == [f"step_{results[0]['step']:08d}"]
    assert not (out / ".omniloom.lock").exists()


# ---- item 2: one run per run folder -------------------------------------------------------------
_HOLDER = textwrap.dedent('''
    import sys, time
    from omniloom.pretrain.train.runlock import RunLock
    lock = RunLock(sys.argv[1])
    print("locked", flush=True)
    time.sleep(600)
''')


def _hold(run_dir: Path, tmp_path: Path) -> subprocess.Popen:
    script = tmp_path / "holder.py"
    script.write_text(_HOLDER)
    p = subprocess.Popen([sys.executable, str(script), str(run_dir)], env=_env(), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "locked"
    return p


def test_a_second_training_into_a_live_run_folder_is_refused_naming_the_holder(tmp_path, capsys):
    """Before: a second `--resume auto` into a live run resumed, deleted the first run's .tmp-
    folder, truncated metrics.jsonl and crashed. Now it is one line naming pid and host, exit 2,
    and nothing in the folder is touched."""
    import socket

    from omniloom.pretrain.cli import main

    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp-step_00000200").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 341)))
    before = (run / "metrics.jsonl").read_text()
    holder = _hold(run, tmp_path)
    try:
        assert main(["-q", "train", "--run-dir", str(run), "--resume", "auto", "tiny", "model.vocab_size=64",
                     "data.sources=[{path: /no/such/shards}]"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"is in use by another running omniloom train in {run} (pid {holder.pid} on host {socket.gethostname()}," in err
        assert "choose another --run-dir" in err
        with pytest.raises(ValueError, match=f"pid {holder.pid} "):
            _trainer(run, "checkpoint.resume=auto")
    finally:
        holder.kill()
        holder.wait()
    assert (run / "checkpoints" / ".tmp-step_00000200").is_dir() and (run / "metrics.jsonl").read_text() == before


def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_warning(tmp_path, caplog):
    run = tmp_path / "run"
    holder = _hold(run, tmp_path)
    holder.kill()  # SIGKILL: the kernel drops the lock, the file and its line stay
    holder.wait()
    assert f"pid {holder.pid} " in (run / ".omniloom.lock").read_text()
    with caplog.at_level(logging.WARNING):
        trainer = _trainer(run, "train.num_steps=1")
    warned = [r.getMessage() for r in caplog.records if "taking over the lock" in r.getMessage()]
    assert len(warned) == 1 and f"pid {holder.pid} " in warned[0] and "ended without releasing it" in warned[0]
    assert f"pid {os.getpid()} " in (run / ".omniloom.lock").read_text()
    trainer.fit()
    assert not (run / ".omniloom.lock").exists()  # released when the training ends


def test_run_lock_without_a_lock_service_decides_by_the_holder_line(tmp_path, monkeypatch):
    """A filesystem without record locks (some NFS setups): a live holder on this host is refused,
    a dead one taken over, one on another host refused with the file to delete."""
    import fcntl
    import socket

    from omniloom.data import outlock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    run = tmp_path / "run"
    run.mkdir()
    lock_file = run / outlock.LOCK
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        host = socket.gethostname()
        lock_file.write_text(f"omniloom train in {run} (pid {sleeper.pid} on host {host}, started x)\n")
        with pytest.raises(outlock.OutputLocked, match=f"pid {sleeper.pid} "):
            outlock.OutputLock(str(run), "test")
    finally:
        sleeper.kill()
        sleeper.wait()
    outlock.OutputLock(str(run), "test").release()  # its holder is dead now: taken over
    lock_file.write_text(f"omniloom train in {run} (pid 1 on host elsewhere-0, started x)\n")
    with pytest.raises(outlock.OutputLocked, match=f"once it is over, delete {lock_file}"):
        outlock.OutputLock(str(run), "test")


# ---- item 3: a folder that holds a run ----------------------------------------------------------
def test_a_folder_holding_a_run_needs_resume_or_overwrite(tmp_path):
    """Before: a fresh run appended to metrics.jsonl from step 1 after step 169 and kept the old
    checkpoints (a later --resume auto would pick them up)."""
    run = tmp_path / "run"
    _trained(run, steps=2)
    rows = (run / "metrics.jsonl").read_text()
    with pytest.raises(ValueError) as err:
        _trainer(run, "train.num_steps=2")
    msg = str(err.value)
    assert "\n" not in msg and f"{run} already holds a run (checkpoints up to step_00000002, " in msg
    for option in ("--resume auto", "--run-dir", "--overwrite"):
        assert option in msg
    assert (run / "metrics.jsonl").read_text() == rows and not (run / ".omniloom.lock").exists()
    with pytest.raises(ValueError, match="cannot be combined with --resume auto"):
        _trainer(run, "train.num_steps=2", "checkpoint.resume=auto", overwrite=True)
    (run / "keep.txt").write_text("not omniloom's")
    t = _trainer(run, "train.num_steps=1", "checkpoint.every=0", overwrite=True)
    t.fit()
    assert [p.name for p in ckpt_mod.list_checkpoints(run / "checkpoints")] == ["step_00000001"]
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1]
    assert (run / "keep.txt").exists()


def test_resume_auto_without_a_checkpoint_drops_the_lost_attempts_metrics(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in range(1, 6)))
    _trainer(run, "train.num_steps=2", "checkpoint.resume=auto").fit()
    assert [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())] == [1, 2]


def test_train_cli_has_overwrite_and_takes_overrides_after_options():
    from omniloom.pretrain.cli import build_parser, parse_args
    from omniloom.pretrain.train.main import build_arg_parser

    args = parse_args(build_parser(), ["train", "--run-dir", "r", "tiny", "train.num_steps=3", "--resume", "auto",
                                       "optim.lr=1e-3", "--overwrite"])
    assert (args.preset, args.resume, args.overwrite) == ("tiny", "auto", True)
    assert args.overrides == ["train.num_steps=3", "optim.lr=1e-3"]
    args = build_arg_parser().parse_intermixed_args(["--config", "tiny", "a.b=1", "--resume", "auto", "c.d=2"])
    assert args.resume == "auto" and args.overrides == ["a.b=1", "c.d=2"]
    with pytest.raises(SystemExit):
        parse_args(build_parser(), ["train", "tiny", "--no-such-option"])


# ---- item 4: huge rows, and a stop while a step is being built ----------------------------------
def test_step_memory_is_checked_before_setup_naming_the_figure(tmp_path, capsys):
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.train.preflight import check_step_memory

    cfg = load_config("tiny", ["model.vocab_size=64", "data.seq_len=1000000000"])
    with pytest.raises(ValueError) as err:
        check_step_memory(cfg, torch.device("cpu"), available=64 << 30)
    msg = str(err.value)
    assert msg.startswith("data.seq_len=1,000,000,000 x data.batch_size=4: one step needs at least ")
    assert "GiB of activations" in msg and "more than the 64.0 GiB this machine has" in msg
    assert "train.grad_accum_steps" in msg
    fine = check_step_memory(load_config("tiny", ["model.vocab_size=64"]), torch.device("cpu"), available=4 << 30)
    assert 0 < fine["activations"] < 1 << 30
    checkpointed = load_config("tiny", ["model.vocab_size=64", "train.activation_checkpointing=true"])
    assert check_step_memory(checkpointed, "cpu", available=4 << 30)["activations"] < fine["activations"]
    cached = load_config("tiny", ["model.vocab_size=64", "data.doc_cache_mb=3000", "data.num_workers=2"])
    with pytest.raises(ValueError, match=r"data.doc_cache_mb=3000 per loader worker x 2 worker\(s\) may hold 5.9 GiB"):
        check_step_memory(cached, "cpu", available=4 << 30)
    assert check_step_memory(cached, "cpu", available=8 << 30)["activations"] == fine["activations"]
    # refused before the model and the loader are built (the shards do not exist)
    assert main(["-q", "train", "--run-dir", str(tmp_path / "r"), "tiny", "model.vocab_size=64", "data.seq_len=1000000000",
                 "data.sources=[{path: /no/such/shards}]"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "GiB of activations" in err, err


def test_a_stop_while_a_batch_is_still_being_built_is_honoured_at_once(tmp_path):
    """Before: SIGTERM set a flag the loop read only after the step, so a step whose batch took
    minutes (or forever) to build never stopped. Now the wait ends, the last trained step is saved
    and resumes exactly."""
    build_model, plain = standin.standin_builders(num_workers=0)

    class SlowThird(standin.StandinLoader):
        def __iter__(self):
            for batch in super().__iter__():
                if self.consumed == 3:
                    time.sleep(300)  # building batch 3 takes minutes
                yield batch

    def build_loader(cfg, split, rank, world):
        if split == "eval":
            return plain(cfg, split, rank, world)
        return SlowThird(cfg.data.seed, rank, cfg.data.batch_size, cfg.data.seq_len, num_workers=0)

    trainer = _trainer(tmp_path, "train.num_steps=50", "checkpoint.every=0", build_model=build_model,
                       build_loader=build_loader)
    timer = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGTERM))
    t0 = time.monotonic()
    timer.start()
    try:
        result = trainer.fit()
    finally:
        timer.cancel()
    assert time.monotonic() - t0 < 120  # not the 300 s the batch takes
    assert result.stopped_by == "signal" and result.step == 1  # step 2 was waiting for batch 3 (staged ahead)
    latest = ckpt_mod.latest_checkpoint(tmp_path / "checkpoints")
    assert latest.name == "step_00000001"
    assert torch.load(latest / "data_rank00000.pt", weights_only=True) == {"consumed": 1}


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_two_ranks_waiting_for_a_batch_that_never_comes_stop_together_on_sigterm(tmp_path):
    """Both ranks wait for batch 4 (it takes an hour to build); SIGTERM to `omniloom launch` ends
    the wait on both, they agree to drop step 3, save step 2 together and the launcher exits 0."""
    from omniloom.pretrain.rundir import read_metrics

    proctree = _proctree()
    out = tmp_path / "run"
    out.mkdir()
    cmd = _launch_standin(out, proctree, "--stall-at", "4", "train.num_steps=100", "checkpoint.every=0",
                          "data.num_workers=0")
    proc = subprocess.Popen(cmd, env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        def stalled():
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
            return [r["step"] for r in rows if "loss" in r] == [1, 2] and all((out / f"pid_rank{r}").exists() for r in (0, 1))

        _wait_for(stalled, 300, "two steps, then the stall")
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proctree.kill_tree(proc.pid)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["step"], r["stopped_by"]) for r in results] == [(2, "signal"), (2, "signal")], output[-3000:]
    (ckpt,) = ckpt_mod.list_checkpoints(out / "checkpoints")
    assert ckpt.name == "step_00000002"
    assert [torch.load(ckpt / f"data_rank0000{r}.pt", weights_only=True) for r in (0, 1)] == [{"consumed": 2}] * 2


# ---- item 5: values out of range, ignored settings, provenance ----------------------------------
@pytest.mark.parametrize("override, key", [
    ("optim.warmup_steps=-3", "optim.warmup_steps"), ("train.num_steps=-5", "train.num_steps"),
    ("train.num_steps=0", "train.num_steps"), ("checkpoint.every=-1", "checkpoint.every"),
    ("logging.every=0", "logging.every"), ("train.grad_accum_steps=0", "train.grad_accum_steps"),
    ("optim.lr=-1e-3", "optim.lr"), ("optim.min_lr_ratio=2", "optim.min_lr_ratio"),
    ("optim.decay_fraction=0", "optim.decay_fraction"),
    ("checkpoint.keep_last=0", "checkpoint.keep_last"), ("train.eval_every=-1", "train.eval_every"),
])
def test_negative_and_out_of_range_values_are_refused_with_their_source(tmp_path, override, key):
    from omniloom.pretrain.config.io import ConfigError

    with pytest.raises(ConfigError, match=rf"\(from command line\): {key} must be ") as err:
        load_config("tiny", [override])
    assert "tiny.yaml" not in str(err.value)
    section, name = key.split(".")
    value = override.split("=", 1)[1]
    preset = tmp_path / "p.yaml"
    preset.write_text(f"{section}:\n  {name}: {value}\n")
    with pytest.raises(ConfigError, match=rf"\(from {preset}\): {key} must be "):
        load_config(str(preset), ["train.seed=3"])


def test_a_command_line_value_in_a_preset_section_is_reported_as_from_the_command_line():
    """Before: 'invalid DataConfig at data (from .../tiny.yaml): data.seq_len=4 is too short',
    though seq_len=4 came from the command line."""
    from omniloom.pretrain.config.io import ConfigError

    with pytest.raises(ConfigError, match=r"\(from command line\): data\.seq_len=4 is too short"):
        load_config("tiny", ["data.seq_len=4"])
    with pytest.raises(ConfigError, match=r"unknown key 'train\.warmup_steps' .*did you mean 'optim\.warmup_steps'"):
        load_config("tiny", ["train.warmup_steps=5"])


def test_an_indexer_selector_without_b_layers_is_warned_about_not_refused():
    from omniloom.pretrain.train.preflight import ignored_settings

    cfg = load_config("tiny", ["model.vocab_size=64", "model.attention.selector=indexer"]).model
    cfg.validate()  # a valid model: the setting has nothing to act on
    (msg,) = ignored_settings(cfg)
    assert msg.startswith("model.attention.selector=indexer is ignored: model.attention.pattern='LLLG' has no B layer")
    short = load_config("tiny", ["model.vocab_size=64", "model.attention.selector=indexer", "model.attention.pattern=LLLB",
                                 "model.num_layers=2", "model.attention.dense_warmup_steps=10"]).model
    assert [m.split(" is ignored")[0] for m in ignored_settings(short)] == [
        "model.attention.selector=indexer", "model.attention.dense_warmup_steps=10"]
    assert "over model.num_layers=2 ('LL')" in ignored_settings(short)[0]
    with_b = load_config("tiny", ["model.vocab_size=64", "model.attention.selector=indexer",
                                  "model.attention.pattern=LLLB"]).model
    assert ignored_settings(with_b) == []


# ---- item 6: checksums --------------------------------------------------------------------------
def test_every_checkpoint_file_is_hashed_while_written_and_recorded(tmp_path, monkeypatch):
    read_back = []
    real = integrity.hash_files
    monkeypatch.setattr(integrity, "hash_files", lambda root, rels, threads=4: read_back.extend(rels) or real(root, rels, threads))
    (ckpt,) = _trained(tmp_path, steps=1)
    info = json.loads((ckpt / ckpt_mod.MARKER).read_text())
    assert sorted(info["sha256"]) == info["files"]
    assert {"accelerate/model.safetensors", "accelerate/optimizer.bin", "accelerate/random_states_0.pkl",
            "data_rank00000.pt", "trainer.pt", "config.yaml"} <= set(info["files"])
    assert all(integrity.hash_file(ckpt / f) == h for f, h in info["sha256"].items())
    assert read_back == []  # nothing was read back to be hashed


def test_streamed_safetensors_load_like_safetensors_own(tmp_path):
    from safetensors.torch import load_file

    tensors = {"w": torch.randn(3, 5), "b16": torch.randn(7).bfloat16(), "h": torch.randn(3).half(),
               "i": torch.arange(5), "flag": torch.tensor([True, False]), "empty": torch.zeros(0, 4)}
    with integrity.HashingWriter(tmp_path / "x.safetensors") as fh:
        integrity.write_safetensors(tensors, fh, {"format": "pt"})
    back = load_file(str(tmp_path / "x.safetensors"))
    assert set(back) == set(tensors)
    assert all(torch.equal(back[k], v) and back[k].dtype == v.dtype for k, v in tensors.items())


def test_fsdp2_sharded_saves_are_hashed_while_written_too(tmp_path):
    """FSDP2 checkpoints are torch.distributed.checkpoint folders: their file streams go through
    the hashing writer as well (here DCP in one process, without a process group)."""
    import warnings

    import torch.distributed.checkpoint as dcp

    root = tmp_path / "ckpt"
    digests = integrity.Digests(root)
    with integrity.hashing_saves(digests), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.randn(64, 8), "b": torch.randn(8)}}, checkpoint_id=str(root / "dcp"))
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert "dcp/.metadata" in files and any(f.endswith(".distcp") for f in files)
    assert digests.by_path == {f: integrity.hash_file(root / f) for f in files}


def _flip(path: Path, n: int = 256) -> None:
    data = bytearray(path.read_bytes())
    for i in range(n):
        data[-1 - 3 * i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_flipped_bytes_are_refused_on_resume_and_export_and_auto_falls_back(tmp_path, caplog):
    """Before: 256 flipped bytes in model.safetensors resumed silently (64 weights changed)."""
    from omniloom.pretrain.export.write import export_checkpoint

    run = tmp_path / "run"
    older, newer = _trained(run, steps=2)
    _flip(newer / "accelerate" / "model.safetensors")
    with pytest.raises(ValueError, match=r"step_00000002: accelerate/model\.safetensors does not match the checksum "
                                         r"recorded when it was saved") as err:
        _trainer(run, "train.num_steps=3", f"checkpoint.resume={newer}")
    assert "\n" not in str(err.value)
    _reset()
    with caplog.at_level(logging.WARNING):
        t = _trainer(run, "train.num_steps=3", "checkpoint.resume=auto")
    assert t.step == 1 and t.last_checkpoint == str(older)
    assert any("accelerate/model.safetensors does not match" in r.getMessage() and "step_00000001" in r.getMessage()
               and "instead" in r.getMessage() for r in caplog.records)
    t.close()
    _reset()
    with pytest.raises(ValueError, match=r"accelerate/model\.safetensors does not match the checksum"):
        export_checkpoint(newer, tmp_path / "export", tokenizer=tmp_path)
    _flip(older / "accelerate" / "optimizer.bin")
    with pytest.raises(ValueError, match=r"no checkpoint in .* matches its checksums"):
        _trainer(run, "train.num_steps=3", "checkpoint.resume=auto")


def test_auto_falls_back_before_planning_the_batch_from_a_damaged_config_yaml(tmp_path, caplog):
    """Review: the global batch was planned from the newest checkpoint's config.yaml before its
    checksums were checked, so a damaged one refused the whole resume instead of falling back."""
    run = tmp_path / "run"
    older, newer = _trained(run, steps=2)
    (newer / "config.yaml").write_text("data: [unclosed\n")
    _reset()
    with caplog.at_level(logging.WARNING):
        t = _trainer(run, "train.num_steps=3", "checkpoint.resume=auto")
    assert t.step == 1 and t.last_checkpoint == str(older)
    assert any("config.yaml does not match" in r.getMessage() for r in caplog.records)
    t.close()


def test_a_checkpoint_without_checksums_still_resumes_with_a_warning(tmp_path, caplog):
    (ckpt,) = _trained(tmp_path, steps=1)
    info = json.loads((ckpt / ckpt_mod.MARKER).read_text())
    del info["sha256"]  # as written before checksums were recorded
    (ckpt / ckpt_mod.MARKER).write_text(json.dumps(info))
    with caplog.at_level(logging.WARNING):
        t = _trainer(tmp_path, "train.num_steps=2", "checkpoint.resume=auto")
    assert t.step == 1
    assert any("without checksums: its files cannot be verified" in r.getMessage() for r in caplog.records)


# ---- item 7: a damaged model.safetensors --------------------------------------------------------
@pytest.mark.parametrize("damage", ["truncated", "header", "pickle"])
def test_a_damaged_model_safetensors_is_one_line_naming_it(tmp_path, damage, capsys):
    """Before: a 37-line SafetensorError traceback, exit 1 (in a checkpoint without checksums, or
    one whose COMPLETE was rewritten to match)."""
    from omniloom.pretrain.checkpoint.offline import read_checkpoint_weights

    (ckpt,) = _trained(tmp_path, steps=1)
    model = ckpt / "accelerate" / "model.safetensors"
    raw = model.read_bytes()
    if damage == "truncated":
        model.write_bytes(raw[: len(raw) // 2])
    elif damage == "header":
        model.write_bytes(raw[:8] + b"{not json" + raw[17:])
    else:
        torch.save({"x": torch.zeros(3)}, model)
    info = json.loads((ckpt / ckpt_mod.MARKER).read_text())
    info["sha256"]["accelerate/model.safetensors"] = integrity.hash_file(model)
    (ckpt / ckpt_mod.MARKER).write_text(json.dumps(info))
    with pytest.raises(ValueError, match=r"cannot resume from .*: accelerate/model\.safetensors is unreadable") as err:
        _trainer(tmp_path, "train.num_steps=2", "checkpoint.resume=auto")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"model\.safetensors is unreadable") as err:
        read_checkpoint_weights(ckpt)
    assert "\n" not in str(err.value)


# ---- item 8: the data state ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from omniloom.data.stream.stream_bench import synthetic_documents, write_shards

    root = tmp_path_factory.mktemp("state")
    return write_shards(str(root / "a"), synthetic_documents(24, seed=1, mean_text=100), name="a", docs_per_shard=[12, 12])


def _loader(shards):
    from omniloom.data.config import DataConfig, SourceConfig
    from omniloom.data.stream.loader import build_loader
    from omniloom.data.stream.stream_bench import SyntheticTokenizer

    tok = SyntheticTokenizer()
    cfg = DataConfig(sources=[SourceConfig(path=shards)], seq_len=128, batch_size=1, num_workers=1, shuffle_buffer=3,
                     pack_buffer=3, seed=2)
    return build_loader(cfg, tok, patch_dim=tok.tubelet_dim, rank=0, world_size=1)


@pytest.mark.parametrize("edit, match", [
    (lambda st: st["workers"][0]["shuffle"].__setitem__(0, [0, 0, 10**6]), r"shuffle\[0\] sample index is 1000000, past its range"),
    (lambda st: st["workers"][0]["shuffle"].__setitem__(0, [7, 0, 1]), r"shuffle\[0\] source is 7, past its range"),
    (lambda st: st["workers"][0]["cursors"].__setitem__(0, [0, -3]), r"cursors\[0\] position .* is -3, below 0"),
    (lambda st: st["workers"][0]["cursors"].__setitem__(0, [0, 10**9]), r"cursors\[0\] position .* past its range"),
    (lambda st: st.__setitem__("workers", []), r"workers is empty"),
    (lambda st: st.__setitem__("consumed", -1), r"consumed is -1, below 0"),
    (lambda st: st["workers"][0]["packer"].append([[0, 0, -2], 0]), r"packer\[\d+\] sample index is -2"),
    (lambda st: st["workers"][0].__setitem__("rng", {"bit_generator": "nope"}), r"rng is not a random generator state"),
])
def test_an_edited_data_state_is_refused_in_one_line(shards, edit, match):
    """Before: an out-of-range reference was an IndexError traceback from a loader worker, and a
    negative cursor or an empty worker list were accepted."""
    loader = _loader(shards)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    fresh = _loader(shards)
    fresh.load_state_dict(json.loads(json.dumps(state)))  # the untouched state loads
    edit(state)
    with pytest.raises(ValueError, match="data state of rank 0: .*" + match) as err:
        _loader(shards).load_state_dict(state)
    assert "\n" not in str(err.value)


# ---- item 9: step_N links -----------------------------------------------------------------------
def test_a_step_folder_linking_out_of_the_run_is_never_followed_nor_deleted_through(tmp_path, caplog):
    run, other = tmp_path / "run", tmp_path / "other"
    _trained(other, steps=1)
    outside = other / "checkpoints" / "step_00000001"
    (older,) = _trained(run, steps=1)
    link = run / "checkpoints" / "step_00000005"
    link.symlink_to(outside, target_is_directory=True)
    reason = ckpt_mod.incomplete_reason(link)
    assert reason.startswith("it is a link to ") and "outside the run folder" in reason
    with pytest.raises(ValueError, match=r"refusing to resume from .*step_00000005: it is a link to .*outside the run folder"):
        _trainer(run, "train.num_steps=9", f"checkpoint.resume={link}")
    _reset()
    with caplog.at_level(logging.WARNING):
        t = _trainer(run, "train.num_steps=6", "checkpoint.every=1", "checkpoint.keep_last=2", "checkpoint.resume=auto")
    assert t.step == 1 and any("skipping the newer step_00000005 (it is a link" in r.getMessage() for r in caplog.records)
    t.fit()  # saves 2..6: re-saving step 5 replaces the link, keep_last prunes through links without following
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert names == ["step_00000005", "step_00000006"] and not (run / "checkpoints" / "step_00000005").is_symlink()
    assert ckpt_mod.is_complete(outside) and (outside / "accelerate" / "model.safetensors").is_file()
    inner = run / "checkpoints" / "step_00000006" / "trainer.pt"
    inner.unlink()
    inner.symlink_to(outside / "trainer.pt")
    assert "trainer.pt in it links to" in ckpt_mod.incomplete_reason(inner.parent)



def test_a_link_loop_in_a_step_folder_is_a_reason_not_a_traceback(tmp_path):
    # review: Path.resolve raised RuntimeError("Symlink loop") from the check, so --resume auto
    # ended in a traceback and a save's pruning reported the save itself as failed
    (ckpt,) = _trained(tmp_path, steps=1)
    loop = ckpt / "loop"
    loop.symlink_to(loop)
    assert "loop in it links to" in ckpt_mod.incomplete_reason(ckpt)
    looped = tmp_path / "checkpoints" / "step_00000007"
    looped.symlink_to(looped, target_is_directory=True)
    assert ckpt_mod.incomplete_reason(looped).startswith("it is a link to ")
    with pytest.raises(ValueError, match=r"holds no complete checkpoint, only step_00000007 \(it is a link"):
        ckpt_mod.resolve_resume("auto", tmp_path / "checkpoints")


# ---- item 10: a full disk -----------------------------------------------------------------------
def test_a_full_disk_while_saving_says_so_keeps_the_last_checkpoint_and_resumes(tmp_path, monkeypatch):
    """Before: `RuntimeError: ... unexpected pos ...`. Now one line saying the disk is full, where,
    and that the last complete checkpoint is intact; the cut-off write is removed; after space is
    freed, --resume auto continues."""
    from omniloom.pretrain.console import USER_ERRORS

    trainer = _trainer(tmp_path, "train.num_steps=4", "checkpoint.every=2")
    real_write = integrity.HashingWriter.write

    def write(self, data):
        if "step_00000004" in str(self.path) and self.path.name == "optimizer.bin" and self.size > 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(integrity.HashingWriter, "write", write)
    with pytest.raises(console.DiskFullError) as err:
        trainer.fit()
    msg = str(err.value)
    assert isinstance(err.value, USER_ERRORS) and "\n" not in msg
    assert msg.startswith(f"disk full while saving checkpoint step_00000004 into {tmp_path / 'checkpoints'}")
    assert "the last complete checkpoint, step_00000002, is intact" in msg and "--resume auto" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000002"]  # no .tmp- left
    monkeypatch.undo()  # space freed
    _reset()
    resumed = _trainer(tmp_path, "train.num_steps=4", "checkpoint.every=2", "checkpoint.resume=auto")
    assert resumed.step == 2
    assert resumed.fit().step == 4 and ckpt_mod.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000004"


def test_torchs_own_disk_full_error_is_recognised():
    inner = OSError(errno.ENOSPC, "No space left on device")
    try:
        try:
            raise inner
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 232 vs 0")
    except RuntimeError as err:
        assert console.is_disk_full(err)
    assert not console.is_disk_full(RuntimeError("unexpected pos 1 vs 2"))


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux") or os.geteuid() != 0, reason="mounts a tmpfs (root)")
def test_a_full_tmpfs_while_saving_then_resume_after_space_is_freed(tmp_path):
    """The real thing: a run folder on a 3 MiB tmpfs fills while saving; the run ends in one line
    (exit 2), then training resumes once the filesystem is made larger."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        script = (Path(__file__).resolve().parents[1] / "support" / "train_standin.py")  # a script: its loader workers unpickle its batches
        args = ["--out", str(mnt), "train.num_steps=40", "checkpoint.every=2", "checkpoint.keep_last=50"]
        res = subprocess.run([sys.executable, str(script), *args], env=_env(), capture_output=True, text=True, timeout=300)
        assert res.returncode == 2, res.stderr[-3000:]
        line = res.stderr.strip().splitlines()[-1]
        assert line.startswith("omniloom train: error: disk full") and "Traceback" not in res.stderr, res.stderr[-3000:]
        last = ckpt_mod.latest_checkpoint(mnt / "checkpoints")
        assert last is not None and not list((mnt / "checkpoints").glob(".tmp-*"))
        subprocess.run(["mount", "-o", "remount,size=64m", str(mnt)], check=True)
        res = subprocess.run([sys.executable, str(script), *args, "checkpoint.resume=auto"], env=_env(),
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        assert ckpt_mod.latest_checkpoint(mnt / "checkpoints").name == "step_00000040"
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# ---- item 11: another model shape ---------------------------------------------------------------
def test_resuming_with_another_model_shape_names_the_tensor_and_the_settings(tmp_path):
    """Before: 'accelerate/model.safetensors is unreadable (Error(s) in loading state_dict ...)'."""
    from omniloom.pretrain.train import build as B

    small = ["model.vocab_size=64", "model.num_heads=2", "model.num_kv_heads=1", "model.num_layers=2",
             "model.moe.num_experts=0", "model.moe.dense_dim=64"]
    t = _trainer(tmp_path, *small, "model.dim=64", "model.rope_sections=[8,12,12]", build_model=B.build_model)
    t.step = 1
    t.save()
    t.close()
    _reset()
    with pytest.raises(ValueError) as err:
        _trainer(tmp_path, *small, "model.dim=96", "model.rope_sections=[16,16,16]", "checkpoint.resume=auto",
                 build_model=B.build_model)
    msg = str(err.value)
    assert "\n" not in msg and "unreadable" not in msg
    assert "the checkpoint's model has other shapes than this run's: " in msg
    assert re.search(r": \S+ is \[\d+(, \d+)*\] in the checkpoint and \[\d+(, \d+)*\] here", msg), msg
    assert "model.dim 64 there, 96 here" in msg and "model.rope_sections" in msg


def test_shape_mismatch_messages_from_torch_and_dcp():
    from omniloom.pretrain.checkpoint.fit import shape_mismatch

    torch_err = RuntimeError("Error(s) in loading state_dict for M:\n\tsize mismatch for layers.0.w: copying a param "
                             "with shape torch.Size([64, 32]) from checkpoint, the shape in current model is "
                             "torch.Size([128, 64]).")
    assert shape_mismatch(torch_err).endswith("layers.0.w is [64, 32] in the checkpoint and [128, 64] here")
    dcp_err = RuntimeError("Size mismatch between saved torch.Size([8, 4]) and current: torch.Size([8, 6]) for "
                           "model.head.weight")
    assert "model.head.weight is [8, 4] in the checkpoint and [8, 6] here" in shape_mismatch(dcp_err)
    missing = RuntimeError('Error(s) in loading state_dict for M:\n    Missing key(s) in state_dict: "layers.2.w", "x"')
    assert shape_mismatch(missing).endswith("layers.2.w is missing from the checkpoint (and 1 more)")
    assert shape_mismatch(RuntimeError("something else")) is None


def test_resuming_under_another_rope_layout_is_refused_once_the_weights_fit(tmp_path):
    # issue 29: no weight's shape records the rotary layout; resumed under another one the run
    # would silently go on training another model on the checkpoint's weights
    from omniloom.pretrain.train import build as B

    small = ["model.vocab_size=64", "model.num_heads=2", "model.num_kv_heads=1", "model.num_layers=2",
             "model.moe.num_experts=0", "model.moe.dense_dim=64", "model.dim=64", "model.rope_sections=[8,12,12]"]
    t = _trainer(tmp_path, *small, "model.rope_layout=sections", build_model=B.build_model)
    t.step = 1
    t.save()
    t.close()
    _reset()
    with pytest.raises(ValueError, match=r"trained with model.rope_layout=sections .*use model.rope_layout=sections"):
        _trainer(tmp_path, *small, "model.rope_layout=interleaved", "checkpoint.resume=auto", build_model=B.build_model)
    _reset()
    t = _trainer(tmp_path, *small, "model.rope_layout=sections", "checkpoint.resume=auto", build_model=B.build_model)
    assert t.step == 1
    t.close()


def test_a_bad_local_source_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """Issue 41 item 5: a mistyped source was reported only after the model and optimizer were built."""
    from omniloom.pretrain.train import build, loop

    def too_late(*a, **k):
        raise AssertionError("the model was built before the sources were checked")

    monkeypatch.setattr(build, "build_model", too_late)
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    tok = tmp_path / "tok"
    make_tiny_tokenizer(tok)
    (tmp_path / "empty").mkdir()
    for source, message in ((tmp_path / "nowhere", "no such folder or shard file"),
                            (tmp_path / "empty", "has no manifest.json")):
        cfg = load_config("tiny", [f"data.sources={source}", f"train.run_dir={tmp_path / 'run'}", f"data.tokenizer={tok}"])
        with pytest.raises(FileNotFoundError, match=message):
            loop.Trainer(cfg)
