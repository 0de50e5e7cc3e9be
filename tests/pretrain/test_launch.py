"""Fatal errors end every process, and `omniloom launch` gives the exit codes a scheduler relies on
(issue 14 items 1-3).

- A fatal data error (every shard unreadable) used to hang forever: the DataLoader workers ignored
  SIGTERM, so the trainer's exit waited for them. Now every process (launcher, ranks, workers)
  ends within seconds with a non-zero status, one process or two.
- `accelerate launch` exits 1 with a SignalException traceback on SIGTERM; `omniloom launch`
  (accelerate's launcher in-process, torchrun's signal handling replaced) exits 0 after every
  rank saved, even when the signal reaches every process at once (Slurm).
- A user error under the launcher is one line, once, exit 2.

Subprocesses are limited by CPU work and stalls (tests/support/subproc_budget.py), not wall time.
"""

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

from omniloom.pretrain.checkpoint.manager import list_checkpoints
from omniloom.pretrain.config.run import presets_dir
from omniloom.pretrain.rundir import read_metrics

_spec = importlib.util.spec_from_file_location("subproc_budget", (Path(__file__).resolve().parents[1] / "support" / "subproc_budget.py"))
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)

STANDIN = (Path(__file__).resolve().parents[1] / "support" / "train_standin.py")
CPU_2PROC = presets_dir() / "accelerate" / "cpu_2proc.yaml"
_pspec = importlib.util.spec_from_file_location("proctree", (Path(__file__).resolve().parents[1] / "support" / "proctree.py"))
_proctree = importlib.util.module_from_spec(_pspec)
_pspec.loader.exec_module(_proctree)
# a port of our own: another run holding the default 29500 makes accelerate warn on stderr
LAUNCH = [sys.executable, "-m", "omniloom.pretrain.cli", "launch", "--config_file", str(CPU_2PROC),
          "--main_process_port", str(_proctree.free_port())]
TRAIN = [sys.executable, "-m", "omniloom.pretrain.cli", "train", "--no-progress"]
SMALL = ["data.seq_len=64", "data.batch_size=1", "model.dim=32", "model.num_layers=2", "model.num_heads=2",
         "model.num_kv_heads=1", "model.rope_sections=[4,6,6]", "model.attention.window=32",
         "model.attention.block_size=16", "model.moe.expert_dim=16", "model.moe.dense_dim=32",
         "train.num_steps=3", "logging.trackers=[]"]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process-tree checks read /proc")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _assert_all_gone(marker: str, within_s: float = 10.0) -> None:
    alive = _proctree.still_alive(marker, within_s)
    assert not alive, alive


@pytest.fixture(scope="module")
def unreadable(tmp_path_factory):
    """A tokenizer and a shard set whose every tar is cut to 100 bytes (`truncate -s 100`)."""
    from omniloom.data.stream.stream_bench import synthetic_documents, write_shards
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("unreadable")
    make_tiny_tokenizer(root / "tok")
    shards = write_shards(str(root / "shards"), synthetic_documents(24, seed=3, mean_text=80), name="bad",
                          docs_per_shard=[12, 12])
    for tar in Path(shards).glob("*.tar"):
        os.truncate(tar, 100)
    return root


def _one_error_line(stderr: str) -> str:
    lines = [ln for ln in stderr.splitlines() if "error" in ln.lower() and "skipping sample" not in ln]
    assert len(lines) == 1, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    return lines[0]


# ---- item 1: a fatal error ends every process ----------------------------------------------------
def test_unreadable_shards_end_omniloom_train_at_once_with_one_line(unreadable, tmp_path):
    """One process, two loader workers: before, the error printed and the process never exited."""
    run_dir = tmp_path / "run"
    res = budget.run(TRAIN + ["--run-dir", str(run_dir), "tiny", f"data.sources=[{{path: {unreadable / 'shards'}}}]",
                              f"data.tokenizer={unreadable / 'tok'}", "data.num_workers=2", *SMALL],
                     env=_env(), cpu_budget_s=120, stall_s=20)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "not one readable sample" in _one_error_line(res.stderr)
    _assert_all_gone(str(run_dir))


