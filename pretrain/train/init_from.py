"""`train.init_from=EXPORT`: start a run from an export's weights (continued pretraining).

Weights only: the optimizer, schedule, step and data position start fresh. The export is an
`omniloom export` folder or a Hugging Face `save_pretrained` folder of one (config.json keeps
omniloom's keys there, and the weights keep omniloom's names), so a model fine-tuned in Hugging
Face comes back, and so does a PEFT LoRA adapter folder: it is merged onto the export its
`adapter_config.json` names (pretrain/train/adapter.py). Its weights must fit this run's model exactly (every tensor name and shape);
settings that do not change a shape (attention backend, window, rotary layout...) come from this
run's config, and where they differ from the export's a warning names them. A run resumed from
its own checkpoint ignores init_from (the checkpoint already holds trained weights).
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)

EXPERT_WEIGHTS = ("w_gate", "w_up", "w_down")
IGNORED = frozenset({"backend", "kernels", "expert_parallel", "dispatch"})  # how the model runs, not what it is


def check_init_from(path: str) -> Path | None:
    """The export folder of train.init_from, checked before any setup (None when unset): its
    config.json, and its safetensors headers (dtypes, the shard index; no tensor data is read)."""
    if not path:
        return None
    from omniloom.model.pretrained import read_export_config, read_safetensors_shapes

    from .adapter import adapter_base, is_adapter

    folder = Path(path)
    try:
        base = adapter_base(folder) if is_adapter(folder) else folder
        read_export_config(base)
        read_safetensors_shapes(base)
    except (FileNotFoundError, ValueError) as err:
        raise ValueError(f"train.init_from={path}: {err}") from err
    return folder


def load_init_weights(model, folder: Path, run_cfg, *, expert_range: tuple[int, int] | None = None) -> None:
    """Copy the export's weights into `model` (built from `run_cfg`, a RunConfig; with
    `expert_range`, only those routed experts: each rank takes its slice of the full tensors)."""
    from omniloom.model.pretrained import (
        check_config_against_shapes,
        model_config_from_dict,
        read_export_config,
        read_safetensors,
        read_safetensors_shapes,
    )

    from .adapter import adapter_base, is_adapter, merge_adapter

    adapter, folder = (folder, adapter_base(folder)) if is_adapter(folder) else (None, folder)
    info = read_export_config(folder)
    full = dataclasses.replace(run_cfg.model, moe=dataclasses.replace(run_cfg.model.moe, expert_parallel=1))
    try:
        shapes = read_safetensors_shapes(folder)
        exported = model_config_from_dict(info.get("model") or {})
    except ValueError as err:  # the export itself is broken, whatever this run's model
        raise ValueError(f"train.init_from={folder}: {err}") from err
    try:
        check_config_against_shapes(full, shapes, folder)
    except ValueError as err:
        raise ValueError(f"train.init_from={folder}: its weights do not fit this run's model: {err}") from err
    want = (info.get("tokenizer") or {}).get("model_sha256")
    if want and run_cfg.data.tokenizer:
        from omniloom.tokenizers.text import Tokenizer

        have = Tokenizer.load(run_cfg.data.tokenizer).to_json().get("model_sha256")
        if have and have != want:
            raise ValueError(f"train.init_from={folder} was trained with another tokenizer than data.tokenizer="
                             f"{run_cfg.data.tokenizer} (tokenizer.model sha256 {want[:12]}... vs {have[:12]}...): the "
                             "ids would mean other tokens; use the export's tokenizer")
    from omniloom.pretrain.config.run import config_differences, refuse_position_changes

    refuse_position_changes(exported, full, f"train.init_from={folder}")  # no weight's shape shows them
    changed = [f"{k} ({y} in the export, {x} here)" for k, x, y in config_differences(full, exported, ignore=IGNORED)]
    if changed:
        log.warning("train.init_from: this run's model settings differ from the export's in %s", "; ".join(changed))
    state = read_safetensors(folder)
    if adapter is not None:
        try:
            merged = merge_adapter(state, adapter)
        except (OSError, ValueError) as err:
            raise ValueError(f"train.init_from={adapter}: {err}") from err
        log.info("train.init_from: merged the LoRA adapter %s (%d weights) onto %s", adapter, len(merged), folder)
    mine = model.state_dict()
    with torch.no_grad():
        for name, tensor in mine.items():
            src = state[name]
            if expert_range is not None and name.rsplit(".", 1)[-1] in EXPERT_WEIGHTS and src.shape != tensor.shape:
                src = src[expert_range[0]:expert_range[1]]
            tensor.copy_(src.to(tensor.dtype))
    log.info("train.init_from: started from the weights of %s (step %s of its run); optimizer and data start fresh",
             folder, (info.get("source") or {}).get("step", "?"))
