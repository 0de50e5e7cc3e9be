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
    is a ValueError naming the closest valid one (an export from a newer omniloom, or a typo).
    A saved config without `rope_layout` was written before the key existed: its model was
    trained with the `sections` layout, and keeps it."""
    from .config import LEGACY_ROPE_LAYOUT, ModelConfig

    if isinstance(data, dict) and "rope_layout" not in data:
        data = {**data, "rope_layout": LEGACY_ROPE_LAYOUT}
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
        else:
            if typing.get_origin(tp) is tuple and isinstance(value, list):
                value = tuple(value)
            _check_type(value, tp, f"{path}.{key}")
        kwargs[key] = value
    try:
        return cls(**kwargs)
    except ValueError as err:  # a range its __post_init__ checks (model.norm_eps=-1, ...)
        raise ValueError(f"{err} (in {CONFIG_NAME}: the file is corrupt or was not written by `omniloom export`)") from err


def _type_ok(value, tp) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if origin is typing.Union:
        return any(_type_ok(value, a) for a in args)
    if origin is tuple:
        if not isinstance(value, tuple):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_type_ok(v, args[0]) for v in value)
        return len(value) == len(args) and all(_type_ok(v, a) for v, a in zip(value, args))
    if tp is type(None):
        return value is None
    if tp is float:  # JSON writes 1.0 as 1 when a float is whole
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, tp) if isinstance(tp, type) else True


def _check_type(value, tp, key: str) -> None:
    """A config value of the wrong JSON type (`"dim": "32"`) is one clear error naming the key,
    not a TypeError deep inside a constructor."""
    if not _type_ok(value, tp):
        want = getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
        raise ValueError(f"{key}={value!r} in {CONFIG_NAME} is not of type {want}; the export is corrupt or was "
                         "not written by `omniloom export`")


def _inside(folder: Path, file: Path) -> Path:
    """`file`, after checking that it (followed through any symlinks) stays inside `folder`: an
    export whose weights link to a file elsewhere (`/etc/...`, another user's home) is refused,
    as shard names with `../` are."""
    target, root = file.resolve(), folder.resolve()
    if not target.is_relative_to(root):
        raise ValueError(f"{file} links to {target}, outside the export folder {root}; refusing to read it "
                         "(copy the file into the folder instead of linking it)")
    return file


def read_json_object(path: Path) -> dict:
    """The JSON object in `path` (a file of an export folder), or one ValueError line naming the
    file: not JSON, not an object, or nested too deep for the parser (a RecursionError otherwise)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except RecursionError:
        raise ValueError(f"{path} is nested too deep to be a file omniloom wrote; refusing to read it") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{path} must be a JSON object, got a {json_type(data)}")
    return data


def json_type(value) -> str:
    """The JSON name of a parsed value's type, for messages ('a list', not 'a list object')."""
    for tp, name in ((bool, "boolean"), (dict, "object"), (list, "list"), (str, "string"), ((int, float), "number")):
        if isinstance(value, tp):
            return name
    return "null" if value is None else type(value).__name__


def read_export_config(path: str | Path) -> dict:
    """The parsed config.json of an export folder (FileNotFoundError / ValueError say what is wrong)."""
    folder = Path(path)
    cfg_path = folder / CONFIG_NAME
    if not cfg_path.is_file():
        hint = " (that is a training run: export it first with `omniloom export RUN --out DIR`)" if (folder / "checkpoints").is_dir() else ""
        raise FileNotFoundError(f"{folder} has no {CONFIG_NAME}; pass a folder written by `omniloom export`{hint}")
    _inside(folder, cfg_path)
    info = read_json_object(cfg_path)
    if info.get("format") != FORMAT:
        raise ValueError(f"{cfg_path} is not an omniloom export (format {info.get('format')!r}, want {FORMAT!r})")
    version = info.get("format_version", 0)
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"{cfg_path}: format_version {version!r} is not a whole number; the file is corrupt or was not "
                         "written by `omniloom export`")
    if version > FORMAT_VERSION:
        raise ValueError(f"{cfg_path} has format_version {version}, newer than this omniloom reads "
                         f"({FORMAT_VERSION}); upgrade omniloom")
    for key in ("model", "tokenizer", "source"):
        if key in info and not isinstance(info[key], dict):
            raise ValueError(f"{cfg_path}: '{key}' must be an object, got a {json_type(info[key])}; the file is corrupt "
                             "or was not written by `omniloom export`")
    return info


