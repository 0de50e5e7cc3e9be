"""Several machines under `omniloom launch` (issue 41 item 2, and the port of item 5).

Before: with a machine missing (or a mistyped main_process_ip) the launch hung in torchrun's
TCPStore for 15 minutes, silent, deaf to SIGTERM and SIGINT; `--num_processes 1` on the 2-machine
config said only "AssertionError"; multi_node.yaml hard-coded 10.0.0.1 and 16 processes; there was
no Slurm script. Two "machines" here are two launchers on 127.0.0.1, one process each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from omniloom.pretrain.checkpoint.manager import list_checkpoints
from omniloom.pretrain.config.io import ConfigError
from omniloom.pretrain.config.run import presets_dir
from omniloom.pretrain.runtime import machines, rendezvous
from omniloom.pretrain.runtime.rendezvous import Machines, RendezvousError

SUPPORT = Path(__file__).resolve().parents[1] / "support"
_spec = importlib.util.spec_from_file_location("subproc_budget", SUPPORT / "subproc_budget.py")
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)
_pspec = importlib.util.spec_from_file_location("proctree", SUPPORT / "proctree.py")
proctree = importlib.util.module_from_spec(_pspec)
_pspec.loader.exec_module(proctree)

STANDIN = SUPPORT / "train_standin.py"
SLURM = presets_dir() / "slurm"
OMNILOOM = Path(sys.executable).with_name("omniloom")
LAUNCH = [sys.executable, "-m", "omniloom.pretrain.cli", "launch", "--config_file", "multi_node"]

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="process-tree checks read /proc")


def _env(**extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(proctree.free_port()), NUM_MACHINES="2", NUM_PROCESSES="2")
    for key in ("CUDA_VISIBLE_DEVICES", "MACHINE_RANK", "SLURM_NODEID", "SLURM_NNODES", "OMNILOOM_RDZV_TIMEOUT"):
        env.pop(key, None)
    env.update(extra)
    return env


# ---- the two-machine path, through the shipped sbatch script under a stand-in srun ---------------
def _sbatch(script: str, log: Path, *args: str, **env) -> subprocess.CompletedProcess:
    env = _env(PATH=f"{SUPPORT / 'fake_slurm'}:{OMNILOOM.parent}:{os.environ['PATH']}", FAKE_SRUN_LOG=str(log),
               SLURM_NNODES="2", SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[1-2]",
               SLURM_GPUS_PER_NODE="h100:1", OMNILOOM=str(OMNILOOM), **env)
    for key in ("MASTER_ADDR", "NUM_MACHINES", "NUM_PROCESSES"):  # the script sets them
        env.pop(key)
    return budget.run(["bash", str(SLURM / script), *args], env=env, cpu_budget_s=240, stall_s=60)


def test_two_machines_on_localhost_train_and_resume_through_the_sbatch_script(tmp_path):
    """multi_node.sbatch under a stand-in srun that runs its task on two "nodes" at once: two
    `omniloom launch` (machine_rank 0 and 1 from SLURM_NODEID) meet on 127.0.0.1, train with world
    size 2 over gloo, save, and a second submission resumes."""
    out, log = tmp_path / "run", tmp_path / "srun.log"
    out.mkdir()
    common = ["--rdzv_timeout", "60", str(STANDIN), "--out", str(out), "data.num_workers=0", "checkpoint.every=2"]
    res = _sbatch("multi_node.sbatch", log, *common, "train.num_steps=2")
    nodes = [Path(f"{log}.node{n}").read_text() for n in (0, 1)]
    assert res.returncode == 0, res.stderr[-2000:] + "\n".join(n[-3000:] for n in nodes)
    recorded = log.read_text()
    assert "argv: --ntasks-per-node=1 --kill-on-bad-exit=1" in recorded and "launch --config_file multi_node" in recorded
    port = _env_line(recorded, "MASTER_PORT")
    assert "MASTER_ADDR=127.0.0.1" in recorded and "NUM_PROCESSES=2" in recorded and "GPUS_PER_NODE=1" in recorded
    assert f"all 2 machines joined at 127.0.0.1:{port}" in nodes[0]
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["step"]) for r in results] == [(2, 2), (2, 2)]
    assert "Traceback" not in "".join(nodes), nodes

    res = _sbatch("multi_node.sbatch", log, *common, "train.num_steps=4", "checkpoint.resume=auto")
    nodes = [Path(f"{log}.node{n}").read_text() for n in (0, 1)]
    assert res.returncode == 0, "\n".join(n[-3000:] for n in nodes)
    results = [json.loads((out / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world_size"], r["step"]) for r in results] == [(2, 4), (2, 4)]
    assert [p.name for p in list_checkpoints(out / "checkpoints")][-1] == "step_00000004"
    assert [r["bias_updates"] for r in results] == [2, 2]  # steps 3 and 4 only: resumed from step 2


def _env_line(text: str, key: str) -> str:
    return next(line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{key}="))


def test_the_torchrun_sbatch_script_renders_one_torchrun_per_node(tmp_path):
    """torchrun_multi_node.sbatch under the stand-in srun, with a stand-in torchrun that records its
    arguments: each node gets its own --node-rank and the same address, port and timeout."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/bash\nprintf "%s\\n" "$@"\n')
    (fake / "torchrun").chmod(0o755)
    log = tmp_path / "srun.log"
    res = _sbatch("torchrun_multi_node.sbatch", log, "--config", "tiny", "--run-dir", "/shared/runs/t 1",
                  TORCHRUN=str(fake / "torchrun"), MASTER_PORT="29555", OMNILOOM_RDZV_TIMEOUT="42")
    assert res.returncode == 0, res.stderr
    for node in (0, 1):
        argv = Path(f"{log}.node{node}").read_text().splitlines()
        assert argv == ["--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node), "--rdzv-backend", "static",
                        "--master-addr", "127.0.0.1", "--master-port", "29555", "--rdzv-conf", "timeout=42",
                        "-m", "omniloom.pretrain.train", "--config", "tiny", "--run-dir", "/shared/runs/t 1"], argv
    for script in SLURM.glob("*.sbatch"):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


