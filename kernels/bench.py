"""`omniloom bench kernels`: per-kernel accuracy against float64, time of the fast (Triton) path and
of the eager reference, speedup and peak memory, at the widths of a ~1B-active MoE; a summary in
the manner of KernelBench (share correct, share faster than eager = fast_1, geometric-mean
speedup); and the peak memory of the chunked linear cross-entropy against the naive logits path.

Every timed step is forward + backward (the training cost). Peak memory: on CUDA
`torch.cuda.max_memory_allocated` above the inputs; on CPU the growth of the resident set of a
fresh process (VmHWM, reset once the inputs exist, minus the RSS then), so each CPU figure costs one
subprocess run (`python -m omniloom.kernels.bench --child SPEC`).

Shapes: T tokens, D width, V vocab, E experts, K experts per token, M rows, N columns.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from . import parity
from .ops import get_ops, triton_usable

GiB = 1024**3
KEEP_SPEEDUP = 1.3  # a Triton kernel earns its place at this speedup over eager (issue 13)


def compiled_reference_ops():
    """The reference ops, each under torch.compile: what a Triton kernel must beat to stay."""
    from types import SimpleNamespace

    from . import reference
    from .ops import OP_NAMES

    return SimpleNamespace(name="compiled", **{n: torch.compile(getattr(reference, n)) for n in OP_NAMES})


def resolve_device(name: str) -> str:
    """A benchmark's `--device`: `auto` is cuda when one is visible, else cpu; cuda without one,
    or anything else, is a ValueError saying what to pass."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("--device cuda but no CUDA device is visible; use --device cpu")
    if name != "cpu" and not name.startswith("cuda"):
        raise ValueError(f"unknown --device {name!r}; use auto, cuda or cpu")
    return name


def case_at(op: str, s: dict, tokens: int) -> dict:
    """A MODEL_CASES shape with its token dimension set to `tokens` (widths unchanged)."""
    s = dict(s)
    if op == "rms_norm":
        s["M"] = tokens
    elif op == "swiglu":
        s["M"] = tokens * 8  # routed rows: 8 experts per token
    elif op in ("apply_rope", "qk_norm_rope"):
        s["S"] = min(tokens, 2048)
        s["B"] = max(1, tokens // s["S"])
    elif op in ("linear_cross_entropy", "moe"):
        s["T"] = tokens
        if op == "linear_cross_entropy":
            s["chunk"] = min(s["chunk"], tokens)
    return s


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn, device: str, warmup: int, iters: int) -> float:
    """Median wall time of fn() in ms after `warmup` calls (CUDA: synchronized around each call)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def cuda_peak_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak_rss() -> int:
    """Reset the high-water mark to the current RSS (Linux >= 4.0) and return the RSS in bytes.
    VmHWM, not ru_maxrss: the latter survives exec and would report the parent's peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not permitted: VmHWM still starts at this fresh process's own peak
        pass
    return _status_kib("VmRSS") * 1024


def _peak_rss() -> int:
    return _status_kib("VmHWM") * 1024


def _child(spec: dict) -> dict:
    """Run one fwd+bwd step in this (fresh) process and report the RSS growth over the inputs."""
    torch.set_num_threads(max(1, torch.get_num_threads()))
    op, s, dtype = spec["op"], spec["shapes"], getattr(torch, spec["dtype"])
    if op == "ce_naive":
        g = torch.Generator().manual_seed(0)
        h = torch.randn(s["T"], s["D"], generator=g, dtype=dtype)
        w = (torch.randn(s["V"], s["D"], generator=g, dtype=dtype) * s["D"] ** -0.5).requires_grad_(spec["backward"])
        labels = torch.randint(0, s["V"], (s["T"],), generator=g)
        base = _reset_peak_rss()
        logits = h.float() @ w.float().t()
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        z = torch.logsumexp(logits, -1).square()
        if spec["backward"]:
            (ce.sum() + 1e-4 * z.sum()).backward()
    else:
        inp = parity.make_inputs(op, s, dtype, "cpu")
        ops = get_ops("reference")
        base = _reset_peak_rss()
        parity.run(op, ops, inp, s)
    return {"peak_bytes": max(0, _peak_rss() - base)}


def cpu_peak_bytes(spec: dict) -> int | None:
    """Peak RSS growth of one step in a fresh process, or None if the child failed."""
    proc = subprocess.run(
        [sys.executable, "-m", "omniloom.kernels.bench", "--child", json.dumps(spec)],
        capture_output=True, text=True, env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
    )
    if proc.returncode != 0:
        print(f"  (memory child failed: {proc.stderr.strip().splitlines()[-1:]})", flush=True)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_bytes"]


