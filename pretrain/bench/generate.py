"""`omniloom bench generate`: decode tokens/s of a random model with and without the KV cache."""

from __future__ import annotations

from omniloom.pretrain.inference.cli import _set_threads


def _bench_generate(args) -> int:
    import torch

    _set_threads(args.threads, tune=False)  # both decoders are timed at one count: no tuning inside the timing
    from omniloom.model import OmniModel
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
    from omniloom.pretrain.inference.generate import generate, random_text_prompt

    torch.manual_seed(0)
    cfg = ModelConfig(dim=args.dim, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=2048, patch_token_id=8,
                      rope_sections=_sec(args.dim // 4), patch_dim=48, tubelet_dim=96,
                      attention=AttentionConfig(backend="sdpa", pattern="LLBG", window=64, block_size=32, num_selected_blocks=4),
                      moe=MoEConfig(num_experts=8, num_experts_per_token=2, expert_dim=args.dim, num_dense_layers=1, dense_dim=2 * args.dim))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = OmniModel(cfg).to(device).eval()
    S = args.prompt_len
    prompt = random_text_prompt(2048, S, 96)
    print(f"device {device} ({torch.get_num_threads()} CPU threads), prompt {S} tokens, {args.new_tokens} new tokens, "
          "greedy, eos disabled")
    rows = []
    for use_cache in (False, True):
        res = generate(model, prompt, max_new_tokens=args.new_tokens, use_cache=use_cache, eos_id=-1)
        rows.append((use_cache, res))
        print(f"  {'KV cache ' if use_cache else 'no cache '}: {args.new_tokens / res.seconds:8.1f} tok/s  ({res.seconds:.2f}s)"
              + (f", cache {res.cache_bytes / 1e6:.2f} MB" if use_cache else ""))
    same = rows[0][1].ids == rows[1][1].ids
    print(f"  speedup with cache: {rows[0][1].seconds / rows[1][1].seconds:.1f}x; same greedy tokens: {same}")
    return 0 if same else 1


def _sec(head: int) -> tuple[int, int, int]:
    """An even (t, h, w) split of the head dim for M-RoPE."""
    t = (head // 4) // 2 * 2
    h = ((head - t) // 2) // 2 * 2
    return (t, h, head - t - h)


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser("generate", help="decode tokens/s with and without the KV cache (same run, same tokens)",
                             description="Greedy decoding of a random tiny MoE with the KV cache against full recomputation "
                             "every step; prints tokens/s, the speedup and whether both produced the same tokens.")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: OMP_NUM_THREADS, else the cores available)")
    p.set_defaults(func=_bench_generate)
