"""The GPU rows of BENCHMARKS.md that are still unmeasured (issues 13 and 17), in one command
sized for a lent H200, most important first:

    python -m omniloom.pretrain.bench.gpu_rows [--out DIR] [--budget-s 560] [--only NAME,...] [--list]

Each row runs in its own process under its own time limit, so one slow compile or a hang cannot
eat the rows after it; a row that would start with less than a minute of the budget left is
skipped and says so. Every row's full output goes to DIR/NAME.txt, and a summary (each row's
command, exit status, seconds and last lines) to DIR/rows.txt. Exit status: 0 when every row
that ran exited 0, else 1.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

CLI = [sys.executable, "-m", "omniloom.pretrain.cli"]
MIN_START_S = 60.0  # a row is not started with less than this left of the budget

# (name, argv after the python executable, time limit in seconds, what it measures)
ROWS: list[tuple[str, list[str], int, str]] = [
    ("large_1b", [*CLI, "bench", "train", "--steps", "5", "--warmup", "2", "large_1b", "model.vocab_size=32768",
                  "train.grad_accum_steps=1"], 140,
     "issue 13: the real 24-layer preset's tokens/s and MFU (target >= 30%), step-time breakdown"),
    ("step_speed", [sys.executable, "-m", "omniloom.pretrain.bench.gpu_check", "--only", "5", "--budget-s", "120"], 150,
     "issue 13: host syncs per step, flex L vs G at 4k/16k/64k, recompiles after warm-up, d1024 equal math vs HF"),
    ("data_stream", [*CLI, "bench", "stream", "--workers", "14", "--docs", "4000", "--batches", "160"], 90,
     "issue 13: does the data path (shards, decode, tokenize, pack, 14 DataLoader workers on this machine's cores) "
     "keep up with the large_1b row's tokens/s? (a synthetic mixed corpus with images and videos)"),
    ("attention_64k", [*CLI, "bench", "model", "--skip-moe", "--kinds", "LGB", "--backends", "flex",
                       "--seq-lens", "8192,16384,32768,65536", "--block-size", "128", "--selected", "16",
                       "--window", "2048", "--selector", "indexer", "--iters", "3"], 100,
     "issue 17: B and L against G at 8k-64k, forward + backward (target B, L >= 5x faster than G at 64k)"),
    ("kernels", [*CLI, "bench", "kernels", "--compile", "--skip-ce-memory", "--no-memory"], 150,
     "issue 13: every Triton kernel against eager (target >= 1.3x) and against torch.compile of its reference"),
    ("large_1b_compiled_kernels", [*CLI, "bench", "train", "--steps", "5", "--warmup", "2", "large_1b",
                                   "model.vocab_size=32768", "train.grad_accum_steps=1", "model.kernels=compiled"], 140,
     "issue 13: the first row with the element-wise ops under torch.compile instead of Triton "
     "(model.kernels=compiled): which is faster for a whole step"),
    ("long_64k", [*CLI, "bench", "train", "--steps", "2", "--warmup", "1", "--seq-lens", "8192,16384,32768,65536",
                  "long_64k", "model.attention.dense_warmup_steps=0", "train.compile=false", "train.grad_accum_steps=1"], 150,
     "issue 17: long_64k training steps with sparse B layers at 8k-64k tokens, step time per doubling "
     "(eager blocks: compile time is unknown)"),
    ("decode", [*CLI, "bench", "decode", "--contexts", "8192,32768,131072"], 60,
     "issue 17: KV-cache memory and decode tokens/s at 8k-128k against a full-attention cache"),
    ("long_64k_compiled", [*CLI, "bench", "train", "--steps", "2", "--warmup", "1", "--seq-lens", "8192,65536",
                           "long_64k", "model.attention.dense_warmup_steps=0", "train.compile=true",
                           "train.grad_accum_steps=1"], 240,
     "issues 13/17: the long_64k row with compiled, checkpointed blocks (every kind compiles whole): "
     "is compile faster, and what does it cost to compile (the warm-up step)"),
]


def run_rows(rows, out_dir: str, budget_s: float, min_start_s: float = MIN_START_S, env=None) -> list[dict]:
    """Run `rows` in order, each under min(its limit, what is left of the budget); return one
    dict per row (name, rc or None when skipped, seconds, timed_out)."""
    os.makedirs(out_dir, exist_ok=True)
    summary_path = os.path.join(out_dir, "rows.txt")
    t_start = time.monotonic()
    results = []
    for name, argv, limit, what in rows:
        left = budget_s - (time.monotonic() - t_start)
        with open(summary_path, "a") as summary:
            summary.write(f"== {name}: {what}\n   $ {' '.join(argv)}\n")
            if left < min_start_s:
                summary.write(f"   skipped: {left:.0f} s of the budget left (needs {min_start_s:.0f})\n")
                print(f"[{name}] skipped: budget spent", flush=True)
                results.append(dict(name=name, rc=None, seconds=0.0, timed_out=False))
                continue
        cap = min(float(limit), left)
        print(f"[{name}] {what} (limit {cap:.0f} s)", flush=True)
        t0 = time.monotonic()
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
            try:
                rc, timed_out = proc.wait(timeout=cap), False
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                rc, timed_out = proc.returncode, True
        secs = time.monotonic() - t0
        with open(os.path.join(out_dir, f"{name}.txt")) as f:
            tail = f.read().splitlines()[-25:]
        with open(summary_path, "a") as summary:
            summary.write(f"   rc {rc}{' (time limit)' if timed_out else ''} in {secs:.0f} s\n")
            summary.writelines(f"   | {line}\n" for line in tail)
        print(f"[{name}] rc {rc}{' (time limit)' if timed_out else ''} in {secs:.0f} s", flush=True)
        print("\n".join(tail), flush=True)
        results.append(dict(name=name, rc=rc, seconds=secs, timed_out=timed_out))
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniloom.pretrain.bench.gpu_rows", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "") or "gpu_rows_out", help="folder for the outputs")
    p.add_argument("--budget-s", type=float, default=560.0, help="seconds for all rows together")
    p.add_argument("--only", default="", help="comma-separated row names to run (see --list)")
    p.add_argument("--list", action="store_true", help="print the rows and their commands, run nothing")
    args = p.parse_args(argv)
    rows = ROWS
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(names) - {r[0] for r in ROWS})
        if unknown:
            p.error(f"unknown row(s) {', '.join(unknown)}; choose from {', '.join(r[0] for r in ROWS)}")
        rows = [r for r in ROWS if r[0] in names]
    if args.list:
        for name, cmd, limit, what in rows:
            print(f"{name} ({limit} s): {what}\n  {' '.join(cmd)}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_rows times GPU rows and needs a CUDA device (see --list for the commands)", file=sys.stderr)
        return 2
    results = run_rows(rows, args.out, args.budget_s)
    return 0 if all(r["rc"] in (0, None) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