@dataclass
class Row:
    op: str
    shapes: dict
    err_fast: float | None
    err_ref: float
    correct: bool
    ms_fast: float | None
    ms_ref: float
    mem_fast: int | None
    mem_ref: int | None
    ms_compiled: float | None = None  # the reference under torch.compile (--compile)

    @property
    def speedup(self) -> float | None:
        return None if self.ms_fast is None else self.ms_ref / self.ms_fast

    @property
    def verdict(self) -> str:
        """Issue 13's rule: a kernel stays if it is at least KEEP_SPEEDUP x eager and faster than
        torch.compile of its reference; otherwise compiled PyTorch should replace it."""
        if self.ms_fast is None:
            return "n/a"
        if not self.correct:
            return "wrong"
        if self.ms_compiled is not None and self.ms_compiled <= self.ms_fast:
            return "use compile"
        return "keep" if self.speedup >= KEEP_SPEEDUP else "slow"


def _err_vs_float64(op: str, s: dict, dtype, device, ops) -> float:
    r = parity.run_case(op, s, dtype, device, ops, get_ops("reference"), ref_dtype=torch.float64)
    if not all(r.exact.values()):
        return math.inf
    return r.max_error


def _fmt_mem(b: int | None) -> str:
    return "n/a" if b is None else f"{b / 2**20:.0f}M"


def bench_kernels(*, device: str, dtype: torch.dtype, tokens: int, check_tokens: int, warmup: int, iters: int,
                  ops_filter: list[str] | None = None, measure_memory: bool = True, compare_compile: bool = False) -> list[Row]:
    """Run every MODEL_CASES kernel; print one line per kernel and return the rows.
    `compare_compile`: also time each reference under torch.compile (its compile falls in the
    warm-up calls) and print the verdict: keep the kernel, or use the compiled reference."""
    fast = get_ops("triton") if device.startswith("cuda") and triton_usable()[0] else None
    ref = get_ops("reference")
    compiled = compiled_reference_ops() if compare_compile else None
    rows = []
    print(f"{'kernel':<22} {'shape':<34} {'err fast':>9} {'err ref':>9} {'ok':>3} {'fast ms':>9} "
          f"{'eager ms':>9} {'speedup':>8} {'mem fast':>9} {'mem eager':>9}"
          + (f" {'compiled ms':>11} {'verdict':>11}" if compiled else ""), flush=True)
    for op, base_s in parity.MODEL_CASES:
        if ops_filter and op not in ops_filter:
            continue
        s, s_chk = case_at(op, base_s, tokens), case_at(op, base_s, check_tokens)
        err_ref = _err_vs_float64(op, s_chk, dtype, device, ref)
        err_fast = _err_vs_float64(op, s_chk, dtype, device, fast) if fast else None
        # correct: within the dtype's tolerance, or no worse than twice the eager reference's own error
        bound = max(parity.TOLERANCE[dtype], 2 * err_ref)
        correct = (err_fast if fast else err_ref) <= bound
        inp = parity.make_inputs(op, s, dtype, device)
        with torch.no_grad():
            cots = parity.make_cotangents({k: v.requires_grad_() if v.is_floating_point() else v
                                           for k, v in parity.forward(op, ref, inp, s).items()})
        ms_ref = time_ms(lambda: parity.run(op, ref, inp, s, cots=cots), device, warmup, iters)
        ms_fast = time_ms(lambda: parity.run(op, fast, inp, s, cots=cots), device, warmup, iters) if fast else None
        ms_compiled = None
        if compiled is not None:
            ms_compiled = time_ms(lambda: parity.run(op, compiled, inp, s, cots=cots), device, max(warmup, 2), iters)
        mem_fast = mem_ref = None
        if measure_memory:
            if device.startswith("cuda"):
                mem_ref = cuda_peak_bytes(lambda: parity.run(op, ref, inp, s, cots=cots))
                mem_fast = cuda_peak_bytes(lambda: parity.run(op, fast, inp, s, cots=cots)) if fast else None
            else:
                mem_ref = cpu_peak_bytes({"op": op, "shapes": s, "dtype": str(dtype).replace("torch.", "")})
        del inp, cots
        row = Row(op, s, err_fast, err_ref, correct, ms_fast, ms_ref, mem_fast, mem_ref, ms_compiled)
        rows.append(row)
        shape = ",".join(f"{k}={v}" for k, v in s.items())
        print(f"{op:<22} {shape:<34} {'n/a' if err_fast is None else f'{err_fast:.1e}':>9} {err_ref:>9.1e} "
              f"{'yes' if correct else 'NO':>3} {'n/a' if ms_fast is None else f'{ms_fast:.3f}':>9} {ms_ref:>9.3f} "
              f"{'n/a' if row.speedup is None else f'{row.speedup:.2f}x':>8} {_fmt_mem(mem_fast):>9} {_fmt_mem(mem_ref):>9}"
              + (f" {ms_compiled:>11.3f} {row.verdict:>11}" if compiled is not None else ""),
              flush=True)
    return rows


