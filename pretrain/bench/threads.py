"""`omniloom bench threads`: the default thread count against every --threads value, idle and busy.

The measurements run in fresh processes (`python -m omniloom.pretrain.bench.threads --worker
...`) that start as a user's `omniloom eval`, `generate` or `train` does: `import omniloom.pretrain`
sets OpenMP's wait policy before torch loads, and each workload's default thread count is chosen
as its command chooses it (pretrain/runtime/threads.py: the count from the cores, then kept or dropped for 1
thread by timing the first units of work); then the workload is timed at each --threads
value (the default's count among them) in turn, four times round, so that every setting sees the
same machine. The workloads, on the `tiny` preset's model with random weights:

- eval: one document of 512 tokens per forward, batch 1, no gradient (what `omniloom eval` does);
- generate: greedy decoding of 16 tokens with the KV cache after a 64-token prompt (`omniloom generate`);
- train: the Trainer's steps on synthetic batches (`omniloom train tiny`, batch 2 x 512).

Every workload runs with the default, with each --threads value, and once the way it ran before
this policy (libgomp's spinning waits, GOMP_SPINCOUNT=300000, with one thread per core); first
with nothing else of ours running ("idle": on a shared machine other jobs still run), then with
one busy process per core beside it ("busy"). Printed: the figure per setting and the default's
time over the best --threads value's time, against the targets (within 1.1x idle, 1.3x busy).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WORKLOADS = ("eval", "generate", "train")
TARGETS = {"idle": 1.1, "busy": 1.3}
SPIN = {"GOMP_SPINCOUNT": "300000"}  # libgomp's own default: threads spin ~300k rounds before sleeping


def _model_config():
    from omniloom.pretrain.config.run import load_config

    from .train import synthetic_config

    return synthetic_config(load_config("tiny")).model


def _eval_step():
    """One eval-like forward per call: (work done, unit)."""
    import torch

    from omniloom.data.batch import PackedBatch
    from omniloom.model import OmniModel
    from omniloom.model.synthetic import random_packed_batch
    from omniloom.pretrain.train import build as B

    cfg = _model_config()
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    batch = PackedBatch(**random_packed_batch(cfg, batch_size=1, seq_len=512, docs_per_row=1, seed=0))
    layout = model.batch_layout(batch.doc_ids, batch.block_ids)

    @torch.no_grad()
    def step() -> int:
        B.forward(model, batch, layout=layout)
        return 1
    return step


def tiny_text_prompt(prompt_tokens: int = 64):
    """The `tiny` model with random weights (seed 0) and a random text prompt: (model, Prompt)."""
    import torch

    from omniloom.model import OmniModel
    from omniloom.pretrain.inference.generate import random_text_prompt

    cfg = _model_config()
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    return model, random_text_prompt(cfg.vocab_size, prompt_tokens, max(cfg.patch_dim, cfg.tubelet_dim))


def _generate_step():
    from omniloom.pretrain.inference.generate import generate

    model, prompt = tiny_text_prompt(64)

    def step() -> int:  # the prompt's prefill included, as in `omniloom generate`
        return len(generate(model, prompt, max_new_tokens=16, use_cache=True, eos_id=-1).ids)
    return step


def _train_step(tmp: str, threads: int):
    from .train import bench_trainer

    # batch 2 (tiny's is 4): the spinning "before" row takes tens of seconds per step beside busy cores
    trainer = bench_trainer("tiny", [f"train.num_threads={threads}", "data.batch_size=2"], run_dir=tmp, num_steps=1_000_000)

    def step() -> int:
        trainer.run_step()
        return 1
    return step


UNITS = {"eval": ("ms/doc", True), "generate": ("tokens/s", False), "train": ("ms/step", True)}


def _timed(step, seconds: float, lower_is_better: bool, *, warmup: bool = True) -> float:
    """Run `step` for `seconds` (at least once), after one warm-up call; ms per unit of work, or work per second."""
    if warmup:
        step()
    work, t0 = 0, time.perf_counter()
    while work < 1 or time.perf_counter() - t0 < seconds:
        work += step()
    wall = time.perf_counter() - t0
    return wall / work * 1000 if lower_is_better else work / wall


def _worker(workloads: list[str], settings: list[int], seconds: float, rounds: int, warmup: bool = True) -> dict:
    """Measure each workload in this (fresh) process: first the thread count its command would
    choose here (settings[0] == 0) or settings[0], then every setting, `rounds` times in turn so
    that every setting sees the same machine. Returns per workload {"unit", "lower_is_better",
    "values": {threads: median over the rounds}, "spread": {threads: largest over smallest round},
    "chosen": the count the command chose, "reason"}."""
    import tempfile

    import torch

    from omniloom.pretrain.runtime import threads as T
    from omniloom.pretrain.runtime.threads import choose_threads, configure_threads, wait_policy

    out = {}
    with tempfile.TemporaryDirectory(prefix="omniloom-bench-threads-") as tmp:
        for workload in workloads:
            unit, lower = UNITS[workload]
            if workload == "train":  # the Trainer chooses (train.num_threads) as `omniloom train` does
                step = _train_step(tmp, settings[0])
            else:  # as `omniloom eval` / `generate` do, before loading the model
                configure_threads(settings[0], option="--threads", quiet=True, tune=True)
                step = _eval_step() if workload == "eval" else _generate_step()
            started = torch.get_num_threads()
            # the command's own choice: it times its first units of work (threads.ThreadTuner) until it keeps a count
            for _ in range(1000):
                if T._TUNER is None or T._TUNER.chosen is not None:
                    break
                if workload == "generate":  # generate() times its decode steps itself
                    step()
                else:  # one eval forward or one optimizer step is the unit, as in `omniloom eval` / `train`
                    with T.tuned():
                        step()
            chosen = torch.get_num_threads()
            counts = sorted({chosen, *(s for s in settings if s)})
            got: dict[int, list[float]] = {n: [] for n in counts}
            for i in range(rounds):
                for n in counts:
                    torch.set_num_threads(n)
                    got[n].append(_timed(step, seconds / rounds, lower, warmup=warmup and i == 0))
            out[workload] = {"unit": unit, "lower_is_better": lower,
                             "values": {str(n): statistics.median(v) for n, v in got.items()},
                             "spread": {str(n): max(v) / min(v) for n, v in got.items()}, "chosen": chosen,
                             "reason": f"{choose_threads(0, num_workers=0).reason}: started at {started}"
                                       + (f", timed {', '.join(f'{k}: {1e3 * statistics.median(v):.3g} ms' for k, v in T._TUNER.times.items())}"
                                          f" per unit, kept {chosen}" if T._TUNER is not None else "")
                                       + f"; waiting threads: {wait_policy()}"}
    return out


def _measure(workloads: list[str], settings: list[int], seconds: float, rounds: int, *, warmup: bool = True,
             env_extra: dict | None = None) -> dict:
    env = dict(os.environ)
    for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME"):
        env.pop(k, None)  # each run starts as a user's plain command would
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "omniloom.pretrain.bench.threads", "--worker", ",".join(workloads),
           "--settings", ",".join(map(str, settings)), "--seconds", str(seconds), "--rounds", str(rounds)]
    res = subprocess.run(cmd + ([] if warmup else ["--no-warmup"]), env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"bench threads: the worker failed: {res.stderr.strip()[-800:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


class _Hogs:
    """One busy process per core (a Python loop), started on enter and ended on exit."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(self.n)]
        time.sleep(0.5)  # let them take their cores
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.wait()


