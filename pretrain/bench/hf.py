"""`omniloom bench hf`: one training step of omniloom against Hugging Face's Qwen3-MoE of the
same math, side by side in one process (steps interleaved, so both see the same machine load).

Equal math: width, layers, heads / KV heads (GQA), QK-norm, RoPE, routed experts (softmax
router, top-k, normalised gates, no shared expert), SwiGLU experts of the same width, untied head
over the same vocabulary; one causal text document per row. omniloom adds its z-loss (one
log-sum-exp it computes anyway). A step is forward + backward + AdamW (the same fused AdamW for
both). Needs `transformers` (an optional bench dependency: `pip install transformers`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

EQUAL_MATH = dict(dim=256, layers=4, heads=8, kv_heads=2, experts=16, top_k=2, expert_dim=256, vocab=8192)
# the GPU row of issue 13 (gpu_check runs it on CUDA with bf16 autocast and the flex backend)
EQUAL_MATH_GPU = dict(dim=1024, layers=8, heads=16, kv_heads=4, experts=32, top_k=4, expert_dim=512, vocab=32768)


def _omni_model(shape: dict, pattern: str, backend: str, kernels: str = "auto"):
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
    from omniloom.model.decoder import OmniModel

    head_dim = shape["dim"] // shape["heads"]
    cfg = ModelConfig(
        dim=shape["dim"], num_layers=shape["layers"], num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
        vocab_size=shape["vocab"], rope_sections=(head_dim // 2, head_dim // 4, head_dim // 4), kernels=kernels,
        attention=AttentionConfig(backend=backend, pattern=pattern),
        moe=MoEConfig(num_experts=shape["experts"], num_experts_per_token=shape["top_k"], expert_dim=shape["expert_dim"],
                      num_shared_experts=0, num_dense_layers=0, score_func="softmax"),
    )
    return OmniModel(cfg)


def import_transformers():
    """Import transformers even when run as `python -m ...` from this repository's root, where the
    current folder on sys.path makes the repo's `tokenizers/` shadow Hugging Face's `tokenizers`."""
    import os
    import sys

    root = os.path.abspath(os.getcwd())
    if os.path.isfile(os.path.join(root, "tokenizers", "__init__.py")) and os.path.isfile(os.path.join(root, "pyproject.toml")):
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != root]
        mod = sys.modules.get("tokenizers")
        if mod is not None and os.path.abspath(getattr(mod, "__file__", "") or "").startswith(root):
            del sys.modules["tokenizers"]
    import transformers

    return transformers


def _hf_model(shape: dict):
    import_transformers()
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=shape["vocab"], hidden_size=shape["dim"], intermediate_size=shape["expert_dim"],
        moe_intermediate_size=shape["expert_dim"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"], head_dim=shape["dim"] // shape["heads"],
        num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], tie_word_embeddings=False, output_router_logits=False, max_position_embeddings=65536,
    )
    cfg._attn_implementation = "sdpa"
    model = Qwen3MoeForCausalLM(cfg)
    impl = "eager"
    for name in ("grouped_mm", "batched_mm"):  # transformers >= 5 has faster expert paths; take the fastest it has
        try:
            model.set_experts_implementation(name)
            impl = name
            break
        except Exception:  # noqa: BLE001 - an older transformers or an unsupported path: keep eager
            continue
    return model, impl


def _omni_batch(batch_size: int, seq_len: int, vocab: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((batch_size, 1), -100)], dim=1)
    pos = torch.arange(seq_len, dtype=torch.int32).expand(batch_size, 3, seq_len).contiguous()
    zeros = torch.zeros(batch_size, seq_len, dtype=torch.int32)
    fields = dict(input_ids=ids, labels=labels, positions=pos, doc_ids=zeros, block_ids=zeros - 1,
                  modality=torch.zeros(batch_size, seq_len, dtype=torch.uint8),
                  patches=torch.zeros(0, 1), patch_kind=torch.zeros(0, dtype=torch.uint8))
    return fields, ids


def bench_hf(*, cases: list[tuple[int, int]], patterns: list[str], backend: str, steps: int, warmup: int,
             shape: dict | None = None, device: str = "cpu", kernels: tuple[str, ...] = ("auto",)) -> list[dict]:
    """For each (seq_len, batch), omniloom pattern and kernels mode (`model.kernels`): median
    step seconds of both models over `steps` interleaved steps after `warmup` (on CUDA: bf16
    autocast, synchronized timings). Returns one dict per row."""
    import contextlib

    import torch

    shape = shape or EQUAL_MATH
    dev = torch.device(device)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    rows = []
    for seq_len, batch in cases:
        hf, impl = _hf_model(shape)
        hf.to(dev).train()
        hf_opt = torch.optim.AdamW(hf.parameters(), lr=1e-4, fused=True)
        fields, ids = _omni_batch(batch, seq_len, shape["vocab"], seed=seq_len)
        omnis = []
        for pattern in patterns:
            for mode in kernels:
                torch.manual_seed(0)
                m = _omni_model(shape, pattern, backend, mode)
                m.to(dev).train()
                layout = m.batch_layout(fields["doc_ids"], fields["block_ids"])  # on the host copy
                omnis.append(((pattern, mode), m, torch.optim.AdamW(m.parameters(), lr=1e-4, fused=True), layout))
        fields = {k: v.to(dev) for k, v in fields.items()}
        ids = ids.to(dev)

        def hf_step():
            with amp:
                out = hf(input_ids=ids, labels=ids)
            out.loss.backward()
            hf_opt.step()
            hf_opt.zero_grad(set_to_none=True)

        def omni_step(m, opt, layout):
            with amp:
                out = m(**fields, layout=layout)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        times = {"hf": []} | {p: [] for p, *_ in omnis}
        for i in range(warmup + steps):
            order = [("hf", hf_step)] + [(p, (lambda m=m, o=o, lay=lay: omni_step(m, o, lay))) for p, m, o, lay in omnis]
            if i % 2:
                order.reverse()  # alternate who goes first
            for name, fn in order:
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
        hf_s = statistics.median(times["hf"])
        for (pattern, mode), *_ in omnis:
            om_s = statistics.median(times[(pattern, mode)])
            rows.append(dict(seq_len=seq_len, batch=batch, pattern=pattern, kernels=mode, omni_s=om_s, hf_s=hf_s, hf_impl=impl,
                             speedup=hf_s / om_s, omni_tps=seq_len * batch / om_s, hf_tps=seq_len * batch / hf_s))
        del hf, omnis
    return rows


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "hf",
        help="a training step against Hugging Face Qwen3-MoE of the same math (needs transformers)",
        description=(
            "One training step (forward, backward, fused AdamW) of omniloom and of a Hugging Face Qwen3-MoE with "
            "the same math (d256, 4 layers, 8/2 heads, 16 experts top-2 of width 256, vocab 8192, no shared "
            "expert), steps interleaved in one process. Prints median step times and omniloom's speedup "
            "(HF time / omniloom time) for each sequence length and omniloom attention pattern: `GGGG` is the "
            "equal-math row, `LLLG` the default sparse pattern (window 512)."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--cases", default="1024x2,4096x1", help="comma-separated SEQxBATCH rows")
    p.add_argument("--patterns", default="GGGG,LLLG", help="omniloom attention patterns to time")
    p.add_argument("--backend", default="blocksparse", help="omniloom attention backend (CPU: blocksparse or sdpa)")
    p.add_argument("--kernels", default="auto,compiled",
                   help="omniloom model.kernels modes to time, comma-separated: auto (on CPU the plain PyTorch "
                        "references), compiled (the element-wise ops under torch.compile; its first step compiles, "
                        "in the untimed warm-up), reference, triton"),
    p.add_argument("--steps", type=int, default=4, help="timed steps per model (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    p.add_argument("--malloc", choices=("default", "keep"), default="default",
                   help="glibc allocator policy for both models: default, or keep (freed memory stays in the process, "
                        "so large tensors are not page-faulted in again every step; see omniloom.pretrain.runtime.malloc). "
                        "Page faults cost the Hugging Face model more, and their cost depends on the machine: "
                        "keep measures the two models without it")
    p.set_defaults(func=_run)


def _run(args) -> int:
    import torch

    try:
        transformers = import_transformers()
    except ImportError:
        print("omniloom bench hf needs transformers: pip install transformers")
        return 2
    cases = []
    for item in args.cases.split(","):
        seq, _, batch = item.partition("x")
        cases.append((int(seq), int(batch or 1)))
    patterns = [p for p in args.patterns.split(",") if p]
    malloc = args.malloc
    if malloc == "keep":
        from omniloom.pretrain.runtime.malloc import keep_freed_memory

        if not keep_freed_memory():
            print("--malloc keep needs glibc (Linux); timing with the default policy")
            malloc = "default (keep unavailable)"
    print(f"equal math vs Hugging Face Qwen3-MoE (transformers {transformers.__version__}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, omniloom backend {args.backend}, malloc {malloc}; "
          f"{args.steps} timed steps after {args.warmup}")
    kernels = tuple(k for k in args.kernels.split(",") if k)
    if "compiled" in kernels and not torch.cuda.is_available():
        from omniloom.kernels.ops import cpp_compiler

        if cpp_compiler() is None:  # the default asks for it: time the rest rather than fail
            print("--kernels compiled skipped: torch.compile on CPU needs a C++ compiler (install g++ or set CXX)")
            kernels = tuple(k for k in kernels if k != "compiled")
    if not kernels:
        print("--kernels: no mode left to time", file=sys.stderr)
        return 2
    if args.warmup < 1 and "compiled" in kernels:
        print("--kernels compiled needs --warmup >= 1 (its first step compiles)", file=sys.stderr)
        return 2
    rows = bench_hf(cases=cases, patterns=patterns, backend=args.backend, steps=args.steps, warmup=args.warmup,
                    kernels=kernels)
    print(f"{'seq x batch':>12} {'pattern':>8} {'kernels':>9} {'omniloom s':>11} {'HF s':>8} {'HF experts':>11} {'speedup':>8}")
    for r in rows:
        print(f"{r['seq_len']:>7} x {r['batch']:<2} {r['pattern']:>8} {r['kernels']:>9} {r['omni_s']:>11.3f} {r['hf_s']:>8.3f} "
              f"{r['hf_impl']:>11} {r['speedup']:>7.2f}x")
    return 0
