"""CLI: `omniloom eval` and `omniloom generate`.

Heavy imports (torch, the model) happen inside the handlers so `omniloom --help` stays fast.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)


def _set_threads(n: int | None, *, tune: bool = True) -> None:
    """--threads N, else OMP_NUM_THREADS, else the cores this process may use, kept or dropped for
    1 thread by timing the first units of work when `tune` (pretrain/runtime/threads.py)."""
    from omniloom.pretrain.runtime.threads import configure_threads

    if n is not None and n < 1:
        raise ValueError("--threads must be >= 1")
    configure_threads(n or 0, option="--threads", tune=tune)


def _eval(args) -> int:
    import torch

    from .evaluate import describe_gap, evaluate, json_safe
    from .load import open_model

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
    result, non_finite = json_safe(result)
    losses = [k for k in non_finite if k.startswith("loss.")]
    if losses:  # the model computes nothing usable: said, and no eval.json a report would read
        raise ValueError(f"{args.model}: the loss is not finite (NaN or infinite) for {', '.join(losses[:6])}: the "
                         "model's weights or config.json give no usable numbers" + (f"; nothing written to {args.out}" if args.out else ""))
    if non_finite:
        result["non_finite"] = non_finite
        log.warning("not finite, written as null: %s", ", ".join(non_finite))
    text = json.dumps(result, indent=2, sort_keys=True, allow_nan=False)
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
              + ", ".join(f"{k}=n/a" if v is None else f"{k}={v:.3f}" for k, v in cov.items()))
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
        offload_b=args.offload_b_keys, tokenizer=args.tokenizer,
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
    p.add_argument("--tokenizer", default=None,
                   help="a folder holding the export's tokenizer, when DIR has none (e.g. a Hugging Face save_pretrained "
                   "folder of the model alone); checked against the sha256 DIR's config.json records")
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
