"""Stability guards the training loop calls at named points.

- `NonFiniteGuard`: a step whose loss or gradient norm is not finite skips its update and is
  counted; `max_in_a_row` such steps in a row stop the run with a message naming the step and the
  last good checkpoint.
- `SpikeDetector`: z-score of a value against a trailing window (OLMo-core flags > 6 sigma over 128
  steps); spikes are logged, not acted on.
- `GracefulShutdown`: SIGTERM/SIGINT set a flag; the loop finishes its step, saves and exits 0. A
  signal that comes while the loop waits for a step's batches ends the wait (`interruptible`).
"""

from __future__ import annotations

import collections
import logging
import math

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Raised when too many consecutive steps had a non-finite loss or gradient norm."""


class NonFiniteGuard:
    def __init__(self, max_in_a_row: int):
        if max_in_a_row < 1:
            raise ValueError(f"train.max_bad_steps must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total_skipped = 0

    def check(self, step: int, loss: float, grad_norm: float, last_checkpoint: str | None) -> bool:
        """Return True when the update may be applied. Values must already agree across ranks
        (an all-reduced loss, a global grad norm) so every rank takes the same branch."""
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.total_skipped += 1
        log.warning("step %d: non-finite loss=%s grad_norm=%s; update skipped (%d in a row, %d total)",
                    step, loss, grad_norm, self.in_a_row, self.total_skipped)
        if self.in_a_row >= self.max_in_a_row:
            where = last_checkpoint or "none saved yet"
            raise NonFiniteError(
                f"step {step}: {self.in_a_row} steps in a row had a non-finite loss or gradient norm; "
                f"stopping. Last good checkpoint: {where}. Resume from it with a lower optim.lr, a "
                f"longer warmup or a stronger model.z_loss_coef.")
        return False

    def state_dict(self) -> dict:
        return {"in_a_row": self.in_a_row, "total_skipped": self.total_skipped}

    def load_state_dict(self, state: dict) -> None:
        self.in_a_row, self.total_skipped = int(state["in_a_row"]), int(state["total_skipped"])


class SpikeDetector:
    """z-score of each new value against the previous `window` values (needs a quarter window of
    history before it reports anything, so warmup noise is not a spike)."""

    def __init__(self, window: int = 128, sigma: float = 6.0):
        self.window, self.sigma = max(2, window), sigma
        self.values: collections.deque[float] = collections.deque(maxlen=self.window)

    def update(self, value: float) -> float | None:
        """Add `value`; return its z-score when it is a spike (> sigma), else None."""
        z = self.zscore(value)
        if math.isfinite(value):
            self.values.append(value)
        return z if z is not None and z > self.sigma else None

    def zscore(self, value: float) -> float | None:
        n = len(self.values)
        if n < max(2, self.window // 4) or not math.isfinite(value):
            return None
        mean = sum(self.values) / n
        var = sum((v - mean) ** 2 for v in self.values) / (n - 1)
        std = math.sqrt(var)
        if std == 0.0:
            return None
        return (value - mean) / std

    def state_dict(self) -> dict:
        return {"values": list(self.values)}

    def load_state_dict(self, state: dict) -> None:
        self.values = collections.deque(state["values"], maxlen=self.window)


