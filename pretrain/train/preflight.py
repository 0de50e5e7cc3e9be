"""Checks a run config gets before minutes of setup: are its local held-out sources there
(`check_sources`), will one step fit in memory, and which settings are ignored by the model they
configure.

`check_step_memory` estimates what one micro-batch keeps for the backward pass from the config
alone (`step_memory`) and refuses a run whose estimate exceeds the memory of the device it trains
on, naming both figures. The estimate counts only what certainly exists (each layer's inputs,
projections, the experts' intermediate activations, and the batches the loader workers hold), not
attention scores, logits or allocator slack, so it is a floor: a run refused by it cannot fit,
and a run it lets through can still run out of memory.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

# host bytes per token of one PackedBatch: input_ids, labels (int64), positions (3 x int32),
# doc_ids, block_ids (int32), modality (uint8); patches come on top
_BATCH_BYTES_PER_TOKEN = 8 + 8 + 12 + 4 + 4 + 1


def activation_bytes_per_token(model_cfg, *, dtype_bytes: int, checkpointing: bool) -> float:
    """Bytes of activations one token keeps for the backward pass, summed over the layers (a floor).
    With activation checkpointing only each layer's input is kept, plus one layer's activations
    while it is recomputed."""
    d, hd = model_cfg.dim, model_cfg.head_dim
    attn = 3 * d + 2 * model_cfg.num_heads * hd + 2 * model_cfg.num_kv_heads * hd  # norm in/out, q, k, v, out, proj
    per_layer = []
    for layer in range(model_cfg.num_layers):
        moe = model_cfg.moe
        if model_cfg.is_moe_layer(layer):
            k = moe.num_experts_per_token
            # router scores (fp32), each routed copy: its input, gate, up, activation, output; shared experts
            ffn = 2 * d + moe.num_experts * 4 / dtype_bytes + k * (2 * d + 3 * moe.expert_dim) \
                + moe.num_shared_experts * (2 * d + 3 * moe.expert_dim)
        else:
            ffn = 2 * d + 3 * moe.dense_dim
        per_layer.append((attn + ffn) * dtype_bytes)
    if checkpointing:
        return model_cfg.num_layers * d * dtype_bytes + max(per_layer, default=0)
    return float(sum(per_layer))


def step_memory(cfg, *, device_type: str) -> dict:
    """The floor estimate for one micro-batch of `cfg` on a device of `device_type`: tokens,
    activation bytes (device), loader bytes (host: the batches the workers keep ready)."""
    tokens = cfg.data.batch_size * cfg.data.seq_len
    mp = cfg.train.mixed_precision
    half = device_type == "cuda" and mp in ("auto", "bf16", "fp16")
    per_token = activation_bytes_per_token(cfg.model, dtype_bytes=2 if half else 4,
                                           checkpointing=cfg.train.activation_checkpointing)
    ready = max(cfg.data.num_workers, 1) * cfg.data.prefetch_factor
    return {"tokens": tokens, "per_token": per_token, "activations": per_token * tokens,
            "loader": ready * tokens * _BATCH_BYTES_PER_TOKEN}


def device_memory(device) -> tuple[int | None, str]:
    """(bytes, what) of the memory a step on `device` can use: the GPU's total memory, or on CPU
    the memory the OS has available (total RAM when /proc/meminfo is missing)."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(device).total_memory), "GPU"
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "machine (available RAM)"
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "machine (RAM)"
    except (ValueError, OSError, AttributeError):
        return None, "machine"


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_step_memory(cfg, device, *, available: int | None = None) -> dict:
    """Refuse (ValueError, naming the figures) a data.seq_len x data.batch_size whose one step cannot
    fit in this device's memory; returns the estimate. `available` overrides the measured memory."""
    dev_type = getattr(device, "type", device)
    est = step_memory(cfg, device_type=dev_type)
    what = "GPU" if dev_type == "cuda" else "machine"
    if available is None:
        available, what = device_memory(device)
    if available is None:
        return est
    shape = f"data.seq_len={cfg.data.seq_len:,} x data.batch_size={cfg.data.batch_size:,}"
    advice = ("lower data.batch_size or data.seq_len (raise train.grad_accum_steps to keep the tokens per step"
              + ("" if cfg.train.activation_checkpointing else ", or set train.activation_checkpointing=true") + ")")
    need = est["activations"] + (est["loader"] if dev_type != "cuda" else 0)
    if need > available:
        loader = f" plus {_gib(est['loader'])} of batches the loader keeps ready" if dev_type != "cuda" else ""
        raise ValueError(f"{shape}: one step needs at least {_gib(est['activations'])} of activations "
                         f"({est['per_token']:,.0f} bytes per token, estimated from the model config){loader}, "
                         f"more than the {_gib(available)} this {what} has; {advice}")
    cache = max(cfg.data.num_workers, 1) * cfg.data.doc_cache_mb * 2**20
    host = available if dev_type != "cuda" else device_memory("cpu")[0]
    if cache and host is not None and cache > host:
        raise ValueError(f"data.doc_cache_mb={cfg.data.doc_cache_mb:g} per loader worker x {max(cfg.data.num_workers, 1)} "
                         f"worker(s) may hold {_gib(cache)} of tokenized documents, more than the {_gib(host)} this "
                         "machine has available; lower data.doc_cache_mb (0 turns the cache off)")
    if dev_type == "cuda" and est["loader"] > (device_memory("cpu")[0] or float("inf")):
        raise ValueError(f"{shape}: the loader's ready batches alone need {_gib(est['loader'])} of host memory, more "
                         f"than this machine has available; lower data.batch_size, data.seq_len or data.num_workers")
    return est


def ignored_settings(model_cfg) -> list[str]:
    """Model settings that the model they configure will not use (said as warnings, not refused:
    the run is valid, it just does not do what the setting asks)."""
    out = []
    att = model_cfg.attention
    if model_cfg.num_b_layers == 0:
        kinds = "".join(model_cfg.layer_kinds())
        where = (f"model.attention.pattern='{att.pattern}'" if kinds == att.pattern
                 else f"model.attention.pattern='{att.pattern}' over model.num_layers={model_cfg.num_layers} ('{kinds}')")
        if att.selector == "indexer":
            out.append(f"model.attention.selector=indexer is ignored: {where} has no B layer, so no indexer is built "
                       "or trained; put B layers in the pattern (e.g. LLLB) or drop the setting")
        if att.dense_warmup_steps > 0:
            out.append(f"model.attention.dense_warmup_steps={att.dense_warmup_steps} is ignored: {where} has no B "
                       "layer to warm up")
    return out


def warn_ignored_settings(model_cfg, *, quiet: bool = False) -> list[str]:
    messages = ignored_settings(model_cfg)
    if not quiet:
        for message in messages:
            log.warning("%s", message)
    return messages


def check_sources(sources) -> None:
    """Resolve every local source of `sources` (its manifest, its shards), so that a mistyped folder
    fails before minutes of setup, in one line. Remote sources (http, object stores, pipe:) are
    left to the loader. The trainer builds its training stream before the model (which resolves
    those sources once) and checks the held-out ones here."""
    from omniloom.data.stream.reader import is_local, resolve_source

    for source in sources:
        if source.path and is_local(source.path) and not source.manifest:
            resolve_source(source)
