"""Training metrics: JSONL + experiment trackers (trackers.py: TensorBoard, W&B, MLflow, ...) + a tqdm bar on rank 0, MFU from a
peak-FLOPs table, expert load balance summaries, and a step timer for the data/forward/backward/
optimizer breakdown.

Legend: L layers, M modalities (5: text, code, image, video, special), E experts.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from omniloom.data.progress import bar_wanted, hms
from omniloom.pretrain.rundir import METRICS, TENSORBOARD

log = logging.getLogger(__name__)

MODALITY_NAMES = ("text", "code", "image", "video", "special")

# Dense bf16 tensor-core peak, TFLOP/s per device (without the 2:4 sparsity factor). Matched by
# substring of torch.cuda.get_device_name(); the first match wins, so specific names come first.
PEAK_BF16_TFLOPS = (
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("H800", 989.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
    ("RTX 4090", 165.0),
    ("RTX 3090", 71.0),
    ("MI300X", 1307.0),
)


def peak_flops_per_device(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of `device`, or None on CPU / unknown GPUs (MFU is then omitted)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops * 1e12
    log.warning("no peak-FLOPs entry for GPU '%s'; MFU will not be reported", name)
    return None


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: float | None,
        extra_flops_per_s_per_device: float = 0.0) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the device's peak (None without a peak).
    `extra_flops_per_s_per_device`: FLOPs counted per batch rather than per token (a vision
    encoder's, which depend on the batch's visual blocks)."""
    if not peak or not flops_per_token:
        return None
    return (flops_per_token * tokens_per_s_per_device + extra_flops_per_s_per_device) / peak


def expert_balance(expert_counts_LME: torch.Tensor) -> dict[str, float]:
    """Summaries of expert load (token counts per layer, modality, expert), already summed over the
    steps and ranks being reported. For each MoE layer: max load over mean load (1.0 = perfect
    balance) across all modalities, and per modality where that modality had tokens."""
    out: dict[str, float] = {}
    counts = expert_counts_LME.detach().double().cpu()
    if counts.ndim != 3 or counts.numel() == 0:
        return out
    for layer in range(counts.shape[0]):
        per_layer_E = counts[layer].sum(0)
        if per_layer_E.sum() <= 0:
            continue  # a dense layer (no experts) reports all zeros
        out[f"moe/max_over_mean/layer{layer}"] = float(per_layer_E.max() / per_layer_E.mean())
        for m in range(counts.shape[1]):
            row_E = counts[layer, m]
            if row_E.sum() > 0 and m < len(MODALITY_NAMES):
                out[f"moe/max_over_mean/layer{layer}/{MODALITY_NAMES[m]}"] = float(row_E.max() / row_E.mean())
    layer_vals = [v for k, v in out.items() if k.count("/") == 2]
    if layer_vals:
        out["moe/max_over_mean"] = max(layer_vals)
    return out


def per_modality_losses(ce_sum_M: torch.Tensor, count_M: torch.Tensor, prefix: str) -> dict[str, float]:
    """Mean cross-entropy per modality from (sum, count) tensors; modalities without tokens are left out."""
    out = {}
    for m, name in enumerate(MODALITY_NAMES[: ce_sum_M.numel()]):
        n = float(count_M[m])
        if n > 0:
            out[f"{prefix}/{name}"] = float(ce_sum_M[m]) / n
    return out


class StepTimer:
    """Accumulates wall time per phase (`with timer.phase("forward"):`). On CUDA each phase ends
    with a synchronize when `sync=True` so the split is real, at a small cost (bench mode)."""

    PHASES = ("data", "forward", "backward", "optimizer")

    def __init__(self, sync: bool = False):
        self.sync = sync and torch.cuda.is_available()
        self.totals = {p: 0.0 for p in self.PHASES}

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """Return the totals since the last pop and reset them."""
        totals, self.totals = self.totals, {p: 0.0 for p in self.PHASES}
        return totals


