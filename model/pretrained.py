"""Rebuild an `OmniModel` from an `omniloom export` folder (config.json + safetensors).

    from omniloom.model import load_pretrained
    model = load_pretrained("export/")            # fp32, eval mode, on CPU

Weights are read with safetensors only (never unpickled). The folder layout is written by
`omniloom.pretrain.export`: `config.json` (`{"model": ModelConfig fields, "tokenizer": ...,
"omniloom_version": ...}`), `model.safetensors` or `model-0000i-of-0000N.safetensors` +
`model.safetensors.index.json`. The model package reads files here and nowhere else; the reader
is kept self-contained so `omniloom.model` imports nothing from `omniloom.pretrain`.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from pathlib import Path

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
FORMAT = "omniloom-export"
FORMAT_VERSION = 1

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}


def model_config_from_dict(data: dict):
    """ModelConfig (with its nested attention / moe configs) from plain JSON data; an unknown key
    is a ValueError naming the closest valid one (an export from a newer omniloom, or a typo)."""
    from .config import ModelConfig

    return _build(ModelConfig, data, "model")


def _build(cls, data: dict, path: str):
    if not isinstance(data, dict):
        raise ValueError(f"{path} in {CONFIG_NAME} must be an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ValueError(f"unknown key '{path}.{key}' in {CONFIG_NAME}{hint} (exported by a newer omniloom?)")
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            value = _build(tp, value, f"{path}.{key}")
        elif typing.get_origin(tp) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[key] = value
    return cls(**kwargs)


def read_export_config(path: str | Path) -> dict:
    """The parsed config.json of an export folder (FileNotFoundError / ValueError say what is wrong)."""
    folder = Path(path)
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        hint = " (that is a training run: export it first with `omniloom export RUN --out DIR`)" if (folder / "checkpoints").is_dir() else ""
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}; pass a folder written by `omniloom export`{hint}")
    try:
        info = json.loads(cfg_path.read_text())
    except ValueError as err:
        raise ValueError(f"{cfg_path} is not valid JSON: {err}") from err
    if info.get("format") != FORMAT:
        raise ValueError(f"{cfg_path} is not an omniloom export (format {info.get('format')!r}, want {FORMAT!r})")
    if int(info.get("format_version", 0)) > FORMAT_VERSION:
        raise ValueError(f"{cfg_path} has format_version {info['format_version']}, newer than this omniloom reads "
                         f"({FORMAT_VERSION}); upgrade omniloom")
    return info


def read_safetensors(path: str | Path, device: str = "cpu") -> dict:
    """All tensors of an export folder: `model.safetensors`, or every shard its index lists
    (each listed tensor must be found in its shard)."""
    from safetensors.torch import load_file

    folder = Path(path)
    index = folder / INDEX_NAME
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        if not weight_map:
            raise ValueError(f"{index} lists no tensors")
        state: dict = {}
        for fname in sorted(set(weight_map.values())):
            shard = folder / fname
            if Path(fname).name != fname or not shard.is_file():
                raise FileNotFoundError(f"{index} names shard {fname!r}, which is not in {folder}; copy the whole export folder")
            state.update(load_file(str(shard), device=device))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ValueError(f"{folder}: the index lists tensors no shard holds: {missing[:5]}")
        return state
    single = folder / SINGLE_NAME
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {folder}; is it an `omniloom export` folder?")
    return load_file(str(single), device=device)


def load_pretrained(path: str | Path, *, device: str = "cpu", dtype: str | None = None, backend: str | None = None):
    """Rebuild the exported OmniModel with its weights, in eval mode.

    dtype: None keeps float32 parameters (bf16 exports are upcast exactly); "bf16"/"fp16" casts
    the parameters after loading (the router-bias buffers stay fp32).
    backend: override the attention backend recorded at training time (e.g. "sdpa" to run a
    model trained with "flex" on a CPU)."""
    import torch

    from .decoder import OmniModel

    info = read_export_config(path)
    cfg = model_config_from_dict(info.get("model") or {})
    if backend is not None:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend=backend))
    elif cfg.attention.backend in ("flex", "flash") and not torch.cuda.is_available():
        # a model trained on GPUs still loads on a CPU: same mask rule, portable backend
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend="blocksparse"))
    state = read_safetensors(path)
    # Built on the CPU (its random init is overwritten): the model also holds buffers outside
    # the state dict (the MoE's allowed-expert table) that only its constructor knows how to fill.
    model = OmniModel(cfg)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config.json (missing {missing[:5]}, unexpected {unexpected[:5]})")
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            src = state[name]
            if tuple(src.shape) != tuple(tensor.shape):
                raise ValueError(f"{path}: tensor {name} has shape {tuple(src.shape)}, config.json implies {tuple(tensor.shape)}")
            tensor.copy_(src)
    if dtype is not None:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(sorted(_DTYPES))}, got {dtype!r}")
        target = getattr(torch, _DTYPES[dtype])
        for p in model.parameters():  # buffers (router biases) stay fp32: routing runs in fp32
            p.data = p.data.to(target)
    return model.to(device).eval()

