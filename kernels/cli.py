"""CLI for the kernels package: `omniloom bench kernels` (torch is imported inside the handler)."""

from __future__ import annotations

import argparse

# ops.py imports torch; the names are spelled here so `omniloom --help` stays fast
OP_NAMES = ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope", "linear_cross_entropy", "moe_permute", "moe_unpermute")

BENCH_OPS = ("rms_norm", "swiglu", "apply_rope", "qk_norm_rope", "linear_cross_entropy", "moe")


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "kernels",
        help="kernel accuracy vs float64, Triton vs eager speed and memory, chunked-CE memory",
        description=(
            "For each kernel at the widths of a ~1B-active MoE (dim 2048, 16x128 heads, vocab 64k, "
            "64 experts top-8 of width 1024): max relative error against float64 of the fast path and of "
            "the eager reference, forward+backward time of both, speedup, peak memory; then a KernelBench-style "
            "summary (share correct, share faster than eager = fast_1, geometric-mean speedup) and the peak "
            "memory of the chunked linear cross-entropy against the naive [T, V] logits path. On CPU there is "
            "no fast path: it reports the reference's accuracy, time and memory and says Triton timings need CUDA. "
            f"Kernels in the API: {', '.join(OP_NAMES)} (moe = permute + unpermute)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="input dtype; auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--tokens", type=int, default=0, help="tokens per timed step; 0 = 8192 on CUDA, 256 on CPU")
    p.add_argument("--check-tokens", type=int, default=0, help="tokens for the float64 accuracy check; 0 = 2048 on CUDA, 64 on CPU")
    p.add_argument("--warmup", type=int, default=0, help="untimed calls first; 0 = 3 on CUDA, 1 on CPU")
    p.add_argument("--iters", type=int, default=0, help="timed calls (median reported); 0 = 20 on CUDA, 2 on CPU")
    p.add_argument("--ops", default="", help=f"comma-separated subset of {','.join(BENCH_OPS)}")
    p.add_argument("--no-memory", action="store_true", help="skip per-kernel peak memory (on CPU it costs a subprocess per kernel)")
    p.add_argument("--compile", action="store_true",
                   help="also time each reference under torch.compile and print each kernel's verdict: keep it "
                        "(correct, >= 1.3x eager, faster than compiled) or give way to compiled PyTorch "
                        "(compiling costs seconds to minutes per kernel)")
    p.add_argument("--skip-ce-memory", action="store_true", help="skip the chunked-vs-naive cross-entropy memory comparison")
    p.add_argument("--ce-tokens", type=int, default=16384, help="tokens for the CE memory comparison")
    p.add_argument("--ce-vocab", type=int, default=65536, help="vocab for the CE memory comparison")
    p.add_argument("--ce-dim", type=int, default=0,
                   help="width for the CE memory comparison (the logits' size does not depend on it); 0 = 2048 on CUDA, 64 on CPU")
    p.add_argument("--ce-chunks", default="1024,4096", help="comma-separated chunk sizes to measure")
    p.add_argument("--ce-naive-backward", action="store_true",
                   help="also run the naive path's backward (about 4x the [T, V] logits in memory; default: its forward only)")
    p.add_argument("--json", default="", help="also write every figure to this JSON file")
    p.set_defaults(func=_bench_kernels)


def _bench_kernels(args) -> int:
    import json
    from dataclasses import asdict

    import torch

    from . import bench

    device = bench.resolve_device(args.device)
    on_cuda = device.startswith("cuda")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else (torch.bfloat16 if on_cuda else torch.float32)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in BENCH_OPS]
    if unknown:
        raise ValueError(f"unknown --ops {unknown}; choose from {', '.join(BENCH_OPS)}")
    chunks = [int(c) for c in args.ce_chunks.split(",") if c]
    if any(c < 1 for c in chunks) or min(args.tokens, args.check_tokens, args.ce_tokens, args.ce_vocab) < 0:
        raise ValueError("sizes and chunk sizes must be positive")
    tokens = args.tokens or (8192 if on_cuda else 256)
    check_tokens = args.check_tokens or (2048 if on_cuda else 64)
    warmup = args.warmup or (3 if on_cuda else 1)
    iters = args.iters or (20 if on_cuda else 2)

    name = torch.cuda.get_device_name() if on_cuda else "CPU"
    print(f"omniloom bench kernels: {name}, {str(dtype).replace('torch.', '')}, {tokens} tokens/step "
          f"(float64 check at {check_tokens}), fwd+bwd, median of {iters}", flush=True)
    if not on_cuda:
        print("no CUDA: the fast column is n/a (Triton timings need CUDA); the eager reference is measured", flush=True)
    rows = bench.bench_kernels(device=device, dtype=dtype, tokens=tokens, check_tokens=check_tokens, warmup=warmup,
                               iters=iters, ops_filter=ops or None, measure_memory=not args.no_memory,
                               compare_compile=args.compile)
    fast_available = any(r.ms_fast is not None for r in rows)
    bench.print_summary(rows, fast_available)
    out = {"device": name, "dtype": str(dtype), "tokens": tokens, "rows": [asdict(r) for r in rows],
           "summary": bench.summarize(rows)}
    if not args.skip_ce_memory:
        out["ce_memory"] = bench.ce_memory(device=device, tokens=args.ce_tokens, vocab=args.ce_vocab,
                                           dim=args.ce_dim or (2048 if on_cuda else 64), chunks=chunks,
                                           naive_backward=args.ce_naive_backward)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0 if all(r.correct for r in rows) else 1
