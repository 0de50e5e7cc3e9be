"""`omniloom bench arch`: the architecture comparison of issue 42, at equal training FLOPs.

Each *arm* is a set of config overrides on one preset (arms are data: `ARMS`, plus `--arm NAME:K=V,...`):

- `early_moe`: native early fusion with MoE FFNs, the preset as it is;
- `early_dense`: every FFN dense, at the MoE's active compute (`model.moe.num_experts=0`,
  `model.moe.dense_dim` from `dense_equal_active_width`);
- `late_moe`: late fusion (`model.vision_encoder.enabled=true`; its FLOPs per token add the
  encoder's, for the share of patch tokens and the block length measured on the training stream,
  `measure_visual_mix`); skipped, with a line saying so,
  where this omniloom's config has no such key;
- `moe_grouping` / `moe_no_grouping`: MoE with and without modality groups (`model.moe.modality_groups`);
- `text_first`: a text-first start, `data.text_first_steps` = `TEXT_FIRST_SHARE` of its steps.

Every arm trains on the same data for the same training FLOPs: its steps are the budget over its
own FLOPs per token (model/accounting.py, what `OmniModel.flops_per_token` reports) times the
tokens of a step, so a bigger arm trains fewer steps (`equal_flops_steps`). Each (arm, size, seed)
is a real `omniloom train` run in `OUT/runs/`, then `omniloom eval --captions` on the held-out shards;
a point whose `result.json` exists is not run again, and a cut-off training continues
(`--resume auto`), so a killed bench reruns only what is unfinished. Arms whose resolved configs
are identical (moe_no_grouping is early_moe when the preset has no modality groups) train once.
`--sizes` trains the fusion arms at several model widths; with the evaluations during training,
that gives held-out loss against training FLOPs per arm (`arch_report.py`: table and plot).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

TEXT_FIRST_SHARE = 0.3  # of an arm's steps trained on text and code only


@dataclass(frozen=True)
class Arm:
    """One arm of the comparison: overrides on the preset, and how its config is derived."""

    name: str
    overrides: tuple[str, ...] = ()
    about: str = ""
    fusion: bool = False  # trained at every --sizes width
    dense_equal_active: bool = False  # dense FFNs matched to the MoE's active parameters
    text_first: float = 0.0  # share of the steps before the switch to the full mix


ARMS = {a.name: a for a in (
    Arm("early_moe", (), "native early fusion, MoE (the preset)", fusion=True),
    Arm("early_dense", (), "dense FFNs at the MoE's active compute", dense_equal_active=True),
    Arm("late_moe", ("model.vision_encoder.enabled=true",), "late fusion: a vision encoder before the decoder", fusion=True),
    Arm("moe_grouping", ("model.moe.modality_groups=true",), "MoE with modality expert groups"),
    Arm("moe_no_grouping", ("model.moe.modality_groups=false",), "MoE without modality expert groups"),
    Arm("text_first", (), f"text and code only for the first {TEXT_FIRST_SHARE:.0%} of the steps", text_first=TEXT_FIRST_SHARE),
)}
DEFAULT_ARMS = ("early_moe", "early_dense", "late_moe", "moe_grouping", "moe_no_grouping", "text_first")


def parse_arm(text: str) -> Arm:
    """`NAME:key=value,key=value` (a custom arm) or the name of one of ARMS."""
    if ":" not in text:
        if text not in ARMS:
            raise ValueError(f"unknown arm '{text}'; arms: {', '.join(ARMS)} (or NAME:key=value,... for your own)")
        return ARMS[text]
    name, _, spec = text.partition(":")
    overrides = tuple(o.strip() for o in spec.split(",") if o.strip())
    if not name or not all("=" in o for o in overrides):
        raise ValueError(f"--arm takes NAME:key=value[,key=value...], got '{text}'")
    return Arm(name, overrides, "custom: " + " ".join(overrides))


def equal_flops_steps(budget_flops: float, flops_per_token: float, tokens_per_step: int) -> int:
    """Steps that spend `budget_flops` training FLOPs (rounded to the nearest, at least 1)."""
    if not (budget_flops > 0 and flops_per_token > 0 and tokens_per_step > 0):
        raise ValueError(f"a FLOPs budget, FLOPs per token and tokens per step must be positive, got "
                         f"{budget_flops}, {flops_per_token}, {tokens_per_step}")
    return max(1, round(budget_flops / (flops_per_token * tokens_per_step)))


def dense_equal_active_width(model_cfg) -> int:
    """`model.moe.dense_dim` of an all-dense model (num_experts=0) whose active parameters match
    `model_cfg`'s, the closest integer (active parameters are linear in the dense width: every
    layer gets 3 x dim x width). The first num_dense_layers, dense already, are counted in."""
    from omniloom.model.accounting import num_active_params

    target = num_active_params(model_cfg)
    moe = dataclasses.replace(model_cfg.moe, num_experts=0)

    def active(width: int) -> int:
        return num_active_params(dataclasses.replace(model_cfg, moe=dataclasses.replace(moe, dense_dim=width)))

    slope = active(2) - active(1)  # 3 x dim x num_layers
    return max(1, round(1 + (target - active(1)) / slope))


def size_overrides(model_cfg, dim: int) -> list[str]:
    """Overrides for a model of width `dim` with the preset's head width and proportions (heads,
    kv heads, expert and dense widths scale with dim)."""
    hd = model_cfg.dim // model_cfg.num_heads
    if dim % hd:
        raise ValueError(f"--sizes: width {dim} is not a multiple of the preset's head width {hd}")
    heads = dim // hd
    kv = max(1, heads * model_cfg.num_kv_heads // model_cfg.num_heads)
    while heads % kv:
        kv -= 1
    scale = dim / model_cfg.dim
    return [f"model.dim={dim}", f"model.num_heads={heads}", f"model.num_kv_heads={kv}",
            f"model.moe.expert_dim={max(8, round(model_cfg.moe.expert_dim * scale))}",
            f"model.moe.dense_dim={max(8, round(model_cfg.moe.dense_dim * scale))}"]


@dataclass
class Point:
    """One (arm, size, seed) run as planned."""

    arm: str
    size: int | None
    seed: int
    overrides: list[str]
    steps: int
    flops_per_token: float
    tokens_per_step: int
    params: int
    active_params: int
    key: str = ""  # the resolved config (run folder aside): identical keys train once
    same_as: str = ""
    figures: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.arm if self.size is None else f"{self.arm}@{self.size}"

    @property
    def train_flops(self) -> float:
        return float(self.steps) * self.tokens_per_step * self.flops_per_token


def _resolve(preset: str, overrides: list[str]):
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train import build as B

    return B.resolve_model_config(load_config(preset, overrides))


def measure_visual_mix(cfg, batches: int = 16) -> tuple[float, int]:
    """(share of row slots that are patches, token-weighted mean visual block length) over the
    first batches of the training stream: what a vision encoder's FLOPs per token depend on (the
    same data for every arm; row slots as tokens_per_step counts them, padding included)."""
    import torch

    from omniloom.pretrain.train import build as B

    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_workers=0))
    it = iter(B.build_loader(cfg, "train", 0, 1))
    slots = patches = squares = 0
    try:
        for _ in range(batches):
            batch = next(it, None)
            if batch is None:
                break
            slots += batch.block_ids.numel()
            for row in batch.block_ids:
                ids = row[row >= 0].long()
                if ids.numel():
                    counts = torch.bincount(ids)
                    counts = counts[counts > 0]
                    patches += int(counts.sum())
                    squares += int((counts * counts).sum())
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()
    return patches / max(slots, 1), (round(squares / patches) if patches else 0)


def plan_point(preset: str, base: list[str], arm: Arm, size: int | None, seed: int, budget: float,
               visual: tuple[float, int] = (0.0, 0)) -> Point:
    """The overrides and step count of one run; ConfigError when the config lacks an arm's key.
    `visual`: measure_visual_mix's figures, which a vision encoder's FLOPs per token need."""
    from omniloom.model.accounting import flops_per_token, num_active_params, num_params
    from omniloom.pretrain.config.io import to_yaml

    overrides = list(base)
    if size is not None:
        overrides += size_overrides(_resolve(preset, overrides).model, size)
    overrides += list(arm.overrides) + [f"train.seed={seed}", f"data.seed={seed}"]
    cfg = _resolve(preset, overrides)
    if arm.dense_equal_active:
        overrides += ["model.moe.num_experts=0", f"model.moe.dense_dim={dense_equal_active_width(cfg.model)}"]
        cfg = _resolve(preset, overrides)
    seq = cfg.data.seq_len
    fpt = flops_per_token(cfg.model, seq, visual_fraction=visual[0], visual_block_len=visual[1])
    tokens = seq * cfg.data.batch_size * cfg.train.grad_accum_steps
    steps = equal_flops_steps(budget, fpt, tokens)
    if arm.text_first:
        overrides.append(f"data.text_first_steps={max(1, round(arm.text_first * steps))}")
    overrides.append(f"train.num_steps={steps}")
    cfg = _resolve(preset, overrides)
    key = to_yaml(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir="")))
    return Point(arm.name, size, seed, overrides, steps, fpt, tokens, num_params(cfg.model),
                 num_active_params(cfg.model), key=key)


def plan(preset: str, base: list[str], arms: list[Arm], sizes: list[int], seeds: int, budget: float,
         say=print) -> list[Point]:
    """Every run of the comparison; an arm the config cannot express is skipped with one line."""
    from omniloom.pretrain.config.io import ConfigError

    points: list[Point] = []
    seen: dict[str, str] = {}
    visual = (0.0, 0)
    if any(any(o.startswith("model.vision_encoder.enabled=true") for o in arm.overrides) for arm in arms):
        try:
            visual = measure_visual_mix(_resolve(preset, base))
        except ConfigError:
            pass  # this omniloom has no vision encoder: its arm is skipped below
        say(f"visual tokens: {visual[0]:.1%} of row slots, blocks of {visual[1]} patches (token-weighted): "
            "the vision encoder's FLOPs per token count them")
    for arm in arms:
        for size in (sizes or [None]) if arm.fusion else [None]:
            try:
                planned = [plan_point(preset, base, arm, size, seed, budget, visual) for seed in range(seeds)]
            except ConfigError as err:
                if "unknown key" not in str(err):
                    raise
                say(f"arm {arm.name} skipped: this omniloom's config cannot express it ({err})")
                break
            for p in planned:
                p.same_as = seen.setdefault(p.key, f"{p.label}/seed{p.seed}")
                if p.same_as == f"{p.label}/seed{p.seed}":
                    p.same_as = ""
            if planned[0].same_as:
                say(f"arm {planned[0].label} has the config of {planned[0].same_as.split('/')[0]}: its runs are reused")
            points += planned
    return points


def _in_process(fn, log_path: Path):
    """Run fn() in this process (no interpreter start per run), its printed output appended to
    `log_path`; accelerate's process-wide state is reset after, so the next training starts clean."""
    import contextlib

    from accelerate.state import AcceleratorState, GradientState, PartialState

    log_path.parent.mkdir(parents=True, exist_ok=True)
    root, own = logging.getLogger(), logging.getLogger("omniloom")
    saved = (root.handlers[:], root.level, own.level)  # the training sets up logging (to the log file here)
    try:
        with open(log_path, "a") as fh, contextlib.redirect_stdout(fh), contextlib.redirect_stderr(fh):
            return fn()
    finally:
        root.handlers[:], _, _ = saved
        root.setLevel(saved[1])
        own.setLevel(saved[2])
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def _train(argv: list[str], log_path: Path) -> int:
    """`omniloom train ARGV` (pretrain/train/main.py), in this process."""
    from omniloom.pretrain.train.main import main as train_main

    return _in_process(lambda: train_main(argv), log_path)


