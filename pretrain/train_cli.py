"""`omniloom train` (one process) and `omniloom bench train` (tokens/s and step-time breakdown).

Several processes: `omniloom launch --config_file NAME -m omniloom.pretrain.train --config PRESET
[key=value ...]` (same arguments as `omniloom train`; NAME a shipped accelerate config or a file).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def register(sub) -> None:
    from .config import list_presets

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
    from .train_args import add_train_args

    add_train_args(p)
    p.set_defaults(func=_train)
    from .launch import register as register_launch

    register_launch(sub)


def _train(args) -> int:
    import sys

    from .guards import NonFiniteError
    from .train import run
    from .train_args import config_from_args

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


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "train",
        help="training throughput: tokens/s and data/forward/backward/optimizer time per step",
        description="Train PRESET for --steps steps after --warmup untimed steps, in this process, and print "
        "tokens/s and the step-time breakdown (data wait, forward, backward, optimizer) as seconds and as "
        "shares of the step. As a reference measured in the same run it also times forward-only passes "
        "on the same batches and prints the train/forward-only time ratio. Without data sources in the "
        "preset it uses random PackedBatch-shaped batches (the data share is then ~0: say so when quoting).",
    )
    p.add_argument("preset", nargs="?", default="tiny", help="preset name or YAML path (default tiny)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.sources='[{path: shards}]'")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--seq-lens", default="",
                   help="comma-separated sequence lengths: run the bench at each (a fresh trainer each) and end "
                        "with a table of step time per length and its ratio to the previous one (default: the "
                        "preset's data.seq_len only)")
    p.epilog = ("Options go before PRESET. Example: omniloom bench train --steps 5 tiny data.seq_len=256; "
                "omniloom bench train --steps 3 --seq-lens 8192,16384,32768,65536 long_64k")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    from .bench import bench_train, bench_train_lengths

    if args.seq_lens:
        try:
            lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--seq-lens takes comma-separated integers, got '{args.seq_lens}'") from None
        if not lens or min(lens) < 1:
            raise ValueError(f"--seq-lens takes positive sequence lengths, got '{args.seq_lens}'")
        print(bench_train_lengths(args.preset, list(args.overrides), lens, steps=args.steps, warmup=args.warmup))
        return 0
    report = bench_train(args.preset, list(args.overrides), steps=args.steps, warmup=args.warmup)
    print(report)
    return 0
