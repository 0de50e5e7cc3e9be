"""The global batch across a resume on another number of processes.

`data.batch_size` is per rank, so the global batch of a step is `processes x batch_size x
train.grad_accum_steps` rows. A checkpoint resumed on fewer processes would train on with a smaller
global batch (tokens per step halved from 2 processes to 1) while the step count, the learning-rate
schedule and `tokens_seen` went on as if nothing changed. So by default
(`checkpoint.resume_global_batch=keep`) the resumed run keeps the checkpoint's global batch by
choosing the gradient accumulation: `saved rows // (processes x batch_size)`, when that divides, and
refuses otherwise, naming process counts that work. `checkpoint.resume_global_batch=change` trains on
with this run's own `processes x batch_size x train.grad_accum_steps` instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import yaml

from omniloom.pretrain.checkpoint.manager import MARKER
from omniloom.pretrain.rundir import CHECKPOINT_CONFIG

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Batching:
    processes: int
    batch_size: int
    grad_accum_steps: int

    @property
    def rows(self) -> int:
        return self.processes * self.batch_size * self.grad_accum_steps

    def describe(self, seq_len: int) -> str:
        return (f"{self.rows} rows ({self.processes} process(es) x {self.batch_size} rows x {self.grad_accum_steps} "
                f"accumulation step(s); {self.rows * seq_len:,} tokens per step)")


def saved_batching(checkpoint: str | Path) -> Batching | None:
    """How the run that wrote `checkpoint` batched: its marker's world size and its config.yaml
    (None without one: loading the checkpoint then says what is wrong with it)."""
    path = Path(checkpoint)
    if not (path / CHECKPOINT_CONFIG).is_file() or not (path / MARKER).is_file():
        return None
    try:
        world = json.loads((path / MARKER).read_text()).get("world_size")
        saved = yaml.safe_load((path / CHECKPOINT_CONFIG).read_text()) or {}
    except (OSError, ValueError, AttributeError, yaml.YAMLError) as err:
        raise ValueError(f"cannot resume from {path}: its {MARKER} or config.yaml is unreadable ({err}); resume from "
                         "another checkpoint") from None
    data, train = saved.get("data") or {}, saved.get("train") or {}
    values = (world, data.get("batch_size"), train.get("grad_accum_steps", 1))
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ValueError(f"cannot resume from {path}: its world size, data.batch_size or train.grad_accum_steps is "
                         f"missing or invalid ({values}); resume from another checkpoint")
    return Batching(*values)


def plan_accumulation(saved: Batching, now: Batching, *, policy: str, seq_len: int) -> tuple[int, str]:
    """(the gradient accumulation this run uses, a note for the resume line, or "").
    Raises ValueError when the saved global batch cannot be kept and `policy` is "keep"."""
    if policy not in ("keep", "change"):
        raise ValueError(f"checkpoint.resume_global_batch must be keep or change, got {policy!r}")
    if now.rows == saved.rows:
        return now.grad_accum_steps, ""
    if policy == "change":
        return now.grad_accum_steps, (f"the global batch changes from {saved.describe(seq_len)} to {now.describe(seq_len)} "
                                      "(checkpoint.resume_global_batch=change)")
    per_micro = now.processes * now.batch_size
    if (now.processes, now.batch_size) == (saved.processes, saved.batch_size):
        # the same layout with another accumulation asked for: keeping the global batch ignores it
        log.warning("train.grad_accum_steps=%d ignored: resuming keeps the checkpoint's global batch, %s; pass "
                    "checkpoint.resume_global_batch=change to train on with %d accumulation steps",
                    now.grad_accum_steps, saved.describe(seq_len), now.grad_accum_steps)
        return saved.grad_accum_steps, ""
    if saved.rows % per_micro == 0:
        accum = saved.rows // per_micro
        kept = dataclasses.replace(now, grad_accum_steps=accum)
        return accum, (f"on {now.processes} process(es) (saved on {saved.processes}): gradient accumulation "
                       f"{now.grad_accum_steps} -> {accum} keeps the global batch at {kept.describe(seq_len)}")
    fits = [p for p in range(1, saved.rows // now.batch_size + 1) if saved.rows % (p * now.batch_size) == 0]
    if not fits:
        raise ValueError(
            f"the checkpoint's global batch is {saved.describe(seq_len)}, and no number of processes x "
            f"data.batch_size={now.batch_size} rows divides it (the checkpoint ran data.batch_size={saved.batch_size}): "
            f"resume with data.batch_size={saved.batch_size}, or pass checkpoint.resume_global_batch=change to train on "
            f"with {now.describe(seq_len)}")
    # the other way out on this many processes: a data.batch_size whose rows an accumulation fits
    sizes = [b for b in range(now.batch_size - 1, 0, -1) if saved.rows % (now.processes * b) == 0]
    smaller = (f", pass data.batch_size={sizes[0]} ({now.processes} x {sizes[0]} rows x accumulation "
               f"{saved.rows // (now.processes * sizes[0])} keeps it; the data stream goes on with the same rows)"
               if sizes else "")
    raise ValueError(
        f"the checkpoint's global batch is {saved.describe(seq_len)}; on {now.processes} process(es) x {now.batch_size} rows "
        f"no gradient accumulation gives {saved.rows} rows: launch {', '.join(map(str, fits))} process(es){smaller}, or "
        f"pass checkpoint.resume_global_batch=change to train on with {now.describe(seq_len)}")


def keep_global_batch(cfg, checkpoint: str | Path, processes: int):
    """`cfg` with the gradient accumulation that keeps `checkpoint`'s global batch on `processes`
    processes (plan_accumulation), and the note for the resume line."""
    saved = saved_batching(checkpoint)
    if saved is None:
        return cfg, ""
    now = Batching(processes, cfg.data.batch_size, cfg.train.grad_accum_steps)
    accum, note = plan_accumulation(saved, now, policy=cfg.checkpoint.resume_global_batch, seq_len=cfg.data.seq_len)
    if accum != cfg.train.grad_accum_steps:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=accum))
    return cfg, note