# ---- a machine missing ---------------------------------------------------------------------------
def _start_alone(tmp_path, rank: int, timeout_s: float, env=None):
    out = tmp_path / f"alone{rank}"
    out.mkdir()
    cmd = LAUNCH + ["--rdzv_timeout", str(timeout_s), str(STANDIN), "--out", str(out), "data.num_workers=0"]
    proc = subprocess.Popen(cmd, env=env or _env(MACHINE_RANK=str(rank)), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln.rstrip())) for ln in proc.stdout],
                              daemon=True)
    reader.start()
    return proc, lines, reader, out


def _wait_for(lines, text: str, proc, within_s: float = 120) -> float:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        for t, line in list(lines):
            if text in line:
                return t
        assert proc.poll() is None or any(text in ln for _, ln in lines), "\n".join(ln for _, ln in lines)
        time.sleep(0.05)
    pytest.fail(f"no line with {text!r}: " + "\n".join(ln for _, ln in lines))


def test_a_missing_machine_is_named_while_waiting_and_ends_the_launch_at_the_timeout(tmp_path):
    env = _env(MACHINE_RANK="0")
    proc, lines, reader, out = _start_alone(tmp_path, 0, 2, env)
    try:
        first = _wait_for(lines, f"waiting for 1 of 2 machines at 127.0.0.1:{env['MASTER_PORT']} "
                                 "(missing: machine_rank 1", proc)
        proc.wait(timeout=60)
        ended = time.monotonic()
        reader.join(5)
    finally:
        if proc.poll() is None:
            proctree.kill_tree(proc.pid)
    text = "\n".join(ln for _, ln in lines)
    assert proc.returncode == 1, text
    assert ended - first < 2 + 6, (ended - first, text)  # the timeout, plus the interpreter's exit on a busy machine
    errors = [ln for _, ln in lines if "error" in ln]
    assert len(errors) == 1 and "Traceback" not in text, text
    assert f"1 of 2 machines did not join at 127.0.0.1:{env['MASTER_PORT']} within 2 s (missing: machine_rank 1)" \
        in errors[0]
    assert not proctree.still_alive(str(out))


