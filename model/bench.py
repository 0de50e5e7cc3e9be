"""`omniloom bench model`: MoE dispatch and attention backend throughput, as ratios within one run.

1. Forward + backward tokens/s of a small MoE model with grouped-matmul dispatch against the
   per-expert loop (same weights, same batch).
2. One attention layer's forward + backward time, blocksparse against sdpa, at growing sequence
   lengths (one document of text), with the time ratio per doubling: a window layer should cost
   about 2x per doubling (linear), dense sdpa about 4x (quadratic).
3. Packed short documents (the demo's rows of captioned images): one L layer's forward + backward
   with the small spans gathered into padded calls against one kernel call per span, and the conv
   patch stem channels-last (as the model runs it) against the same weights in NCHW.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
from tqdm import tqdm

from . import span_attention
from .attention import AttnContext
from .config import AttentionConfig, ModelConfig, MoEConfig
from .decoder import OmniModel
from .embeddings import ConvStem
from .masks import batch_layout, build_mask_info
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


def bench_packed(*, device: torch.device, rows: int, seq_len: int, doc_len: int, visual: int, num_heads: int,
                 num_kv_heads: int, head_dim: int, window: int, stem_rows: int, stem_width: int, warmup: int,
                 iters: int) -> dict[str, float]:
    """Seconds per forward + backward of (a) the conv patch stem on `stem_rows` 16x16 RGB patches
    as the model runs it (channels-last) and the same weights in NCHW (the reference); (b) one L
    layer over `rows` rows packed with documents of `doc_len` tokens, each a visual block of
    `visual` tokens after its first token (a captioned image), blocksparse backend: small spans
    batched (span_attention.SpanPlan, the default) and one call per span (the thresholds set to
    0; CPU only: elsewhere spans are one sdpa call each).

    Each pair is timed in alternating rounds (the median of the rounds' medians): on the CPU a
    convolution's speed moved by 10-20% depending on which kernels ran just before it (the stem
    timed right after the attention calls came out 0.85-0.95x, alone and alternating 1.2-1.35x)."""
    out: dict[str, float] = {}
    sync = sync_for(device)
    g = torch.Generator(device=device).manual_seed(0)
    rounds = 3

    def alternate(fns: dict) -> None:
        times = {name: [] for name in fns}
        for r in range(rounds):
            for name, fn in fns.items():
                times[name].append(_time(fn, warmup=warmup if r == 0 else 1, iters=iters, sync=sync))
        out.update({name: statistics.median(t) for name, t in times.items()})

    torch.manual_seed(0)
    stem = ConvStem(3, 16, stem_width).to(device)
    x = torch.randn(stem_rows, 3 * 16 * 16, generator=g, device=device)
    gy = torch.randn(stem_rows, stem.out_features, generator=g, device=device)

    def nchw():
        h = torch.nn.functional.gelu(stem.conv1(x.reshape(-1, 3, 16, 16)))
        torch.nn.functional.gelu(stem.conv2(h)).flatten(1).backward(gy)

    alternate({"stem channels-last": lambda: stem(x).backward(gy), "stem NCHW": nchw})
    pos = torch.arange(seq_len, device=device)
    doc = (pos // doc_len).to(torch.int32).expand(rows, seq_len).contiguous()
    off = pos % doc_len
    blk = torch.where((off >= 1) & (off < 1 + visual), pos // doc_len, -1).to(torch.int32).expand(rows, seq_len).contiguous()
    info = build_mask_info(doc, blk, block_size=32, window=window)
    layout = batch_layout(doc, blk, block_size=32, window=window, num_selected=4)
    q = torch.randn(rows, seq_len, num_heads, head_dim, generator=g, device=device).transpose(1, 2).requires_grad_()
    k = torch.randn(rows, num_kv_heads, seq_len, head_dim, generator=g, device=device, requires_grad=True)
    v = torch.randn(rows, num_kv_heads, seq_len, head_dim, generator=g, device=device, requires_grad=True)
    w = torch.randn(rows, num_heads, seq_len, head_dim, generator=g, device=device)

    def layer():
        ctx = AttnContext(info, "blocksparse", 4, q.device, layout)  # the plan is built per forward, as in the model
        (ctx.attend(q, k, v, "L") * w).sum().backward()

    def per_span():
        before = span_attention.SMALL_QUERIES
        span_attention.SMALL_QUERIES = 0
        try:
            layer()
        finally:
            span_attention.SMALL_QUERIES = before

    alternate({"spans batched": layer, **({"spans per span": per_span} if device.type == "cpu" else {})})
    return out
