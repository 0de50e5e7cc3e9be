"""`omniloom bench hf-generate`: greedy decoding of one export by `omniloom generate` and by
Hugging Face `generate()` on its remote code (docs/huggingface.md), runs interleaved in one
process so both see the same machine load; tokens/s and their ratio, and whether both produced
the same tokens. Without an export it writes a random one of `omniloom bench generate`'s shape.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def _random_export(root: Path, dim: int) -> Path:
    import torch

    from omniloom.model import OmniModel
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
    from omniloom.pretrain.export.write import save_export
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    from .cli import _sec

    tok = make_tiny_tokenizer(root / "tok", vocab_size=1024)
    cfg = ModelConfig(dim=dim, num_layers=4, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size,
                      patch_token_id=tok.patch_id, pad_token_id=tok.pad_id, rope_sections=_sec(dim // 4),
                      patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim,
                      attention=AttentionConfig(backend="sdpa", pattern="LLBG", window=64, block_size=32, num_selected_blocks=4),
                      moe=MoEConfig(num_experts=8, num_experts_per_token=2, expert_dim=dim, num_dense_layers=1,
                                    dense_dim=2 * dim))
    torch.manual_seed(0)
    save_export(OmniModel(cfg), root / "tok", root / "export")
    return root / "export"


def bench(export: Path, *, prompt: str, new_tokens: int, repeats: int) -> dict:
    """Median seconds of each side over `repeats` interleaved runs, and their tokens."""
    import copy

    import torch

    from omniloom.model.pretrained import load_pretrained
    from omniloom.pretrain.inference.generate import build_prompt, generate
    from omniloom.pretrain.inference.load import load_export_tokenizer

    from .hf import import_transformers

    transformers = import_transformers()
    tok = load_export_tokenizer(export)
    ours = load_pretrained(export)
    omni_prompt = build_prompt(tok, prompt)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(export), trust_remote_code=True).eval()
    inputs = transformers.AutoProcessor.from_pretrained(str(export), trust_remote_code=True)(text=prompt)
    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None  # both decode exactly new_tokens tokens
    config.max_new_tokens, config.do_sample = new_tokens, False
    times: dict[str, list[float]] = {"omniloom": [], "hf": []}
    tokens = {}
    for _ in range(repeats + 1):  # the first round warms both up, untimed
        t0 = time.perf_counter()
        tokens["omniloom"] = generate(ours, omni_prompt, max_new_tokens=new_tokens, eos_id=-1).ids
        times["omniloom"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(**inputs, generation_config=config)
        times["hf"].append(time.perf_counter() - t0)
        tokens["hf"] = out[0, inputs["input_ids"].shape[1]:].tolist()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    return {"seconds": med, "same": tokens["omniloom"] == tokens["hf"], "prompt_tokens": omni_prompt.length,
            "transformers": transformers.__version__}


def register_bench(bench_sub) -> None:
    p = bench_sub.add_parser(
        "hf-generate",
        help="greedy decoding tokens/s: Hugging Face generate() on an export's remote code vs omniloom generate",
        description="Greedy decoding of the same export by `omniloom generate` (its KV-cached loop) and by "
        "Hugging Face generate() on the export's remote code, interleaved in one process; prints tokens/s of "
        "each, the ratio (Hugging Face / omniloom) and whether the tokens agree. Without EXPORT a random export "
        "of omniloom bench generate's shape is written to a temporary folder first.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("export", nargs="?", default=None, help="a folder written by `omniloom export`")
    p.add_argument("--prompt", default="The river bends twice before it reaches the old mill.", help="prompt text")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each (median reported), after one untimed")
    p.add_argument("--dim", type=int, default=128, help="width of the random export (without EXPORT)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: OMP_NUM_THREADS, else the cores available)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from omniloom.pretrain.inference.cli import _set_threads

    _set_threads(args.threads, tune=False)  # timed against Hugging Face at one count: no tuning inside the timing
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(args.export) if args.export else _random_export(Path(tmp), args.dim)
        res = bench(export, prompt=args.prompt, new_tokens=args.new_tokens, repeats=args.repeats)
    import torch

    s = res["seconds"]
    tps = {k: args.new_tokens / v for k, v in s.items()}
    print(f"{export if args.export else 'random export'}: prompt {res['prompt_tokens']} tokens, {args.new_tokens} new "
          f"tokens, greedy, {torch.get_num_threads()} threads, transformers {res['transformers']}; median of {args.repeats}")
    print(f"  omniloom generate      : {tps['omniloom']:8.1f} tok/s  ({s['omniloom']:.3f}s)")
    print(f"  Hugging Face generate(): {tps['hf']:8.1f} tok/s  ({s['hf']:.3f}s)")
    print(f"  ratio (Hugging Face / omniloom): {tps['hf'] / tps['omniloom']:.2f}; same tokens: {res['same']}")
    return 0 if res["same"] else 1
