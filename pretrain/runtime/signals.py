"""Stop signals: a SIGTERM or SIGINT ends a run at the next step boundary with a checkpoint."""

from __future__ import annotations

import contextlib
import logging
import os
import signal

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
        self.repeat_stops_hard = (not under_launcher()) if repeat_stops_hard is None else repeat_stops_hard

    def install(self) -> "GracefulShutdown":
        for sig in self.SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. inside a test runner thread)
                log.warning("cannot install a %s handler outside the main thread", sig.name)
        return self

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
