"""One run per run folder.

Before a training touches its run folder (removing a cut-off checkpoint's `.tmp-` folder, trimming
`metrics.jsonl` on resume, writing anything), the main process (global rank 0) takes the folder's
lock, `RUN/.omniloom.lock`, the same POSIX record lock `data build` takes on `--out`
(`omniloom.data.outlock`). It names the holder (pid and host, so a run on another node of a
shared filesystem is named too); a second training into the folder is refused with that name,
and a lock left by a holder that died is taken over with a warning. The lock is held until the
training ends.

With the lock held, a folder that already holds a run (checkpoints, or metric rows) is refused
unless the training continues it (`--resume auto` / a checkpoint) or starts it over
(`--overwrite`, which deletes what omniloom train wrote there).
"""

from __future__ import annotations

import atexit
import json
import logging
from pathlib import Path

from omniloom.data.outlock import OutputLock
from omniloom.pretrain.rundir import CHECKPOINTS, METRICS, RUN_OUTPUTS

log = logging.getLogger(__name__)



def describe_run(run_dir: str | Path) -> str | None:
    """What an earlier training left in `run_dir`, in words ("checkpoints up to step_00000169, 169
    metric rows (last step 169)"), or None when there is nothing of one."""
    from omniloom.pretrain.checkpoint.manager import _STEP_RE, TMP_PREFIX

    run_dir = Path(run_dir)
    parts = []
    ckpt_dir = run_dir / CHECKPOINTS
    if ckpt_dir.is_dir():
        steps = sorted(p.name for p in ckpt_dir.iterdir() if _STEP_RE.match(p.name))
        cut = [p.name for p in ckpt_dir.iterdir() if p.name.startswith(TMP_PREFIX)]
        if steps:
            parts.append(f"checkpoints up to {steps[-1]}" if len(steps) > 1 else f"checkpoint {steps[0]}")
        elif cut:
            parts.append(f"a checkpoint cut off while being written ({sorted(cut)[-1]})")
    rows, last = _metric_rows(run_dir / METRICS)
    if rows:
        parts.append(f"{rows} metric row(s)" + (f" up to step {last}" if last is not None else ""))
    return ", ".join(parts) or None


def _metric_rows(path: Path) -> tuple[int, int | None]:
    if not path.is_file():
        return 0, None
    rows, last = 0, None
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            rows += 1
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                last = row["step"] if last is None else max(last, row["step"])
    return rows, last


def clear_run(run_dir: Path) -> list[str]:
    """Delete what omniloom train wrote in `run_dir` (RUN_OUTPUTS); other files stay. Links are
    removed, never followed. Returns the names deleted."""
    from omniloom.pretrain.checkpoint.manager import remove_path

    gone = []
    for name in RUN_OUTPUTS:
        p = run_dir / name
        if p.is_symlink() or p.exists():
            remove_path(p)
            gone.append(name)
    return gone


class RunLock:
    """The lock on a run folder, held by the main process; `release()` (or process exit) frees it."""

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._lock = OutputLock(str(self.run_dir), f"omniloom train in {self.run_dir}",
                                instead="stop it, or choose another --run-dir")
        atexit.register(self.release)

    @property
    def path(self) -> str:
        return self._lock.path

    def release(self) -> None:
        self._lock.release()
        atexit.unregister(self.release)


def claim_run_dir(run_dir: str | Path, *, resume: str, overwrite: bool, has_checkpoint: bool) -> RunLock:
    """Lock `run_dir` for this training, then check that it may train there: a folder holding an
    earlier run needs `resume` (continue) or `overwrite` (start over: its outputs are deleted
    here, under the lock). `has_checkpoint`: whether resuming finds a complete checkpoint; with
    `resume="auto"` and none, the metric rows an earlier attempt left are dropped (each step is
    logged once). Raises OutputLocked / ValueError with one line saying what to do."""
    if overwrite and resume:
        raise ValueError(f"--overwrite starts the run in {run_dir} over; it cannot be combined with "
                         f"--resume {resume} (drop one of them)")
    lock = RunLock(run_dir)
    try:
        held = describe_run(lock.run_dir)
        if held and overwrite:
            gone = clear_run(lock.run_dir)
            log.warning("--overwrite: deleted the earlier run in %s (%s: %s)", lock.run_dir, held, ", ".join(gone))
        elif held and not resume:
            raise ValueError(
                f"{lock.run_dir} already holds a run ({held}); continue it with --resume auto, train in a new "
                "folder with --run-dir, or start it over with --overwrite (deletes its checkpoints and metrics)")
        elif held and resume == "auto" and not has_checkpoint:
            metrics = lock.run_dir / METRICS
            if metrics.is_file():
                rows, _ = _metric_rows(metrics)
                metrics.unlink()
                log.warning("checkpoint.resume=auto: no complete checkpoint in %s to continue from, so the %d "
                            "metric row(s) an earlier attempt logged are dropped and the run starts at step 0",
                            lock.run_dir, rows)
    except BaseException:
        lock.release()
        raise
    return lock


def claim_collective(acc, run_dir: str | Path, **kwargs) -> RunLock | None:
    """`claim_run_dir` on the main process, its refusal raised on every rank (so all of them exit
    with the same one line instead of the others waiting in a collective). Returns the lock on
    the main process, None elsewhere."""
    from omniloom.pretrain.console import USER_ERRORS

    lock, message = None, None
    if acc.is_main_process:
        try:
            lock = claim_run_dir(run_dir, **kwargs)
        except USER_ERRORS as err:
            message = str(err)
    if acc.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        message = broadcast_object_list([message])[0]
    if message is not None:
        raise ValueError(message)
    return lock


__all__ = ["RUN_OUTPUTS", "RunLock", "claim_collective", "claim_run_dir", "clear_run", "describe_run"]
