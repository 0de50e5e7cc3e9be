"""`omniloom demo`: the whole product on embedded defaults, from raw files to an exported model.

Each stage runs the same `omniloom ...` / `omniloom launch ...` command a user would type, in a
subprocess, and is skipped when its output is already complete, so an interrupted demo picks up
where it stopped. The stage list below is the demo; the summary at the end says where everything is.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .export.complete import incomplete_reason
from .rundir import CHECKPOINTS, METRICS, REPORT


@dataclass
class Stage:
    name: str
    argv: list[str]
    done_when: Path  # the stage is complete when this file exists
    env: dict[str, str] = field(default_factory=dict)
    also_done_when: tuple[Path, ...] = ()  # older names of the same output
    # names of the stages whose outputs this one reads; None: every stage listed before it. Stages
    # whose needs are met run side by side, as many as `demo_parallel` allows.
    needs: tuple[str, ...] | None = None
    # what is missing or cut off in the stage's output, None when it is whole; set where a file
    # existing is not enough (an export's config.json says nothing of its weights being whole)
    incomplete: Callable[[], str | None] | None = None

    def done(self) -> bool:
        if self.incomplete is not None:
            return self.done_when.exists() and self.incomplete() is None
        return self.done_when.exists() or any(p.exists() for p in self.also_done_when)


def _omniloom(*args: str) -> list[str]:
    return [sys.executable, "-m", "omniloom.pretrain.cli", *args]


def demo_threads(processes: int, env=None) -> list[str]:
    """`--threads N` for the one-process eval and generate stages: the training's share of the
    cores this process may use (affinity and cgroup quota, pretrain/runtime/threads.py), not every core.
    On a shared 2-core machine two threads per process run several times slower as soon as other
    jobs take a core (the one-process eval of 298 held-out documents: 110 s with 2 threads on a
    busy machine). Nothing when the user set OMP_NUM_THREADS: their choice wins. The training
    stage chooses for itself under the launcher (cores / processes, less its loader workers)."""
    from omniloom.pretrain.runtime.threads import available_cores

    env = os.environ if env is None else env
    if env.get("OMP_NUM_THREADS", "").strip():
        return []
    return ["--threads", str(max(1, available_cores() // max(1, processes)))]


def demo_parallel(processes: int, env=None) -> int:
    """How many one-process stages may run at once: the cores this process may use over the
    threads each stage takes (`demo_threads`, or the user's OMP_NUM_THREADS). The training runs
    alone whatever this says: every later stage needs its checkpoint."""
    from omniloom.pretrain.runtime.threads import available_cores

    env = os.environ if env is None else env
    cores = available_cores()
    try:
        threads = int(env.get("OMP_NUM_THREADS", "").strip() or 0)
    except ValueError:
        threads = 0
    if threads < 1:
        threads = max(1, cores // max(1, processes))
    return max(1, cores // threads)


def demo_stages(out: Path, *, steps: int, processes: int, overrides: list[str]) -> list[Stage]:
    from omniloom.pretrain.config.run import resolve_accelerate_config

    corpus, shards, tok, run, export = out / "corpus", out / "shards", out / "tokenizer", out / "run", out / "export"
    threads = demo_threads(processes)
    # omniloom launch: accelerate launch's arguments, with a scheduler's exit codes (Ctrl-C saves, exits 0)
    launch = [sys.executable, "-m", "omniloom.pretrain.runtime.launch"]
    if processes > 1:
        launch += ["--config_file", str(resolve_accelerate_config("cpu_2proc")), "--num_processes", str(processes)]
    else:
        launch += ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    train = corpus / "train"
    # Two shard sets mixed by weight: the synthetic captioned shapes and clips are short (~40
    # tokens) and the real stdlib code and docs long (~3,500), so per-document weights of 1000:1
    # give the captions about nine tenths of the tokens. At 250:1 (three quarters) the demo's
    # budget left shape and motion direction short; BENCHMARKS.md "Positions for images and video".
    train_overrides = [
        f"data.sources=[{{path: {shards / 'synthetic'}, weight: 1000}}, {{path: {shards / 'real'}, weight: 1}}]",
        f"data.eval_sources=[{{path: {shards / 'heldout'}}}]",
        f"data.tokenizer={tok}",
        f"train.run_dir={run}",
        f"train.num_steps={steps}",
        *overrides,
    ]
    return [
        Stage("demo corpus", _omniloom("data", "demo-corpus", "--out", str(corpus)), corpus / "README.txt"),
        # --shuffle: the inputs come grouped (all images, then all clips); in input order one rank
        # would read mostly images and the other mostly clips for long stretches (unequal work a
        # step, and each rank's stream one kind at a time)
        Stage("data build (synthetic)", _omniloom("data", "build", str(train / "shapes.jsonl"), str(train / "motion.jsonl"),
                                                  str(train / "interleaved.jsonl"), "--out", str(shards / "synthetic"),
                                                  "--name", "synthetic", "--workers", "2", "--shuffle", "0"),
              shards / "synthetic" / "manifest.json", needs=("demo corpus",)),
        Stage("data build (real files)", _omniloom("data", "build", str(train / "stdlib"), str(train / "docs"), str(train / "photos"),
                                                   "--out", str(shards / "real"), "--name", "real"),
              shards / "real" / "manifest.json", needs=("demo corpus",)),
        Stage("data build (held-out)", _omniloom("data", "build", str(corpus / "heldout"), "--out", str(shards / "heldout"),
                                                 "--name", "heldout"),
              shards / "heldout" / "manifest.json", needs=("demo corpus",)),
        Stage("tokenizer train", _omniloom("tokenizer", "train", "--data", str(shards / "synthetic"), str(shards / "real"),
                                           "--vocab-size", "2048", "--image-patch-budget", "16", "--video-frame-budget", "4",
                                           "--video-patch-budget", "16", "--out", str(tok), "--force"),  # redo a cut-off write
              tok / "omniloom_tokenizer.json", also_done_when=(tok / "tokenizer.json",),  # a demo_out from before the rename
              needs=("data build (synthetic)", "data build (real files)")),
        Stage("train (omniloom launch)", [*launch, "-m", "omniloom.pretrain.train", "--config", "demo",
                                            "--resume", "auto", *train_overrides],  # a re-run continues a cut-off training
              run / CHECKPOINTS / f"step_{steps:08d}"),
        Stage("eval", _omniloom("eval", str(run), "--data", str(shards / "heldout"), "--out", str(out / "eval.json"),
                                "--no-progress", "--captions", *threads), out / "eval.json",
              needs=("train (omniloom launch)",)),
        # export and generate run beside eval (one thread each); the report waits for eval.json
        # done when whole (export/complete.py), not when its config.json exists; --force redoes one
        # that is not (an export from before exports were moved into place whole; the demo owns that folder)
        Stage("export", _omniloom("export", str(run), "--out", str(export), "--force"), export / "config.json",
              needs=("train (omniloom launch)",), incomplete=lambda: incomplete_reason(export)),
        Stage("generate from an image", _omniloom("generate", str(export), "--image", str(_first_heldout_image(corpus)),
                                                  "--prompt", "", "--max-new-tokens", "16", "--out", str(out / "generate.txt"),
                                                  *threads),
              out / "generate.txt", needs=("export",)),
        Stage("report", _omniloom("report", str(run), "--eval", str(out / "eval.json")), run / REPORT / "index.html",
              needs=("eval",)),
    ]


def _first_heldout_image(corpus: Path) -> Path:
    return corpus / "heldout" / "shapes" / "000000.png"


def run_demo(out: Path, *, steps: int, processes: int, overrides: list[str], fresh: bool) -> int:
    if fresh and out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    began = time.time()
    stages = demo_stages(out, steps=steps, processes=processes, overrides=overrides)
    needs, finished, pending = {}, set(), []
    for i, stage in enumerate(stages):
        needs[stage.name] = set(stage.needs if stage.needs is not None else (s.name for s in stages[:i]))
        if stage.done():
            print(f"[demo] {stage.name}: already done ({stage.done_when})", flush=True)
            finished.add(stage.name)
        else:
            pending.append(stage)
    slots = demo_parallel(processes, env)
    running: dict[str, tuple[Stage, subprocess.Popen, float]] = {}
    timings: dict[str, float] = {}
    failed: tuple[Stage, int] | None = None
    try:
        while pending or running:
            # start, in list order, every stage whose inputs are ready while there is a free slot;
            # after a failure nothing new starts, the running stages finish
            for stage in list(pending):
                if failed is not None or len(running) >= slots:
                    break
                if needs[stage.name] <= finished:
                    print(f"[demo] {stage.name}: {' '.join(shlex.quote(a) for a in stage.argv)}", flush=True)
                    running[stage.name] = (stage, subprocess.Popen(stage.argv, env={**env, **stage.env}), time.time())
                    pending.remove(stage)
            if not running:
                break
            time.sleep(0.02)
            for name, (stage, proc, start) in list(running.items()):
                code = proc.poll()
                if code is None:
                    continue
                del running[name]
                timings[name] = round(time.time() - start, 1)
                if code == 0 and stage.done():
                    finished.add(name)
                elif failed is None:
                    failed = (stage, code)
    except KeyboardInterrupt:
        # Ctrl-C reached the stages too (same process group): each does what it does on SIGINT
        # (the training finishes its step, saves a checkpoint and exits 0). They are waited for,
        # not killed as `subprocess.run` would after 0.25 s; a second Ctrl-C kills them.
        print("[demo] interrupted: letting the running stage(s) stop cleanly (Ctrl-C again to kill them)",
              file=sys.stderr, flush=True)
        _wait_all([proc for _, proc, _ in running.values()])
        print(f"[demo] stopped during {', '.join(running)}: finished stages are kept (a cut-off training resumes "
              f"from its last checkpoint); run `omniloom demo --out {out}` again to continue.", file=sys.stderr)
        return 130
    if failed is None and pending:  # a stage list whose needs cannot be met: a bug in demo_stages
        raise RuntimeError(f"demo stages never ready: {[s.name for s in pending]}")
    if failed is not None:
        stage, code = failed
        if code == 0:  # the training stopped by a signal (it saved and exited 0)
            print(f"[demo] {stage.name} stopped before its end ({stage.done_when.name} is not there): finished "
                  f"stages are kept; run `omniloom demo --out {out}` again to continue.", file=sys.stderr)
            return 130
        print(f"[demo] {stage.name} failed with exit code {code}; fix the error above and run "
              f"`omniloom demo --out {out}` again: finished stages are kept.", file=sys.stderr)
        return code
    _summary(out, timings, wall=time.time() - began)
    return 0


def _wait_all(procs: list[subprocess.Popen]) -> None:
    """Wait for every process; a second Ctrl-C kills the ones still running (and is not raised)."""
    try:
        for proc in procs:
            proc.wait()
    except KeyboardInterrupt:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()


def _summary(out: Path, timings: dict, wall: float | None = None) -> None:
    print("\n=== omniloom demo: done ===")
    for label, rel in (("corpus", "corpus"), ("shards", "shards"), ("tokenizer", "tokenizer"), ("run", "run"),
                       ("export", "export"), ("report", "run/report/index.html")):
        print(f"  {label:10s} {out / rel}")
    eval_path = out / "eval.json"
    if eval_path.exists():
        ev = json.loads(eval_path.read_text())
        def fmt(values: dict, sign: str = "") -> str:  # 4 significant digits, not 16
            return ", ".join(f"{k} {'n/a' if v is None else format(v, sign + '.4g')}" for k, v in sorted(values.items()))

        if "loss" in ev:
            docs = (ev.get("counts") or {}).get("docs")
            print(f"  held-out loss (omniloom eval{f', {docs} documents' if docs else ''}, nats/token): {fmt(ev['loss'])}")
        if "cross_modal_gap" in ev:
            from omniloom.pretrain.inference.evaluate import describe_gap

            detail = ev.get("cross_modal_gap_detail") or {}
            print("  cross-modal gap (nats/token; > 0: the model reads its pixels): "
                  + "; ".join(f"{k} {describe_gap(v, detail.get(k))}" for k, v in sorted(ev["cross_modal_gap"].items())))
        cap = ev.get("captions") or {}
        if cap.get("exact"):
            docs = cap.get("docs") or {}
            print("  exact captions from the pixels alone (greedy, held-out): "
                  + ", ".join(f"{k} {v:.1%} of {docs.get(k)}" for k, v in cap["exact"].items()))
            for kind, rows in (cap.get("attributes") or {}).items():
                print(f"    {kind}: " + ", ".join(f"{a} {r['accuracy']:.0%} (majority {r['majority']:.0%})" for a, r in rows.items()))
            probes = [(name, attr, p) for name, p in (cap.get("probes") or {}).items()
                      for attr in ("column", "row", "direction") if f"{attr}_changed" in p]
            if probes:
                print("    probes: " + ", ".join(f"{name} changes the {attr} word in {p[attr + '_changed']:.0%}"
                                              for name, attr, p in probes))
    metrics = out / "run" / METRICS
    if metrics.exists():
        from .rundir import read_metrics

        evals = [r for r in read_metrics(metrics) if any(k.startswith("eval/loss/") for k in r)]
        if len(evals) >= 2:
            first, last = evals[0], evals[-1]
            mods = sorted(k.split("/")[-1] for k in last if k.startswith("eval/loss/"))
            print(f"  held-out loss, untrained (step {first['step']}) -> trained (step {last['step']}): "
                  + ", ".join(f"{m} {first.get('eval/loss/' + m, float('nan')):.2f} -> {last['eval/loss/' + m]:.2f}" for m in mods))
    gen = out / "generate.txt"
    if gen.exists():
        print(f"  generated from an image: {gen.read_text().strip()[:200]!r}")
        held = out / "corpus" / "heldout" / "shapes.jsonl"
        if held.exists():  # the image is the first held-out shape; its caption was never trained on
            caption = json.loads(held.read_text(encoding="utf-8").splitlines()[0])["meta"]["caption"]
            print(f"  its true caption:         {caption!r}")
    if timings:
        print("  stage seconds: " + ", ".join(f"{k}={v}" for k, v in timings.items())
              + ("" if wall is None else f"; wall {wall:.1f} (stages whose inputs are ready run side by side)"))


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="run the whole pipeline on an embedded demo corpus (CPU; 4-6 minutes on a 2-core machine with little else running)",
        description="Demo corpus -> data build -> tokenizer train -> `omniloom launch` (accelerate) training of a tiny "
        "sparse-attention MoE -> eval (held-out loss, cross-modal gap, captions from the pixels) -> export -> "
        "generate from an image -> HTML report. Takes 4-6 minutes on a 2-core machine with little else running "
        "(measured: 3 min 58 s to 4 min 2 s on one machine, 5 min 42 s on another 2-core machine on another day; "
        "training is about 90% of it; BENCHMARKS.md), several times longer when other jobs share the "
        "cores. Training shows a progress bar on a terminal, else a line every 30 s (step, loss, tokens/s, "
        "time left). After training, eval runs beside export and generate when the cores allow (one "
        "thread each). Finished stages are skipped on a re-run (use --fresh to start over).",
    )
    p.add_argument("--out", default="demo_out", help="folder for every artifact (default: ./demo_out)")
    p.add_argument("--steps", type=int, default=1000, help="training steps (default 1000; a step is 2 packed 512-token sequences per process)")
    p.add_argument("--processes", type=int, default=2, help="data-parallel training processes (default 2)")
    p.add_argument("--fresh", action="store_true", help="delete --out first")
    p.add_argument("overrides", nargs="*", help="extra dotted config overrides for training, e.g. model.num_layers=2")
    p.set_defaults(func=lambda a: run_demo(Path(a.out), steps=a.steps, processes=a.processes, overrides=a.overrides, fresh=a.fresh))
