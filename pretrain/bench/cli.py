"""`omniloom bench NAME` for every pretrain benchmark: each module registers its own command (its
flags stand beside the code they time); this list is their order in `omniloom bench`.

Benchmarks of the other rooms register from their own `cli.py` (`omniloom bench data`, `tokenizers`,
`model`, `kernels`). The modules that only run as scripts (`python -m omniloom.pretrain.bench.NAME`:
expert_parallel, integrity, selector, gpu_check, gpu_rows) are not listed here.
"""

from __future__ import annotations

import importlib

BENCHMARKS = ("arch", "generate", "hf", "hf_generate", "decode", "threads")


def register_bench(bench_sub) -> None:
    _register_train(bench_sub)  # here, not in train.py: that module imports torch, and --help must not
    for name in BENCHMARKS:
        importlib.import_module(f"{__package__}.{name}").register_bench(bench_sub)


def _register_train(bench_sub) -> None:
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
    p.set_defaults(func=_bench_train)


def _bench_train(args) -> int:
    from omniloom.pretrain.bench.train import bench_train, bench_train_lengths

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