def summarize(rows: list[Row]) -> dict:
    """KernelBench-style figures: share correct, fast_1 (correct and faster than eager), geomean speedup."""
    n = len(rows)
    timed = [r for r in rows if r.speedup is not None]
    out = {"kernels": n, "correct": sum(r.correct for r in rows) / max(n, 1)}
    if timed:
        out["fast_1"] = sum(r.correct and r.speedup > 1 for r in timed) / len(timed)
        out["geomean_speedup"] = math.exp(sum(math.log(r.speedup) for r in timed) / len(timed))
        out[f"at_least_{KEEP_SPEEDUP}x"] = sum(r.correct and r.speedup >= KEEP_SPEEDUP for r in timed) / len(timed)
    if any(r.ms_compiled is not None for r in timed):
        out["verdicts"] = {r.op: r.verdict for r in timed}
    return out


def print_summary(rows: list[Row], fast_available: bool) -> None:
    s = summarize(rows)
    line = f"summary: {s['kernels']} kernels, correct {s['correct']:.0%}"
    if fast_available and "fast_1" in s:
        line += (f", faster than eager (fast_1) {s['fast_1']:.0%}, at least {KEEP_SPEEDUP}x eager "
                 f"{s[f'at_least_{KEEP_SPEEDUP}x']:.0%}, geomean speedup {s['geomean_speedup']:.2f}x")
    else:
        line += " (reference vs float64); Triton timings need CUDA: fast_1 and speedups not measured"
    print(line, flush=True)
    if "verdicts" in s:
        give_way = [op for op, v in s["verdicts"].items() if v != "keep"]
        print("verdicts (keep: correct, >= %.1fx eager and faster than torch.compile of the reference): %s%s" % (
            KEEP_SPEEDUP, ", ".join(f"{op} {v}" for op, v in s["verdicts"].items()),
            f"; give way to compiled PyTorch or fix: {', '.join(give_way)}" if give_way else "; every kernel stays"), flush=True)


def ce_memory(*, device: str, tokens: int, vocab: int, dim: int, chunks: list[int], naive_backward: bool) -> dict:
    """Peak memory of the chunked linear-CE (fwd+bwd) against the naive logits path; prints a table."""
    res: dict = {"tokens": tokens, "vocab": vocab, "dim": dim}
    logits_bytes = tokens * vocab * 4
    naive_kind = "fwd+bwd" if naive_backward else "fwd"
    if device.startswith("cuda"):
        method = "torch.cuda.max_memory_allocated above the inputs"
        inp = parity.make_inputs("linear_cross_entropy", dict(T=tokens, D=dim, V=vocab), torch.bfloat16, device)
        h, w, labels = inp["h"], inp["weight"], inp["labels"].clamp_min(0)

        def naive():
            logits = h.float() @ w.float().t()
            ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
            loss = ce.sum() + 1e-4 * torch.logsumexp(logits, -1).square().sum()
            if naive_backward:
                loss.backward()

        res["naive"] = cuda_peak_bytes(naive)
        backends = [("reference", get_ops("reference"))] + ([("triton", get_ops("triton"))] if triton_usable()[0] else [])
        for name, ops in backends:
            for c in chunks:
                def step():
                    ce, z = ops.linear_cross_entropy(h, w, labels, chunk_size=c)
                    (ce.sum() + 1e-4 * z.sum()).backward()
                res[f"{name}/chunk{c}"] = cuda_peak_bytes(step)
    else:
        method = "RSS growth of a fresh process (VmHWM minus RSS, peak reset once the inputs exist)"
        need = logits_bytes * (4 if naive_backward else 3)
        avail = _mem_available()
        if avail is not None and avail < need * 1.2:
            print(f"ce memory: skipping the naive path: needs ~{need / GiB:.1f} GiB, {avail / GiB:.1f} GiB available", flush=True)
        else:
            res["naive"] = cpu_peak_bytes({"op": "ce_naive", "shapes": dict(T=tokens, V=vocab, D=dim), "dtype": "float32", "backward": naive_backward})
        for c in chunks:
            res[f"reference/chunk{c}"] = cpu_peak_bytes(
                {"op": "linear_cross_entropy", "shapes": dict(T=tokens, D=dim, V=vocab, chunk=c), "dtype": "float32"}
            )
    res["method"] = method
    print(f"linear CE peak memory, T={tokens} V={vocab} D={dim} ([T, V] fp32 logits = {logits_bytes / GiB:.2f} GiB); {method}", flush=True)
    naive_b = res.get("naive")
    print(f"  naive logits path ({naive_kind}): {'n/a' if naive_b is None else f'{naive_b / GiB:.2f} GiB'}", flush=True)
    for k, v in res.items():
        if "/chunk" in k:
            ratio = f"{v / naive_b:.3f} of naive" if naive_b and v is not None else ""
            print(f"  {k} (fwd+bwd): {'n/a' if v is None else f'{v / GiB:.3f} GiB'} {ratio}", flush=True)
    return res


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(_child(json.loads(sys.argv[2]))))
    else:
        sys.exit("internal entry point; use `omniloom bench kernels`")