@pytest.mark.parametrize("rank,sig", [(0, signal.SIGTERM), pytest.param(1, signal.SIGINT, marks=pytest.mark.slow)])
def test_a_signal_ends_a_launch_waiting_for_a_machine_within_seconds(tmp_path, rank, sig):
    """Machine 0 waiting for machine 1 (SIGTERM), machine 1 waiting for a machine 0 that is not
    there, as with a mistyped main_process_ip (SIGINT): each ends at once, with everything it
    started, and says it was stopped before the ranks started."""
    proc, lines, reader, out = _start_alone(tmp_path, rank, 120)
    try:
        _wait_for(lines, "waiting for", proc)
        sent = time.monotonic()
        proc.send_signal(sig)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
        reader.join(5)
    finally:
        if proc.poll() is None:
            proctree.kill_tree(proc.pid)
    text = "\n".join(ln for _, ln in lines)
    assert took < 5 and proc.returncode == 128 + sig, (took, text)
    assert f"stopped by {sig.name} before the ranks started" in text and "Traceback" not in text, text
    assert not proctree.still_alive(str(out))


_STUCK = '''
import datetime, sys
import accelerate.commands.launch as acc
from torch.distributed import TCPStore
from omniloom.pretrain.runtime.launch import launch
def wait_for_a_machine_that_never_comes(args):  # what torchrun's static rendezvous does, in C++
    print("waiting in the TCPStore", flush=True)
    TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, datetime.timedelta(seconds=120))
acc.launch_command = wait_for_a_machine_that_never_comes
sys.exit(launch(["--config_file", "cpu_2proc", "x.py"]))
'''


