"""Stop signals: a SIGTERM or SIGINT ends a run at the next step boundary with a checkpoint."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import traceback

log = logging.getLogger(__name__)


def under_launcher() -> bool:
    """True in a rank started by a launcher (`omniloom launch`, torchrun / `accelerate launch`)."""
    return bool(os.environ.get("OMNILOOM_LAUNCHED") or os.environ.get("TORCHELASTIC_RUN_ID"))


class StopRequested(BaseException):
    """Raised out of a `GracefulShutdown.interruptible()` section by a stop signal. A BaseException,
    so that no `except Exception` in the code it interrupts (a loader skipping bad samples) takes
    it for an error of its own."""


class GracefulShutdown:
    """Installs SIGTERM/SIGINT handlers that only set a flag. The loop checks `requested` (agreed
    across ranks by the caller) after each step, saves a checkpoint and exits with code 0.

    Alone (`omniloom train`), a second signal while a save is pending falls back to the default
    handler (hard stop: Ctrl-C twice). Under a launcher a rank gets the same stop twice as a
    matter of course (Slurm signals every process, then the launcher forwards the signal to its
    ranks), so there repeats are ignored and the launcher is the one that stops hard."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, *, repeat_stops_hard: bool | None = None):
        self.requested = False
        self.signal_name = ""
        self._previous = {}
        self._interruptible = False
        self._previous_hook = None
        self.repeat_stops_hard = (not under_launcher()) if repeat_stops_hard is None else repeat_stops_hard

    def install(self) -> "GracefulShutdown":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                log.warning("cannot install a %s handler outside the main thread", sig.name)
        if self._previous_hook is None:
            self._previous_hook, threading.excepthook = threading.excepthook, self._thread_exception
        return self

    def _thread_exception(self, args) -> None:
        """A DataLoader worker stopped by the same signal can die in the middle of handing a shared
        tensor over: this process's multiprocessing resource-sharer thread then fails on a broken
        pipe and would print a traceback under the clean stop (seen under load). Once a stop is
        requested that is the stop itself: one debug line. Every other thread error goes on to the
        hook that was there before."""
        sharer = any(frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py"))
                     for frame, _ in traceback.walk_tb(args.exc_traceback))
        if self.requested and sharer and issubclass(args.exc_type, (BrokenPipeError, ConnectionResetError, EOFError)):
            log.debug("stopping: a loader worker left during a tensor hand-over (%s)", args.exc_value)
            return
        (self._previous_hook or threading.__excepthook__)(args)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            if not self.repeat_stops_hard:
                return  # the same stop, delivered again (by the scheduler and by the launcher)
            log.warning("second %s: stopping without waiting for the checkpoint", signal.Signals(signum).name)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        self.requested = True
        self.signal_name = signal.Signals(signum).name
        if self._interruptible:
            self._interruptible = False
            log.warning("%s received while the next step's batches were being read: stopping the wait, saving the "
                        "last trained step, then exiting", self.signal_name)
            raise StopRequested(self.signal_name)
        log.warning("%s received: finishing this step, saving a checkpoint, then exiting", self.signal_name)

    @contextlib.contextmanager
    def interruptible(self):
        """A section (waiting for data) that a stop signal ends at once with StopRequested, instead
        of only setting the flag for the end of the step; raised at entry when a stop is pending."""
        if self.requested:
            raise StopRequested(self.signal_name)
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._previous_hook is not None and not self.requested:  # a stopping process keeps it to its end:
            threading.excepthook, self._previous_hook = self._previous_hook, None  # its loader workers go last
