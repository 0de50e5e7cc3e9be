"""`omniloom report RUN`: an HTML page with PNG plots of a training run.

Reads `RUN/metrics.jsonl` (written by the trainer) and, when given, the JSON of `omniloom eval`;
writes `RUN/report/index.html` beside its PNGs, so the folder opens in any browser offline.
Plots: loss overall and per modality (train and held-out), learning rate, gradient norm,
tokens/s, expert load per layer and modality (heatmap), padding fraction and data-loader wait,
final-layer output norm, and the cross-modal gap.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

MODALITIES = ("text", "code", "image", "video", "special")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _line_plot(path: Path, title: str, curves: list[tuple[str, list[int], list[float]]], *, ylabel: str, logy: bool = False) -> bool:
    curves = [c for c in curves if c[1]]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for label, xs, ys in curves:
        ax.plot(xs, ys, label=label, marker="o" if len(xs) < 12 else None, markersize=3)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if logy and all(y > 0 for _, _, ys in curves for y in ys):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(curves) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _expert_heatmap(path: Path, rows: list[dict]) -> bool:
    """Token share per expert, one panel per modality, MoE layers down (counted among MoE layers
    only: leading dense layers have no experts) and experts across, from the last logged
    `moe/counts_LME`; falls back to max/mean imbalance per (layer, modality)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    counts = next((r["moe/counts_LME"] for r in reversed(rows) if isinstance(r.get("moe/counts_LME"), list)), None)
    if counts is not None:
        arr = np.asarray(counts, dtype=float)  # [L, M, E]
        moe_layers = [i for i in range(arr.shape[0]) if arr[i].sum() > 0]
        mods = [m for m in range(arr.shape[1]) if arr[moe_layers, m].sum() > 0] if moe_layers else []
        if not mods:
            return False
        fig, axes = plt.subplots(1, len(mods), figsize=(3.2 * len(mods) + 1, 0.5 * len(moe_layers) + 2), dpi=100, squeeze=False)
        for ax, m in zip(axes[0], mods):
            sub = arr[moe_layers, m]
            share = sub / np.maximum(sub.sum(-1, keepdims=True), 1)
            im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0)
            ax.set_title(f"{MODALITIES[m] if m < len(MODALITIES) else m}")
            ax.set_xlabel("expert")
            ax.set_yticks(range(len(moe_layers)), [f"MoE layer {i}" for i in moe_layers])
            fig.colorbar(im, ax=ax, fraction=0.046, label="token share")
        fig.suptitle("expert load per layer and modality (last logged window)")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return True
    last = next((r for r in reversed(rows) if any(k.startswith("moe/max_over_mean/layer") for k in r)), None)
    if last is None:
        return False
    layers = sorted({int(k.split("/")[2][5:]) for k in last if k.startswith("moe/max_over_mean/layer")})
    grid = np.full((len(layers), len(MODALITIES)), np.nan)
    for i, layer in enumerate(layers):
        for j, mod in enumerate(MODALITIES):
            v = last.get(f"moe/max_over_mean/layer{layer}/{mod}")
            if v is not None:
                grid[i, j] = v
    fig, ax = plt.subplots(figsize=(6, 0.5 * len(layers) + 2), dpi=100)
    im = ax.imshow(grid, aspect="auto", cmap="magma")
    ax.set_xticks(range(len(MODALITIES)), MODALITIES)
    ax.set_yticks(range(len(layers)), [f"MoE layer {i}" for i in layers])
    fig.colorbar(im, ax=ax, label="max / mean expert load")
    ax.set_title("expert load imbalance per layer and modality")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _gap_plot(path: Path, ev: dict) -> bool:
    gap = ev.get("cross_modal_gap") or {}
    gap = {k: v for k, v in gap.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if not gap:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.8, 3.2), dpi=100)
    bars = ax.bar(list(gap), list(gap.values()), color=["#4a7dd6", "#d6894a", "#6ab04c"][: len(gap)])
    ax.bar_label(bars, fmt="%.2f")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_ylabel("nats / caption token")
    ax.set_title("cross-modal gap: own visual vs another document's")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_report(run_dir: str | Path, *, eval_json: str | Path | None = None, out_dir: str | Path | None = None) -> Path:
    """Write the report for `run_dir`; returns the path of index.html."""
    from .metrics import read_metrics

    run_dir = Path(run_dir)
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: is {run_dir} a training run folder (train.run_dir)?")
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} holds no metrics yet; train for at least logging.every steps")
    out = Path(out_dir) if out_dir else run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    ev = json.loads(Path(eval_json).read_text()) if eval_json else {}

    sections: list[tuple[str, str, str]] = []  # (title, png name, caption)

    def add(name: str, title: str, made: bool, caption: str = "") -> None:
        if made:
            sections.append((title, name, caption))

    add("loss.png", "Loss per modality", _line_plot(out / "loss.png", "training loss", [
        ("overall", *_series(rows, "loss")),
        *[(m, *_series(rows, f"loss/{m}")) for m in MODALITIES],
    ], ylabel="nats / token"), "Training cross-entropy overall and per modality (window means).")
    add("eval_loss.png", "Held-out loss per modality", _line_plot(out / "eval_loss.png", "held-out loss", [
        ("overall", *_series(rows, "eval/loss")),
        *[(m, *_series(rows, f"eval/loss/{m}")) for m in MODALITIES],
    ], ylabel="nats / token"))
    add("lr.png", "Learning rate", _line_plot(out / "lr.png", "learning rate", [("lr", *_series(rows, "lr"))], ylabel="lr"))
    add("grad_norm.png", "Gradient norm", _line_plot(out / "grad_norm.png", "gradient norm (before clipping)",
                                                     [("grad norm", *_series(rows, "grad_norm"))], ylabel="L2 norm", logy=True))
    add("throughput.png", "Throughput", _line_plot(out / "throughput.png", "tokens / s",
                                                   [("all ranks", *_series(rows, "tokens_per_s")),
                                                    ("per device", *_series(rows, "tokens_per_s_per_device"))], ylabel="tokens / s"))
    add("experts.png", "Expert load", _expert_heatmap(out / "experts.png", rows))
    pad_key = next((k for k in ("data/padding_fraction", "padding_fraction") if any(k in r for r in rows)), "data/padding_fraction")
    add("padding.png", "Padding and data wait", _line_plot(out / "padding.png", "share of the step", [
        ("padding fraction", *_series(rows, pad_key)),
        ("data-loader wait", *_series(rows, "data_wait_fraction")),
    ], ylabel="fraction"))
    add("out_norm.png", "Final-layer output norm", _line_plot(out / "out_norm.png", "final-layer output RMS",
                                                             [("rms", *_series(rows, "final_out_rms"))], ylabel="RMS"),
        "Steady growth here is the early sign of divergence in from-scratch multimodal runs.")
    add("gap.png", "Cross-modal gap", _gap_plot(out / "gap.png", ev),
        "Caption loss with another document's visual minus with its own: positive means the model reads the pixels.")

    last = rows[-1]
    summary = {k: last[k] for k in ("step", "loss", "tokens_seen", "tokens_per_s", "lr") if k in last}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>omniloom report: "
        + html.escape(run_dir.name) + "</title><style>body{font-family:sans-serif;max-width:980px;margin:2em auto;}"
        "img{max-width:100%;border:1px solid #ddd} table{border-collapse:collapse} td,th{padding:2px 8px;border:1px solid #ccc}</style></head><body>",
        f"<h1>omniloom run report: {html.escape(run_dir.name)}</h1>",
        "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>" for k, v in summary.items()) + "</table>",
    ]
    if ev:
        parts.append("<h2>Evaluation</h2><pre>" + html.escape(json.dumps({k: ev[k] for k in ev if k in ("loss", "perplexity", "cross_modal_gap")}, indent=2, sort_keys=True)) + "</pre>")
    for title, name, caption in sections:
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{name}' alt='{html.escape(title)}'>")
        if caption:
            parts.append(f"<p>{html.escape(caption)}</p>")
    parts.append("</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts), encoding="utf-8")
    return index


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def register(sub) -> None:
    p = sub.add_parser(
        "report",
        help="write an HTML report with plots of a training run",
        description="Write RUN/report/index.html with PNG plots: loss per modality, learning rate, gradient norm, "
        "tokens/s, expert load heatmap, padding fraction, output norm and (with --eval) the cross-modal gap.",
    )
    p.add_argument("run", help="training run folder (holds metrics.jsonl)")
    p.add_argument("--eval", default=None, help="JSON written by `omniloom eval --out` (adds the cross-modal gap)")
    p.add_argument("--out", default=None, help="output folder (default RUN/report)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    index = write_report(args.run, eval_json=args.eval, out_dir=args.out)
    print(f"report written: {index}")
    return 0