def test_sigterm_ends_a_launch_stuck_in_torchs_own_rendezvous(tmp_path):
    """Python runs signal handlers only between bytecodes, so a SIGTERM while torchrun's TCPStore
    constructor waits (up to its timeout) went unheard; the launcher's wakeup-fd watcher ends it."""
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK)
    proc = subprocess.Popen([sys.executable, str(script), str(proctree.free_port())], env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert "waiting in the TCPStore" in proc.stdout.readline()
        time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proctree.kill_tree(proc.pid)
    assert proc.returncode == 128 + signal.SIGTERM and took < 8, (took, output)
    assert "stopped by SIGTERM while torch's rendezvous was waiting" in output and "Traceback" not in output


# ---- the rendezvous itself, in threads -----------------------------------------------------------
def _meet(num: int, ranks, timeout_s: float = 10.0, overrides: dict | None = None) -> dict:
    port = proctree.free_port()
    outcome = {}

    def one(rank):
        fields = dict(num_machines=num, machine_rank=rank, main_process_ip="127.0.0.1", main_process_port=port)
        fields.update((overrides or {}).get(rank, {}))
        try:
            rendezvous.rendezvous(Machines(**fields), timeout_s, report_every_s=0.5)
            outcome[rank] = "go"
        except RendezvousError as err:
            outcome[rank] = err

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
        time.sleep(0.05)
    for t in threads:
        t.join(30)
    return outcome


def test_three_machines_meet_and_disagreements_are_refused_on_both_sides(capsys):
    assert _meet(3, [2, 0, 1]) == {0: "go", 1: "go", 2: "go"}  # any order: the others wait for machine 0
    out = _meet(2, [0, 1], overrides={1: {"num_machines": 3}})
    assert out[0].code == 2 and "num_machines 3 and machine_rank 0 has 2" in str(out[0])
    assert out[1].code == 2 and str(out[1]) == str(out[0])
    out = _meet(3, [0, 1, 2], overrides={2: {"machine_rank": 1}})
    assert "two machines checked in as machine_rank 1" in str(out[0]) and out[0].code == 2
    alone = _meet(2, [1], timeout_s=1.0)[1]  # as with a mistyped main_process_ip
    assert alone.code == 1 and "machine_rank 0 did not answer at 127.0.0.1:" in str(alone)
    assert "(Connection refused): check main_process_ip and main_process_port" in str(alone)
    err = capsys.readouterr().err
    assert "waiting for machine_rank 0 at 127.0.0.1:" in err and "waiting for 2 of 3 machines at 127.0.0.1:" in err


def test_a_machine_that_leaves_before_all_joined_is_missing_again(capsys):
    port = proctree.free_port()
    outcome = []
    host = threading.Thread(target=lambda: outcome.append(_raises(rendezvous.rendezvous, Machines(3, 0, "127.0.0.1", port),
                                                                   1.0, report_every_s=0.2)))
    host.start()
    conn = _connect(port)
    conn.sendall(b"omniloom-rendezvous/1 num_machines=3 machine_rank=1 host=gone\n")
    assert conn.recv(16) == b"ok\n"
    conn.close()
    host.join(30)
    assert "2 of 3 machines did not join" in str(outcome[0]) and "(missing: machine_ranks 1, 2)" in str(outcome[0])
    assert "machine_rank 1 (gone) left before every machine joined" in capsys.readouterr().err


def _raises(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except RendezvousError as err:
        return err


def _connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_a_machine_0_that_resets_or_never_answers_is_one_clear_error(capsys):
    """Machine 1 reaches something on the port that resets the connection (machine 0 gone, another
    program) or that never answers: a RendezvousError that says so, never "joined" nor a traceback."""
    import socket
    import struct

    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def reset_once():
        conn, _ = srv.accept()
        conn.recv(4096)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        conn.close()

    t = threading.Thread(target=reset_once, daemon=True)
    t.start()
    with pytest.raises(rendezvous.RendezvousError, match="dropped the connection before every machine joined|closed the "
                       "connection before every machine joined"):
        rendezvous.rendezvous(Machines(2, 1, "127.0.0.1", port), 5.0, report_every_s=0.5)
    t.join(timeout=5)
    # a listener that accepts and says nothing: the timeout, with what was (not) heard
    held: list = []  # the accepted connection stays open, silent
    silent = threading.Thread(target=lambda: held.append(srv.accept()), daemon=True)
    silent.start()
    t0 = time.monotonic()
    with pytest.raises(rendezvous.RendezvousError, match="machine_rank 0 has not answered yet"):
        rendezvous.rendezvous(Machines(2, 1, "127.0.0.1", port), 1.0, report_every_s=0.5)
    assert time.monotonic() - t0 < 5
    for conn, _ in held:
        conn.close()
    srv.close()
    assert "joined machine_rank 0" not in capsys.readouterr().err


def test_machine_0_says_when_main_process_ip_is_not_one_of_its_addresses(capsys):
    rendezvous._warn_if_not_local("127.0.0.1")
    assert capsys.readouterr().err == ""
    rendezvous._warn_if_not_local("192.0.2.77")  # TEST-NET-1: never a local address
    assert "main_process_ip 192.0.2.77 is not an address of this machine" in capsys.readouterr().err


def test_the_rendezvous_timeout_comes_from_the_flag_the_environment_or_the_default():
    assert rendezvous.timeout_from(None, {}) == rendezvous.DEFAULT_TIMEOUT_S == 300
    assert rendezvous.timeout_from(None, {"OMNILOOM_RDZV_TIMEOUT": "12"}) == 12
    assert rendezvous.timeout_from(4.5, {"OMNILOOM_RDZV_TIMEOUT": "12"}) == 4.5
    with pytest.raises(ValueError, match="must be > 0"):
        rendezvous.timeout_from(0, {})


# ---- the config: placeholders, what must agree, the port -----------------------------------------
def test_placeholders_fill_from_the_environment_and_a_missing_one_names_its_variable_and_flag():
    env = {"A": "1", "SLURM_NODEID": "3", "EMPTY": ""}
    assert machines.expand("${A}", env) == "1" and machines.expand("x${B:-${SLURM_NODEID}}y", env) == "x3y"
    assert machines.expand("${EMPTY:-29500}", env) == "29500" and machines.expand("plain", env) == "plain"
    with pytest.raises(ConfigError, match=r"\$\{NAME\}"):
        machines.expand("${1BAD}", env)


def _set_env(monkeypatch, env: dict) -> None:
    for key in ("MASTER_ADDR", "MASTER_PORT", "NUM_MACHINES", "NUM_PROCESSES", "MACHINE_RANK", "SLURM_NODEID",
                "SLURM_NNODES", "OMNILOOM_RDZV_TIMEOUT"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def _launch_seen(monkeypatch, argv, env) -> tuple[int, list]:
    """launch(argv) with accelerate's launcher and the rendezvous recorded instead of run: the
    exit code, and [(Machines, timeout) when it met, (args, the config file accelerate read)]."""
    import accelerate.commands.launch as acc_launch

    from omniloom.pretrain.runtime import launch

    seen = []
    monkeypatch.setattr(acc_launch, "launch_command", lambda a: seen.append((a, Path(a.config_file).read_text())))
    monkeypatch.setattr(rendezvous, "rendezvous", lambda m, t: seen.append((m, t)))
    _set_env(monkeypatch, env)
    return launch.launch(argv), seen


def test_multi_node_yaml_takes_its_machines_from_the_environment_or_flags(monkeypatch, tmp_path):
    """The shipped multi_node.yaml holds placeholders, not 10.0.0.1 and 16 processes."""
    import yaml

    code, seen = _launch_seen(monkeypatch, ["--config_file", "multi_node", "--rdzv_timeout", "7", "x.py"],
                              {"MASTER_ADDR": "10.1.2.3", "NUM_PROCESSES": "32", "NUM_MACHINES": "4",
                               "SLURM_NODEID": "2"})
    assert code == 0
    (meet, timeout), (args, filled) = seen
    assert meet == Machines(num_machines=4, machine_rank=2, main_process_ip="10.1.2.3", main_process_port=29500)
    assert timeout == 7 and args.rdzv_conf == "timeout=7"
    assert yaml.safe_load(filled) == {**yaml.safe_load((presets_dir() / "accelerate" / "multi_node.yaml").read_text()),
                                      "num_machines": 4, "num_processes": 32, "machine_rank": 2,
                                      "main_process_ip": "10.1.2.3", "main_process_port": 29500}
    code, seen = _launch_seen(monkeypatch, ["--config_file", "multi_node", "--machine_rank", "1", "--main_process_ip",
                                            "h0", "--num_processes", "2", "--main_process_port", "1234", "x.py"],
                              {"NUM_MACHINES": "2"})
    assert code == 0 and seen[0][0] == Machines(2, 1, "h0", 1234)
    raw = yaml.safe_load((presets_dir() / "accelerate" / "multi_node.yaml").read_text())
    assert raw["main_process_ip"] == "${MASTER_ADDR}" and raw["num_processes"] == "${NUM_PROCESSES}"


def test_inconsistent_machine_settings_are_one_line_and_v_shows_the_traceback(monkeypatch, capsys):
    """`--num_processes 1` on the 2-machine config printed only 'the launcher failed: AssertionError'."""
    from omniloom.pretrain.cli import main

    _set_env(monkeypatch, {"MASTER_ADDR": "127.0.0.1", "NUM_PROCESSES": "2", "NUM_MACHINES": "2", "MACHINE_RANK": "0"})
    cases = [
        (["--num_processes", "1"], "--num_processes 1 with num_machines 2 (from multi_node.yaml, ${NUM_MACHINES:-"
                                   "${SLURM_NNODES}}): num_processes counts the processes of every machine together, "
                                   "so it must be a multiple of num_machines"),
        (["--machine_rank", "2"], "--machine_rank 2 with num_machines 2"),
        (["--main_process_port", "0"], "several machines must agree on a port"),
    ]
    for flags, expected in cases:
        capsys.readouterr()
        assert main(["launch", "--config_file", "multi_node", *flags, "x.py"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and expected in err, err
    monkeypatch.delenv("MASTER_ADDR")
    assert main(["launch", "--config_file", "multi_node", "x.py"]) == 2
    assert "main_process_ip is ${MASTER_ADDR} and MASTER_ADDR is not set: export MASTER_ADDR or give " \
           "--main_process_ip" in capsys.readouterr().err
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    with pytest.raises(ConfigError, match="multiple of num_machines"):
        main(["-v", "launch", "--config_file", "multi_node", "--num_processes", "1", "x.py"])


def test_a_launcher_failure_shows_its_traceback_with_v(capsys):
    from omniloom.pretrain.runtime import launch

    def boom():
        raise AssertionError("nproc_per_node must be > 0")

    try:
        boom()
    except AssertionError as err:
        failure = err
    assert launch._summarise(failure, {}, launch._Forwarder()) == 1
    err = capsys.readouterr().err
    assert "the launcher failed: AssertionError: nproc_per_node must be > 0 (omniloom -v launch" in err
    assert "Traceback" not in err
    assert launch._summarise(failure, {}, launch._Forwarder(), verbose=True) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in boom" in err


def test_one_machine_gets_a_free_port_unless_one_was_chosen(monkeypatch):
    """accelerate's default 29500 warned 'Port 29500 is already in use' whenever another run held it."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    try:
        code, seen = _launch_seen(monkeypatch, ["--config_file", "cpu_2proc", "x.py"], {})
        port = seen[0][0].main_process_port
        assert code == 0 and isinstance(port, int) and port not in (29500, held.getsockname()[1])
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))  # free
        code, seen = _launch_seen(monkeypatch, ["--config_file", "cpu_2proc", "--main_process_port",
                                                str(held.getsockname()[1]), "x.py"], {})
        assert seen[0][0].main_process_port == held.getsockname()[1]  # the user's choice stands
    finally:
        held.close()