def peak_memory(device: torch.device | None) -> tuple[int, str]:
    """(bytes, what) of this process's peak memory so far: the CUDA caching allocator's largest
    allocation ("GPU") on a CUDA device, else the peak resident set size ("RSS"). A host read of
    counters: no device sync."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(device)), "GPU"
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024), "RSS"  # macOS says bytes, Linux KiB
    except (ImportError, OSError):
        return 0, "RSS"


class MetricsLogger:
    """Rank-0 sink for metric dicts: one JSON object per line in `run_dir/metrics.jsonl`, the
    experiment trackers of `logging.trackers` (trackers.py; TensorBoard under `run_dir/tb`), and progress: a tqdm bar
    (loss, tokens/s) when `progress` and stderr is a terminal that reports a width, otherwise
    (a launcher, a pipe, a log file, a pty of 0 columns or COLUMNS=0) one log line every
    `progress_seconds` (step, loss, tokens/s, the mean step time since the last line, the peak
    memory so far, elapsed, time left) so that the run is never silent for minutes. `progress_seconds=0` turns the lines off.

    Other ranks get a logger whose methods do nothing, so the loop needs no rank checks."""

    def __init__(self, accelerator, run_dir: str | Path, *, total_steps: int, start_step: int,
                 trackers: list[str] | tuple = (), run_name: str, project: str = "omniloom", hparams: dict | None = None,
                 progress: bool = True, progress_seconds: float = 30.0):
        self.acc = accelerator
        self.enabled = accelerator.is_main_process
        self.path = Path(run_dir) / METRICS
        self._bar = None
        self.trackers = None
        self.total_steps, self.start_step = total_steps, start_step
        self.progress_seconds = progress_seconds
        self._t0 = self._last_line = time.perf_counter()
        self._line_step = start_step  # the step of the last periodic line: step time is the mean since
        self._tokens0: int | None = None
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step > 0:
            _drop_rows_after(self.path, start_step)
        self._fh = open(self.path, "a", buffering=1)
        if trackers:
            from .trackers import Trackers

            self.trackers = Trackers(list(trackers), Path(run_dir), run_name=run_name, project=project,
                                     resuming=start_step > 0, tb_dir=Path(run_dir) / TENSORBOARD)
            flat = _flat_hparams(hparams or {})
            tb = self.trackers.get("tensorboard")
            if tb is not None:
                _write_hparams(tb.writer, flat)
            self.trackers.config(hparams or {}, flat)
            if self.trackers.names:
                log.info("trackers: %s (metric names as group/name: loss -> train/loss)", ", ".join(self.trackers.names))
        if progress and bar_wanted(sys.stderr):
            # a terminal that reports 0 columns (COLUMNS=0, some CI ptys) would get an empty bar:
            # it gets the periodic lines instead
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                             mininterval=1.0)

    def log(self, record: dict, step: int) -> None:
        """Write `record` (floats, ints, strings) for `step` to every sink."""
        if not self.enabled:
            return
        clean = {k: _plain(v) for k, v in record.items()}
        clean["step"] = step
        self._fh.write(json.dumps(clean, allow_nan=True) + "\n")
        if self.trackers is not None:
            self.trackers.log(clean, step)
            counts = clean.get("moe/counts_LME")
            if counts is not None:
                from .trackers import heat_map

                img = heat_map(counts)
                if img is not None:
                    self.trackers.images({"moe/expert_load": img}, step)

    def progress(self, step: int, postfix: dict | None = None, *, tokens_seen: int | None = None) -> None:
        """Advance the bar (or write the periodic line) to `step`; `tokens_seen` gives tokens/s."""
        if not self.enabled:
            return
        now = time.perf_counter()
        postfix = dict(postfix or {})
        if tokens_seen is not None:
            if self._tokens0 is None:  # the first step's tokens count from the logger's start
                self._tokens0 = 0 if self.start_step == 0 else tokens_seen
            rate = (tokens_seen - self._tokens0) / max(now - self._t0, 1e-9)
            postfix["tok/s"] = f"{rate:,.0f}"
        if self._bar is not None:
            self._bar.n = step
            if postfix:
                self._bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in postfix.items()},
                                      refresh=False)
            self._bar.refresh()
            return
        last = step >= self.total_steps
        if self.progress_seconds > 0 and (now - self._last_line >= self.progress_seconds or last):
            if step > self._line_step:
                postfix["step time"] = f"{(now - self._last_line) / (step - self._line_step):.2f}s"
            peak, what = peak_memory(getattr(self.acc, "device", None))
            if peak:
                postfix["peak mem"] = f"{peak / 2**30:.2f} GiB ({what})"
            self._last_line, self._line_step = now, step
            log.info("%s", self.progress_line(step, postfix, now))

    def progress_line(self, step: int, postfix: dict, now: float | None = None) -> str:
        now = time.perf_counter() if now is None else now
        elapsed = now - self._t0
        done = step - self.start_step
        parts = [f"step {step}/{self.total_steps} ({100.0 * step / max(self.total_steps, 1):.0f}%)"]
        parts += [f"{k} {f'{v:.4g}' if isinstance(v, float) else v}" for k, v in postfix.items()]
        parts.append(f"elapsed {hms(elapsed)}")
        if 0 < done and step < self.total_steps:
            parts.append(f"left ~{hms(elapsed / done * (self.total_steps - step))}")
        return ", ".join(parts)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        self._fh.close()
        if self.trackers is not None:
            self.trackers.close()


def _write_hparams(writer, flat: dict) -> None:
    """The run config as TensorBoard hyperparameters, in the main run's own event file (what
    SummaryWriter.add_hparams does, minus the sub-run it creates)."""
    if not flat or writer is None or not hasattr(writer, "file_writer"):
        return
    from torch.utils.tensorboard.summary import hparams

    exp, ssi, sei = hparams(flat, {})
    for summary in (exp, ssi, sei):
        writer.file_writer.add_summary(summary)
    writer.flush()


def _drop_rows_after(path: Path, step: int) -> None:
    """On resume, forget the rows a killed run wrote after its last checkpoint: those steps are
    about to be trained again, and each step should appear once in the file."""
    if not path.exists():
        return
    keep, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            row_step = json.loads(line).get("step", 0)
        except ValueError:  # a line cut off by the kill
            dropped += 1
            continue
        if row_step <= step:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        tmp.replace(path)
        log.info("metrics.jsonl: dropped %d rows after step %d (re-trained after the resume)", dropped, step)


def _plain(v):
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def _flat_hparams(tree: dict, prefix: str = "") -> dict:
    """TensorBoard hparams accept only scalars and strings: flatten and stringify the rest."""
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flat_hparams(v, key + "."))
        elif isinstance(v, (int, float, str, bool)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


