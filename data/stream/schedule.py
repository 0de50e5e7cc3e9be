"""Source schedules of the training stream: which sources a step draws from, and modality filters.

A source may be drawn only from a training step on (`SourceConfig.start_step`), only before one
(`end_step`), and only for documents whose segments are all of some types (`modalities`). A
text-first start (`data.text_first_steps=N`) is written with them: a text-and-code-only copy of
each source before N, the source itself from N on (data/config.py: text_first_sources).

The stream counts batches, not steps: batch b of a rank (0, 1, 2, ... in the order the trainer
consumes them) belongs to training step `base_step + (b - base_batch) // batches_per_step`, where
`batches_per_step` is the gradient accumulation and (base_step, base_batch) the point the stream
started or resumed from (`StepClock`). The loader saves the step its next batch belongs to, so a
resume (same layout, another layout, another accumulation) goes on with the same steps.

Everything here is a pure function of the config, the step and the document: two runs that reach
a step draw from the same sources with the same probabilities, and a resumed run does too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omniloom.data.config import SourceConfig

# skipped/<reason> of a document a source's `modalities` leave out (counted, never logged one by one)
OUTSIDE_MODALITIES = "outside_modalities"


@dataclass(frozen=True)
class StepClock:
    """Training step of a rank's batch b: base_step + (b - base_batch) // batches_per_step."""

    batches_per_step: int = 1
    base_step: int = 0
    base_batch: int = 0

    def step_of(self, batch: int) -> int:
        return self.base_step + (batch - self.base_batch) // self.batches_per_step

    def position(self, batch: int) -> list[int]:
        """[step, batches of that step already drawn] of the next batch b: what a state saves."""
        return [self.step_of(batch), (batch - self.base_batch) % self.batches_per_step]

    def resumed(self, batch: int, position: list[int] | None) -> StepClock:
        """The clock of a stream resumed at batch index `batch` from a saved `position` (None: a
        state from before schedules: the batches count from step 0)."""
        if position is None:
            return StepClock(self.batches_per_step, batch // self.batches_per_step,
                             batch - batch % self.batches_per_step)
        step, within = int(position[0]), int(position[1])
        return StepClock(self.batches_per_step, step, batch - within)


class SourceSchedule:
    """The active sources and their renormalized weights at each step, and each source's filter."""

    def __init__(self, sources: list[SourceConfig]):
        self.starts = [s.start_step for s in sources]
        self.ends = [s.end_step for s in sources]
        self.weights = np.array([s.weight for s in sources], dtype=np.float64)
        self.modalities = [frozenset(s.modalities) if s.modalities else None for s in sources]
        self.bounds = sorted({0, *self.starts, *(e for e in self.ends if e)})
        self._phases: dict[int, tuple[np.ndarray, list[int]]] = {}

    @property
    def trivial(self) -> bool:
        """No source has a schedule: every step draws from every source."""
        return len(self.bounds) == 1

    def at(self, step: int) -> tuple[np.ndarray, list[int]]:
        """(probability per source, indices of the active ones) at training step `step`."""
        phase = int(np.searchsorted(self.bounds, step, side="right")) - 1
        if phase not in self._phases:
            start = self.bounds[phase]
            active = [i for i, (a, e) in enumerate(zip(self.starts, self.ends)) if a <= start and (not e or start < e)]
            assert active, f"no active source at step {step}: data/config.py check_schedule lets none through"
            p = np.zeros_like(self.weights)
            p[active] = self.weights[active] / self.weights[active].sum()
            self._phases[phase] = (p, active)
        return self._phases[phase]

    def outside(self, src: int, doc: dict) -> str | None:
        """Why document `doc` is not drawn from source `src` (its modality filter), or None."""
        allowed = self.modalities[src]
        if allowed is None:
            return None
        found = sorted({seg.get("type") for seg in doc.get("segments", []) if isinstance(seg, dict)} - allowed)
        return f"segments of type {', '.join(map(str, found))} (the source takes {', '.join(sorted(allowed))})" if found else None

    def fingerprint(self) -> list | None:
        """[[start_step, end_step, modalities]] per source for the data-state fingerprint; None when no
        source is scheduled (so states saved before schedules existed keep matching)."""
        if self.trivial and not any(self.modalities):
            return None
        return [[a, e, sorted(m) if m else []] for a, e, m in zip(self.starts, self.ends, self.modalities)]
