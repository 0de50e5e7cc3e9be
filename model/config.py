"""Model configuration: one keyword-only dataclass per component.

    ModelConfig
      attention: AttentionConfig   layer kinds (pattern), window, block selection, backend
      moe: MoEConfig               routed + shared experts, routing, balancing, modality groups
      vision_encoder: VisionEncoderConfig   late fusion: a ViT over each visual block (off by default)

`validate()` checks the combinations a dataclass cannot express and raises ValueError with what
to change; `OmniModel` calls it at construction. Parameter and FLOP accounting from the config
alone lives in `omniloom.model.accounting`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

LAYER_KINDS = ("L", "G", "B")
ROPE_LAYOUTS = ("sections", "interleaved")
CONV_STEM_WIDTH = 16  # default channels of the conv patch stem's first convolution (its second has twice)


def patch_side(patch_dim: int) -> int:
    """The side p of an RGB patch of `patch_dim` = 3 * p * p values."""
    return round(math.sqrt(patch_dim / 3))


def conv_stem_features(p: int, width: int = CONV_STEM_WIDTH) -> int:
    """Features the conv patch stem gives a p x p patch: two stride-2 3x3 convolutions (padding 1)."""
    side = (((p + 1) // 2) + 1) // 2
    return 2 * width * side * side


def check_floats(section: str, obj, *, above: dict[str, float] | None = None, at_least: dict[str, float] | None = None) -> None:
    """ValueError naming `section.key` for a float setting that is not finite, or not above
    (`above`) or at least (`at_least`) its bound: checked where a config is built (a YAML preset,
    a checkpoint's config.yaml, an export's config.json), so a nonsense value (norm_eps=-1,
    rope_base=0: every loss NaN) never reaches a model. Values of another type are left to the
    reader's type check."""
    for bounds, strict in ((above or {}, True), (at_least or {}, False)):
        for name, low in bounds.items():
            value = getattr(obj, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                raise ValueError(f"{section}.{name}={value!r} must be a finite number")
            if value < low or (strict and value == low):
                raise ValueError(f"{section}.{name}={value!r} must be {'>' if strict else '>='} {low:g}")


# the value a saved config (config.json of an export, config.yaml of a checkpoint) written before
# the key existed means: the layout those models were trained with
LEGACY_ROPE_LAYOUT = "sections"


@dataclass(kw_only=True)
class AttentionConfig:
    """Attention layers. `pattern` is a string of layer kinds, repeated to `num_layers`:
    `L` sliding window (keys within `window` tokens), `G` global (the whole document),
    `B` block top-k selection: each query keeps its own key block, the first block of its
    document, the blocks of its own visual block, and the best `num_selected_blocks - 1` other
    earlier blocks of its document. Every kind keeps documents apart, text causal and visual
    blocks bidirectional. Dense first layers: write them into the pattern (e.g. "GGGLLB", with
    num_layers equal to its length).

    selector: how B layers score the earlier blocks.
      `pooled`  the layer's own (summed group) query against each block's mean key; nothing learned
                (MoBA style).
      `indexer` a small learned index branch per B layer (MSA / DeepSeek-V3.2 style):
                `indexer_heads` query heads and one key head of width `indexer_dim` per kv head;
                a block's score is the max over its keys, averaged over the index heads. It is
                trained by an auxiliary KL loss (`indexer_loss_coef`) toward the dense
                attention's per-block mass on `indexer_sample_blocks` sampled query blocks per
                row (stop-gradient on both the target and the indexer's input), so it never
                pushes on the language model. `indexer_rope_dim`: the first that many index
                dims are rotated by the token's position in the model's `rope_layout` (t alone
                under `sections`), so the index can score by distance as well as content (0: no
                position, NoPE). See docs/sparse-attention.md.
    dense_warmup_steps: B layers attend densely (as G) for the first N training steps while the
      indexer already learns; the trainer logs the switch.

    backend: `sdpa` reference (any device; per document, dense masks only for B layers),
    `blocksparse` per-document slices for L/G layers and gathered key blocks for B layers (any
    device; CPU training uses it), `flex` FlexAttention (CUDA only),
    `flash` flash-attn varlen (CUDA + flash_attn installed; L/G layers on text-only batches,
    other cases go through blocksparse)."""

    backend: Literal["sdpa", "blocksparse", "flex", "flash"] = "sdpa"
    pattern: str = "LLLG"
    window: int = 512
    block_size: int = 64
    num_selected_blocks: int = 8
    qk_norm: bool = True
    selector: Literal["pooled", "indexer"] = "pooled"
    indexer_dim: int = 64
    indexer_heads: int = 2
    indexer_loss_coef: float = 0.1
    indexer_sample_blocks: int = 16
    indexer_rope_dim: int = 0
    dense_warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_floats("model.attention", self, at_least={"indexer_loss_coef": 0.0})


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-Experts feed-forward layers (fine-grained routed experts + shared).

    The first `num_dense_layers` layers use a dense SwiGLU of width `dense_dim`; the others route
    each token to `num_experts_per_token` of `num_experts` experts of width `expert_dim`, plus
    `num_shared_experts` always-on experts of the same width. `num_experts: 0` makes every layer
    dense. Balancing: a per-expert bias added to the scores only to choose the top-k, moved by
    `bias_update_rate` after each optimizer step (`OmniModel.update_router_biases`).
    `modality_groups`: text/code/special tokens route among the first experts, image/video
    tokens among the last `num_visual_experts` (0: half of them).
    `expert_parallel`: split the routed experts of every MoE layer over this many ranks (an expert
    group; it must divide `num_experts` and the world size). The model itself stays single-device:
    `omniloom.pretrain.train.expert_parallel.parallelize_experts` shards a built model; 1 changes nothing."""

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
    num_visual_experts: int = 0
    dispatch: Literal["auto", "grouped", "loop"] = "auto"  # auto: grouped matmul where it works, loop otherwise
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        check_floats("model.moe", self, at_least={"bias_update_rate": 0.0, "aux_loss_coef": 0.0, "router_z_loss_coef": 0.0})


VISION_PROJECTORS = ("mlp", "linear")
VISION_PARAM_SHARE = 4  # the auto-sized encoder holds about 1/4 of the decoder's active non-embedding parameters
VISION_FFN_RATIO = 4  # the auto-sized encoder's SwiGLU width: 4 x its width


@dataclass(kw_only=True)
class VisionEncoderConfig:
    """Late fusion (model/vision_encoder.py): a bidirectional transformer over the patches of each
    visual block alone, then a projector into the decoder's width; the decoder reads the projected
    tokens where the patch embeddings were. Off: the patch stem's embeddings go straight into the
    decoder (native early fusion). The stem then projects to `dim`, not to the decoder's width.

    Each encoder layer: RMSNorm, multi-head attention (QK-norm, the decoder's M-RoPE layout over the
    patch's (t, h, w) position) within the visual block only, RMSNorm, SwiGLU of `ffn_dim`. Then
    RMSNorm and the projector: `mlp` Linear(dim, D) GELU Linear(D, D) (LLaVA-1.5), or `linear`.

    0 means sized from the decoder (`resolved`): `dim` the decoder's width, `num_heads` so that
    heads keep the decoder's head dim, `ffn_dim` 4 x dim, `num_layers` the depth that brings the
    encoder's layers to about 1/4 of the decoder's active non-embedding parameters (at least 1)."""

    enabled: bool = False
    dim: int = 0
    num_layers: int = 0
    num_heads: int = 0
    ffn_dim: int = 0
    projector: Literal["mlp", "linear"] = "mlp"

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads if self.num_heads else 0

    @property
    def rope_sections(self) -> tuple[int, int, int]:
        """The (t, h, w) split of the encoder's head dim (its rotary follows the decoder's layout)."""
        return tuple(_suggest_sections(self.head_dim))

    def resolved(self, decoder: "ModelConfig") -> "VisionEncoderConfig":
        """This config with every 0 replaced by the size the default rule gives for `decoder`."""
        from dataclasses import replace

        dim = self.dim or decoder.dim
        heads = self.num_heads or (decoder.num_heads if dim == decoder.dim else max(1, round(dim / decoder.head_dim)))
        ffn = self.ffn_dim or VISION_FFN_RATIO * dim
        layers = self.num_layers
        if not layers:
            from .accounting import num_active_params  # accounting imports this module

            target = (num_active_params(decoder) - 2 * decoder.vocab_size * decoder.dim) / VISION_PARAM_SHARE
            layers = max(1, round(target / (4 * dim * dim + 3 * dim * ffn)))
        return replace(self, dim=dim, num_heads=heads, ffn_dim=ffn, num_layers=layers)

    def validate(self, decoder: "ModelConfig") -> None:
        """Raise ValueError naming the key when the encoder cannot be built (nothing when off)."""
        if not self.enabled:
            return
        for key in ("dim", "num_layers", "num_heads", "ffn_dim"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.vision_encoder.{key}={getattr(self, key)} must be >= 0 (0: sized from the decoder)")
        if self.projector not in VISION_PROJECTORS:
            raise ValueError(f"model.vision_encoder.projector='{self.projector}': choose one of {', '.join(VISION_PROJECTORS)}")
        if decoder.visual_pos_max:
            raise ValueError("model.vision_encoder takes positions from its rotary embedding: set model.visual_pos_max=0 "
                             "or model.vision_encoder.enabled=false")
        enc = self.resolved(decoder)
        if enc.dim % enc.num_heads or enc.head_dim % 2:
            raise ValueError(f"model.vision_encoder.dim={enc.dim} must be a multiple of model.vision_encoder.num_heads="
                             f"{enc.num_heads} with an even head dim")


@dataclass(kw_only=True)
class ModelConfig:
    """The decoder. `vocab_size` and `patch_token_id` come from omniloom_tokenizer.json (pretrain/ fills
    them); `rope_sections` splits the head dim between the (t, h, w) position axes (M-RoPE) and
    sums to `dim // num_heads`. Image patches occupy the first `patch_dim` columns of the
    PackedBatch `patches` rows, video tubelets the first `tubelet_dim`."""

    dim: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    vocab_size: int = 0  # 0: taken from omniloom_tokenizer.json by pretrain/
    patch_token_id: int = -1  # id of <|patch|>; -1: taken from omniloom_tokenizer.json by pretrain/
    # id of the packing pad token: padding is routed (static shapes) but never counted in expert
    # loads, balancing or aux losses; -1: taken from omniloom_tokenizer.json by pretrain/ (-1 there: no padding)
    pad_token_id: int = -1
    rope_base: float = 10000.0
    rope_sections: tuple[int, int, int] = (16, 24, 24)  # head-dim split (t, h, w); sums to head_dim
    # which rotary frequencies follow which axis (model/embeddings.py rope_axes, docs/positions.md):
    # "interleaved" spreads every axis over the whole range, so rows, columns and time all turn
    # fast enough to tell neighbours apart; "sections" gives columns only the slowest (models
    # trained before 2026-12 use it: a saved config without the key means "sections")
    rope_layout: Literal["sections", "interleaved"] = "interleaved"
    # > 0: learned absolute (time, row, column) embeddings added to patch embeddings, this many
    # entries per axis (NaViT / AIMv2 style); 0: position through the rotary embedding alone
    visual_pos_max: int = 0
    # how a patch's pixels become its embedding: "linear" (one projection, ViT) or "conv" (two 3x3
    # stride-2 convolutions with GELU before the projection, an early-convolution stem)
    patch_stem: Literal["linear", "conv"] = "linear"
    # channels of the conv stem's first convolution (its second has twice as many): the stem's
    # features are 2 * width * (p / 4)^2 per patch (a saved config without the key: 16)
    conv_stem_width: int = CONV_STEM_WIDTH
    # how the conv stem reads a video tubelet: "channels" (its own stem, the frames as input
    # channels) or "frames" (each frame through the image stem, the same weights, features side
    # by side: what images teach the stem serves clips too); a saved config without the key: channels
    conv_stem_video: Literal["channels", "frames"] = "channels"
    patch_dim: int = 3 * 16 * 16
    tubelet_dim: int = 3 * 2 * 16 * 16
    norm_eps: float = 1e-6
    z_loss_coef: float = 1e-5
    init_std: float = 0.02
    kernels: Literal["auto", "reference", "triton", "compiled"] = "auto"
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    vision_encoder: VisionEncoderConfig = field(default_factory=VisionEncoderConfig)

    def __post_init__(self) -> None:
        # rope_base 0 or less gives NaN rotations; 1 gives every frequency pair the same (no long range)
        check_floats("model", self, above={"norm_eps": 0.0, "rope_base": 1.0}, at_least={"z_loss_coef": 0.0, "init_std": 0.0})

    @property
    def patch_size(self) -> int:
        """The side p of an image patch (patch_dim = 3 * p * p)."""
        return patch_side(self.patch_dim)

    @property
    def head_dim(self) -> int:
        return self.dim // self.num_heads

    def layer_kinds(self) -> list[str]:
        """The attention kind of every layer: the pattern repeated to num_layers."""
        pattern = self.attention.pattern
        return [pattern[i % len(pattern)] for i in range(self.num_layers)]

    @property
    def num_b_layers(self) -> int:
        return sum(kind == "B" for kind in self.layer_kinds())

    @property
    def has_indexer(self) -> bool:
        return self.attention.selector == "indexer" and self.num_b_layers > 0

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe.num_experts > 0 and layer >= self.moe.num_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    def num_text_experts(self) -> int:
        """Experts text/code/special tokens may use (all of them without modality groups)."""
        moe = self.moe
        if not moe.modality_groups:
            return moe.num_experts
        return moe.num_experts - (moe.num_visual_experts or moe.num_experts // 2)

    def validate(self) -> None:
        """Raise ValueError naming the key to change when the combination cannot work."""
        att, moe = self.attention, self.moe
        if self.vocab_size <= 0:
            raise ValueError("model.vocab_size is 0: set it from omniloom_tokenizer.json (pretrain fills it) or pass model.vocab_size=N")
        for name in ("patch_token_id", "pad_token_id"):
            if getattr(self, name) >= self.vocab_size:
                raise ValueError(f"model.{name}={getattr(self, name)} is not an id of the vocabulary "
                                 f"(model.vocab_size={self.vocab_size}); it must come from the same omniloom_tokenizer.json")
        if self.num_heads <= 0 or self.dim % self.num_heads:
            raise ValueError(f"model.dim={self.dim} must be a multiple of model.num_heads={self.num_heads}")
        if self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2 or sum(self.rope_sections) != self.head_dim or any(s % 2 or s < 0 for s in self.rope_sections):
            raise ValueError(
                f"model.rope_sections={list(self.rope_sections)} must be even numbers summing to the head dim "
                f"{self.head_dim} (= dim / num_heads), e.g. {_suggest_sections(self.head_dim)}"
            )
        if self.rope_layout not in ROPE_LAYOUTS:
            raise ValueError(f"model.rope_layout='{self.rope_layout}': choose one of {', '.join(ROPE_LAYOUTS)}")
        if self.visual_pos_max < 0:
            raise ValueError(f"model.visual_pos_max={self.visual_pos_max} must be >= 0 (0: no learned visual positions)")
        if self.patch_stem not in ("linear", "conv"):
            raise ValueError(f"model.patch_stem='{self.patch_stem}': choose linear or conv")
        if self.conv_stem_width < 1:
            raise ValueError(f"model.conv_stem_width={self.conv_stem_width} must be >= 1")
        if self.conv_stem_video not in ("channels", "frames"):
            raise ValueError(f"model.conv_stem_video='{self.conv_stem_video}': choose channels or frames")
        if self.conv_stem_video == "frames" and self.patch_stem != "conv":
            raise ValueError("model.conv_stem_video=frames runs a tubelet's frames through the conv patch stem: "
                             "it needs model.patch_stem=conv")
        if self.patch_stem == "conv":
            p = self.patch_size
            if 3 * p * p != self.patch_dim or self.tubelet_dim % self.patch_dim:
                raise ValueError(f"model.patch_stem=conv needs patch_dim = 3 * p * p and tubelet_dim a multiple of it, "
                                 f"got {self.patch_dim} and {self.tubelet_dim}")
        if not att.pattern or set(att.pattern) - set(LAYER_KINDS):
            raise ValueError(f"model.attention.pattern='{att.pattern}' may only use L (window), G (global), B (block top-k)")
        if att.window < 1 or att.block_size < 1 or att.num_selected_blocks < 1:
            raise ValueError("model.attention.window, block_size and num_selected_blocks must be >= 1")
        if att.selector not in ("pooled", "indexer"):
            raise ValueError(f"model.attention.selector='{att.selector}': choose pooled or indexer")
        if att.selector == "indexer" and (att.indexer_dim < 1 or att.indexer_heads < 1 or att.indexer_sample_blocks < 1):
            raise ValueError("model.attention.indexer_dim, indexer_heads and indexer_sample_blocks must be >= 1")
        if att.indexer_rope_dim < 0 or att.indexer_rope_dim % 2 or (att.selector == "indexer" and att.indexer_rope_dim > att.indexer_dim):
            raise ValueError(f"model.attention.indexer_rope_dim={att.indexer_rope_dim} must be even and at most "
                             f"indexer_dim ({att.indexer_dim}); 0 turns the index's position off")
        if att.indexer_loss_coef < 0 or att.dense_warmup_steps < 0:
            raise ValueError("model.attention.indexer_loss_coef and dense_warmup_steps must be >= 0")
        if moe.num_experts < 0 or moe.num_dense_layers < 0:
            raise ValueError("model.moe.num_experts and num_dense_layers must be >= 0")
        if moe.num_experts:
            if not 1 <= moe.num_experts_per_token <= moe.num_experts:
                raise ValueError(f"model.moe.num_experts_per_token must be in 1..num_experts ({moe.num_experts})")
            if moe.modality_groups:
                n_vis = moe.num_visual_experts or moe.num_experts // 2
                if min(n_vis, moe.num_experts - n_vis) < moe.num_experts_per_token:
                    raise ValueError(
                        "with model.moe.modality_groups each group needs >= num_experts_per_token experts: "
                        "raise model.moe.num_experts or set model.moe.num_visual_experts"
                    )
            if moe.expert_dim < 1:
                raise ValueError("model.moe.expert_dim must be >= 1")
        if moe.expert_parallel < 1:
            raise ValueError(f"model.moe.expert_parallel must be >= 1, got {moe.expert_parallel}")
        if moe.expert_parallel > 1:
            if moe.num_experts == 0 or self.num_moe_layers == 0:
                raise ValueError("model.moe.expert_parallel > 1 needs MoE layers: set model.moe.num_experts "
                                 "(and num_dense_layers < num_layers) or expert_parallel=1")
            if moe.num_experts % moe.expert_parallel:
                raise ValueError(f"model.moe.expert_parallel={moe.expert_parallel} must divide model.moe.num_experts="
                                 f"{moe.num_experts} (each rank of an expert group holds the same number of experts)")
        if moe.num_dense_layers and moe.dense_dim < 1 or (moe.num_experts == 0 and moe.dense_dim < 1):
            raise ValueError("model.moe.dense_dim must be >= 1 for dense layers")
        self.vision_encoder.validate(self)


def _suggest_sections(head_dim: int) -> list[int]:
    t = (head_dim // 4) // 2 * 2
    h = ((head_dim - t) // 2) // 2 * 2
    return [t, h, head_dim - t - h]
