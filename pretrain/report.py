"""`omniloom report RUN`: an HTML page with PNG plots of a training run.

Reads `RUN/metrics.jsonl` (written by the trainer) and, when given, the JSON of `omniloom eval`;
writes `RUN/report/index.html`, one self-contained file (the plots inline as data: URIs, so it can
be mailed or attached to an issue), and the PNGs beside it. Plots: loss overall and per modality
(raw values faint, a moving average over them), held-out loss, learning rate, gradient norm,
tokens/s, expert load per layer and modality (heatmaps), padding fraction and data-loader wait,
final-layer output norm (its trend, and jumps against it), and the cross-modal gap with its
interval.
"""

from __future__ import annotations

import base64
import html
import json
import math
from pathlib import Path

from .rundir import CHECKPOINT_CONFIG, CHECKPOINTS, METRICS, REPORT

MODALITIES = ("text", "code", "image", "video", "special")


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and "step" in r:
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


SMOOTH_MIN_POINTS = 10  # fewer points are drawn as they are


def smooth(ys: list[float], span: int) -> list[float]:
    """Exponential moving average over about `span` points, debiased at the start (TensorBoard's
    smoothing): per-step losses of mixed modalities jump (0.9 on a caption, 4.8 on code)."""
    alpha, mean, weight, out = 2.0 / (span + 1), 0.0, 0.0, []
    for y in ys:
        mean = (1 - alpha) * mean + alpha * y
        weight = (1 - alpha) * weight + alpha
        out.append(mean / weight)
    return out


def smoothing_span(n: int) -> int:
    return max(3, n // 20)


def _line_plot(path: Path, title: str, curves: list[tuple[str, list[int], list[float]]], *, ylabel: str, logy: bool = False,
               smoothed: bool = False) -> bool:
    """One line per curve; with `smoothed`, a curve of SMOOTH_MIN_POINTS or more is drawn raw
    (faint) under its moving average (`smooth`)."""
    curves = [c for c in curves if c[1]]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    for label, xs, ys in curves:
        if smoothed and len(xs) >= SMOOTH_MIN_POINTS:
            (raw,) = ax.plot(xs, ys, linewidth=0.6, alpha=0.3)
            ax.plot(xs, smooth(ys, smoothing_span(len(ys))), color=raw.get_color(), label=label)
            continue
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


# An output RMS this many times its trend so far is a sudden jump, the sign of divergence. The
# demo's healthy run has windows up to 1.7x its trend (the RMS of a window of mixed modalities is
# noisy), and grows 0.5 -> 3 in its first tenth, while the trend is still forming: not counted.
JUMP = 2.0


def norm_jumps(xs: list[int], ys: list[float]) -> list[int]:
    """Indices of the values at least JUMP times the trend of the values before them (their
    moving average), after the first tenth of the run: a sudden jump, unlike the steady growth a
    healthy run shows."""
    if len(ys) < 3:
        return []
    trend = smooth(ys, smoothing_span(len(ys)))
    start = max(2, len(ys) // 10)
    return [i for i in range(start, len(ys)) if trend[i - 1] > 0 and ys[i] >= JUMP * trend[i - 1]]


def _out_norm_plot(path: Path, rows: list[dict]) -> bool:
    """The final-layer output RMS with its trend, and the points that jump against the trend."""
    xs, ys = _series(rows, "final_out_rms")
    if not xs:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    ax.plot(xs, ys, linewidth=0.8, alpha=0.6, label="RMS", marker="o" if len(xs) < 12 else None, markersize=3)
    if len(xs) >= 3:
        ax.plot(xs, smooth(ys, smoothing_span(len(ys))), color="black", linewidth=1.2, label="trend (steady growth is normal)")
    jumps = norm_jumps(xs, ys)
    if jumps:
        ax.scatter([xs[i] for i in jumps], [ys[i] for i in jumps], color="red", zorder=3,
                   label=f"sudden jump (>= {JUMP:g}x the trend): check loss and grad norm")
    ax.set_title("final-layer output RMS")
    ax.set_xlabel("step")
    ax.set_ylabel("RMS")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")  # a growing curve leaves that corner empty
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def _save_figure(path: Path, fig) -> bool:
    """Write a Figure (None: nothing to draw) as PNG and close it; True when written."""
    if fig is None:
        return False
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
    return True


def _expert_heatmap(path: Path, rows: list[dict]) -> bool:
    return _save_figure(path, _expert_figure(rows))


def _expert_figure(rows: list[dict]):
    """Token share per expert, one panel per modality, MoE layers down (counted among MoE layers
    only: leading dense layers have no experts) and experts across, from the last logged
    `moe/counts_LME`; falls back to max/mean imbalance per (layer, modality). A Figure, or None."""
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
            return None
        # one full-width panel per modality, stacked: cells large enough to read, each annotated
        # with its share when there are few enough to fit a label
        num_e = arr.shape[2]
        cell_w, cell_h = max(0.35, min(0.9, 9.0 / num_e)), 0.45
        fig, axes = plt.subplots(len(mods), 1, figsize=(cell_w * num_e + 2.5, (cell_h * len(moe_layers) + 0.9) * len(mods) + 0.6),
                                 dpi=110, squeeze=False)
        for ax, m in zip(axes[:, 0], mods):
            sub = arr[moe_layers, m]
            share = sub / np.maximum(sub.sum(-1, keepdims=True), 1)
            im = ax.imshow(share, aspect="auto", cmap="viridis", vmin=0, vmax=max(float(share.max()), 1e-9))
            ax.set_title(f"{MODALITIES[m] if m < len(MODALITIES) else m} tokens: share per expert "
                         f"(even load: {100 / num_e:.0f}% each)", fontsize=10)
            ax.set_xticks(range(num_e))
            ax.set_xlabel("expert")
            ax.set_yticks(range(len(moe_layers)), [f"MoE layer {i}" for i in moe_layers])
            if num_e <= 32:
                for (i, e), v in np.ndenumerate(share):
                    ax.text(e, i, f"{100 * v:.0f}", ha="center", va="center", fontsize=7,
                            color="black" if v > 0.6 * share.max() else "white")
            fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02, label="token share")
        fig.suptitle("expert load per layer and modality (last logged window; cells in %)")
        fig.tight_layout()
        return fig
    last = next((r for r in reversed(rows) if any(k.startswith("moe/max_over_mean/layer") for k in r)), None)
    if last is None:
        return None
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
    return fig


def _gap_figure(ev: dict):
    """The cross-modal gap bar chart (a matplotlib Figure), or None without finite gaps."""
    gap = ev.get("cross_modal_gap") or {}
    gap = {k: v for k, v in gap.items() if isinstance(v, (int, float)) and math.isfinite(v)}
    if not gap:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    detail = ev.get("cross_modal_gap_detail") or {}
    ci = [(detail.get(k) or {}).get("ci95") for k in gap]
    # the 95% interval over documents as error bars (none where there was no interval)
    yerr = [[v - c[0] if c else 0.0 for v, c in zip(gap.values(), ci)], [c[1] - v if c else 0.0 for v, c in zip(gap.values(), ci)]]
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    bars = ax.bar(list(gap), list(gap.values()), color=["#4a7dd6", "#d6894a", "#6ab04c"][: len(gap)],
                  yerr=yerr if any(ci) else None, capsize=6)
    ax.bar_label(bars, fmt="%.3g", label_type="center")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.margins(y=0.15)  # room for the bar labels
    ax.set_ylabel("nats / caption token")
    ax.set_title("cross-modal gap\n(caption loss: another document's visual minus its own)", fontsize=10)
    fig.tight_layout()
    return fig


def _gap_plot(path: Path, ev: dict) -> bool:
    return _save_figure(path, _gap_figure(ev))


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
            ci = d.get("ci95")
            verdict = ("yes" if d.get("distinguishable_from_zero") else "no") if "ci95" in d else "n/a"
            rows.append([kind, _sig(gap.get(kind, d.get("gap"))), f"{_sig(ci[0])} to {_sig(ci[1])}" if ci else "n/a", verdict,
                         _sig(d.get("own_visual_loss")), _sig(d.get("donor_visual_loss")), _sig(d.get("docs")),
                         _sig(d.get("text_tokens"))])
        parts.append("<h3>Cross-modal gap</h3><p>Caption loss with another document's image or video minus with its "
                     "own, in nats per caption token: positive means the model reads its visual tokens. The 95% "
                     "interval is over documents; a gap whose interval holds 0 is not distinguishable from 0 (which "
                     "donor each document drew decides it, not the pixels).</p>")
        parts.append(_table(["kind", "gap", "95% interval", "distinguishable from 0", "loss with own visual",
                             "loss with another's", "documents", "caption tokens"], rows, "cross_modal_gap"))
    if (ev.get("captions") or {}).get("exact"):
        parts.append(_captions_html(ev["captions"]))
    return "\n".join(parts)


def _captions_html(cap: dict) -> str:
    """`omniloom eval --captions`: exact captions, the per-attribute table, the probes."""
    from omniloom.pretrain.inference.captions import PROBE_TARGETS

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
    from omniloom.pretrain.checkpoint.manager import latest_checkpoint

    ckpts = run_dir / CHECKPOINTS
    ckpt = latest_checkpoint(ckpts) if ckpts.is_dir() else None
    if ckpt is None or not (ckpt / CHECKPOINT_CONFIG).is_file():
        return []
    try:
        from omniloom.pretrain.config.run import load_saved_config

        cfg = load_saved_config(ckpt / CHECKPOINT_CONFIG)
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
         + (f", learned visual positions up to {m.visual_pos_max}" if m.visual_pos_max else "")
         + (f", conv patch stem {m.conv_stem_width} wide" + (", clips frame by frame through it" if m.conv_stem_video == "frames" else "")
            if m.patch_stem == "conv" else "")),
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
    from .rundir import read_metrics

    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS
    if not metrics_path.is_file():
        raise FileNotFoundError(f"{metrics_path} not found: is {run_dir} a training run folder (train.run_dir)?")
    rows = read_metrics(metrics_path)
    if not rows:
        raise ValueError(f"{metrics_path} holds no metrics yet; train for at least logging.every steps")
    out = Path(out_dir) if out_dir else run_dir / REPORT
    out.mkdir(parents=True, exist_ok=True)
    ev = json.loads(Path(eval_json).read_text()) if eval_json else {}

    sections: list[tuple[str, str, str]] = []  # (title, png name, caption)

    def add(name: str, title: str, made: bool, caption: str = "") -> None:
        if made:
            sections.append((title, name, caption))

    n_loss = len(_series(rows, "loss")[0])
    add("loss.png", "Loss per modality", _line_plot(out / "loss.png", "training loss", [
        ("overall", *_series(rows, "loss")),
        *[(m, *_series(rows, f"loss/{m}")) for m in MODALITIES],
    ], ylabel="nats / token", smoothed=True),
        "Training cross-entropy overall (every step) and per modality (window means). Faint: the raw values (a step "
        "of captions and a step of code differ by several nats); solid: their moving average over about "
        f"{smoothing_span(n_loss)} points (curves with fewer than {SMOOTH_MIN_POINTS} points are drawn as they are).")
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
    add("out_norm.png", "Final-layer output norm", _out_norm_plot(out / "out_norm.png", rows),
        "The final layer's output RMS per logged window. Steady growth over training is normal: a model learning to "
        "be confident grows it (the demo's run goes from about 0.5 to 5 and trains well). A divergence shows as a "
        f"sudden jump against the trend, a value {JUMP:g} times the moving average before it or more (red points; "
        "the first tenth of the run, while the trend forms, is not judged), usually with loss and gradient-norm "
        "spikes in the same steps.")
    add("gap.png", "Cross-modal gap", _gap_plot(out / "gap.png", ev),
        "Caption loss with another document's visual minus with its own: positive means the model reads the pixels. "
        "Error bars: the 95% interval over documents; a bar whose interval crosses 0 is not distinguishable from 0.")

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
    for title, name, caption in sections:  # inline: index.html is the whole report, to mail or attach
        data = base64.b64encode((out / name).read_bytes()).decode("ascii")
        parts.append(f"<h2>{html.escape(title)}</h2><img src='data:image/png;base64,{data}' alt='{html.escape(title)}' "
                     f"title='{html.escape(name)}'>")
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
        description="Write RUN/report/index.html, one self-contained page (plots inline; the PNGs are also written "
        "beside it): loss per modality (raw and smoothed), learning rate, gradient norm, tokens/s, expert load heatmaps, "
        "padding fraction, output norm (trend and jumps) and (with --eval) the cross-modal gap with its interval.",
    )
    p.add_argument("run", help="training run folder (holds metrics.jsonl)")
    p.add_argument("--eval", default=None, help="JSON written by `omniloom eval --out` (adds the cross-modal gap)")
    p.add_argument("--out", default=None, help="output folder (default RUN/report)")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    index = write_report(args.run, eval_json=args.eval, out_dir=args.out)
    print(f"report written: {index}")
    return 0
