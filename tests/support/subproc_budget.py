"""Run a test's subprocess against a budget of work (CPU seconds), not of wall time.

A fixed wall-clock timeout fails on a loaded CI machine: the interpreter parity run takes 111 s
alone on 2 cores and more than 300 s when four jobs share them. What a test wants to catch is a
run that does far more work than it should, or none at all (a hang), so the child is stopped when
its CPU time (with its own children's) passes `cpu_budget_s`, or when that CPU time has not grown
for `stall_s` seconds of wall time (a deadlock or a wait that never ends). A starved but working
child keeps going however long the machine makes it wait. `wall_cap_s` remains as a last resort.

Imported by the tests through importlib (tests/ is not a package); Linux reads CPU time from
/proc, elsewhere only the wall cap applies.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    except OSError:
        return []


def _kill_tree(pid: int) -> None:
    """SIGKILL `pid` and every descendant: torchrun starts each rank in a session of its own, so
    killing the child's process group alone would leave the ranks (and their workers) running."""
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += _children(tree[-1])
    for p in reversed(tree):  # leaves first: a parent killed first would orphan them to init
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _cpu_seconds(pid: int) -> float | None:
    """utime + stime of `pid` and of its descendants (live ones read directly, reaped ones through
    cutime/cstime), or None where /proc is missing."""
    total, seen = 0.0, False
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        seen = True
        total += sum(int(x) for x in fields[11:15]) / _TICK  # utime stime cutime cstime
        todo.extend(_children(p))
    return total if seen else None


class BudgetExceeded(AssertionError):
    pass


def run(cmd, *, cpu_budget_s: float, stall_s: float = 180.0, wall_cap_s: float = 3600.0,
        poll_s: float = 0.2, **popen_kwargs) -> subprocess.CompletedProcess:
    """Like `subprocess.run(cmd, capture_output=True, text=True)`, but the limit is work: raises
    BudgetExceeded (killing the child with all its descendants) when the child has used more than
    `cpu_budget_s` CPU seconds, when its CPU time stood still for `stall_s` seconds, or after
    `wall_cap_s`. The CompletedProcess gets a `cpu_s` attribute with the CPU time it used."""
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, start_new_session=True, **popen_kwargs)
        start = last_change = time.monotonic()
        cpu = last_cpu = 0.0
        reason = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                measured = _cpu_seconds(proc.pid)
                if measured is not None:
                    cpu = max(cpu, measured)
                    if cpu > last_cpu + 0.01:
                        last_cpu, last_change = cpu, now
                if cpu > cpu_budget_s:
                    reason = f"used {cpu:.0f} CPU seconds, over its budget of {cpu_budget_s:.0f}"
                elif measured is not None and now - last_change > stall_s:
                    reason = f"did no work for {stall_s:.0f} s (hung?) after {cpu:.0f} CPU seconds"
                elif now - start > wall_cap_s:
                    reason = f"still running after the {wall_cap_s:.0f} s wall-clock cap"
                if reason:
                    break
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                _kill_tree(proc.pid)
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        out.seek(0)
        err.seek(0)
        result = subprocess.CompletedProcess(cmd, proc.returncode, out.read(), err.read())
    result.cpu_s = cpu
    if reason:
        raise BudgetExceeded(f"{cmd[0]} ... {reason}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return result
