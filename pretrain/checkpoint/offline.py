"""Reading a training checkpoint offline, without training."""

from __future__ import annotations

import dataclasses
import io
import logging
import pickle
import warnings
from pathlib import Path

import torch

from omniloom.pretrain.rundir import CHECKPOINT_CONFIG, CHECKPOINTS

from .manager import (
    FULL_FSDP_MODEL_FILE,
    MARKER,
    SHARDED_MODEL_DIR,
    describe_incomplete,
    incomplete_checkpoints,
    incomplete_reason,
    latest_checkpoint,
    list_checkpoints,
    step_of,
    verify_files,
)
from .safe_io import safe_torch_load

log = logging.getLogger(__name__)




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
    if (p / CHECKPOINTS).is_dir() or (p.name == CHECKPOINTS and p.is_dir()):
        ckpt_dir = p / CHECKPOINTS if (p / CHECKPOINTS).is_dir() else p
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
    from omniloom.pretrain.config.run import load_saved_config

    path = Path(ckpt) / CHECKPOINT_CONFIG
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
              "accelerate/" + ACC_FSDP_DCP, CHECKPOINT_CONFIG, "trainer.pt")


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
                                config_name=CHECKPOINT_CONFIG)
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
