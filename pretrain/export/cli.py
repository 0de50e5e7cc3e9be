"""CLI: `omniloom export`.

Heavy imports (torch, the model) happen inside the handlers so `omniloom --help` stays fast.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def _export(args) -> int:
    from .write import export_checkpoint

    res = export_checkpoint(args.src, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size, tokenizer=args.tokenizer,
                            force=args.force, license=args.license)
    print(f"exported {res.checkpoint} -> {res.out_dir}: {res.num_params / 1e6:.2f} M parameters, "
          f"{len(res.files)} safetensors file(s), {res.total_bytes / 1e6:.1f} MB")
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
    p.add_argument("--license", default="unknown", metavar="ID",
                   help="the license in the model card's Hub front matter: a Hugging Face Hub license id "
                        "(apache-2.0, mit, cc-by-4.0, other, ...); default unknown: the data's licenses decide it")
    p.add_argument("--force", action="store_true", help="write into an --out folder that already holds files (the export's files are replaced)")
    p.set_defaults(func=_export)
