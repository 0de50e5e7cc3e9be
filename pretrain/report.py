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


def _gap_figure(ev: dict):
    """The cross-modal gap bar chart (a matplotlib Figure), or None without finite gaps."""
    gap = ev.get("cross_modal_gap") or {}
    gap = {k: v for k, v in gap.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if not gap:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    bars = ax.bar(list(gap), list(gap.values()), color=["#4a7dd6", "#d6894a", "#6ab04c"][: len(gap)])
    ax.bar_label(bars, fmt="%.3g")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.margins(y=0.15)  # room for the bar labels
    ax.set_ylabel("nats / caption token")
    ax.set_title("cross-modal gap\n(caption loss: another document's visual minus its own)", fontsize=10)
    fig.tight_layout()
    return fig


def _gap_plot(path: Path, ev: dict) -> bool:
    fig = _gap_figure(ev)
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return True


def _sig(v, digits: int = 4) -> str:
    """A number with `digits` significant digits (no 16-digit floats in the page)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "n/a" if v is None else str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.{digits}g}"


def _table(header: list[str], rows: list[list[str]], table_id: str = "") -> str:
    ident = f" id='{table_id}'" if table_id else ""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table{ident}><tr>{head}</tr>{body}</table>"


def _eval_html(ev: dict) -> str:
    """Evaluation as tables: loss and perplexity per modality, the cross-modal gap per kind."""
    parts = ["<h2>Evaluation</h2>"]
    counts = ev.get("counts") or {}
    if "docs" in counts:
        line = f"{_sig(counts['docs'])} documents scored"
        if "docs_available" in counts:
            line += f" of {_sig(counts['docs_available'])} available"
        skipped = sum((counts.get("skipped") or {}).values())
        if skipped:
            line += f", {skipped} skipped"
        src = f" (model {ev['model']}, data {ev['data']})" if ev.get("model") and ev.get("data") else ""
        parts.append(f"<p>{html.escape(line + src)}.</p>")
    loss, ppl = ev.get("loss") or {}, ev.get("perplexity") or {}
    order = [k for k in ("all", *MODALITIES) if k in loss] + sorted(k for k in loss if k not in ("all", *MODALITIES))
    if order:
        parts.append(_table(["modality", "loss (nats/token)", "perplexity"],
                            [[k, _sig(loss[k]), _sig(ppl.get(k))] for k in order], "eval_loss"))
    gap, detail = ev.get("cross_modal_gap") or {}, ev.get("cross_modal_gap_detail") or {}
    if gap or detail:
        rows = []
        for kind in [*gap, *(k for k in detail if k not in gap)]:
            d = detail.get(kind) or {}
            rows.append([kind, _sig(gap.get(kind, d.get("gap"))), _sig(d.get("own_visual_loss")),
                         _sig(d.get("donor_visual_loss")), _sig(d.get("docs")), _sig(d.get("text_tokens"))])
        parts.append("<h3>Cross-modal gap</h3><p>Caption loss with another document's image or video minus with its "
                     "own, in nats per caption token: positive means the model reads its visual tokens.</p>")
        parts.append(_table(["kind", "gap", "loss with own visual", "loss with another's", "documents", "caption tokens"],
                            rows, "cross_modal_gap"))
    if (ev.get("captions") or {}).get("exact"):
        parts.append(_captions_html(ev["captions"]))
    return "\n".join(parts)


def _captions_html(cap: dict) -> str:
    """`omniloom eval --captions`: exact captions, the per-attribute table, the probes."""
    from .captions import PROBE_TARGETS

    pct = lambda v: "-" if v is None else f"{100 * v:.1f}%"  # noqa: E731
    docs = cap.get("docs") or {}
    parts = ["<h3>Captions</h3><p>Greedy captions generated from each held-out image or video alone, compared "
             "with its true caption. A model that reads where things are gets position words right; one that "
             "reads an image as a bag of patches gets them at the majority baseline.</p>"]
    parts.append(_table(["kind", "documents", "exact captions"],
                        [[k, _sig(docs.get(k)), pct(v)] for k, v in cap["exact"].items()], "captions_exact"))
    for kind, rows in (cap.get("attributes") or {}).items():
        parts.append(_table([f"{kind} attribute", "accuracy", "majority baseline"],
                            [[a, pct(r["accuracy"]), f"{pct(r['majority'])} ({r['majority_value']})"] for a, r in rows.items()],
                            f"captions_{kind}_attributes"))
    probes = cap.get("probes") or {}
    if probes:
        rows = []
        for name, p in probes.items():
            attr = PROBE_TARGETS.get(name, (None,))[0]
            has = attr is not None and f"{attr}_changed" in p
            rows.append([name, _sig(p["docs"]), pct(p["changed"]),
                         f"{pct(p[attr + '_changed'])} of {p[attr + '_docs']} ({attr})" if has else "-",
                         pct(p[attr + "_transformed"]) if has else "-"])
        parts.append("<p>Probes: the same captions after mirroring (left-right) or flipping (top-bottom) each image, "
                     "shuffling its patches, or reversing each video in time.</p>")
        parts.append(_table(["probe", "documents", "captions changed", "position/direction word changed",
                             "... to the transformed truth"], rows, "captions_probes"))
    return "\n".join(parts)


def _run_settings(run_dir: Path) -> list[tuple[str, str]]:
    """Key settings of the run from its newest checkpoint's config.yaml (empty when none)."""
    from .checkpoint import latest_checkpoint

    ckpts = run_dir / "checkpoints"
    ckpt = latest_checkpoint(ckpts) if ckpts.is_dir() else None
    if ckpt is None or not (ckpt / "config.yaml").is_file():
        return []
    try:
        from .config import load_saved_config

        cfg = load_saved_config(ckpt / "config.yaml")
    except Exception:  # the report must not fail on an old or hand-edited config
        return []
    world = None
    try:
        world = json.loads((ckpt / "COMPLETE").read_text()).get("world_size")
    except (OSError, ValueError):
        pass
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.train
    out = [
        ("model", f"{m.num_layers} layers, width {m.dim}, {m.num_heads} heads ({m.num_kv_heads} kv), vocabulary {m.vocab_size}"),
        ("attention", f"pattern {m.attention.pattern}, backend {m.attention.backend}, window {m.attention.window}"),
        ("positions", f"M-RoPE {m.rope_layout} (t, h, w head dims {list(m.rope_sections)})"
         + (f", learned visual positions up to {m.visual_pos_max}" if m.visual_pos_max else "")),
        ("MoE", f"{m.moe.num_experts} experts, top-{m.moe.num_experts_per_token}, {m.moe.num_shared_experts} shared"),
        ("data", ", ".join(f"{s.path} (weight {s.weight:g})" for s in d.sources) or "(none recorded)"),
        ("batch", f"{d.batch_size} rows x {d.seq_len} tokens per rank" + (f", {world} process(es)" if world else "")
         + (f", {t.grad_accum_steps} accumulation steps" if t.grad_accum_steps > 1 else "")),
        ("optimizer", f"lr {o.lr:g} ({o.schedule}, warmup {o.warmup_steps}), weight decay {o.weight_decay:g}"),
        ("steps", f"{t.num_steps} planned; checkpoint {ckpt.name}"),
    ]
    return out


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

    last_step = max((r["step"] for r in rows if isinstance(r.get("step"), int)), default=None)
    summary: dict = {}
    for r in rows:  # the newest value of each key over the last training rows (eval rows carry no loss)
        for k in ("step", "loss", "tokens_seen", "tokens_per_s", "lr"):
            if k in r:
                summary[k] = r[k]
    name = _run_name(run_dir)
    settings = [("run folder", str(run_dir.resolve()))] + _run_settings(run_dir)
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>omniloom report: "
        + html.escape(name) + "</title><style>body{font-family:sans-serif;max-width:980px;margin:2em auto;}"
        "img{max-width:100%;border:1px solid #ddd} table{border-collapse:collapse;margin:0.5em 0} "
        "td,th{padding:2px 8px;border:1px solid #ccc;text-align:left}</style></head><body>",
        f"<h1>omniloom run report: {html.escape(name)}</h1>",
        "<table id='settings'>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in settings) + "</table>",
        f"<h2>Last logged (step {html.escape(str(last_step))})</h2>",
        "<table>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_sig(v))}</td></tr>" for k, v in summary.items()) + "</table>",
    ]
    if ev:
        parts.append(_eval_html(ev))
    for title, name, caption in sections:
        parts.append(f"<h2>{html.escape(title)}</h2><img src='{name}' alt='{html.escape(title)}'>")
        if caption:
            parts.append(f"<p>{html.escape(caption)}</p>")
    parts.append("</body></html>")
    index = out / "index.html"
    index.write_text("\n".join(parts), encoding="utf-8")
    return index


def _run_name(run_dir: Path) -> str:
    """The run folder's name; a generic one ("run", as the demo's demo_out/run) with its parent."""
    resolved = run_dir.resolve()
    if resolved.name in ("run", "runs", "default", "") and resolved.parent.name:
        return f"{resolved.parent.name}/{resolved.name}"
    return resolved.name


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
