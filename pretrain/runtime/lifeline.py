"""A rank stops when the launcher that started it dies.

torchrun (under `omniloom launch` or `accelerate launch`) starts every rank in a session of its
own, so a SIGKILL of the launcher (a scheduler killing the job step, `kill -9`, an OOM kill) does
not reach the ranks: they trained on as orphans, writing checkpoints into a folder a requeued job
was starting in. A launched rank therefore watches its parent, the launcher (torchrun's agent runs
inside `omniloom launch` / `accelerate launch`, so the ranks are its direct children):

- on Linux the kernel sends the rank SIGTERM the moment its parent dies
  (`prctl(PR_SET_PDEATHSIG)`; strictly, when the parent *thread* that started it ends, which is
  the launcher's main thread here);
- everywhere, a daemon thread checks once a second whether the parent changed (the rank was
  re-parented to init or a subreaper) and then sends the same SIGTERM, which also covers a
  launcher that died before the rank could ask the kernel.

SIGTERM is the stop a rank already handles (`signals.GracefulShutdown`): every rank finishes its
step, they save a checkpoint together and exit, as when the launcher forwards a scheduler's
SIGTERM; before the training loop starts it simply ends the process. A rank that is still alive
`OMNILOOM_ORPHAN_TIMEOUT` seconds (default 600) after its launcher died (a save that cannot
finish, a collective waiting for a peer that is gone) ends itself with SIGKILL, so no orphan
outlives a requeue by more than that.

No torch here: the module is imported by every rank before anything heavy.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_TIMEOUT_ENV = "OMNILOOM_ORPHAN_TIMEOUT"
LAUNCHER_PID_ENV = "OMNILOOM_LAUNCHER_PID"  # set by `omniloom launch` for its ranks

_armed: list["Lifeline"] = []


def _set_parent_death_signal(sig: int) -> bool:
    """Ask the kernel to send `sig` when the parent dies (Linux only). True when it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class Lifeline:
    """Watch the parent process; when it is gone, SIGTERM this process (once), and SIGKILL it
    `timeout_s` later if it is still running. `check_s`: how often the thread looks."""

    def __init__(self, *, timeout_s: float | None = None, check_s: float = 1.0):
        self.parent = os.getppid()
        self.timeout_s = float(os.environ.get(_TIMEOUT_ENV, 600)) if timeout_s is None else timeout_s
        self.check_s = check_s
        self.orphaned_at: float | None = None
        self._thread: threading.Thread | None = None

    def arm(self) -> "Lifeline":
        _set_parent_death_signal(signal.SIGTERM)
        self._thread = threading.Thread(target=self._watch, name="omniloom-lifeline", daemon=True)
        self._thread.start()
        if os.getppid() != self.parent or not _launcher_alive():  # it died before prctl took effect
            self._orphaned()
        return self

    def _watch(self) -> None:
        while True:
            time.sleep(self.check_s)
            if self.orphaned_at is None:
                if os.getppid() != self.parent:
                    self._orphaned()
            elif time.monotonic() - self.orphaned_at > self.timeout_s:
                log.error("the launcher died %.0f s ago and this rank has not finished stopping: killing it "
                          "(%s=%g)", self.timeout_s, _TIMEOUT_ENV, self.timeout_s)
                os.kill(os.getpid(), signal.SIGKILL)

    def _orphaned(self) -> None:
        if self.orphaned_at is not None:
            return
        self.orphaned_at = time.monotonic()
        log.warning("the launcher (pid %d) is gone: this rank stops (finishing its step and saving a checkpoint "
                    "with the other ranks when it is training)", self.parent)
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except OSError:
            pass


def _launcher_alive() -> bool:
    """False when `omniloom launch` (whose pid it exports) is known to be gone. The pid is not
    compared with the parent's: a wrapper script between the launcher and the rank is allowed."""
    try:
        pid = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    except ValueError:
        return True
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def arm_if_launched() -> Lifeline | None:
    """Arm a Lifeline in a rank started by a launcher (`omniloom launch`, torchrun, `accelerate
    launch`); once per process. None when this process was not launched (or it is already armed)."""
    from .signals import under_launcher

    if _armed:
        return _armed[0]
    if not under_launcher():
        return None
    line = Lifeline().arm()
    _armed.append(line)
    return line
