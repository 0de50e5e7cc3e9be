"""Subprocess tests are limited by work (CPU seconds), not wall time (issue 14 item 19): a starved
child passes, a runaway or hung child is stopped with a reason. See tests/support/subproc_budget.py."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("subproc_budget", (Path(__file__).resolve().parents[0] / "support" / "subproc_budget.py"))
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads CPU time from /proc")

_BUSY = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\n" \
        "t = time.process_time()\nwhile time.process_time() - t < float(sys.argv[2]):\n    pass\nprint('done')\n"


def test_a_starved_child_passes_where_a_wall_clock_timeout_would_fail(tmp_path):
    """0.3 CPU seconds of work, but the child runs only a quarter of the time (as on a loaded
    machine): it takes well over a second of wall time and still passes a 5 CPU-second budget."""
    pid_file = tmp_path / "pid"
    stop = threading.Event()

    def starve():
        while not pid_file.exists() or not pid_file.read_text():
            if stop.is_set():
                return
            time.sleep(0.005)
        pid = int(pid_file.read_text())
        try:
            while not stop.is_set():
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.12)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.04)
        except ProcessLookupError:
            pass

    thread = threading.Thread(target=starve, daemon=True)
    thread.start()
    t0 = time.monotonic()
    try:
        res = budget.run([sys.executable, "-c", _BUSY, str(pid_file), "0.3"], cpu_budget_s=5, stall_s=2)
    finally:
        stop.set()
        thread.join()
    wall = time.monotonic() - t0
    assert res.returncode == 0 and "done" in res.stdout
    assert wall > 1.0 and res.cpu_s < 2.0, (wall, res.cpu_s)


def test_a_runaway_child_is_stopped_at_its_cpu_budget(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(budget.BudgetExceeded, match="over its budget"):
        budget.run([sys.executable, "-c", _BUSY, str(tmp_path / "pid"), "1000"], cpu_budget_s=0.5, stall_s=30)
    assert time.monotonic() - t0 < 20


def test_a_hung_child_is_stopped_when_it_does_no_work(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(budget.BudgetExceeded, match="did no work"):
        budget.run([sys.executable, "-c", "import time; time.sleep(1000)"], cpu_budget_s=100, stall_s=1.5)
    assert time.monotonic() - t0 < 20


def test_a_stopped_child_takes_its_own_sessions_descendants_with_it(tmp_path):
    """torchrun starts each rank in a session of its own: killing the child's process group left
    them running after the budget stopped the test's launcher."""
    pid_file = tmp_path / "grandchild"
    script = ("import subprocess, sys, time\n"
              "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1000)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(1000)\n")
    with pytest.raises(budget.BudgetExceeded, match="did no work"):
        budget.run([sys.executable, "-c", script], cpu_budget_s=100, stall_s=1.5)
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{grandchild}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break  # gone
        if state == "Z":  # killed, waiting for init to reap it
            break
        time.sleep(0.05)
    else:
        os.kill(grandchild, signal.SIGKILL)
        raise AssertionError("the grandchild in its own session outlived the budget's kill")