def _evaluate(run: Path, heldout: str, out: Path, *, max_docs: int, probes: bool) -> None:
    """What `omniloom eval RUN --data SET --captions` gives (pretrain/inference), for each held-out
    set separately (so `max_docs` cuts each, and the text-only set is always scored), merged:
    `loss` per modality weighted by tokens, `loss_by_doc_kind` likewise where known, `captions`
    over every set, and each set's own result under `sets`."""
    from omniloom.pretrain.inference.captions import caption_benchmark
    from omniloom.pretrain.inference.evaluate import evaluate, json_safe
    from omniloom.pretrain.inference.load import open_model

    model, tok, seq_len = open_model(str(run), device="cpu")
    sets = {}
    for path in [h for h in heldout.split(",") if h]:
        sets[path] = evaluate(model, tok, path, max_docs=max_docs or None, max_len=seq_len, progress=False)
    loss: dict = {}
    for m in {k for r in sets.values() for k in r["loss"]}:
        have = [(r["loss"][m], r["counts"]["tokens"].get(m, 0)) for r in sets.values() if m in r["loss"]]
        total = sum(n for _, n in have)
        loss[m] = sum(v * n for v, n in have) / total if total else sum(v for v, _ in have) / len(have)
    kinds: dict = {}
    for kind in {k for r in sets.values() for k in r.get("loss_by_doc_kind", {})}:
        vals = [r["loss_by_doc_kind"][kind] for r in sets.values() if r["loss_by_doc_kind"].get(kind) is not None]
        if vals:
            kinds[kind] = sum(vals) / len(vals)
    result = {"loss": loss, "loss_by_doc_kind": kinds, "sets": sets,
              "captions": caption_benchmark(model, tok, heldout, max_docs=max_docs or None, probes=probes)}
    result, _ = json_safe(result)
    out.write_text(json.dumps(result, indent=1, sort_keys=True, allow_nan=False) + "\n")


