"""Expert-parallel throughput: tokens/s per process with and without expert parallelism at a fixed
global batch, and the share of the step spent in the expert exchange (issue 16).

    python -m omniloom.pretrain.bench.expert_parallel [--preset tiny] [--worlds 2 4] [--global-batch 8] [--steps 5]
    python -m omniloom.pretrain.bench.expert_parallel --build-memory --preset large_1b --worlds 8

`--build-memory` instead measures what building the model costs one rank (peak resident memory
and seconds, a fresh process each): the whole model, against only the experts rank 0 holds under
model.moe.expert_parallel=W (what the trainer builds).

For every world size W it launches W processes (torchrun, gloo on CPU / NCCL on GPUs) twice: data
parallel only, and with model.moe.expert_parallel=W; each rank gets global-batch / W rows of
synthetic batches (the real Trainer, model and optimizer). The exchange time is the wall time of
the all_to_all calls (counts and rows, forward and backward), synchronised on CUDA, so on a GPU it
includes waiting for the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def _worker(args) -> None:
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train import build as B
    from omniloom.pretrain.train import expert_parallel as EP
    from omniloom.pretrain.train.loop import Trainer
    from omniloom.pretrain.train.main import close_process_group

    from . import train as bench

    world = int(os.environ["WORLD_SIZE"])
    import tempfile

    with tempfile.TemporaryDirectory(prefix="omniloom-bench-ep-") as tmp:
        cfg = load_config(args.preset, [
            f"train.run_dir={tmp}", f"train.num_steps={args.warmup + args.steps}", "checkpoint.every=0",
            "logging.trackers=[]", "train.eval_every=0", "checkpoint.resume=",
            f"data.batch_size={args.global_batch // world}", f"model.moe.expert_parallel={args.ep}",
            f"model.vocab_size={bench._SYNTHETIC_VOCAB}", f"model.patch_token_id={bench._SYNTHETIC_PATCH_ID}",
            *args.overrides])
        cfg = B.resolve_model_config(cfg)
        trainer = Trainer(cfg, progress=False, build_model=B.build_model,
                          build_loader=lambda c, split, rank, w: bench.SyntheticLoader(c, rank) if split == "train" else None)
        for _ in range(args.warmup):
            trainer.run_step()
        EP.EXCHANGE_TIMER.reset(sync=torch.cuda.is_available())
        tokens0, t0 = trainer.tokens_seen, time.perf_counter()
        for _ in range(args.steps):
            trainer.run_step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        exchange = EP.EXCHANGE_TIMER.seconds
        EP.EXCHANGE_TIMER.enabled = False
        model = trainer.acc.unwrap_model(trainer.model)
        params = sum(p.numel() for p in model.parameters())
        if trainer.acc.is_main_process:
            print("BENCH_EP " + json.dumps({
                "world": world, "ep": args.ep, "tokens_per_s": (trainer.tokens_seen - tokens0) / wall,
                "step_s": wall / args.steps, "exchange_share": exchange / wall, "params_per_rank": params}), flush=True)
    close_process_group()


def _build_probe(args) -> None:
    """One build in this fresh process: BUILD_MEM {json} with the peak RSS growth."""
    import resource

    from omniloom.model import OmniModel
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train.expert_parallel import shard_range

    from . import train as bench

    cfg = load_config(args.preset, [f"model.vocab_size={bench._SYNTHETIC_VOCAB}",
                                    f"model.patch_token_id={bench._SYNTHETIC_PATCH_ID}", *args.overrides]).model
    if cfg.attention.backend == "flex" and not torch.cuda.is_available():
        cfg.attention.backend = "sdpa"  # the same parameters; flex refuses to build without CUDA
    held = shard_range(cfg.moe.num_experts, args.ep, 0) if args.ep > 1 else None
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    torch.manual_seed(0)
    model = OmniModel(cfg, expert_range=held)
    seconds = time.perf_counter() - t0
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024
    params = sum(p.numel() for p in model.parameters())
    print("BUILD_MEM " + json.dumps({"ep": args.ep, "peak_bytes": peak, "seconds": seconds, "params": params,
                                     "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}))


def _build_memory(args) -> int:
    rows = {}
    for ep in [1] + [w for w in args.worlds if w > 1]:
        cmd = [sys.executable, "-m", "omniloom.pretrain.bench.expert_parallel", "--build-probe", "--ep", str(ep),
               "--preset", args.preset, *args.overrides]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BUILD_MEM ")), None)
        if proc.returncode != 0 or line is None:
            print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
            raise SystemExit(f"bench_ep --build-memory: expert_parallel {ep} failed (exit {proc.returncode})")
        r = rows[ep] = json.loads(line[len("BUILD_MEM "):])
        what = "whole model" if ep == 1 else f"rank 0 of expert_parallel {ep}"
        ratio = "" if ep == 1 else f"  ({r['peak_bytes'] / rows[1]['peak_bytes']:.2f}x the whole model's peak)"
        print(f"{args.preset}, {what}: {r['params'] / 1e6:,.0f}M parameters ({r['param_bytes'] / 2**30:.2f} GiB), "
              f"peak RSS +{r['peak_bytes'] / 2**30:.2f} GiB, built in {r['seconds']:.1f}s{ratio}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniloom.pretrain.bench.expert_parallel", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--build-memory", action="store_true",
                   help="measure the peak memory and time of building the model, whole and as rank 0's expert shard")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--build-probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ep", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. data.seq_len=256")
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    if args.build_probe:
        _build_probe(args)
        return 0
    if args.build_memory:
        return _build_memory(args)
    rows = []
    for world in args.worlds:
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of every world size ({world})")
        for ep in (1, world):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
                   "-m", "omniloom.pretrain.bench.expert_parallel", "--worker", "--ep", str(ep), "--preset", args.preset,
                   "--global-batch", str(args.global_batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   *args.overrides]
            env = dict(os.environ)
            if not torch.cuda.is_available():
                env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world)))
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_EP ")), None)
            if proc.returncode != 0 or line is None:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                raise SystemExit(f"bench_ep: world {world}, expert_parallel {ep} failed (exit {proc.returncode})")
            rows.append(json.loads(line[len("BENCH_EP "):]))
            r = rows[-1]
            print(f"world {r['world']}  expert_parallel {r['ep']}:  {r['tokens_per_s'] / r['world']:9,.0f} tokens/s per "
                  f"process  step {1000 * r['step_s']:8.1f} ms  exchange {100 * r['exchange_share']:5.1f}% of the step  "
                  f"{r['params_per_rank'] / 1e6:.2f}M params per rank", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
