"""CLI: `omniloom export`, `omniloom eval`, `omniloom generate`, and `omniloom bench generate`.

Heavy imports (torch, the model) happen inside the handlers so `omniloom --help` stays fast.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _export(args) -> int:
    from .export import export_checkpoint

    res = export_checkpoint(args.src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, tokenizer=args.tokenizer,
                            force=args.force)
    print(f"exported {res.checkpoint} -> {res.out_dir}: {res.num_params / 1e6:.2f} M parameters, "
          f"{len(res.files)} safetensors file(s), {res.total_bytes / 1e6:.1f} MB")
    return 0


def _set_threads(n: int | None, *, tune: bool = True) -> None:
    """--threads N, else OMP_NUM_THREADS, else the cores this process may use, kept or dropped for
    1 thread by timing the first units of work when `tune` (pretrain/threads.py)."""
    from .threads import configure_threads

    if n is not None and n < 1:
        raise ValueError("--threads must be >= 1")
    configure_threads(n or 0, option="--threads", tune=tune)


def _eval(args) -> int:
    import torch

    from .evaluate import describe_gap, evaluate, open_model

    _set_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tok, seq_len = open_model(args.model, device=device, tokenizer=args.tokenizer)
    result = evaluate(model, tok, args.data, max_docs=args.max_docs, max_len=args.max_len or seq_len,
                      progress=not args.no_progress)
    if args.captions:
        from .captions import caption_benchmark

        result["captions"] = caption_benchmark(model, tok, args.data, max_docs=args.max_docs, probes=not args.no_probes)
    result["model"] = str(args.model)
    result["data"] = args.data
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    c = result["counts"]
    skipped = sum(c.get("skipped", {}).values())
    print(f"scored {c['docs']} of {c['docs_available']} documents"
          + (f" (--max-docs {args.max_docs})" if args.max_docs and c["docs_read"] < c["docs_available"] else "")
          + (f"; {skipped} skipped: {c['skipped']}" if skipped else ""))
    loss = result["loss"]
    print("loss (nats/token): " + ", ".join(f"{k}={v:.4f}" for k, v in loss.items()))
    gap, detail = result["cross_modal_gap"], result.get("cross_modal_gap_detail") or {}
    print("cross-modal gap (nats/token, donor visual - own visual): "
          + "; ".join(f"{k}={describe_gap(v, detail.get(k))}" for k, v in gap.items()))
    cov = result.get("block_coverage")
    if cov:
        print("B-layer coverage (dense attention mass in the selected blocks): "
              + ", ".join(f"{k}={v:.3f}" for k, v in cov.items()))
    if "captions" in result:
        from .captions import format_captions

        print("\n".join(format_captions(result["captions"])))
    if args.out:
        print(f"wrote {args.out}")
    elif not args.quiet:
        print(text)
    return 0


def _generate(args) -> int:
    from .generate import generate_from_export

    _set_threads(args.threads)
    text, res = generate_from_export(
        args.model, args.prompt, image=args.image, video=args.video, max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, device=args.device, use_cache=not args.no_cache,
        offload_b=args.offload_b_keys,
    )
    n = len(res.ids)
    log.info("%d prompt tokens, %d new tokens in %.2fs (%.1f tok/s), stopped by %s, cache %.1f KB",
             res.prompt_tokens, n, res.seconds, n / max(res.seconds, 1e-9), res.stopped_by, res.cache_bytes / 1e3)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}")
    sys.stdout.write(text + "\n")
    return 0


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a run or checkpoint to safetensors + config.json + tokenizer + model card",
        description="Consolidate a training checkpoint (plain, DDP, or FSDP2 sharded) into an export folder: "
        "model.safetensors (sharded with model.safetensors.index.json above --max-shard-size, metadata in each "
        "header), config.json (model config, tokenizer layout, omniloom version), the tokenizer (tokenizer.model, "
        "omniloom_tokenizer.json, and tokenizer.json / tokenizer_config.json / special_tokens_map.json for Hugging Face's "
        "AutoTokenizer), Hugging Face remote code (omniloom's own model modules, copied, with configuration_omniloom.py, "
        "modeling_omniloom.py, processing_omniloom.py, generation_config.json, processor_config.json: "
        "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True) runs it without omniloom; see "
        "docs/huggingface.md) and a README model card. A non-empty --out is refused without --force. Nothing is unpickled: .pt files load with weights_only. Load the result with "
        "omniloom.model.load_pretrained(DIR).",
    )
    p.add_argument("src", metavar="RUN_OR_CHECKPOINT", help="a run folder (its newest complete checkpoint is used) or a checkpoints/step_N folder")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="weight dtype (bf16 keeps 1-D norms/biases in fp32; default fp32)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 2GB, 500MiB (default 5GB)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder, when the run's data.tokenizer path has moved")
    p.add_argument("--force", action="store_true", help="write into an --out folder that already holds files (the export's files are replaced)")
    p.set_defaults(func=_export)

    p = sub.add_parser(
        "eval",
        help="held-out loss/perplexity per modality and the cross-modal gap",
        description="Score held-out shards one document at a time: loss and perplexity by target modality and by "
        "document kind, and the cross-modal gap: text loss with another document's image/video minus text loss "
        "with the document's own, in nats/token, for image and video documents (positive: the model reads its "
        "visual tokens), with its 95% interval over documents and whether it is distinguishable from 0 "
        "(cross_modal_gap_detail: stderr, ci95, distinguishable_from_zero). Writes JSON with keys loss, perplexity, "
        "cross_modal_gap, cross_modal_gap_detail, counts.",
    )
    p.add_argument("model", metavar="DIR_OR_RUN", help="an export folder, a run folder or a checkpoint folder")
    p.add_argument("--data", required=True, help="held-out shards: a folder with manifest.json, a brace pattern or URL (comma-separate several)")
    p.add_argument("--max-docs", type=int, default=None, help="score only the first N documents, in manifest order (default: all)")
    p.add_argument("--max-len", type=int, default=None, help="score longer documents in pieces of this many tokens (default: the run's seq_len, else 8192)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the export's, or the run's data.tokenizer)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: OMP_NUM_THREADS, else the cores available)")
    p.add_argument("--captions", action="store_true",
                   help="also greedy-caption every held-out document that is one image or video followed by its caption: "
                   "exact-caption accuracy, per-attribute accuracy against the majority baseline for the demo's caption "
                   "grammar, and sensitivity probes (captions changed by mirroring, flipping or shuffling an image's "
                   "patches, or reversing a video); key 'captions' of the JSON")
    p.add_argument("--no-probes", action="store_true", help="with --captions: skip the sensitivity probes (5x fewer decodes)")
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "generate",
        help="sample text from an exported model, optionally conditioned on an image or video",
        description="Greedy (--temperature 0) or temperature + top-p sampling with a KV cache that keeps each "
        "attention layer's rule (window layers hold only their window). The prompt is one document: the image "
        "(then the video) tokenized by the export's tokenizer, then the prompt text.",
    )
    p.add_argument("model", metavar="DIR", help="a folder written by `omniloom export`")
    p.add_argument("--prompt", default="", help="prompt text (may be empty with --image/--video)")
    p.add_argument("--image", default=None, help="image file placed before the prompt text")
    p.add_argument("--video", default=None, help="video file placed before the prompt text (after the image)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="most tokens to generate (default 64; stops at eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--out", default=None, help="also write the generated text to this file")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--no-cache", action="store_true", help="recompute the whole sequence every step (reference, slow)")
    p.add_argument("--offload-b-keys", action="store_true",
                   help="keep B layers' cached keys and values in host memory and copy only the blocks each query block "
                   "chose to the device (less GPU memory at long context; same tokens)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: OMP_NUM_THREADS, else the cores available; decode steps are "
                   "small, so 1 is often fastest on a busy CPU)")
    p.set_defaults(func=_generate)


def _bench_generate(args) -> int:
    import torch

    _set_threads(args.threads, tune=False)  # both decoders are timed at one count: no tuning inside the timing
    from omniloom.model import OmniModel
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig

    from .generate import generate, random_text_prompt

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
