"""`omniloom export`: a training checkpoint to a self-contained safetensors folder.

    export/
      config.json                      model config, tokenizer layout, omniloom version, provenance
      model.safetensors                (or model-0000i-of-0000N.safetensors + model.safetensors.index.json)
      tokenizer.model                  the run's tokenizer model, byte for byte
      omniloom_tokenizer.json          its layout, special ids and media settings
      tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                       the same tokenizer for Hugging Face's AutoTokenizer
      README.md                        model card: data, steps, tokens, final losses
      configuration_omniloom.py, modeling_omniloom.py, processing_omniloom.py, model_*.py,
      kernels_*.py, tokenizers_*.py, generation_config.json, processor_config.json
                                       Hugging Face remote code: omniloom's own modules, copied
                                       (pretrain/hf; docs/huggingface.md)

Checkpoints are read without unpickling anything (issue 9): accelerate's `model.safetensors`
through safetensors; `.bin`/`.pt` files through `torch.load(weights_only=True)` (safe_io); FSDP2
sharded state dicts (torch.distributed.checkpoint folders) offline, with no process group, their
`.metadata` pickle read by an unpickler that admits only DCP's own metadata classes and the tensor
payloads by DCP's weights_only loader. `omniloom.model.load_pretrained(DIR)` rebuilds the model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import torch

from omniloom.pretrain.checkpoint.manager import step_of, verify_files
from omniloom.pretrain.checkpoint.offline import (
    READ_FILES,
    _build_checked,
    find_tokenizer_dir,
    load_checkpoint_config,
    portable_model_config,
    read_checkpoint_weights,
    resolve_checkpoint,
)
from omniloom.pretrain.checkpoint.safe_io import INDEX_NAME, parse_size, save_sharded
from omniloom.tokenizers.text import SAVED_FILES

from .card import _trainer_state, model_card
from .complete import carry_other_files, move_into_place, staging_dir

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---- writing an export -------------------------------------------------------------------------
@dataclasses.dataclass
class ExportResult:
    out_dir: Path
    checkpoint: Path | None
    files: list[Path]
    num_params: int
    total_bytes: int


def export_checkpoint(src: str | Path, out_dir: str | Path, *, dtype: str = "fp32", max_shard_size: str | int = "5GB",
                      tokenizer: str | Path | None = None, force: bool = False, license: str = "unknown") -> ExportResult:
    """Export a run (its newest complete checkpoint) or a checkpoint folder into `out_dir`.

    dtype "bf16" stores the matrices in bfloat16; 1-D tensors (norm weights, router biases) stay
    fp32, being tiny and what routing and normalization are most sensitive to."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    parse_size(max_shard_size)  # a malformed size fails before any reading
    ckpt = resolve_checkpoint(src)
    verify_files(ckpt, only=list(READ_FILES))  # damaged weights are refused, naming the file
    out = Path(out_dir)
    if out.resolve() == ckpt.resolve() or ckpt.resolve() in out.resolve().parents:
        raise ValueError(f"--out {out} lies inside the checkpoint {ckpt}; choose another folder")
    check_export_dir(out, force)
    cfg = load_checkpoint_config(ckpt)
    tok_dir = find_tokenizer_dir(cfg, ckpt, tokenizer)
    log.info("exporting %s", ckpt)
    state = read_checkpoint_weights(ckpt)
    # validates names and shapes against the config before anything is written
    model = _build_checked(portable_model_config(cfg.model), state, ckpt)
    trainer = _trainer_state(ckpt)
    step = int(trainer.get("step", step_of(ckpt)))
    tokens_seen = int(trainer.get("tokens_seen", 0))
    source = {"checkpoint": str(ckpt.resolve()), "step": step, "tokens_seen": tokens_seen, "seq_len": cfg.data.seq_len}
    card = model_card(cfg, ckpt, step=step, tokens_seen=tokens_seen, num_params=model.num_params(),
                      num_active=model.num_active_params(), dtype=dtype, license=license)
    result = save_export(model, tok_dir, out, dtype=dtype, max_shard_size=max_shard_size, source=source, card=card,
                         model_config=cfg.model, force=force)  # the training backend is recorded; load_pretrained adapts it
    result.checkpoint = ckpt
    return result


def check_export_dir(out: Path, force: bool) -> None:
    """Refuse to write into a folder that already holds files, unless `force` (then the export's own
    files are replaced, in one step once the new ones are whole; other files stay)."""
    if force or not out.exists():
        return
    if not out.is_dir():
        raise NotADirectoryError(f"--out {out} is a file; choose a folder")
    if any(out.iterdir()):
        raise ValueError(f"--out {out} already exists and is not empty; pass --force to overwrite it or choose another folder")


