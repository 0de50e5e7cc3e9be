"""Experiment trackers (`logging.trackers`): TensorBoard, Weights & Biases, MLflow and the others
accelerate ships, started on rank 0 with the run's name, its config as hyperparameters, its scalar
metrics under names every tracker accepts, and the expert-load heat map as an image where the
tracker takes images.

accelerate's own tracker classes (accelerate.tracking) do the talking; this module decides what
each gets:

- names: `tracker_name` maps a metric key to `group/name` with exactly one slash (`loss` ->
  `train/loss`, `loss/text` -> `loss/text`, `eval/loss/text` -> `eval/loss_text`). MLflow's file
  store keeps a metric as a file under its name, so `loss` beside `loss/text` (a file and a folder
  of one name) fails there; with one slash every name is a file in a group folder. TensorBoard and
  W&B group charts by the part before the slash, so they show the same groups.
- scalars only: lists (the `moe/counts_LME` table) and non-finite values stay in metrics.jsonl.
- resume: the W&B and MLflow run ids are kept in RUN/trackers.json, so a resumed run goes on
  logging into the same tracker run instead of starting a new one.
- where files go: W&B writes under RUN/ (RUN/wandb/; `WANDB_MODE=offline` works as usual); MLflow
  logs to MLFLOW_TRACKING_URI when it is set, else to the file store RUN/mlflow/.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
from pathlib import Path

from omniloom.pretrain.config.run import TRACKERS as KNOWN
from omniloom.pretrain.rundir import MLFLOW, TRACKER_IDS

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9_.\- ]")


def check_installed(names: list[str]) -> None:
    """ValueError naming a tracker whose package is missing: said before the model is built, not
    after minutes of start-up (and not a silent drop, which is what accelerate does)."""
    for name in names:
        if importlib.util.find_spec(KNOWN[name]) is None:
            extra = " (or pip install 'omniloom[trackers]')" if name in ("wandb", "mlflow") else ""
            pip = "mlflow-skinny" if name == "mlflow" else KNOWN[name]
            raise ValueError(f"logging.trackers names {name!r}, but the {KNOWN[name]} package is not installed: "
                             f"pip install {pip}{extra}, or drop it from logging.trackers")


def tracker_name(key: str) -> str:
    """The name a metric has in the trackers: `group/name`, exactly one slash, no characters a
    tracker refuses (see the module docstring)."""
    group, _, rest = key.partition("/")
    if not rest:
        group, rest = "train", group
    return f"{_UNSAFE.sub('_', group)}/{_UNSAFE.sub('_', rest.replace('/', '_'))}"


def scalars(record: dict) -> dict:
    """The record's finite int/float values under their tracker names (the step excluded)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if math.isfinite(value):
            out[tracker_name(key)] = value
    return out


class Trackers:
    """The started trackers of one run (rank 0 only; an empty list logs nothing)."""

    def __init__(self, names: list[str], run_dir: Path, *, run_name: str, project: str, resuming: bool,
                 tb_dir: Path):
        self.run_dir, self.trackers = Path(run_dir), []
        ids = self._read_ids() if resuming else {}
        for name in names:
            try:
                tracker = _make(name, run_dir=self.run_dir, run_name=run_name, project=project, tb_dir=tb_dir,
                                resume_id=ids.get(name))
                tracker.start()
            except Exception as err:  # a tracker that cannot start (no login, no server) must not kill the run
                log.warning("tracker %s disabled: %s: %s", name, type(err).__name__, err)
                continue
            self.trackers.append(tracker)
        self._write_ids()

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def config(self, nested: dict, flat: dict) -> None:
        """The run config as hyperparameters: nested for W&B, flat (dotted keys) for the others;
        TensorBoard's go through metrics._write_hparams, in the main run's own event file."""
        for tracker in self.trackers:
            if tracker.name == "tensorboard":
                continue
            self._call(tracker, "store_init_configuration", nested if tracker.name == "wandb" else flat)

    def log(self, record: dict, step: int) -> None:
        values = scalars(record)
        if values:
            for tracker in self.trackers:
                self._call(tracker, "log", values, step=step)

    def images(self, images: dict, step: int) -> None:
        """{name: HxWx3 uint8 array} to every tracker that takes images (TensorBoard, W&B)."""
        for tracker in self.trackers:
            if tracker.name == "tensorboard":
                for key, img in images.items():
                    self._call(tracker.writer, "add_image", tracker_name(key), img, global_step=step, dataformats="HWC")
            elif hasattr(tracker, "log_images"):
                self._call(tracker, "log_images", {tracker_name(k): [v] for k, v in images.items()}, step=step)

    def get(self, name: str):
        return next((t for t in self.trackers if t.name == name), None)

    def close(self) -> None:
        for tracker in self.trackers:
            self._call(tracker, "finish")

    def _call(self, obj, method: str, *args, **kwargs) -> None:
        try:
            getattr(obj, method)(*args, **kwargs)
        except Exception as err:  # one tracker's failure (a full disk, a lost connection) is a warning
            log.warning("tracker %s: %s failed: %s: %s", getattr(obj, "name", type(obj).__name__), method,
                        type(err).__name__, err)

    def _read_ids(self) -> dict:
        try:
            data = json.loads((self.run_dir / TRACKER_IDS).read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_ids(self) -> None:
        ids = {}
        for tracker in self.trackers:
            if tracker.name == "wandb" and getattr(tracker, "run", None) is not None:
                ids["wandb"] = tracker.run.id
            elif tracker.name == "mlflow" and getattr(tracker, "active_run", None) is not None:
                ids["mlflow"] = tracker.active_run.info.run_id
        if ids:
            tmp = self.run_dir / (TRACKER_IDS + ".tmp")
            tmp.write_text(json.dumps(ids, indent=1) + "\n")
            tmp.replace(self.run_dir / TRACKER_IDS)


def _make(name: str, *, run_dir: Path, run_name: str, project: str, tb_dir: Path, resume_id: str | None):
    from accelerate import tracking

    if name == "tensorboard":
        return tracking.TensorBoardTracker(run_name, str(tb_dir))
    if name == "wandb":
        kwargs = {"name": run_name, "dir": str(run_dir)}  # W&B makes its wandb/ folder in it
        if resume_id:
            kwargs.update(id=resume_id, resume="allow")
        return tracking.WandBTracker(project, **kwargs)
    if name == "mlflow":
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            import mlflow

            # the run's own file store (MLflow 3 asks for this opt-in; mlflow-skinny has no sqlite store)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((run_dir / MLFLOW).resolve().as_uri())
        return tracking.MLflowTracker(experiment_name=project, run_id=resume_id, run_name=None if resume_id else run_name)
    cls = tracking.LOGGER_TYPE_TO_CLASS[name]
    if cls.requires_logging_directory:
        return cls(project, str(run_dir / name))
    return cls(project)


def heat_map(counts_LME):
    """The expert-load table (layers x modalities x experts) as an image: one row per (layer,
    modality), one column per expert, each row scaled to its own maximum, 8x8 pixels per cell; None
    for anything that is not such a table."""
    import numpy as np

    try:
        arr = np.asarray(counts_LME, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    if arr.ndim != 3 or arr.size == 0 or not np.isfinite(arr).all():
        return None
    rows = arr.reshape(-1, arr.shape[-1])
    peak = rows.max(axis=1, keepdims=True)
    scaled = np.divide(rows, peak, out=np.zeros_like(rows), where=peak > 0)
    gray = (255 * scaled).astype(np.uint8).repeat(8, axis=0).repeat(8, axis=1)
    return np.stack([gray, gray, gray], axis=-1)
