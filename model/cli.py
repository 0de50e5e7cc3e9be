"""CLI for the model package: `omniloom bench model` (torch is imported inside the handler)."""

from __future__ import annotations

import argparse


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "model",
        help="MoE grouped vs loop dispatch tokens/s; blocksparse vs sdpa attention at 2k..16k tokens",
        description=(
            "Part 1: forward+backward tokens/s of a small MoE model with grouped-matmul dispatch "
            "(torch grouped_mm) against the per-expert loop, same weights and batch. Part 2: forward+backward "
            "time of one attention layer (one text document, GQA) for each layer kind and backend at growing "
            "sequence lengths, with the time ratio per doubling (a window layer should be near 2x, dense "
            "sdpa near 4x) and blocksparse's speedup over sdpa. Part 3: rows packed with short captioned images "
            "(the demo's): one L layer with the small document spans batched into padded calls against one call "
            "per span (CPU), and the conv patch stem channels-last against NCHW. Shrink with --seq-lens / --kinds / --iters."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--skip-moe", action="store_true", help="skip the MoE dispatch part")
    p.add_argument("--skip-attention", action="store_true", help="skip the attention part")
    p.add_argument("--moe-dim", type=int, default=128, help="model width (and expert width) for the MoE part")
    p.add_argument("--moe-experts", type=int, default=16, help="routed experts for the MoE part (top-2)")
    p.add_argument("--moe-seq-len", type=int, default=512, help="sequence length for the MoE part")
    p.add_argument("--moe-batch", type=int, default=4, help="batch size for the MoE part")
    p.add_argument("--seq-lens", default="2048,4096,8192,16384", help="comma-separated sequence lengths")
    p.add_argument("--kinds", default="L", help="layer kinds to time: any of L (window), G (global), B (block top-k)")
    p.add_argument("--backends", default="sdpa,blocksparse", help="comma-separated attention backends")
    p.add_argument("--sdpa-max", type=int, default=16384, help="skip sdpa above this length (its time and memory are quadratic)")
    p.add_argument("--heads", type=int, default=4, help="query heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=64, help="head dim")
    p.add_argument("--window", type=int, default=512, help="L-layer window")
    p.add_argument("--block-size", type=int, default=64, help="key block size")
    p.add_argument("--selected", type=int, default=8, help="B-layer blocks per query")
    p.add_argument("--selector", choices=("pooled", "indexer"), default="pooled",
                   help="B-layer selector; indexer: learned index scores plus its KL loss and coverage on sampled blocks")
    p.add_argument("--indexer-dim", type=int, default=64, help="index width per head (--selector indexer)")
    p.add_argument("--skip-packed", action="store_true", help="skip the packed-documents part (short-document spans, conv stem)")
    p.add_argument("--packed-doc-len", type=int, default=29, help="packed part: tokens per document (the demo's captioned image: 29)")
    p.add_argument("--stem-rows", type=int, default=1100, help="packed part: 16x16 patches through the conv stem (the demo: ~1,100 a rank a step)")
    p.add_argument("--warmup", type=int, default=1, help="untimed calls first (attention: at the shortest length of each kind and backend)")
    p.add_argument("--iters", type=int, default=2, help="timed calls (median reported)")
    p.set_defaults(func=_bench_model)


def _bench_model(args) -> int:
    import torch

    from omniloom.kernels.bench import resolve_device

    from . import bench
    from .attention import check_backend

    device = resolve_device(args.device)
    dev = torch.device(device)
    try:
        seq_lens = [int(s) for s in args.seq_lens.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--seq-lens must be comma-separated integers, got '{args.seq_lens}'") from None
    kinds = args.kinds.upper()
    if not kinds or set(kinds) - set("LGB"):
        raise ValueError(f"--kinds may only contain L, G, B; got '{args.kinds}'")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        check_backend(b)
    print(f"device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")

    if not args.skip_moe:
        tps = bench.bench_moe_dispatch(
            device=dev, dim=args.moe_dim, num_experts=args.moe_experts, seq_len=args.moe_seq_len,
            batch_size=args.moe_batch, warmup=args.warmup, iters=args.iters,
        )
        print(f"\nMoE fwd+bwd, dim {args.moe_dim}, {args.moe_experts} experts top-2, "
              f"{args.moe_batch}x{args.moe_seq_len} tokens, 2 MoE layers:")
        print(f"  grouped dispatch {tps['grouped']:>10.0f} tok/s")
        print(f"  loop dispatch    {tps['loop']:>10.0f} tok/s")
        print(f"  grouped / loop   {tps['grouped'] / tps['loop']:>10.2f}x")

    if not args.skip_attention:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        res = bench.bench_attention(
            device=dev, seq_lens=seq_lens, kinds=kinds, backends=backends, num_heads=args.heads,
            num_kv_heads=args.kv_heads, head_dim=args.head_dim, window=args.window, block_size=args.block_size,
            num_selected=args.selected, warmup=args.warmup, iters=args.iters, sdpa_max=args.sdpa_max, dtype=dtype,
            selector=args.selector, indexer_dim=args.indexer_dim,
        )
        print(f"\nattention fwd+bwd, one layer, {args.heads} heads / {args.kv_heads} kv heads x {args.head_dim}, "
              f"window {args.window}, block {args.block_size}, {args.selected} blocks selected ({args.selector}), {dtype}:")
        for line in bench.format_attention(res, seq_lens, kinds, backends):
            print(line)

    if not args.skip_packed:
        iters = max(args.iters, 10)  # millisecond calls: a median over 10 at least
        res = bench.bench_packed(
            device=dev, rows=2, seq_len=512, doc_len=args.packed_doc_len, visual=16, num_heads=4, num_kv_heads=2,
            head_dim=32, window=128, stem_rows=args.stem_rows, stem_width=32, warmup=max(args.warmup, 2), iters=iters,
        )
        print(f"\npacked documents (the demo's shapes), fwd+bwd, ms: median of 3 alternating rounds of {iters}:")
        print(f"  L layer, 2x512 tokens of {args.packed_doc_len}-token documents (16 visual), 4 / 2 heads x 32:")
        for mode in ("batched", "per span"):
            if f"spans {mode}" in res:
                print(f"    spans {mode:<9} {res[f'spans {mode}'] * 1e3:>8.2f} ms")
        if "spans per span" in res:
            print(f"    batched speedup  {res['spans per span'] / res['spans batched']:>8.2f}x")
        print(f"  conv patch stem (32 then 64 channels), {args.stem_rows} patches:")
        print(f"    channels-last    {res['stem channels-last'] * 1e3:>8.2f} ms")
        print(f"    NCHW             {res['stem NCHW'] * 1e3:>8.2f} ms")
        print(f"    speedup          {res['stem NCHW'] / res['stem channels-last']:>8.2f}x")
    return 0
