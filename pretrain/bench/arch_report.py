"""The figures of `omniloom bench arch` (pretrain/bench/arch.py): per run, per arm over seeds, and
the reports: OUT/arch.md (one Markdown table), OUT/arch.json, OUT/loss_vs_flops.png.

Per (arm, size), every figure is given as mean ± std over seeds (sample std; 0 for one seed),
with min and max in the JSON. JSON layout (`format: omniloom-bench-arch/1`):

    {format, preset, corpus (demo, digits, or "" for --train shards), budget_flops, overrides,
     columns: [[key, header]], markdown,
     arms: [{arm, size, label, seeds, same_as?, overrides, figures: {key: {mean, std, min, max, n}},
             curve: [[train FLOPs, held-out loss mean, std], ...] (over seeds, by evaluation)}]}

The curve is the trainer's `eval/loss` during training, on the first held-out set only (the demo's
captioned images and clips: caption tokens, as patches carry no target); the table's losses come
from `omniloom eval` on every held-out set after training.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FORMAT = "omniloom-bench-arch/1"
MODALITIES = ("all", "text", "code", "image", "video")


def point_figures(p, ev: dict, metrics: list[dict]) -> dict:
    """The figures of one run from its eval.json and metrics.jsonl."""
    fig: dict = {"steps": p.steps, "train_flops": p.train_flops, "flops_per_token": p.flops_per_token,
                 "params": p.params, "active_params": p.active_params}
    for m in MODALITIES:
        if ev.get("loss", {}).get(m) is not None:
            fig[f"loss/{m}"] = ev["loss"][m]
    text_docs = (ev.get("loss_by_doc_kind") or {}).get("text")
    if text_docs is not None:  # held-out documents with no image or video: what visual training costs text
        fig["loss/text_only_docs"] = text_docs
    caps = ev.get("captions") or {}
    for kind, v in (caps.get("exact") or {}).items():
        fig[f"exact/{kind}"] = v
    for kind, rows in (caps.get("attributes") or {}).items():
        for attr, r in rows.items():
            fig[f"attr/{kind}/{attr}"] = r["accuracy"]
    rates = [r["tokens_per_s"] for r in metrics if "tokens_per_s" in r][1:]  # the first window holds start-up
    if rates:
        fig["tokens_per_s"] = sum(rates) / len(rates)
    step_flops = p.tokens_per_step * p.flops_per_token
    fig["curve"] = [[r["step"] * step_flops, r["eval/loss"]] for r in metrics if "eval/loss" in r]
    return fig


def _spread(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return {"mean": mean, "std": std, "min": min(values), "max": max(values), "n": n}


def _columns(keys: set[str]) -> list[tuple[str, str]]:
    cols = [("params", "params"), ("active_params", "active"), ("flops_per_token", "FLOPs/token"), ("steps", "steps"),
            ("train_flops", "train FLOPs"), ("tokens_per_s", "tokens/s")]
    # image and video tokens carry no loss (patch positions have no target): their columns only if some run has them
    cols += [(f"loss/{m}", f"loss {m}") for m in MODALITIES if m in ("all", "text", "code") or f"loss/{m}" in keys]
    cols += [("loss/text_only_docs", "loss text-only docs")]
    cols += [(k, k.replace("exact/", "exact ")) for k in sorted(k for k in keys if k.startswith("exact/"))]
    cols += [(k, k.replace("attr/", "").replace("/", " ")) for k in sorted(k for k in keys if k.startswith("attr/"))]
    return cols


def summarize(points, *, preset: str, budget: float, overrides: list[str], corpus: str = "") -> dict:
    groups: dict[str, list] = {}
    for p in points:
        groups.setdefault(p.label, []).append(p)
    keys = {k for p in points for k, v in p.figures.items() if isinstance(v, (int, float))}
    cols = _columns(keys)
    arms = []
    for label, ps in groups.items():
        figures = {}
        for key, _ in cols:
            vals = [float(p.figures[key]) for p in ps if isinstance(p.figures.get(key), (int, float))]
            if vals:
                figures[key] = _spread(vals)
        curves = [p.figures.get("curve") or [] for p in ps]
        n = min(len(c) for c in curves)
        curve = []
        for i in range(n):
            s = _spread([c[i][1] for c in curves])
            curve.append([curves[0][i][0], s["mean"], s["std"]])
        arms.append({"arm": ps[0].arm, "size": ps[0].size, "label": label, "seeds": [p.seed for p in ps],
                     **({"same_as": ps[0].same_as.split("/")[0]} if ps[0].same_as else {}),
                     "overrides": ps[0].overrides, "figures": figures, "curve": curve})
    result = {"format": FORMAT, "preset": preset, "corpus": corpus, "budget_flops": budget, "overrides": list(overrides),
              "columns": [list(c) for c in cols], "arms": arms}
    result["markdown"] = markdown(result)
    return result


def _fmt(key: str, s: dict | None) -> str:
    if s is None:
        return "n/a"
    if key in ("params", "active_params", "steps"):
        v = f"{s['mean']:,.0f}"
        return v if s["std"] == 0 else f"{v} ± {s['std']:,.0f}"
    if key in ("train_flops", "flops_per_token"):
        return f"{s['mean']:.3g}"
    if key == "tokens_per_s":
        return f"{s['mean']:,.0f} ± {s['std']:,.0f}"
    if key.startswith(("exact/", "attr/")):
        return f"{100 * s['mean']:.1f}% ± {100 * s['std']:.1f}"
    return f"{s['mean']:.4f} ± {s['std']:.4f}"


def markdown(result: dict) -> str:
    cols = result["columns"]
    lines = [f"bench arch: preset {result['preset']}, {result['budget_flops']:.3g} training FLOPs per run; "
             "mean ± std over seeds (losses: held-out, nats/token)", "",
             "| arm | seeds | " + " | ".join(h for _, h in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for a in result["arms"]:
        name = a["label"] + (f" (= {a['same_as']})" if a.get("same_as") else "")
        lines.append(f"| {name} | {len(a['seeds'])} | " + " | ".join(_fmt(k, a["figures"].get(k)) for k, _ in cols) + " |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> Path | None:
    """Held-out loss (the first held-out set) against training FLOPs, one line per (arm, size)
    from the evaluations during training, mean over seeds with the spread at each point: the
    scaling-law picture."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for a in result["arms"]:
        if a.get("same_as") or not a["curve"]:
            continue
        pts = [c if len(c) == 3 else (*c, 0.0) for c in a["curve"] if c[0] > 0]  # step 0 has no place on a log axis
        if not pts:
            continue
        xs, ys, errs = zip(*pts)
        ax.errorbar(xs, ys, yerr=errs, marker=".", capsize=2, label=a["label"])
    ax.set_xscale("log")
    ax.set_yscale("log")  # an arm that has not met captions yet (text-first before its switch) sits far above
    ax.set_xlabel("training FLOPs")
    ax.set_ylabel("held-out loss, first held-out set (nats/token)")
    corpus = result.get("corpus")
    ax.set_title(f"bench arch: {corpus + ' corpus, ' if corpus else ''}preset {result['preset']}, "
                 f"{result['budget_flops']:.3g} FLOPs per run")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_reports(result: dict, points, out: Path) -> list[Path]:
    md, js = out / "arch.md", out / "arch.json"
    md.write_text(result["markdown"] + "\n")
    js.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    png = plot(result, out / "loss_vs_flops.png")
    return [md, js] + ([png] if png else [])