def _weight_files(folder: Path) -> tuple[list[Path], dict | None]:
    """The safetensors files of an export folder and its index's weight map (None for a single
    file). Every file must lie inside the folder, links followed."""
    index = folder / INDEX_NAME
    if index.is_file():
        _inside(folder, index)
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: weight_map must be an object of tensor name -> shard file name")
        if not weight_map:
            raise ValueError(f"{index} lists no tensors")
        files = []
        for fname in sorted(set(weight_map.values())):
            shard = folder / str(fname)
            if Path(fname).name != fname or not shard.is_file():
                raise FileNotFoundError(f"{index} names shard {fname!r}, which is not in {folder}; copy the whole export folder")
            files.append(_inside(folder, shard))
        return files, weight_map
    single = folder / SINGLE_NAME
    if not single.is_file():
        raise FileNotFoundError(f"no {SINGLE_NAME} or {INDEX_NAME} in {folder}; is it an `omniloom export` folder?")
    return [_inside(folder, single)], None


# The dtypes omniloom writes (export --dtype fp32 | bf16 | fp16). Integer bytes relabelled as a
# float tensor's (same size, same shape) would load as a silently wrong model.
WEIGHT_DTYPES = ("F32", "BF16", "F16")


def _scan_weights(folder: Path) -> tuple[list[Path], dict[str, tuple[int, ...]]]:
    """(files, name -> shape) from the safetensors headers only. Refuses, naming the file and the
    tensor: a header safetensors cannot read, a dtype omniloom does not write, and with an index,
    a tensor the index does not name or places in another shard (a tensor in two shards would
    otherwise be taken from whichever file came last), or one the index names that no shard holds."""
    from safetensors import safe_open

    files, weight_map = _weight_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as fh:
                header = [(name, fh.get_slice(name).get_dtype(), tuple(fh.get_slice(name).get_shape())) for name in fh.keys()]
        except Exception as err:  # SafetensorError: a header that lies about sizes or offsets
            raise ValueError(f"{file} is not a valid safetensors file: {err}") from err
        for name, dtype, shape in header:
            if weight_map is not None and weight_map.get(name) != file.name:
                where = f"places in {weight_map[name]}" if name in weight_map else "does not name"
                raise ValueError(f"{file} holds {name}, which {INDEX_NAME} {where}; refusing a shard the index does not "
                                 "account for (remove the stray tensor or re-export)")
            if dtype not in WEIGHT_DTYPES:
                raise ValueError(f"{file}: tensor {name} has dtype {dtype}; omniloom's weights are floating point "
                                 f"({', '.join(WEIGHT_DTYPES)}): the file is corrupt or was not written by omniloom")
            shapes[name] = shape
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(shapes))
        if missing:
            raise ValueError(f"{folder / INDEX_NAME} lists tensors no shard holds: {missing[:5]}")
    return files, shapes


