"""The arguments `omniloom train` and `accelerate launch -m omniloom.pretrain.train` share.

Kept free of torch so that `omniloom --help` stays fast.
"""

from __future__ import annotations

import argparse

from omniloom.pretrain.config.run import RunConfig, list_presets, load_config


def add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help=f"preset name ({', '.join(list_presets())}) or YAML path")
    p.add_argument("--resume", default=None,
                   help="'auto' (newest complete checkpoint in RUN_DIR/checkpoints, else start fresh) or a "
                   "step_N folder; same as checkpoint.resume=...")
    p.add_argument("--run-dir", default=None, help="output folder (same as train.run_dir=...)")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run folder that already holds a run: deletes its checkpoints, "
                   "metrics.jsonl, tb/ and data_trace/ first (without it such a folder is refused unless "
                   "--resume is given)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar; without one (this flag, or no terminal) rank 0 logs a progress line every "
                   "logging.progress_seconds (default 30; 0 for none). Metrics still go to JSONL")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.num_steps=50 optim.lr=1e-3")


def config_from_args(args) -> RunConfig:
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"checkpoint.resume={args.resume}")
    if args.run_dir is not None:
        overrides.append(f"train.run_dir={args.run_dir}")
    return load_config(args.config, overrides)