def thread_values(cores: int) -> list[int]:
    """1, 2, 4, ... up to the cores this process may use, and that count itself."""
    values, n = [], 1
    while n < cores:
        values.append(n)
        n *= 2
    return values + [cores]


def run(args) -> int:
    from omniloom.pretrain.runtime.threads import available_cores

    cores = available_cores()
    values = [int(v) for v in args.threads.split(",")] if args.threads else thread_values(cores)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown or not workloads:
        raise ValueError(f"--workloads takes a comma-separated subset of {','.join(WORKLOADS)}, got {args.workloads!r}")
    if min(values) < 1:
        raise ValueError(f"--threads values must be >= 1, got {args.threads!r}")
    conditions = ["idle"] if args.idle_only else ["idle", "busy"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    print(f"bench threads: {cores} core(s) for this process; settings: the default, --threads {', '.join(map(str, values))}, "
          f"and spinning waits (GOMP_SPINCOUNT=300000) with {cores} threads (before, one pass); {args.seconds:g} s per "
          f"setting in {args.rounds} round(s), in fresh processes (the default chosen as the command chooses it)")
    if load is not None:
        print(f"  load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1/5/15 min): 'idle' means no busy "
              "process of this benchmark's own; other jobs on a shared machine still run")
    t_start = time.perf_counter()
    verdicts, reasons = [], []
    for condition in conditions:
        with _Hogs(cores if condition == "busy" else 0):
            print(f"\n{condition}" + (f" ({cores} busy process(es) beside each run)" if condition == "busy" else ""))
            header = ["workload", "default", *[f"--threads {v}" for v in values], "before", "default / best", "noise"]
            rows = []
            results = _measure(workloads, [0, *values], args.seconds, args.rounds)
            # the way it ran before: one pass, no warm-up (a spinning step can take half a minute here)
            before = _measure(workloads, [cores], 0.0, 1, warmup=False, env_extra=SPIN)
            for workload in workloads:
                res = results[workload]
                vals, lower, chosen = res["values"], res["lower_is_better"], res["chosen"]
                cost = (lambda x: x) if lower else (lambda x: 1.0 / x)
                best_v = min(values, key=lambda v: cost(vals[str(v)]))
                ratio = cost(vals[str(chosen)]) / cost(vals[str(best_v)])
                ok = ratio <= TARGETS[condition]
                verdicts.append((condition, workload, ratio, ok))
                rows.append([f"{workload} ({res['unit']})", f"{chosen} threads", *[f"{vals[str(v)]:.1f}" for v in values],
                             f"{before[workload]['values'][str(cores)]:.1f}",
                             f"{ratio:.2f}x ({'ok' if ok else 'over'} {TARGETS[condition]}x; best --threads {best_v})",
                             f"{max(res['spread'].values()):.2f}x"])
                reasons.append(f"{condition} {workload}: default {chosen} thread(s): {res['reason']}")
            widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
            for r in [header, *rows]:
                print("  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
    print("\nfigures: medians over the rounds; default: the count the command kept after timing its first units of work\n"
          "(1 thread against the count from the cores), timed as --threads of that count (the same process, the same\n"
          "configuration; the units it spent timing are not in the figure); noise: the largest over the smallest round of any setting\n"
          "(one setting measured again: ratios below it are not distinguishable on this machine)")
    print("why the default chose its count (each worker's own line):")
    for line in reasons:
        print(f"  {line}")
    missed = [f"{c} {w} {r:.2f}x" for c, w, r, ok in verdicts if not ok]
    print(f"\ntargets (default within {TARGETS['idle']}x of the best --threads idle, {TARGETS['busy']}x busy): "
          + ("all met" if not missed else "missed: " + ", ".join(missed))
          + f"; {time.perf_counter() - t_start:.0f} s in all")
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=2.0, help="seconds of work per setting, split over the rounds (default 2)")
    p.add_argument("--rounds", type=int, default=4, help="times each setting is measured in turn, in one process (default 4)")
    p.add_argument("--threads", default="", help="comma-separated --threads values to compare (default 1, 2, 4, ... up to the cores)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)} (default all)")
    p.add_argument("--idle-only", action="store_true", help="skip the runs with one busy process per core")


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("threads", help="default thread count vs every --threads value, idle and with busy cores",
                             description=(__doc__ or "").strip().split("\n\n")[0])
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    """The worker a measurement runs in (`--worker WORKLOAD`); prints one JSON line."""
    p = argparse.ArgumentParser(prog="python -m omniloom.pretrain.bench.threads")
    p.add_argument("--worker", required=True, help="comma-separated workloads")
    p.add_argument("--settings", default="0", help="comma-separated thread counts; 0: the default choice")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--no-warmup", action="store_true")
    args = p.parse_args(argv)
    settings = [int(v) for v in args.settings.split(",")]
    print(json.dumps(_worker(args.worker.split(","), settings, args.seconds, args.rounds, warmup=not args.no_warmup)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
