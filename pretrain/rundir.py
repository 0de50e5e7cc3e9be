"""The run folder's layout, in one place, and reading its metrics.

    RUN/
      checkpoints/                 CHECKPOINTS: step_NNNNNNNN/ folders (pretrain/checkpoint/manager.py)
        step_00000100/config.yaml  CHECKPOINT_CONFIG: the resolved run config that checkpoint trained with
      metrics.jsonl                METRICS: one JSON object per logged step (pretrain/train/metrics.py)
      tb/                          TENSORBOARD: the TensorBoard tracker's logs (logging.trackers)
      wandb/  mlflow/              WANDB, MLFLOW: those trackers' local files, when they are on
      trackers.json                TRACKER_IDS: the W&B / MLflow run ids a resumed run logs into
      data_trace/                  DATA_TRACE: the documents each rank trained on (logging.data_trace)
      report/                      REPORT: `omniloom report`'s page and plots
      .omniloom.lock               the run lock (omniloom.data.outlock.LOCK, the one `data build` takes)

Every module that reads or writes one of these names takes it from here.
"""

from __future__ import annotations

import json
from pathlib import Path

CHECKPOINTS = "checkpoints"
CHECKPOINT_CONFIG = "config.yaml"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
WANDB, MLFLOW, TRACKER_IDS = "wandb", "mlflow", "trackers.json"
DATA_TRACE = "data_trace"
REPORT = "report"
# what `omniloom train` writes into a run folder (and --overwrite deletes)
RUN_OUTPUTS = (CHECKPOINTS, METRICS, TENSORBOARD, WANDB, MLFLOW, TRACKER_IDS, DATA_TRACE)


def read_metrics(path: str | Path) -> list[dict]:
    """Read a metrics.jsonl back (a truncated last line from a killed run is ignored)."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows
