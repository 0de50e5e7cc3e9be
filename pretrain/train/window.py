"""A logging window's metrics: what the trainer sums over the steps between two log lines
(Window), the averages it logs from them (window_metrics), and the loader's counters summed over
ranks (rank_loader_metrics). pretrain/train/loop.py owns the step vector these sums come from."""

from __future__ import annotations

import torch

from . import build as B
from .metrics import expert_balance, mfu, per_modality_losses


class Window:
    """Sums over the steps between two log lines; `keys` are the step's mean statistics summed
    here (the trainer's MEAN_KEYS but the loss)."""

    def __init__(self, keys):
        self.steps, self.wall, self.tokens, self.visual_flops = 0, 0.0, 0.0, 0.0
        self.sums = {k: 0.0 for k in keys}
        self.ce_sum_M = torch.zeros(B.NUM_MODALITIES, dtype=torch.float64)
        self.count_M = torch.zeros(B.NUM_MODALITIES, dtype=torch.float64)
        self.counts_LME = None
        self.indexer_kl = self.coverage = None
        self.phases: dict[str, float] = {}

    def add(self, stats: dict, counts_LME, wall: float, phases: dict) -> None:
        self.steps += 1
        self.wall += wall
        self.tokens += stats["tokens"]
        self.visual_flops += stats["visual_flops"]
        for k in self.sums:
            self.sums[k] += stats[k]
        self.ce_sum_M += stats["ce_sum_M"]
        self.count_M += stats["count_M"]
        self.indexer_kl = stats["indexer_kl"] if self.indexer_kl is None else self.indexer_kl + stats["indexer_kl"]
        self.coverage = stats["coverage"] if self.coverage is None else self.coverage + stats["coverage"]
        if counts_LME is not None:  # summed on the device; read once, at the log line
            c = counts_LME.detach().double()
            self.counts_LME = c if self.counts_LME is None else self.counts_LME + c
        for k, v in phases.items():
            self.phases[k] = self.phases.get(k, 0.0) + v


def window_metrics(w: Window, *, num_processes: int, flops_per_token: float, peak_flops: float | None,
                   indexer_layers: list[int] | None) -> dict:
    """Averages over the window's steps. `indexer_layers`: the B layers of a learned selector
    (their loss, KL and coverage are logged), None without one."""
    n = max(1, w.steps)
    out = {k: w.sums[k] / n for k in ("ce_loss", "z_loss", "aux_loss", "router_z_loss")}
    out["final_out_rms"] = w.sums["out_norm"] / n
    if indexer_layers is not None:  # the learned B-layer selector: its loss, KL and coverage per layer
        out["indexer/loss"] = w.sums["indexer_loss"] / n
        for j, layer in enumerate(indexer_layers):
            out[f"indexer/kl_layer{layer}"] = float(w.indexer_kl[j]) / n
            out[f"attn/coverage_layer{layer}"] = float(w.coverage[j]) / n
    out.update(per_modality_losses(w.ce_sum_M, w.count_M, "loss"))
    tokens_per_s = w.tokens / max(w.wall, 1e-9)
    out["tokens_per_s"] = tokens_per_s
    out["tokens_per_s_per_device"] = tokens_per_s / num_processes
    visual = w.visual_flops / max(w.wall, 1e-9) / num_processes  # a vision encoder's FLOPs
    u = mfu(flops_per_token, out["tokens_per_s_per_device"], peak_flops, visual)
    if u is not None:
        out["mfu"] = u
    phases = sum(w.phases.values())
    for name, seconds in w.phases.items():
        out[f"time/{name}_s"] = seconds / n
    out["data_wait_fraction"] = w.phases.get("data", 0.0) / max(w.wall, 1e-9)
    out["step_time_s"] = w.wall / n
    out["time/other_s"] = max(0.0, w.wall - phases) / n
    if w.counts_LME is not None:
        counts = w.counts_LME.cpu()
        out.update(expert_balance(counts))
        out["moe/counts_LME"] = counts.tolist()  # raw loads for the report's heatmap (JSONL only)
    return out


def rank_loader_metrics(train_loader, num_processes: int) -> dict:
    """The loader's counters under `data/` (build.loader_metrics). With several processes the
    padding fraction and the token shares are over every rank's batches (the window's counts
    summed over ranks), not this rank's part of the global batch, which with grouped shards can
    be mostly one modality; the skip counts (`data/skipped/*`, `data/skipped_total`) and the
    tokenizer's counters (`data/tokenizer/*`) are summed over ranks too. One gather of each
    rank's counts as objects (the skip reasons differ between ranks). The rates and the
    document cache's figures stay this rank's. A collective: every rank calls it on the same
    (logging) steps."""
    out = B.loader_metrics(train_loader)
    if num_processes == 1 or not hasattr(train_loader, "last_window"):
        return out
    from accelerate.utils import gather_object

    from omniloom.data.stream.loader import composition

    window = train_loader.last_window or {"tokens": [0] * B.NUM_MODALITIES, "padding": 0}
    counts = {k: v for k, v in out.items()
              if k.startswith(("data/skipped/", "data/tokenizer/")) or k == "data/skipped_total"}
    tokens, padding, summed = [0] * B.NUM_MODALITIES, 0, {}
    for rank_window, rank_counts in gather_object([(window, counts)]):
        tokens = [a + b for a, b in zip(tokens, rank_window["tokens"], strict=True)]
        padding += rank_window["padding"]
        for k, v in rank_counts.items():
            summed[k] = summed.get(k, 0.0) + v
    out.update({f"data/{k}": v for k, v in composition(tokens, padding).items()})
    out.update(summed)
    return out
