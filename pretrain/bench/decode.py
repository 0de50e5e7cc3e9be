"""`omniloom bench decode`: KV-cache memory and decode tokens/s at long context, a preset's layer
pattern against the same model with every layer global (a full-attention cache).

For each context length T the cache of every layer is filled with T random keys and values
through the cache's own append path (and, for B layers, what selection needs: index keys or
block means), then `--steps` tokens are decoded with `CachedDecoder.step`, the real decode path.
Random keys are honest here: the work and the memory of a step do not depend on their values,
and a real prefill of 128k tokens through a full-attention model is hours on a CPU. Correctness
of cached decoding is what tests/pretrain/test_generate.py checks (cached decoding equals the full
forward for every layer kind and both selectors).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

FILL_CHUNK = 8192  # tokens appended to a layer cache at a time while filling


def fill_cache(decoder, context: int, generator) -> None:
    """Fill `decoder` (a reset CachedDecoder) as if a one-document text prompt of `context` tokens
    had been prefilled: every layer's keys/values, B layers' index keys or block means."""
    import torch

    cfg, model = decoder.cfg, decoder.model
    p = next(model.parameters())
    K, D, bs = cfg.num_kv_heads, cfg.head_dim, decoder.block_size
    decoder.reset()
    for cache, layer in zip(decoder.caches, model.layers):
        start = 0 if cache.keep is None else max(0, context - cache.keep)  # a window layer keeps its window
        store = decoder.host if decoder.offload_b and cache.kind == "B" else p.device
        for c0 in range(start, context, FILL_CHUNK):
            n = min(FILL_CHUNK, context - c0)
            kv = torch.randn(2, 1, K, n, D, generator=generator, device=p.device, dtype=p.dtype).to(store)
            cache.append(kv[0], kv[1], torch.arange(c0, c0 + n, device=store))
        if cache.kind != "B":
            continue
        indexer = getattr(layer.attn, "indexer", None)
        if indexer is not None:
            for c0 in range(0, context, FILL_CHUNK):
                n = min(FILL_CHUNK, context - c0)
                cache.append_index(torch.randn(1, K, n, indexer.dim_idx, generator=generator, device=p.device, dtype=p.dtype))
        else:
            cache.kmean_BKnD = torch.randn(1, K, context // bs, D, generator=generator, device=p.device)
    decoder.length = context
    decoder.next_position = context


def bench_decode(preset: str, overrides: list[str], *, contexts: list[int], steps: int, device: str,
                 dtype: str | None = None, seed: int = 0) -> list[dict]:
    """One row per (context, variant): cache MB (total, on the model's device, per layer kind) and
    decode tokens/s. Variants: the preset's pattern, the same with B layers' keys in host memory
    (CachedDecoder(offload_b=True)), and every layer G."""
    import torch

    from omniloom.model import OmniModel
    from omniloom.model.bench import sync_for
    from omniloom.model.kv_cache import CachedDecoder
    from omniloom.pretrain.config.run import load_config

    cfg = load_config(preset, list(overrides)).model
    if cfg.vocab_size <= 0:
        cfg = dataclasses.replace(cfg, vocab_size=32768, patch_token_id=max(cfg.patch_token_id, 8))
    att = cfg.attention
    bs = att.block_size
    if device == "cpu" and att.backend in ("flex", "flash"):
        # decode steps never use the backend (prefill does, and this benchmark fills the cache)
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(att, backend="blocksparse"))
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}[dtype]
    if torch_dtype is None:
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    variants = [("pattern " + cfg.attention.pattern, cfg, False)]
    if "B" in cfg.attention.pattern:
        variants.append(("same, B keys in host memory", cfg, True))
    variants.append(("full (all G)", dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, pattern="G")), False))
    rows = []
    model = None
    for name, vcfg, offload in variants:
        if model is None or model.cfg != vcfg:
            model = None
            torch.manual_seed(seed)
            model = OmniModel(vcfg).to(device=device, dtype=torch_dtype).eval()
        decoder = CachedDecoder(model, offload_b=offload)
        g = torch.Generator(device=device).manual_seed(seed)
        for T in contexts:
            if T % bs:
                raise ValueError(f"--contexts: {T} is not a multiple of the block size {bs}")
            fill_cache(decoder, T, g)
            ids = torch.randint(0, vcfg.vocab_size, (steps + 2,), generator=g, device=device)
            with torch.no_grad():
                for t in range(2):  # warm-up (not timed): the first step may allocate
                    decoder.step(ids[t:t + 1])
                fill_cache(decoder, T, g)  # back to exactly T, so the timed steps start a new block
                sync = sync_for(torch.device(device))
                sync()
                t0 = time.perf_counter()
                for t in range(steps):
                    decoder.step(ids[t + 2:t + 3])
                sync()
                secs = time.perf_counter() - t0
            # measured after the steps (T + steps tokens), when B layers hold their working sets
            mb = {kind: sum(c.nbytes() for c in decoder.caches if c.kind == kind) / 2**20 for kind in "LGB"}
            rows.append({"variant": name, "context": T, "cache_mb": decoder.cache_bytes() / 2**20,
                         "device_mb": decoder.device_bytes() / 2**20, "mb": mb, "tok_s": steps / secs})
        del decoder
    return rows


def format_rows(rows: list[dict]) -> list[str]:
    full = {r["context"]: r for r in rows if r["variant"].startswith("full")}
    lines = ["| variant | context | cache MB | on device MB | device / full | L / G / B MB | decode tok/s | vs full |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = full.get(r["context"])
        lines.append(
            f"| {r['variant']} | {r['context']} | {r['cache_mb']:.1f} | {r['device_mb']:.1f} | {r['device_mb'] / f['device_mb']:.3f} | "
            f"{r['mb']['L']:.1f} / {r['mb']['G']:.1f} / {r['mb']['B']:.1f} | {r['tok_s']:.1f} | {r['tok_s'] / f['tok_s']:.2f}x |")
    return lines


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "decode", help="KV-cache memory and decode tokens/s at 8k-128k context, a preset against a full-attention cache",
        description=__doc__.split("\n\n")[0] + " The cache is filled with random keys through its own append path "
        "(decode cost does not depend on their values), then --steps tokens are decoded; tokens/s and cache MB are "
        "printed with their ratio to the full-attention cache of the same model in the same run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="long_64k", help="preset name or YAML path whose model is measured")
    p.add_argument("--contexts", default="8192,32768,131072", help="comma-separated context lengths (multiples of the block size)")
    p.add_argument("--steps", type=int, default=128, help="timed decode steps per context (one block's worth by default)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="model and cache dtype (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. model.moe.num_experts=8 (shrinks the MoE, "
                   "not the attention, for a quick CPU run)")
    p.set_defaults(func=_bench_decode)


def _bench_decode(args) -> int:
    import torch

    from omniloom.kernels.bench import resolve_device

    device = resolve_device(args.device)
    try:
        contexts = [int(c) for c in args.contexts.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--contexts must be comma-separated integers, got '{args.contexts}'") from None
    if args.steps < 1 or not contexts:
        raise ValueError("--steps must be >= 1 and --contexts non-empty")
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}, config {args.config} "
          f"{' '.join(args.overrides)}, {args.steps} decode steps per context")
    rows = bench_decode(args.config, args.overrides, contexts=contexts, steps=args.steps, device=device, dtype=args.dtype)
    for line in format_rows(rows):
        print(line)
    return 0
