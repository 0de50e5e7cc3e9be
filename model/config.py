"""Model configuration: one keyword-only dataclass per component (DESIGN 2.4, 3.2).

First version written with the foundation; the model issue owns and extends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class AttentionConfig:
    """Attention layers. `pattern` is a string of layer kinds, repeated to `num_layers`:
    `L` sliding window, `G` global, `B` block top-k selection."""

    backend: Literal["sdpa", "blocksparse", "flex", "flash"] = "sdpa"
    pattern: str = "LLLG"
    window: int = 512
    block_size: int = 64
    num_selected_blocks: int = 8
    qk_norm: bool = True


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (fine-grained routed experts + shared)."""

    num_experts: int = 8
    num_experts_per_token: int = 2
    expert_dim: int = 256
    num_shared_experts: int = 1
    num_dense_layers: int = 1
    dense_dim: int = 1024
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"
    bias_update_rate: float = 1e-3
    aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    modality_groups: bool = False


@dataclass(kw_only=True)
class ModelConfig:
    dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 0  # 0: taken from tokenizer.json by pretrain/
    rope_base: float = 10000.0
    rope_sections: tuple[int, int, int] = (16, 24, 24)  # head-dim split (t, h, w); sums to head_dim
    patch_dim: int = 3 * 16 * 16
    tubelet_dim: int = 3 * 2 * 16 * 16
    norm_eps: float = 1e-6
    z_loss_coef: float = 1e-5
    init_std: float = 0.02
    kernels: Literal["auto", "reference", "triton"] = "auto"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