def test_unreadable_shards_end_every_process_of_a_two_process_launch(unreadable, tmp_path):
    """Two ranks x two workers under `omniloom launch`: one line, exit 2, no process left."""
    run_dir = tmp_path / "run"
    res = budget.run(LAUNCH + ["-m", "omniloom.pretrain.train", "--config", "tiny", "--run-dir", str(run_dir),
                               "--no-progress", f"data.sources=[{{path: {unreadable / 'shards'}}}]",
                               f"data.tokenizer={unreadable / 'tok'}", "data.num_workers=2", *SMALL],
                     env=_env(), cpu_budget_s=240, stall_s=30)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "not one readable sample" in _one_error_line(res.stderr)
    _assert_all_gone(str(run_dir))


_LOADER_SCRIPT = r'''
import multiprocessing, os, sys
from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.stream import build_loader
from omniloom.data.stream.stream_bench import SyntheticTokenizer
tok = SyntheticTokenizer()
cfg = DataConfig(sources=[SourceConfig(path=sys.argv[1])], seq_len=128, batch_size=1, num_workers=2,
                 shuffle_buffer=2, pack_buffer=2)
it = iter(build_loader(cfg, tok, patch_dim=tok.tubelet_dim))
next(it)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
sys.stdin.readline()  # the test signals the workers now
for _ in range(4):
    next(it)
print("batches after the signal", flush=True)
raise RuntimeError("boom: a bug in the training loop while the loader workers are alive")
'''


def _start_loader(tmp_path, name: str, stderr):
    """_LOADER_SCRIPT over two small shards, in its own session: (script path, process)."""
    from omniloom.data.stream.stream_bench import synthetic_documents, write_shards

    shards = write_shards(str(tmp_path / "good"), synthetic_documents(40, seed=4, mean_text=100), name="g",
                          docs_per_shard=[20, 20])
    script = tmp_path / name
    script.write_text(_LOADER_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), shards], env=_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    return script, proc


def test_loader_workers_outlive_a_group_signal_but_never_their_trainer(tmp_path):
    """A SIGTERM from anyone but their parent (torchrun, Slurm, Ctrl-C reach the whole group) leaves
    the workers running, so the trainer can still save; an unhandled error in the trainer then ends
    the process and its workers at once (before: interpreter exit waited for them forever)."""
    script, proc = _start_loader(tmp_path, "loader.py", stderr=subprocess.PIPE)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        for pid in workers:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail("the process did not exit after its error (workers kept it alive)")
    assert "batches after the signal" in out, err[-3000:]
    assert proc.returncode == 1 and "boom" in err
    _assert_all_gone(str(script), within_s=5)


def test_loader_workers_exit_when_their_trainer_is_killed(tmp_path):
    script, proc = _start_loader(tmp_path, "loader_killed.py", stderr=subprocess.DEVNULL)
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert len(workers) == 2
        proc.kill()  # SIGKILL: no cleanup in the trainer at all
        proc.wait()
        _assert_all_gone(str(script), within_s=5)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---- item 3: a user error under the launcher -----------------------------------------------------
def test_a_user_error_under_omniloom_launch_is_one_line_once_exit_2(tmp_path):
    res = budget.run(LAUNCH + ["-m", "omniloom.pretrain.train", "--config", "tiny", "--run-dir", str(tmp_path / "r"),
                               "model.num_layer=2"], env=_env(), cpu_budget_s=120, stall_s=30)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "did you mean 'model.num_layers'" in _one_error_line(res.stderr)
    assert res.stderr.count("unknown key") == 1 and res.stderr.strip().count("\n") == 0


