"""`omniloom train` (one process).

Several processes: `omniloom launch --config_file NAME -m omniloom.pretrain.train --config PRESET
[key=value ...]` (same arguments as `omniloom train`; NAME a shipped accelerate config or a file).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register(sub) -> None:
    from omniloom.pretrain.config.run import list_presets

    p = sub.add_parser(
        "train",
        help="train a model in this process (multi-process: omniloom launch -m omniloom.pretrain.train)",
        description=f"Train from shards with the run config PRESET (a shipped preset name: {', '.join(list_presets())}; "
        "or a YAML path) plus dotted overrides. Writes RUN_DIR/metrics.jsonl, RUN_DIR/tb "
        "(TensorBoard) and RUN_DIR/checkpoints/step_N. SIGTERM/SIGINT finish the step, save a checkpoint "
        "and exit 0; rerun with --resume auto to continue exactly (guarantees and what must match: docs/resume.md in the "
        "repository). For several processes or GPUs use "
        "`omniloom launch --config_file cpu_2proc -m omniloom.pretrain.train "
        "--config tiny ...` with the same arguments (`omniloom launch` is `accelerate launch` with clean exit codes).",
        epilog="Options may come before or after PRESET and the overrides. A run folder that already holds a run "
        "needs --resume auto (continue) or --overwrite (start over); one training at a time per folder. "
        "Example: omniloom train --run-dir runs/t1 tiny "
        "data.sources='[{path: shards/train}]' data.tokenizer=tok train.num_steps=200",
    )
    p.add_argument("preset", nargs="?", default=None, help="preset name or YAML path (or use --config)")
    from .args import add_train_args

    add_train_args(p)
    p.set_defaults(func=_train)
    from omniloom.pretrain.runtime.launch import register as register_launch

    register_launch(sub)


def _train(args) -> int:
    import sys

    from .args import config_from_args
    from .guards import NonFiniteError
    from .loop import run

    if args.preset is not None:
        if "=" in args.preset:  # only overrides were given
            args.overrides.insert(0, args.preset)
        elif args.config is not None:
            raise ValueError(f"give the preset once: '{args.preset}' and --config {args.config}")
        else:
            args.config = args.preset
    cfg = config_from_args(args)
    try:
        result = run(cfg, progress=not args.no_progress, overwrite=args.overwrite)
    except NonFiniteError as err:
        print(f"omniloom train: {err}", file=sys.stderr)
        return 3
    print(f"finished at step {result.step} ({result.stopped_by}); {result.tokens_seen} tokens; "
          f"last checkpoint: {result.last_checkpoint}")
    return 0


