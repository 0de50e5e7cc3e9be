"""Everything that changes how a finished single-device model executes, applied in one place
in a fixed order: expert parallelism (pretrain/train/expert_parallel.py), then activation checkpointing,
then torch.compile, per transformer block. Data parallelism
and FSDP2 sharding come after, from `accelerator.prepare` and the accelerate config file
(`configs/accelerate/fsdp2.yaml` wraps the same transformer blocks); with expert parallelism
under FSDP2 the trainer shards here instead (`apply_fsdp2`: accelerate cannot leave the expert
shards out), and accelerate takes the sharded model as it is. Also: deterministic mode.

Order matters (as in torchtitan): checkpointing wraps the block's forward, compile then traces the
wrapped forward, and sharding wraps the compiled blocks last.
"""

from __future__ import annotations

import functools
import logging
import os
import random

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

log = logging.getLogger(__name__)

# Attribute names under which models keep their repeated transformer blocks.
BLOCK_CONTAINER_NAMES = ("layers", "blocks", "h")


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated decoder blocks of `model`: the first ModuleList found under one of
    BLOCK_CONTAINER_NAMES (also one level down, e.g. `model.decoder.layers`)."""
    candidates = [model] + [m for _, m in model.named_children()]
    for owner in candidates:
        for name in BLOCK_CONTAINER_NAMES:
            blocks = getattr(owner, name, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
                return list(blocks)
    raise ValueError(f"{type(model).__name__} has no ModuleList named one of {BLOCK_CONTAINER_NAMES}; "
                     "activation checkpointing and compile need the transformer blocks")


def block_class_names(model: torch.nn.Module) -> list[str]:
    """Class names of the transformer blocks (what FSDP's transformer_layer_cls_to_wrap needs)."""
    return sorted({type(b).__name__ for b in transformer_blocks(model)})


def _checkpointed_forward(original_forward, *args, **kwargs):
    # Non-reentrant checkpointing supports keyword args and outputs that are tuples/dataclasses.
    return checkpoint(original_forward, *args, use_reentrant=False, **kwargs)


def encoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers of a vision encoder (`model.vision_encoder`, late fusion: `model.vision.layers`);
    none without one."""
    layers = getattr(getattr(model, "vision", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


def apply_activation_checkpointing(model: torch.nn.Module) -> int:
    """Recompute each block's activations in backward: the decoder's blocks and a vision
    encoder's layers. The forward is replaced on the instance, so parameter names and state-dict
    keys do not change. Returns the number of blocks wrapped."""
    blocks = transformer_blocks(model) + encoder_blocks(model)
    for block in blocks:
        if getattr(block, "_omniloom_ac", False):
            continue
        block.forward = functools.partial(_checkpointed_forward, block.forward)
        block._omniloom_ac = True
    return len(blocks)


def apply_compile(model: torch.nn.Module) -> int:
    """torch.compile each block in place (`Module.compile` keeps state-dict keys). Per-block
    compilation keeps compile time flat in depth and lets the MoE's data-dependent routing run
    between graphs when it must."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)


def fsdp_plugin(accelerator):
    """The accelerate config's FSDP plugin, or None."""
    return getattr(getattr(accelerator, "state", None), "fsdp_plugin", None)


def check_launch(accelerator, expert_parallel: int, num_experts: int) -> None:
    """ValueError saying what to change when `model.moe.expert_parallel` cannot run on this launch."""
    from .expert_parallel import check_expert_parallel

    plugin = fsdp_plugin(accelerator)
    check_expert_parallel(expert_parallel, accelerator.num_processes, num_experts,
                          distributed_type=str(getattr(accelerator, "distributed_type", "")),
                          fsdp_version=getattr(plugin, "fsdp_version", None))


def apply_parallelism(model: torch.nn.Module, train_cfg, accelerator, *, expert_parallel: int = 1) -> torch.nn.Module:
    """Shard the routed experts over expert groups (`expert_parallel` > 1, collective), apply
    activation checkpointing and compile per `train_cfg`, then hand the model to the caller, who
    passes it to `accelerator.prepare` (DDP or FSDP2 from the accelerate config). The expert plan,
    when there is one, is `expert_parallel.find_plan(model)`."""
    plugin = fsdp_plugin(accelerator)
    if expert_parallel > 1:
        from .expert_parallel import parallelize_experts

        num_experts = getattr(getattr(getattr(model, "cfg", None), "moe", None), "num_experts", expert_parallel)
        check_launch(accelerator, expert_parallel, num_experts)
        plan = parallelize_experts(model, expert_parallel)
        log.info("%s", plan.describe())
    else:
        plan = None
    if train_cfg.activation_checkpointing:
        n = apply_activation_checkpointing(model)
        enc = len(encoder_blocks(model))
        log.info("activation checkpointing on %d blocks%s", n, f" ({enc} of them the vision encoder's)" if enc else "")
    if train_cfg.compile:
        if train_cfg.deterministic:
            log.warning("train.compile with train.deterministic: compiled kernels may pick different "
                        "algorithms than eager; exact reproducibility holds only run-to-run with compile")
        n = apply_compile(model)
        log.info("torch.compile on %d blocks", n)
    dist_type = str(getattr(accelerator, "distributed_type", ""))
    if "FSDP" in dist_type and plan is not None:
        # accelerate's FSDP2 would shard the expert shards over the world: shard here instead
        # (ExpertParallel.apply_fsdp2); accelerate.prepare then takes the FSDPModule as it is
        model.to(accelerator.device)
        names = ", ".join(block_class_names(model))  # before fully_shard renames the class Block to FSDPBlock
        if plugin is not None:  # resolve accelerate's wrap policy by that name too
            plugin.set_auto_wrap_policy(model)
        n = apply_fsdp2(model, expert_plan=plan, **_fsdp2_settings(accelerator))
        log.info("FSDP2 over %d ranks on %d %s blocks and the root; %s", accelerator.num_processes, n, names,
                 f"the expert shards sharded over their replica group of {plan.num_replicas} (routers replicated)"
                 if plan.fsdp_experts else "the expert shards stay out")
    elif "FSDP" in dist_type:
        log.info("FSDP from the accelerate config will wrap %s", ", ".join(block_class_names(model)))
    return model


def apply_fsdp2(model: torch.nn.Module, *, expert_plan=None, ignored_params=(), mp_policy=None, offload_policy=None,
                reshard_after_forward: bool = True, mesh=None) -> int:
    """FSDP2 (`fully_shard`) on each transformer block, then on the root (embeddings, norms, the
    output head): every parameter becomes a DTensor sharded over `mesh` (all ranks by default),
    except `ignored_params`, which stay plain tensors that FSDP neither gathers nor reduces.
    With an expert-parallel plan, its MoE layers are prepared first (ExpertParallel.apply_fsdp2:
    with one replica the expert shards stay out of FSDP; with several they are sharded over
    their replica group). Collective; call after activation checkpointing and compile, with the
    model on its device. Returns the block count."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"mp_policy": mp_policy or MixedPrecisionPolicy(), "offload_policy": offload_policy or OffloadPolicy(),
              "reshard_after_forward": reshard_after_forward, "mesh": mesh}
    ignored = set(ignored_params)
    if expert_plan is not None:
        ignored |= expert_plan.apply_fsdp2(kwargs)
    if ignored:
        kwargs["ignored_params"] = ignored
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    # the root's parameters are gathered once for the whole forward (the output head runs last)
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return len(blocks)


def _fsdp2_settings(accelerator) -> dict:
    """mp_policy / offload_policy / reshard_after_forward of the accelerate config's FSDP plugin."""
    plugin = fsdp_plugin(accelerator)
    if plugin is None:
        return {}
    if getattr(plugin, "fsdp_version", 2) != 2:
        raise ValueError("expert parallelism needs FSDP2: set fsdp_version: 2 in the accelerate config")
    # as accelerate's fsdp2_prepare_model passes them
    return {"reshard_after_forward": bool(plugin.reshard_after_forward), "offload_policy": plugin.cpu_offload,
            "mp_policy": plugin.mixed_precision_policy}


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices) identically."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels where torch has them, and an error where it does not (so a silent
    source of nondeterminism cannot sneak into a run that claims to be exact)."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