def read_safetensors_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in an export folder, from the safetensors headers only (no
    tensor data is read; every check of `_scan_weights`): what `load_pretrained` checks
    config.json against before allocating."""
    return _scan_weights(Path(path))[1]


def read_safetensors(path: str | Path, device: str = "cpu") -> dict:
    """All tensors of an export folder: `model.safetensors`, or every shard its index lists, each
    tensor from the shard the index names for it (headers checked first: `_scan_weights`)."""
    from safetensors.torch import load_file

    files, _ = _scan_weights(Path(path))
    state: dict = {}
    for file in files:
        state.update(load_file(str(file), device=device))
    return state


# Config integers that count or size something; ids may be -1 ("none"). Anything above 2**31 is no
# real model, and a negative size would otherwise surface as a torch error deep in a constructor.
_MAX_INT = 2**31 - 1
_MAY_BE_MINUS_ONE = {"patch_token_id", "pad_token_id"}
_MAY_BE_ZERO = {"num_experts", "num_shared_experts", "num_dense_layers", "num_visual_experts", "dense_warmup_steps",
                "indexer_rope_dim", "visual_pos_max"}


def _check_bounds(cfg, path: str = "model", config_name: str = CONFIG_NAME) -> None:
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, key = getattr(cfg, f.name), f"{path}.{f.name}"
        if dataclasses.is_dataclass(value):
            _check_bounds(value, key, config_name)
            continue
        values = list(value) if isinstance(value, (tuple, list)) else [value]
        for v in values:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            if isinstance(v, float) or hints[f.name] is float:  # JSON writes a whole float as an int
                if v != v or abs(v) == float("inf"):
                    raise ValueError(f"{key}={value} in {config_name} is not a finite number")
                continue
            # model.vision_encoder's sizes: 0 means sized from the decoder (VisionEncoderConfig.resolved)
            may_be_zero = f.name in _MAY_BE_ZERO or isinstance(value, tuple) or path.endswith(".vision_encoder")
            low = -1 if f.name in _MAY_BE_MINUS_ONE else (0 if may_be_zero else 1)
            if not low <= v <= _MAX_INT:
                raise ValueError(f"{key}={value} in {config_name} is out of range (must be between {low} and "
                                 f"{_MAX_INT}); the file is corrupt or was not written by omniloom")


def check_config_against_weights(cfg, path: str | Path) -> None:
    """Raise ValueError unless the model `cfg` describes has exactly the tensors, with exactly the
    shapes, that the export's safetensors headers hold. Costs no memory: the model is built on
    the meta device and only the headers are read, so a hostile config.json (a vocabulary of 4e9,
    dim 8192 x 16 layers) is refused before anything is allocated."""
    check_config_against_shapes(cfg, read_safetensors_shapes(path), path)


def _skip_meta_init():
    """A TorchFunctionMode under which random or constant initialisation of a meta tensor does
    nothing: a model built on the meta device only for its shapes need not run its init, whose
    meta kernels (torch._refs) import torch._dynamo, 1 s of every eval, export and generate."""
    import torch
    from torch.overrides import TorchFunctionMode

    names = {"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
             "xavier_normal_", "orthogonal_", "constant_", "zeros_", "ones_", "zero_", "fill_"}

    class SkipMetaInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if getattr(func, "__name__", None) in names:
                t = args[0] if args else kwargs.get("tensor")  # torch.nn.init passes its tensor by keyword
                if isinstance(t, torch.Tensor) and t.is_meta:
                    return t
            return func(*args, **kwargs)

    return SkipMetaInit()


def check_config_against_shapes(cfg, shapes: dict[str, tuple[int, ...]], where, config_name: str = CONFIG_NAME) -> None:
    """`check_config_against_weights` for tensor shapes already known (a training checkpoint's
    weights, read before the model is built): bounds every config integer, then compares the
    state dict of the model built on the meta device (nothing allocated) with `shapes`."""
    import torch

    from .decoder import OmniModel

    _check_bounds(cfg, config_name=config_name)
    try:
        cfg.validate()
    except ValueError as err:
        raise ValueError(f"{where}: {config_name}: {err}") from err
    _refuse_a_name_prefix(shapes, where)
    layers = {int(k.split(".")[1]) for k in shapes if k.startswith("layers.") and k.split(".")[1].isdigit()}
    if cfg.num_layers != len(layers):  # checked first: building a huge layer count even on meta takes long
        raise ValueError(f"{where}: {config_name} says model.num_layers={cfg.num_layers}, the weights hold {len(layers)} layers")
    enc_layers = {k.split(".")[2] for k in shapes if k.startswith("vision.layers.")}
    enc_depth = cfg.vision_encoder.resolved(cfg).num_layers if cfg.vision_encoder.enabled else 0
    if enc_depth != len(enc_layers):  # as for the decoder: a huge depth takes long to build even on meta
        raise ValueError(f"{where}: {config_name} implies {enc_depth} model.vision_encoder layers, the weights hold "
                         f"{len(enc_layers)}")
    with torch.device("meta"), _skip_meta_init():
        expected = {k: tuple(v.shape) for k, v in OmniModel(cfg).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(shapes)), sorted(set(shapes) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: weights do not match {config_name} (missing {missing[:5]}, unexpected {unexpected[:5]})")
    for name, shape in expected.items():
        if tuple(shapes[name]) != shape:
            raise ValueError(f"{where}: tensor {name} has shape {tuple(shapes[name])}, {config_name} implies {shape}")


def _refuse_a_name_prefix(shapes: dict, where) -> None:
    """Weights saved from a wrapper (`model.embed.tok.weight`, as a transformers `...ForCausalLM`
    around the model names them) are not omniloom's layout: refused with the prefix and how to
    strip it, rather than taken as a model with 0 layers. Not stripped silently: the names are the
    contract of the file, and an export of omniloom's own never has the prefix."""
    if not shapes or "embed.tok.weight" in shapes:
        return
    hit = next((k for k in shapes if k.endswith(".embed.tok.weight")), None)
    if hit is None:
        return
    prefix = hit[: -len("embed.tok.weight")]
    if all(k.startswith(prefix) for k in shapes):
        raise ValueError(f"{where}: every weight name in its safetensors files starts with {prefix!r} ({hit}, where omniloom "
                         "expects embed.tok.weight): "
                         f"the weights were saved from a wrapper; strip the prefix, e.g. with safetensors: "
                         f"save_file({{k.removeprefix({prefix!r}): v for k, v in load_file(f).items()}}, f)")


def load_pretrained(path: str | Path, *, device: str = "cpu", dtype: str | None = None, backend: str | None = None):
    """Rebuild the exported OmniModel with its weights, in eval mode.

    dtype: None keeps float32 parameters (bf16 exports are upcast exactly); "bf16"/"fp16" casts
    the parameters after loading (the router-bias buffers stay fp32).
    backend: override the attention backend recorded at training time (e.g. "sdpa" to run a
    model trained with "flex" on a CPU)."""
    import torch

    from .decoder import OmniModel

    info = read_export_config(path)
    try:
        cfg = model_config_from_dict(info.get("model") or {})
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from err
    if backend is not None:
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend=backend))
    elif cfg.attention.backend in ("flex", "flash") and not torch.cuda.is_available():
        # a model trained on GPUs still loads on a CPU: same mask rule, portable backend
        cfg = dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend="blocksparse"))
    check_config_against_weights(cfg, path)  # before anything is allocated
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