def _omniloom(args: list[str], log_path: Path) -> int:
    """An `omniloom` command in a process of its own (data preparation, as `omniloom demo` runs it)."""
    import subprocess
    import sys

    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as fh:
        fh.write("$ omniloom " + " ".join(args) + "\n")
        fh.flush()
        return subprocess.run([sys.executable, "-m", "omniloom.pretrain.cli", *args], stdout=fh, stderr=subprocess.STDOUT).returncode


def run_point(p: Point, out: Path, *, preset: str, heldout: str, eval_points: int, max_eval_docs: int,
              probes: bool, say=print) -> dict:
    """Train and evaluate one point (or read what an earlier bench wrote); its figures."""
    from omniloom.pretrain.rundir import CHECKPOINTS, METRICS, read_metrics

    from .arch_report import point_figures

    folder = out / "runs" / p.label / f"seed{p.seed}"
    done = folder / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    run = folder / "run"
    last = run / CHECKPOINTS / f"step_{p.steps:08d}"
    every = max(1, p.steps // max(1, eval_points))
    t0 = time.perf_counter()
    if not last.exists():
        say(f"train {p.label} seed {p.seed}: {p.steps} steps ({p.train_flops:.3g} FLOPs)")
        rc = _train(["--no-progress", "--run-dir", str(run), "--resume", "auto", "--config", preset, *p.overrides,
                        f"train.eval_every={every}", f"checkpoint.every={every}", "checkpoint.keep_last=1",
                        "logging.tensorboard=false", f"logging.every={every}"], folder / "log.txt")
        if rc != 0 or not last.exists():
            raise RuntimeError(f"bench arch: training {p.label} seed {p.seed} failed (exit {rc}); see {folder / 'log.txt'}")
    eval_json = folder / "eval.json"
    if not eval_json.exists():
        say(f"eval {p.label} seed {p.seed}")
        _evaluate(run, heldout, eval_json, max_docs=max_eval_docs, probes=probes)
    figures = point_figures(p, json.loads(eval_json.read_text()), read_metrics(run / METRICS))
    figures["wall_s"] = time.perf_counter() - t0
    done.write_text(json.dumps(figures, indent=1, sort_keys=True) + "\n")
    return figures


def prepare_demo_data(out: Path, *, images: int, videos: int, say=print) -> tuple[list[str], str, str]:
    """The demo corpus at a bench's size, built once into OUT/data: (training shard sets, held-out
    shards (visual, then text files kept out of training), tokenizer)."""
    import shutil

    data = out / "data"
    corpus, shards, tok = data / "corpus", data / "shards", data / "tokenizer"
    steps = []
    if not (corpus / "README.txt").exists():
        shutil.rmtree(corpus, ignore_errors=True)
        steps.append(["data", "demo-corpus", "--out", str(corpus), "--num-images", str(images), "--num-videos", str(videos),
                      "--num-heldout-images", str(max(20, images // 8)), "--num-heldout-videos", str(max(10, videos // 8))])
    for cmd in steps:
        say("prepare: omniloom " + " ".join(cmd[:2]))
        if _omniloom(["-qq", *cmd], data / "log.txt") != 0:
            raise RuntimeError(f"bench arch: `omniloom {' '.join(cmd)}` failed")
    held_text = corpus / "heldout_text"
    if not held_text.exists():  # every fifth prose and code file of the training corpus, kept out of it
        held_text.mkdir()
        for sub in ("docs", "stdlib"):
            files = sorted(p for p in (corpus / "train" / sub).rglob("*") if p.is_file())
            for i, f in enumerate(files[::5]):
                f.rename(held_text / f"{sub}_{i:03d}{f.suffix}")
    train = corpus / "train"
    builds = [("synthetic", [train / "shapes.jsonl", train / "motion.jsonl", train / "interleaved.jsonl"]),
              ("real", [train / "stdlib", train / "docs", train / "photos"]),
              ("heldout", [corpus / "heldout"]), ("heldout_text", [held_text])]
    for name, inputs in builds:
        if not (shards / name / "manifest.json").exists():
            say(f"prepare: omniloom data build ({name})")
            shutil.rmtree(shards / name, ignore_errors=True)  # a build cut off before its manifest
            argv = ["-qq", "data", "build", *map(str, (p for p in inputs if p.exists())), "--out", str(shards / name),
                    "--name", name]
            if _omniloom(argv + (["--shuffle", "0"] if name == "synthetic" else []), data / "log.txt") != 0:
                raise RuntimeError(f"bench arch: building {name} shards failed")
    if not (tok / "omniloom_tokenizer.json").exists():
        say("prepare: omniloom tokenizer train")
        if _omniloom(["-qq", "tokenizer", "train", "--data", str(shards / "synthetic"), str(shards / "real"),
                      "--vocab-size", "2048", "--image-patch-budget", "16", "--video-frame-budget", "4",
                      "--video-patch-budget", "16", "--out", str(tok), "--force"], data / "log.txt") != 0:
            raise RuntimeError("bench arch: training the tokenizer failed")
    return ([f"{{path: {shards / 'synthetic'}, weight: 1000}}", f"{{path: {shards / 'real'}, weight: 1}}"],
            f"{shards / 'heldout'},{shards / 'heldout_text'}", str(tok))


def bench_arch(out: Path, *, preset: str, overrides: list[str], arms: list[Arm], sizes: list[int], seeds: int,
               budget: float, train: list[str] | None = None, heldout: str = "", tokenizer: str = "",
               eval_points: int = 4, max_eval_docs: int = 0, probes: bool = False, images: int = 800,
               videos: int = 400, corpus: str = "demo", say=print) -> dict:
    """Plan, run (what is not done yet) and report the comparison; returns the JSON written.
    Without `train`: the demo corpus, or with corpus="digits" scikit-learn's handwritten digits
    (pretrain/bench/arch_digits.py)."""
    from .arch_report import summarize, write_reports

    out.mkdir(parents=True, exist_ok=True)
    train_given = bool(train)
    if not train and corpus == "digits":
        from .arch_digits import prepare_digits_data

        train, heldout, tokenizer = prepare_digits_data(out, _omniloom, say=say)
    elif not train:
        train, heldout, tokenizer = prepare_demo_data(out, images=images, videos=videos, say=say)
    elif not (heldout and tokenizer):
        raise ValueError("--train needs --heldout and --tokenizer too")
    srcs = ", ".join(s if s.startswith("{") else f"{{path: {s}}}" for s in train)
    # the evaluations during training (the loss-against-FLOPs curve) read the first held-out set
    # (the demo's and digits' captioned pictures: the skill the visual mix trains); the final
    # evaluation reads every set
    during = heldout.split(",")[0]
    base = [f"data.sources=[{srcs}]", f"data.eval_sources=[{{path: {during}}}]", f"data.tokenizer={tokenizer}",
            *overrides]
    points = plan(preset, base, arms, sizes, seeds, budget, say=say)
    if not points:
        raise ValueError("bench arch: no arm left to run (each was skipped above)")
    by_key: dict[str, dict] = {}
    for p in points:
        if p.same_as:
            continue
        p.figures = run_point(p, out, preset=preset, heldout=heldout, eval_points=eval_points,
                              max_eval_docs=max_eval_docs, probes=probes, say=say)
        by_key[p.key] = p.figures
    for p in points:
        p.figures = p.figures or by_key[p.key]
    result = summarize(points, preset=preset, budget=budget, overrides=overrides, corpus="" if train_given else corpus)
    for path in write_reports(result, points, out):
        say(f"wrote {path}")
    return result


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "arch",
        help="architecture comparison at equal training FLOPs: early/late fusion, MoE/dense, modality groups, text-first",
        description=__doc__.split("\n\n")[0] + " Trains every arm (seeds x sizes) for the same training FLOPs on the "
        "same data (by default a small demo corpus built into OUT/data), evaluates it on held-out shards "
        "(loss per modality, text-only documents, `eval --captions`), and writes OUT/arch.md, OUT/arch.json "
        "and OUT/loss_vs_flops.png. A rerun skips finished runs and continues cut-off ones.",
    )
    p.add_argument("preset", nargs="?", default="demo", help="preset name or YAML path (default demo)")
    p.add_argument("overrides", nargs="*", help="dotted overrides for every arm, e.g. model.dim=64")
    p.add_argument("--out", default="bench_arch", help="work folder: data, runs, reports (default bench_arch)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated arms (default {','.join(DEFAULT_ARMS)})")
    p.add_argument("--arm", action="append", default=[], metavar="NAME:K=V,...", help="an extra arm of your own overrides")
    p.add_argument("--seeds", type=int, default=2, help="seeds per arm (default 2; the table gives mean ± std)")
    p.add_argument("--sizes", default="", help="comma-separated model widths (model.dim) for the fusion arms, "
                   "e.g. 64,128,192 (default: the preset's only)")
    p.add_argument("--budget-flops", type=float, default=1e12, help="training FLOPs per run (default 1e12: minutes on 2 CPU cores)")
    p.add_argument("--train", action="append", default=[], help="training shards instead of the demo corpus (repeat for several)")
    p.add_argument("--heldout", default="", help="held-out shards with --train (comma-separate several; the "
                   "evaluations during training, the plot's curves, read the first)")
    p.add_argument("--tokenizer", default="", help="tokenizer folder with --train")
    p.add_argument("--eval-points", type=int, default=4, help="evaluations during each training, for the loss-vs-FLOPs plot (default 4)")
    p.add_argument("--max-eval-docs", type=int, default=0, help="score only the first N held-out documents (default: all)")
    p.add_argument("--probes", action="store_true", help="also run the caption probes (mirror, flip, shuffle, reverse)")
    p.add_argument("--corpus", choices=("demo", "digits"), default="demo",
                   help="without --train: the demo corpus (synthetic shapes and clips, prose, code), or 'digits': "
                   "scikit-learn's 1,797 real handwritten digits, captioned 'a handwritten digit seven.' (needs "
                   "scikit-learn; exact captions are then classification accuracy)")
    p.add_argument("--images", type=int, default=800, help="synthetic training images of the demo corpus (default 800)")
    p.add_argument("--videos", type=int, default=400, help="synthetic training clips of the demo corpus (default 400)")
    p.epilog = ("Example (smoke): omniloom bench arch --out /tmp/arch --budget-flops 3e11 model.dim=64 model.num_heads=2; "
                "larger: omniloom bench arch --out arch --seeds 3 --sizes 96,128,192 --budget-flops 2e13 --images 6400 --videos 4800")
    # not among `omniloom bench` (all): it trains every arm for minutes to hours, into --out
    p.set_defaults(func=_bench_arch, in_bench_all=False)


def _bench_arch(args) -> int:
    if "=" in args.preset:  # only overrides were given: they are not a preset
        args.overrides, args.preset = [args.preset, *args.overrides], "demo"
    if args.seeds < 1:
        raise ValueError("--seeds must be >= 1")
    arms = [parse_arm(a.strip()) for a in args.arms.split(",") if a.strip()] + [parse_arm(a) for a in args.arm]
    if len({a.name for a in arms}) != len(arms):
        raise ValueError("bench arch: two arms have the same name")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sizes takes comma-separated widths, got '{args.sizes}'") from None
    result = bench_arch(Path(args.out), preset=args.preset, overrides=list(args.overrides), arms=arms, sizes=sizes,
                        seeds=args.seeds, budget=args.budget_flops, train=args.train, heldout=args.heldout,
                        tokenizer=args.tokenizer, eval_points=args.eval_points, max_eval_docs=args.max_eval_docs,
                        probes=args.probes, images=args.images, videos=args.videos, corpus=args.corpus)
    print(result["markdown"])
    return 0