def save_export(model, tokenizer_dir: str | Path, out_dir: str | Path, *, dtype: str = "fp32",
                max_shard_size: str | int = "5GB", source: dict | None = None, card: str | None = None,
                model_config=None, force: bool = False) -> ExportResult:
    """Write an in-memory OmniModel and its tokenizer folder as an export folder (what
    `export_checkpoint` does after reading a checkpoint; also handy after training in a notebook).
    `model_config` (default: the model's) is what config.json records. A non-empty `out_dir` is
    refused unless `force`."""
    from omniloom.model.pretrained import FORMAT
    from omniloom.pretrain.config.io import to_dict
    from omniloom.pretrain.console import version

    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError("--max-shard-size must be positive")
    from omniloom.tokenizers.text import Tokenizer

    tok_dir = Path(tokenizer_dir)
    out = Path(out_dir)
    check_export_dir(out, force)
    tok = Tokenizer.load(tok_dir)  # old folders too; a tokenizer.model not matching its sha256 is refused
    tok_info = tok.to_json()
    mcfg = model_config or model.cfg
    if tok_info.get("vocab_size") not in (None, mcfg.vocab_size):
        raise ValueError(f"tokenizer {tok_dir} has vocab_size {tok_info.get('vocab_size')} but the model has "
                         f"{mcfg.vocab_size}; pass the run's own tokenizer with --tokenizer")
    state = {k: v.detach() for k, v in model.state_dict().items()}
    if dtype != "fp32":
        state = {k: (v.to(DTYPES[dtype]) if v.is_floating_point() and v.dim() > 1 else v) for k, v in state.items()}
    source = dict(source or {})
    model_dict = to_dict(mcfg)
    meta = {"format": "pt", "omniloom_version": version(), "omniloom_format": FORMAT, "dtype": dtype,
            "model_config": json.dumps(model_dict, sort_keys=True)}
    meta.update({k: str(v) for k, v in source.items() if k in ("step", "tokens_seen")})
    # Written whole beside `out`, then moved into place (export/complete.py): a run killed while
    # writing leaves an earlier export at `out` as it was, never half overwritten.
    place = out.resolve() if out.is_symlink() else out  # a link to the folder stays a link; its target is replaced
    stage = staging_dir(place)
    place.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(stage, ignore_errors=True)  # what an export killed earlier left
    stage.mkdir()
    try:
        files = _write_export(model, tok, tok_info, stage, state=state, limit=limit, meta=meta, model_dict=model_dict,
                              dtype=dtype, source=source, card=card)
        if place.is_dir():
            carry_other_files(place, stage)
        move_into_place(stage, place)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    files = [out / f.name for f in files]
    total = sum(f.stat().st_size for f in files)
    log.info("wrote %d weight file(s), %.1f MB, to %s", len(files), total / 1e6, out)
    return ExportResult(out, None, files, model.num_params(), total)


def _write_export(model, tok, tok_info: dict, out: Path, *, state: dict, limit: int, meta: dict, model_dict: dict,
                  dtype: str, source: dict, card: str | None) -> list[Path]:
    """Every file of an export into the (empty, staging) folder `out`; returns the weight files."""
    from omniloom.model.pretrained import CONFIG_NAME, FORMAT, FORMAT_VERSION
    from omniloom.pretrain.console import version

    from .hf import files as hf

    files = save_sharded(state, out, max_shard_size=limit, metadata=meta)
    tok.save(out)  # tokenizer.model byte for byte, omniloom_tokenizer.json and the Hugging Face files
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "omniloom_version": version(),
        "model": model_dict,
        "torch_dtype": {"fp32": "float32", "bf16": "bfloat16"}[dtype],
        "num_params": model.num_params(),
        "num_active_params": model.num_active_params(),
        "tokenizer": {
            "files": list(SAVED_FILES),
            "vocab_size": tok_info.get("vocab_size"),
            "special_ids": tok_info.get("special_ids"),
            "patch_dim": tok_info.get("patch_dim"),
            "tubelet_dim": tok_info.get("tubelet_dim"),
            "patch_layout": tok_info.get("patch_layout"),
            "media": tok_info.get("media"),
            "model_sha256": tok_info.get("model_sha256"),
        },
        "weights": {"files": [f.name for f in files], "index": INDEX_NAME if len(files) > 1 else None,
                    "max_shard_size": limit},
        "source": source,
    }
    # Hugging Face: the keys AutoConfig needs, the remote code (omniloom's own modules, copied)
    # and the generation and processor configs (pretrain/hf, docs/huggingface.md)
    config.update(hf.config_keys(config["tokenizer"]))
    hf.write_hf_files(out, config["tokenizer"], version())
    (out / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    if card is None:
        card = (f"# omniloom model\n\n{model.num_params() / 1e6:.2f} M parameters, exported from memory "
                f"({dtype}).\n\nLoad with `omniloom.model.load_pretrained(DIR)`.\n")
    (out / "README.md").write_text(card.replace("WEIGHT_FILES", f"{len(files)} safetensors file(s)"))
    return files

