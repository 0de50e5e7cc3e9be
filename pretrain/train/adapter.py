"""`train.init_from=ADAPTER`: a PEFT LoRA adapter folder, merged onto the export it was trained on.

A LoRA adapter saved by PEFT (`PeftModel.save_pretrained`) holds `adapter_config.json` (the
base model's path, the rank r, lora_alpha, the target modules) and `adapter_model.safetensors`
(for each adapted Linear, `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r]). Merging is what PEFT's `merge_and_unload` does for a Linear:

    W <- W + (lora_alpha / r) * B @ A        (lora_alpha / sqrt(r) with use_rslora)

on the base export's weights (omniloom's Hugging Face model has omniloom's parameter names, so
`<module>.weight` is the export's tensor). What this does not merge is refused by name: DoRA,
per-module ranks or alphas, modules saved whole (`modules_to_save`), embedding or convolution
adapters, pickled `adapter_model.bin`. Merge those with PEFT (`merge_and_unload()` then
`save_pretrained(DIR)`) and pass DIR.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_MERGE_YOURSELF = ("merge it with PEFT (model = PeftModel.from_pretrained(base, ADAPTER).merge_and_unload(); "
                   "model.save_pretrained(DIR)) and pass DIR")


def is_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file() and not (folder / "config.json").is_file()


def read_adapter_config(folder: Path) -> dict:
    path = folder / ADAPTER_CONFIG
    if path.stat().st_size > 1 << 20:
        raise ValueError(f"{path} is {path.stat().st_size:,} bytes: not a PEFT adapter config")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({type(err).__name__})") from err
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} holds a {type(cfg).__name__}, not a JSON object")
    kind = cfg.get("peft_type")
    if kind != "LORA":
        raise ValueError(f"{path}: peft_type is {kind!r}; only LoRA adapters are merged here, "
                         f"for others {_MERGE_YOURSELF}")
    for key, bad in (("use_dora", True), ("fan_in_fan_out", True)):
        if cfg.get(key) == bad:
            raise ValueError(f"{path}: {key} is set; {_MERGE_YOURSELF}")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"{path}: {key} is set ({str(cfg[key])[:80]}); {_MERGE_YOURSELF}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    for key, value in (("r", r), ("lora_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < 1e6):
            raise ValueError(f"{path}: {key} is {value!r}, not a positive number")
    return cfg


def adapter_base(folder: Path) -> Path:
    """The export folder the adapter was trained on (its `base_model_name_or_path`: as written, or
    relative to the adapter folder)."""
    cfg = read_adapter_config(folder)
    base = cfg.get("base_model_name_or_path")
    if not isinstance(base, str) or not base:
        raise ValueError(f"{folder / ADAPTER_CONFIG} names no base_model_name_or_path: set it to the export the "
                         f"adapter was trained on, or {_MERGE_YOURSELF}")
    for candidate in (Path(base).expanduser(), folder / base):
        if (candidate / "config.json").is_file():
            return candidate
    raise ValueError(f"{folder} is a PEFT LoRA adapter of {base!r}, which is not an export folder "
                     f"here: set base_model_name_or_path in {folder / ADAPTER_CONFIG} to that export's folder, or "
                     f"{_MERGE_YOURSELF}")


def merge_adapter(state: dict[str, torch.Tensor], folder: Path) -> list[str]:
    """Add the adapter's LoRA updates to `state` (the base export's tensors, changed in place).
    Returns the names of the merged weights."""
    from safetensors import safe_open

    cfg = read_adapter_config(folder)
    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        found = "adapter_model.bin (a pickle, not read)" if (folder / "adapter_model.bin").exists() else "no weights"
        raise ValueError(f"{folder} has {found}: save the adapter with safetensors (PEFT's default) or {_MERGE_YOURSELF}")
    lora: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if not key.startswith(_PREFIX):
                raise ValueError(f"{path}: tensor {key!r} is not a LoRA weight of the base model; {_MERGE_YOURSELF}")
            module, _, part = key[len(_PREFIX):].rpartition(".lora_")
            if part not in ("A.weight", "B.weight"):
                raise ValueError(f"{path}: tensor {key!r} is not a Linear LoRA weight (lora_A / lora_B); {_MERGE_YOURSELF}")
            tensor = f.get_tensor(key)
            if not tensor.is_floating_point():
                raise ValueError(f"{path}: tensor {key!r} is {tensor.dtype}, not a floating-point weight")
            lora.setdefault(module, {})[part[0]] = tensor
    if not lora:
        raise ValueError(f"{path} holds no LoRA weights")
    r, alpha = cfg["r"], cfg["lora_alpha"]
    scale = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    merged = []
    for module, ab in sorted(lora.items()):
        name = f"{module}.weight"
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: {module} has lora_{next(iter(ab))} without its pair")
        if name not in state:
            raise ValueError(f"{path}: {module} is not a weight of the base export ({name} not found)")
        w, a, b = state[name], ab["A"], ab["B"]
        if a.shape[0] != r:
            raise ValueError(f"{path}: {module}'s lora_A has rank {a.shape[0]}, the config says r={r}")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1] or (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"{path}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit "
                             f"{name} {tuple(w.shape)}")
        state[name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        merged.append(name)
    return merged
