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
import io
import json
import logging
import pickle
import warnings
from pathlib import Path

import torch

from .checkpoint import (FULL_FSDP_MODEL_FILE, MARKER, SHARDED_MODEL_DIR, describe_incomplete, incomplete_checkpoints,
                         incomplete_reason, latest_checkpoint, list_checkpoints, step_of, verify_files)
from .safe_io import INDEX_NAME, SINGLE_NAME, parse_size, safe_torch_load, save_sharded

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.model", "omniloom_tokenizer.json", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json")
# accelerate.save_state file names for the first (only) model, by how the run was sharded
ACC_SAFETENSORS, ACC_BIN = "model.safetensors", "pytorch_model.bin"
ACC_FSDP_FULL, ACC_FSDP_DCP = FULL_FSDP_MODEL_FILE, SHARDED_MODEL_DIR
# wrapper segments that DDP / torch.compile / FSDP1 / activation checkpointing can leave in names
_WRAPPER_SEGMENTS = ("module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")


# ---- finding and reading a checkpoint -------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> Path:
    """A run folder -> its newest complete checkpoint; a `step_N` folder -> itself (it must be
    complete). Raises FileNotFoundError / ValueError saying what to pass instead."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist; pass a run folder (with checkpoints/) or a checkpoint step_N folder")
    if (p / "checkpoints").is_dir() or (p.name == "checkpoints" and p.is_dir()):
        ckpt_dir = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        found = latest_checkpoint(ckpt_dir)
        damaged = incomplete_checkpoints(ckpt_dir, step_of(found) if found is not None else -1)
        if found is None:
            what = (f"only {describe_incomplete(damaged)}; restore the missing files or pass another run"
                    if damaged else "train longer or pass a step_N folder")
            raise ValueError(f"{p} holds no complete checkpoint yet: {what}")
        if damaged:
            log.warning("using %s, the newest complete checkpoint in %s; skipping the newer %s", found.name, ckpt_dir,
                        describe_incomplete(damaged))
        return found
    if (p / MARKER).exists() or p.name.startswith("step_"):
        reason = incomplete_reason(p)
        if reason is not None:
            older = [c.name for c in list_checkpoints(p.parent)]
            raise ValueError(f"checkpoint {p} is incomplete ({reason}); "
                             + (f"use {older[-1]}" if older else "pass the run folder"))
        return p
    if (p / "config.json").is_file():
        raise ValueError(f"{p} is already an export folder; pass a run or checkpoint folder")
    raise ValueError(f"{p} is neither a run folder (with checkpoints/) nor a checkpoint (step_N with {MARKER})")


def load_checkpoint_config(ckpt: Path):
    """The resolved RunConfig saved with a checkpoint (config.yaml), with model.moe.expert_parallel
    reset to 1: a checkpoint holds the full, unsharded model whatever layout trained it, and what
    reads it here (export, eval) runs it in one process."""
    from .config import load_saved_config

    path = Path(ckpt) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt} has no config.yaml; it was not written by `omniloom train`")
    cfg = load_saved_config(path)
    if cfg.model.moe.expert_parallel != 1:
        moe = dataclasses.replace(cfg.model.moe, expert_parallel=1)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe))
    return cfg


def _clean_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Admits only what a torch.distributed.checkpoint `.metadata` file holds: DCP's own metadata
    classes, torch dtypes / Size / layouts and a few plain types. Anything else (os.system, eval,
    arbitrary callables) is refused before it can run."""

    _PLAIN = {("builtins", n) for n in ("set", "frozenset", "slice", "tuple", "list", "dict", "int", "float", "str", "bytes", "bool")}
    _PLAIN |= {("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "Path"),
               ("torch", "Size"), ("torch.serialization", "_get_layout")}

    def find_class(self, module: str, name: str):
        if (module, name) in self._PLAIN:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        if module.startswith("torch.distributed.checkpoint.") and "." not in name:
            obj = super().find_class(module, name)
            if isinstance(obj, type):
                return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from checkpoint metadata")


def _safe_dcp_reader(path: Path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            meta_path = Path(self._get_metadata_path(rank))
            try:
                metadata = _DCPMetadataUnpickler(io.BytesIO(meta_path.read_bytes())).load()
            except (pickle.UnpicklingError, AttributeError, EOFError) as err:
                raise ValueError(f"refusing to load {meta_path}: {err}") from err
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(str(path))


def read_dcp_state_dict(path: str | Path, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """Consolidated tensors of a torch.distributed.checkpoint folder (e.g. accelerate's FSDP2
    SHARDED_STATE_DICT), read in this one process with no process group. Keys under `prefix`
    (accelerate saves `{"model": state_dict}`) are returned without it; non-tensor entries are
    skipped (they would need unpickling)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} has no .metadata: not a torch.distributed.checkpoint folder")
    reader = _safe_dcp_reader(path)
    metadata = reader.read_metadata()
    keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    if prefix and any(k.startswith(prefix) for k in keys):
        keys = {k for k in keys if k.startswith(prefix)}
    if not keys:
        raise ValueError(f"{path} holds no tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: loading in one process" is the point
        nested = _load_state_dict_from_keys(keys, storage_reader=_safe_dcp_reader(path))
    flat: dict[str, torch.Tensor] = {}

    def walk(obj, name):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{name}.{k}" if name else str(k))
        elif isinstance(obj, torch.Tensor):
            flat[name] = obj

    walk(nested, "")
    if prefix:
        flat = {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in flat.items()}
    return flat


def read_checkpoint_weights(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The model's full (consolidated) state dict from a checkpoint folder, whatever accelerate
    wrote: safetensors, a weights-only `.bin`, an FSDP full state dict or an FSDP2 DCP folder."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    acc = Path(ckpt) / "accelerate"
    if (acc / ACC_SAFETENSORS).is_file():
        try:
            state = load_file(str(acc / ACC_SAFETENSORS))
        except SafetensorError as err:  # truncated, a damaged header, a pickle under that name
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:160]
            raise ValueError(f"{acc / ACC_SAFETENSORS} is unreadable ({first}); export another checkpoint") from err
    elif (acc / ACC_FSDP_DCP).is_dir():
        state = read_dcp_state_dict(acc / ACC_FSDP_DCP)
    elif (acc / ACC_FSDP_FULL).is_file() or (acc / ACC_BIN).is_file():
        path = acc / (ACC_FSDP_FULL if (acc / ACC_FSDP_FULL).is_file() else ACC_BIN)
        state = safe_torch_load(path)
        if not isinstance(state, dict):
            raise ValueError(f"{path} does not hold a state dict")
    elif list(acc.glob("pytorch_model_fsdp_0_rank*.bin")):
        raise ValueError(f"{acc} holds per-rank FSDP shards saved without DCP; re-save the checkpoint with "
                         "accelerate's default (DCP) sharded state dict, which omniloom export reads offline")
    else:
        raise FileNotFoundError(f"no model weights in {acc} (looked for {ACC_SAFETENSORS}, {ACC_FSDP_DCP}/, "
                                f"{ACC_FSDP_FULL}, {ACC_BIN})")
    return {_clean_name(k): v for k, v in state.items() if isinstance(v, torch.Tensor)}


def find_tokenizer_dir(cfg, ckpt: Path, override: str | Path | None = None) -> Path:
    """The run's tokenizer folder: `override`, else data.tokenizer as written in the config
    (as given, or relative to the run folder)."""
    candidates = [Path(override)] if override else []
    if not override and cfg.data.tokenizer:
        t = Path(cfg.data.tokenizer)
        candidates += [t] if t.is_absolute() else [t, Path(ckpt).parent.parent / t]
    from omniloom.tokenizers.text import MODEL_FILE, has_tokenizer

    for c in candidates:
        if (c / MODEL_FILE).is_file() and has_tokenizer(c):
            return c
    tried = ", ".join(str(c) for c in candidates) or "nothing (data.tokenizer is empty)"
    raise FileNotFoundError(f"cannot find the run's tokenizer (tried {tried}); pass --tokenizer DIR "
                            "(the folder made by `omniloom tokenizer train`)")


# what export and eval read from a checkpoint, verified against its recorded checksums first (the
# optimizer is not read, so not hashed)
READ_FILES = ("accelerate/" + ACC_SAFETENSORS, "accelerate/" + ACC_BIN, "accelerate/" + ACC_FSDP_FULL,
              "accelerate/" + ACC_FSDP_DCP, "config.yaml", "trainer.pt")


def load_checkpoint_model(path: str | Path, *, tokenizer: str | Path | None = None):
    """(model in eval mode, RunConfig, checkpoint folder, tokenizer folder) for a run or checkpoint,
    without writing anything (what `omniloom eval RUN` uses)."""
    ckpt = resolve_checkpoint(path)
    verify_files(ckpt, only=list(READ_FILES))
    cfg = load_checkpoint_config(ckpt)
    cfg = dataclasses.replace(cfg, model=portable_model_config(cfg.model))
    state = read_checkpoint_weights(ckpt)
    model = _build_checked(cfg.model, state, ckpt)
    tok_dir = find_tokenizer_dir(cfg, ckpt, tokenizer)
    return model.eval(), cfg, ckpt, tok_dir


def portable_model_config(model_cfg):
    """The model config with a backend that runs here: flex/flash (CUDA only) become blocksparse
    on a machine without CUDA. Same mask rule, same weights, same outputs up to rounding."""
    if model_cfg.attention.backend in ("flex", "flash") and not torch.cuda.is_available():
        log.info("attention backend %s needs CUDA: using blocksparse here", model_cfg.attention.backend)
        att = dataclasses.replace(model_cfg.attention, backend="blocksparse")
        return dataclasses.replace(model_cfg, attention=att)
    return model_cfg


def _build_checked(model_cfg, state: dict, ckpt: Path):
    """The OmniModel of `model_cfg` holding `state`, after checking the config (bounds, then every
    tensor's shape, on the meta device) against the weights: a hand-edited or hostile config.yaml
    (a vocabulary of 4e9) is refused before anything is allocated."""
    from omniloom.model import OmniModel
    from omniloom.model.pretrained import check_config_against_shapes

    check_config_against_shapes(model_cfg, {k: tuple(v.shape) for k, v in state.items()}, ckpt,
                                config_name="config.yaml")
    model = OmniModel(model_cfg)
    _load_strict(model, state, ckpt)
    return model


def _load_strict(model, state: dict, where) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: checkpoint weights do not match its config.yaml (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    for name, t in expected.items():
        if tuple(state[name].shape) != tuple(t.shape):
            raise ValueError(f"{where}: {name} has shape {tuple(state[name].shape)}, the config implies {tuple(t.shape)}")
    model.load_state_dict(state, strict=True)


# ---- writing an export -------------------------------------------------------------------------
@dataclasses.dataclass
class ExportResult:
    out_dir: Path
    checkpoint: Path | None
    files: list[Path]
    num_params: int
    total_bytes: int


def export_checkpoint(src: str | Path, out_dir: str | Path, *, dtype: str = "fp32", max_shard_size: str | int = "5GB",
                      tokenizer: str | Path | None = None, force: bool = False) -> ExportResult:
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
                      num_active=model.num_active_params(), dtype=dtype)
    result = save_export(model, tok_dir, out, dtype=dtype, max_shard_size=max_shard_size, source=source, card=card,
                         model_config=cfg.model, force=force)  # the training backend is recorded; load_pretrained adapts it
    result.checkpoint = ckpt
    return result


def load_export_tokenizer(export_dir: str | Path, tokenizer: str | Path | None = None):
    """The Tokenizer of an export folder (or `tokenizer`, another folder, when given), refused
    unless it is the one the export was made with: `config.json` records its tokenizer.model's
    sha256, and a swapped tokenizer folder (both files replaced together, or `--tokenizer`
    pointing elsewhere) would give the model other ids without any other error. The export's own
    tokenizer files must not link out of the folder (as its weights must not). An export that
    records no hash (older omniloom) is not compared."""
    from omniloom.model.pretrained import _inside, read_export_config
    from omniloom.tokenizers.text import Tokenizer

    export_dir = Path(export_dir)
    want = (read_export_config(export_dir).get("tokenizer") or {}).get("model_sha256")
    src = Path(tokenizer) if tokenizer is not None else export_dir
    if tokenizer is None:
        for name in TOKENIZER_FILES:
            if (export_dir / name).exists() or (export_dir / name).is_symlink():
                _inside(export_dir, export_dir / name)
    tok = Tokenizer.load(src)  # checks tokenizer.model against the folder's own recorded sha256 first
    got = tok.to_json()["model_sha256"]
    if want and got != want:
        raise ValueError(f"the tokenizer in {src} is not the one {export_dir / 'config.json'} was exported with "
                         f"(tokenizer.model sha256 {got[:12]}..., recorded {want[:12]}...); use the export's own "
                         "tokenizer files")
    return tok


def check_export_dir(out: Path, force: bool) -> None:
    """Refuse to write into a folder that already holds files, unless `force` (then the export's own
    files are replaced; other files stay)."""
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
    from omniloom.model.pretrained import CONFIG_NAME, FORMAT, FORMAT_VERSION

    from .cli import version
    from .config_io import to_dict
    from .hf import files as hf

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
    out.mkdir(parents=True, exist_ok=True)
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
            "files": list(TOKENIZER_FILES),
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
    total = sum(f.stat().st_size for f in files)
    log.info("wrote %d weight file(s), %.1f MB, to %s", len(files), total / 1e6, out)
    return ExportResult(out, None, files, model.num_params(), total)


def _trainer_state(ckpt: Path) -> dict:
    path = ckpt / "trainer.pt"
    if not path.is_file():
        return {}
    state = safe_torch_load(path)  # refuses a pickle that carries code
    return state if isinstance(state, dict) else {}


def _final_losses(run_dir: Path) -> dict[str, float]:
    from .metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    out: dict[str, float] = {}
    for row in read_metrics(path):  # later rows overwrite earlier ones: the last value of each key wins
        for k, v in row.items():
            if isinstance(v, (int, float)) and (k == "loss" or k.startswith(("loss/", "eval/loss"))):
                out[k] = float(v)
    return out


def _pattern_kinds(attention) -> str:
    """What the layer kinds of the pattern are, for those it holds only (a pattern without B layers
    says nothing of blocks)."""
    words = {"L": f"L: sliding window of {attention.window} tokens", "G": "G: global",
             "B": f"B: the top {attention.num_selected_blocks} of {attention.block_size}-token blocks"}
    return ", ".join(words[k] for k in "LGB" if k in attention.pattern.upper())


def model_card(cfg, ckpt: Path, *, step: int, tokens_seen: int, num_params: int, num_active: int, dtype: str) -> str:
    """A short README: what the model is, what it saw, how it ended, how to load it."""
    m = cfg.model
    sources = [f"  - `{s.path}` (weight {s.weight:g})" for s in cfg.data.sources] or ["  - (not recorded)"]
    heldout = [f"  - `{s.path}`" for s in cfg.data.eval_sources]
    losses = _final_losses(ckpt.parent.parent)
    loss_lines = [f"| {k} | {v:.4f} |" for k, v in sorted(losses.items())]
    lines = [
        "# omniloom model",
        "",
        f"A native multimodal sparse-attention MoE decoder (text, code, images, videos in one token stream), "
        f"trained from scratch with omniloom.",
        "",
        "## Model",
        f"- {num_params / 1e6:.2f} M parameters, {num_active / 1e6:.2f} M active per token; {m.num_layers} layers, "
        f"width {m.dim}, {m.num_heads} heads ({m.num_kv_heads} kv), vocabulary {m.vocab_size}",
        f"- attention pattern `{m.attention.pattern}` ({_pattern_kinds(m.attention)})",
        f"- MoE: {m.moe.num_experts} experts, top-{m.moe.num_experts_per_token}, {m.moe.num_shared_experts} shared, "
        f"first {m.moe.num_dense_layers} layer(s) dense",
        f"- weights: {dtype}, WEIGHT_FILES",
        "",
        "## Training",
        f"- steps: {step}",
        f"- tokens seen: {tokens_seen:,}",
        f"- sequence length {cfg.data.seq_len}, {cfg.data.batch_size} rows per rank per step",
        "- data:",
        *sources,
    ]
    if heldout:
        lines += ["- held-out data:", *heldout]
    lines += ["", "## Final losses (nats/token, from metrics.jsonl)", ""]
    lines += (["| metric | value |", "|---|---|", *loss_lines] if loss_lines else ["(no metrics.jsonl found beside the checkpoint)"])
    lines += [
        "",
        "## Use",
        "```",
        "from omniloom.model import load_pretrained",
        "model = load_pretrained('THIS_FOLDER')",
        "```",
        "`omniloom generate THIS_FOLDER --prompt TEXT [--image PATH]`, `omniloom eval THIS_FOLDER --data SHARDS`.",
        "",
        "Without omniloom, with Hugging Face transformers (the model's code is in this folder):",
        "```",
        "from transformers import AutoModelForCausalLM, AutoProcessor",
        "model = AutoModelForCausalLM.from_pretrained('THIS_FOLDER', trust_remote_code=True)",
        "processor = AutoProcessor.from_pretrained('THIS_FOLDER', trust_remote_code=True)",
        "```",
        "",
    ]
    return "\n".join(lines)


__all__ = ["ExportResult", "export_checkpoint", "portable_model_config", "save_export", "find_tokenizer_dir", "load_checkpoint_config", "load_checkpoint_model",
           "read_checkpoint_weights", "read_dcp_state_dict", "resolve_checkpoint", "SINGLE_NAME", "INDEX_NAME"]