# ---- item 2: SIGTERM under the launcher ----------------------------------------------------------
def _sigterm_run(out: Path, cmd: list[str], targets: str) -> tuple[int, str]:
    proc = subprocess.Popen(cmd + ["--out", str(out), "--sleep", "0.1", "train.num_steps=10000", "checkpoint.every=0"],
                            env=_env(), start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:
            rows = read_metrics(out / "metrics.jsonl") if (out / "metrics.jsonl").exists() else []
            if len([r for r in rows if "loss" in r]) >= 3 and all((out / f"pid_rank{r}").exists() for r in (0, 1)):
                break
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        pids = [proc.pid]
        if targets == "every process":  # as Slurm does: the launcher and every rank at once
            pids += [int((out / f"pid_rank{r}").read_text()) for r in (0, 1)]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, output


@pytest.mark.parametrize("targets", ["every process", pytest.param("the launcher", marks=pytest.mark.slow)])
def test_sigterm_under_omniloom_launch_saves_and_exits_0(tmp_path, targets):
    """Before: `accelerate launch` saved the checkpoint, then exited 1 with a SignalException
    traceback (and a rank that got the signal twice, from Slurm and from the agent, stopped hard)."""
    code, output = _sigterm_run(tmp_path, LAUNCH + [str(STANDIN)], targets)
    assert code == 0, output[-4000:]
    assert "Traceback" not in output and "SignalException" not in output, output[-4000:]
    results = [json.loads((tmp_path / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["stopped_by"] for r in results] == ["signal", "signal"]
    assert results[0]["step"] == results[1]["step"]
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == [f"step_{results[0]['step']:08d}"]
    _assert_all_gone(str(tmp_path))


def test_a_repeated_signal_is_the_same_stop_under_a_launcher_but_a_hard_stop_alone(monkeypatch):
    from omniloom.pretrain.runtime.signals import GracefulShutdown

    raised = []
    monkeypatch.setattr(signal, "raise_signal", raised.append)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)
    monkeypatch.delenv("OMNILOOM_LAUNCHED", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    alone = GracefulShutdown()
    alone._handle(signal.SIGINT, None)
    alone._handle(signal.SIGINT, None)
    assert raised == [signal.SIGINT]  # Ctrl-C twice on `omniloom train`: stop now
    raised.clear()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    launched = GracefulShutdown()
    launched._handle(signal.SIGTERM, None)
    launched._handle(signal.SIGTERM, None)
    assert launched.requested and raised == []  # Slurm's SIGTERM plus the launcher's: still one clean stop


def test_launch_help_and_a_signal_before_the_ranks_start(tmp_path, capsys):
    from omniloom.pretrain.runtime import launch
    from omniloom.pretrain.cli import main

    assert main(["launch", "--help"]) == 0
    assert "accelerate launch" in capsys.readouterr().out
    forwarder = launch._Forwarder()
    forwarder.ranks = lambda: []
    with pytest.raises(launch._Stopped) as err:
        forwarder.handle(signal.SIGTERM, None)
    assert launch._summarise(err.value, {}, forwarder) == 128 + signal.SIGTERM
    assert "before the ranks started" in capsys.readouterr().err


# ---- issue 28 item 6: a shipped accelerate config by name --------------------------------------
def test_config_file_takes_a_shipped_configs_name_from_any_folder(tmp_path, monkeypatch, capsys):
    """`--config_file configs/accelerate/cpu_2proc.yaml` worked only from the checkout's root (exit 1
    elsewhere); a shipped config's name now works anywhere, and a name that is neither a file nor a
    shipped config is one line naming the shipped ones, exit 2."""
    import accelerate.commands.launch as acc_launch

    from omniloom.pretrain.runtime import launch
    from omniloom.pretrain.cli import main

    seen = []
    monkeypatch.setattr(acc_launch, "launch_command", lambda args: seen.append(args.config_file))
    monkeypatch.chdir(tmp_path)
    for given in ("cpu_2proc", "cpu_2proc.yaml", "configs/accelerate/cpu_2proc.yaml"):
        assert launch.launch(["--config_file", given, "-m", "omniloom.pretrain.train"]) == 0
    own = tmp_path / "mine.yaml"
    own.write_text(CPU_2PROC.read_text())
    assert launch.launch(["--config_file", str(own), "-m", "omniloom.pretrain.train"]) == 0
    assert seen == [str(CPU_2PROC)] * 3 + [str(own)]
    capsys.readouterr()
    assert main(["launch", "--config_file", "cpu_3proc", "-m", "omniloom.pretrain.train"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no shipped accelerate config" in err and "cpu_2proc, ep_8gpu" in err, err
    assert "did you mean 'cpu_2proc'" in err and seen == [str(CPU_2PROC)] * 3 + [str(own)]


def _sharer_and_other(error: str):
    """Two functions raising `error`: one whose frame is in a file named like multiprocessing's
    resource_sharer.py (where a broken tensor hand-over is reported), and one that is not."""
    scope: dict = {}
    exec(compile(f"def serve():\n    raise {error}\n", os.path.join("x", "multiprocessing", "resource_sharer.py"), "exec"),
         scope)
    exec(compile(f"def other():\n    raise {error}\n", "elsewhere.py", "exec"), scope)
    return scope["serve"], scope["other"]


def test_a_hand_over_the_trainer_broke_off_is_no_traceback_in_a_loader_worker(monkeypatch):
    """multiprocessing's resource-sharer thread (a DataLoader worker's side of handing a tensor
    over) reports its errors through sys.excepthook: a trainer stopped by SIGTERM mid hand-over
    printed a ConnectionResetError traceback from a worker under the clean stop (CI, issue 39's
    session). In a worker those are one debug line; other errors still reach the old hook."""
    import sys

    from omniloom.data.stream import worker

    printed = []
    monkeypatch.setattr(sys, "excepthook", lambda t, e, tb: printed.append(t))
    serve, other = _sharer_and_other("ConnectionResetError(104, 'Connection reset by peer')")

    def report(fn):  # what resource_sharer._serve does with an error: sys.excepthook(*sys.exc_info())
        try:
            fn()
        except ConnectionResetError:
            sys.excepthook(*sys.exc_info())

    worker._quiet_handover_errors()
    report(serve)
    assert printed == []
    report(other)  # not the resource sharer
    assert printed == [ConnectionResetError]


def test_a_loader_worker_gone_mid_handover_is_no_traceback_once_stopping(monkeypatch):
    """Under load a DataLoader worker stopped by the same SIGTERM could die while this process's
    multiprocessing resource-sharer thread handed it a tensor: a BrokenPipe traceback printed under a
    clean stop (seen in test_sigterm_under_omniloom_launch_saves_and_exits_0). Once a stop is
    requested that thread's pipe errors are the stop itself; other thread errors still reach the
    hook that was there before."""
    import threading

    from omniloom.pretrain.runtime.signals import GracefulShutdown

    printed = []
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_type))
    serve, other = _sharer_and_other("BrokenPipeError(32, 'Broken pipe')")

    def thread_error(fn):  # what threading.excepthook gets when a thread ends with fn's error
        try:
            fn()
        except BrokenPipeError as err:
            threading.excepthook(threading.ExceptHookArgs((type(err), err, err.__traceback__, None)))

    stop = GracefulShutdown(repeat_stops_hard=False)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: None)
    stop.install()
    thread_error(serve)  # no stop requested yet: a real error
    assert printed == [BrokenPipeError]
    stop.requested = True
    thread_error(serve)
    assert printed == [BrokenPipeError]
    thread_error(other)  # not the resource sharer
    assert printed == [BrokenPipeError, BrokenPipeError]
    stop.restore()
    assert threading.excepthook == stop._thread_exception  # a stopping process keeps it to its end
