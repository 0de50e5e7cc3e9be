"""`omniloom bench model`: MoE dispatch and attention backend throughput, as ratios within one run.

1. Forward + backward tokens/s of a small MoE model with grouped-matmul dispatch against the
   per-expert loop (same weights, same batch).
2. One attention layer's forward + backward time, blocksparse against sdpa, at growing sequence
   lengths (one document of text), with the time ratio per doubling: a window layer should cost
   about 2x per doubling (linear), dense sdpa about 4x (quadratic).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from tqdm import tqdm

from .attention import AttnContext
from .config import AttentionConfig, ModelConfig, MoEConfig
from .decoder import OmniModel
from .masks import build_mask_info
from .synthetic import random_packed_batch


def _time(fn, *, warmup: int, iters: int, sync) -> float:
    """Median seconds of fn() over iters calls after warmup calls."""
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync_for(device: torch.device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def bench_moe_dispatch(*, device: torch.device, dim: int, num_experts: int, seq_len: int, batch_size: int,
                       warmup: int, iters: int) -> dict[str, float]:
    """Tokens/s of forward+backward for grouped vs loop dispatch on a small MoE model."""
    base = ModelConfig(
        dim=dim, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=1024, patch_token_id=1023,
        rope_sections=_sections(dim // 4), patch_dim=48, tubelet_dim=96,
        attention=AttentionConfig(backend="blocksparse", pattern="L", window=128, block_size=64),
        moe=MoEConfig(num_experts=num_experts, num_experts_per_token=2, expert_dim=dim, num_shared_experts=1, num_dense_layers=0),
    )
    batch = {k: v.to(device) for k, v in random_packed_batch(base, batch_size=batch_size, seq_len=seq_len, docs_per_row=2).items()}
    torch.manual_seed(0)
    models = {}
    for mode in ("grouped", "loop"):
        cfg = dataclasses.replace(base, moe=dataclasses.replace(base.moe, dispatch=mode))
        models[mode] = OmniModel(cfg).to(device)
    models["loop"].load_state_dict(models["grouped"].state_dict())
    tokens = batch_size * seq_len
    out = {}
    for mode, model in models.items():
        def step(model=model):
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
        out[mode] = tokens / _time(step, warmup=warmup, iters=iters, sync=sync_for(device))
    return out


def _sections(head_dim: int) -> tuple[int, int, int]:
    t = (head_dim // 4) // 2 * 2
    h = ((head_dim - t) // 2) // 2 * 2
    return (t, h, head_dim - t - h)


def bench_attention(*, device: torch.device, seq_lens: list[int], kinds: str, backends: list[str], num_heads: int,
                    num_kv_heads: int, head_dim: int, window: int, block_size: int, num_selected: int,
                    warmup: int, iters: int, sdpa_max: int, dtype: torch.dtype,
                    warmup_each: bool = False, selector: str = "pooled", indexer_dim: int = 64,
                    indexer_heads: int = 2) -> dict[tuple[str, str, int], float]:
    """Seconds per forward+backward of one attention layer for each (kind, backend, seq_len).
    `warmup_each`: warm up at every length (compiled flex compiles once per shape).
    `selector=indexer`: B layers score blocks with index tensors of that width and also compute
    the training statistics (KL loss toward the dense block mass, coverage) on 16 sampled blocks."""
    results = {}
    jobs = [(k, b, s) for k in kinds for b in backends for s in seq_lens if not (b == "sdpa" and s > sdpa_max)]
    for kind, backend, S in tqdm(jobs, desc="attention", leave=False):
        g = torch.Generator(device=device).manual_seed(0)
        doc = torch.zeros(1, S, dtype=torch.int32, device=device)
        blk = torch.full((1, S), -1, dtype=torch.int32, device=device)
        q = torch.randn(1, num_heads, S, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(1, num_kv_heads, S, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(1, num_kv_heads, S, head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
        index = None
        if kind == "B" and selector == "indexer":
            nq = -(-S // block_size)
            index = (torch.randn(1, num_kv_heads, indexer_heads, nq, indexer_dim, generator=g, device=device, dtype=dtype, requires_grad=True),
                     torch.randn(1, num_kv_heads, S, indexer_dim, generator=g, device=device, dtype=dtype, requires_grad=True))

        def step():
            # the mask description is built per forward in the model too: include it
            info = build_mask_info(doc, blk, block_size=block_size, window=window)
            ctx = AttnContext(info, backend, num_selected, q.device)
            out, stats = ctx.attend_stats(q, k, v, kind, index=index)
            loss = out.sum() + (stats["kl"] if stats is not None and "kl" in stats else 0)
            loss.backward()

        # warm up once per (kind, backend), at its shortest length: a warm-up at 16k sdpa costs a minute
        first = warmup_each or S == min(s for k_, b_, s in jobs if (k_, b_) == (kind, backend))
        results[(kind, backend, S)] = _time(step, warmup=warmup if first else 0, iters=iters, sync=sync_for(device))
    return results


def format_attention(results, seq_lens, kinds, backends) -> list[str]:
    lines = []
    head = f"{'kind':<5}{'backend':<13}" + "".join(f"{s:>10}" for s in seq_lens) + "   per doubling (ms ratio)"
    lines.append(head)
    for kind in kinds:
        for backend in backends:
            times = [results.get((kind, backend, s)) for s in seq_lens]
            cells = "".join(f"{t * 1e3:>8.1f}ms" if t is not None else f"{'-':>10}" for t in times)
            ratios = [f"{b / a:.2f}x" for a, b in zip(times, times[1:]) if a is not None and b is not None]
            lines.append(f"{kind:<5}{backend:<13}{cells}   {' '.join(ratios)}")
        if "sdpa" in backends:
            for backend in backends:
                if backend == "sdpa":
                    continue
                speed = [
                    f"{s}: {results[(kind, 'sdpa', s)] / results[(kind, backend, s)]:.2f}x"
                    for s in seq_lens
                    if (kind, "sdpa", s) in results and (kind, backend, s) in results
                ]
                if speed:
                    lines.append(f"     {backend} speedup over sdpa: {', '.join(speed)}")
    return lines
