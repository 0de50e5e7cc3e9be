"""Parameter counts and FLOPs per token from a ModelConfig alone (no module is built).

`num_params(cfg)` equals `sum(p.numel() for p in OmniModel(cfg).parameters())` (a test checks it);
router biases are buffers, not parameters. Active parameters drop the routed experts a token does
not use. FLOPs per token count forward + backward (x3) of every matmul a token goes through and
of attention according to each layer kind's sparsity. A vision encoder (late fusion) is counted
apart: its parameters in `num_params` (not in the active parameters of a text token), its FLOPs
per visual token by `vision_encoder_flops`.
"""

from __future__ import annotations

from .config import ModelConfig, conv_stem_features


def _indexer_params(cfg: ModelConfig) -> int:
    att = cfg.attention
    # per kv head: indexer_heads query heads and one key head of width indexer_dim
    return cfg.dim * cfg.num_kv_heads * att.indexer_dim * (att.indexer_heads + 1)


def _attention_params(cfg: ModelConfig, kind: str) -> int:
    hd = cfg.head_dim
    n = cfg.dim * cfg.num_heads * hd * 2 + cfg.dim * cfg.num_kv_heads * hd * 2  # wq, wo, wk, wv
    if cfg.attention.qk_norm:
        n += 2 * hd
    if kind == "B" and cfg.attention.selector == "indexer":
        n += _indexer_params(cfg)
    return n + cfg.dim  # pre-attention norm


def _ffn_params(cfg: ModelConfig, layer: int, *, active: bool) -> int:
    d, moe = cfg.dim, cfg.moe
    n = d  # pre-FFN norm
    if not cfg.is_moe_layer(layer):
        return n + 3 * d * moe.dense_dim
    routed = moe.num_experts_per_token if active else moe.num_experts
    n += moe.num_experts * d  # router (every token scores every expert)
    n += routed * 3 * d * moe.expert_dim
    n += 3 * d * moe.expert_dim * moe.num_shared_experts
    return n


def _visual_width(cfg: ModelConfig) -> int:
    """The patch stem's output width: the vision encoder's when there is one, else the decoder's."""
    return cfg.vision_encoder.resolved(cfg).dim if cfg.vision_encoder.enabled else cfg.dim


def _visual_embedding_params(cfg: ModelConfig, in_dim: int, video: bool = False) -> int:
    """One visual projection: linear from the pixels, or the conv stem (model/embeddings.py
    ConvStem: two bias-free 3x3 convolutions) and a linear from its features."""
    out = _visual_width(cfg)
    if cfg.patch_stem != "conv":
        return in_dim * out
    width, frames = cfg.conv_stem_width, in_dim // cfg.patch_dim
    features = conv_stem_features(cfg.patch_size, width)
    if video and cfg.conv_stem_video == "frames":  # the image stem's weights, counted with the image's
        return frames * features * out
    return (3 * frames * width + width * 2 * width) * 9 + features * out


def _vision_matmul_params(cfg: ModelConfig) -> int:
    """The vision encoder's matmul weights: per layer wq, wk, wv, wo (E x E each) and the SwiGLU
    (3 x E x F), then the projector (E x D, and D x D for `mlp`)."""
    enc = cfg.vision_encoder.resolved(cfg)
    n = enc.num_layers * (4 * enc.dim * enc.dim + 3 * enc.dim * enc.ffn_dim)
    return n + enc.dim * cfg.dim + (cfg.dim * cfg.dim if enc.projector == "mlp" else 0)


def vision_encoder_params(cfg: ModelConfig) -> int:
    """Parameters of model.vision_encoder (0 when off): matmuls, per layer two norms and the
    QK-norm weights, the final norm. The patch stem is counted with the embeddings."""
    if not cfg.vision_encoder.enabled:
        return 0
    enc = cfg.vision_encoder.resolved(cfg)
    return _vision_matmul_params(cfg) + enc.num_layers * (2 * enc.dim + 2 * enc.head_dim) + enc.dim


def vision_encoder_flops(cfg: ModelConfig, block_len: int) -> float:
    """Training FLOPs (forward + backward) per visual token of a block of `block_len` patches:
    6 x the encoder's matmul weights (layers and projector) plus, per layer, 12 x E x block_len
    for its attention (QK^T and PV, every patch against every patch of its block). 0 when off."""
    if not cfg.vision_encoder.enabled:
        return 0.0
    enc = cfg.vision_encoder.resolved(cfg)
    return 6.0 * _vision_matmul_params(cfg) + 12.0 * enc.num_layers * enc.dim * block_len


def vision_encoder_batch_flops(cfg: ModelConfig, block_lens) -> float:
    """Training FLOPs of the vision encoder over visual blocks of these lengths."""
    return float(sum(n * vision_encoder_flops(cfg, n) for n in block_lens))


def _embedding_params(cfg: ModelConfig) -> int:
    # token embedding, untied output head, image patch and video tubelet embeddings
    return (2 * cfg.vocab_size * cfg.dim + _visual_embedding_params(cfg, cfg.patch_dim)
            + _visual_embedding_params(cfg, cfg.tubelet_dim, video=True))


def num_params(cfg: ModelConfig) -> int:
    """Total trainable parameters."""
    n = _embedding_params(cfg) + cfg.dim + vision_encoder_params(cfg)  # final norm, late fusion's encoder
    for layer, kind in enumerate(cfg.layer_kinds()):
        n += _attention_params(cfg, kind) + _ffn_params(cfg, layer, active=False)
    return n


def num_active_params(cfg: ModelConfig) -> int:
    """Parameters one text token uses: everything except the routed experts it is not sent to
    (and the patch/tubelet embeddings, which only visual tokens use)."""
    n = 2 * cfg.vocab_size * cfg.dim + cfg.dim
    for layer, kind in enumerate(cfg.layer_kinds()):
        n += _attention_params(cfg, kind) + _ffn_params(cfg, layer, active=True)
    return n


def mean_keys_per_query(cfg: ModelConfig, kind: str, seq_len: int) -> float:
    """Average number of keys a causal query attends in a layer of `kind` over a seq_len document."""
    att = cfg.attention
    # B: own block, the document's first block and num_selected_blocks - 1 others
    span = {"G": seq_len, "L": att.window, "B": (att.num_selected_blocks + 1) * att.block_size}[kind]
    span = min(span, seq_len)
    # query i sees min(i + 1, span) keys; average over i in [0, seq_len)
    return (span * (span + 1) / 2 + (seq_len - span) * span) / seq_len


def flops_per_token(cfg: ModelConfig, seq_len: int, *, visual_fraction: float = 0.0, visual_block_len: int = 0) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), for documents of seq_len tokens:
    6 x active matmul parameters (embedding lookup excluded, output head included) plus attention
    12 x heads x head_dim x mean keys per query per layer, plus the B layers' block scoring; with
    a vision encoder, plus `visual_fraction` x `vision_encoder_flops(cfg, visual_block_len)` (the
    share of tokens that are patches, in blocks of that many)."""
    att = cfg.attention
    matmul = num_active_params(cfg) - cfg.vocab_size * cfg.dim  # the embedding is a lookup
    if att.selector == "indexer":  # indexer projections: forward and weight gradient only (input detached)
        matmul -= cfg.num_b_layers * _indexer_params(cfg) / 3
    flops = 6.0 * matmul
    hq, hd = cfg.num_heads, cfg.head_dim
    for kind in cfg.layer_kinds():
        flops += 12.0 * hq * hd * mean_keys_per_query(cfg, kind, seq_len)
        if kind == "B" and att.selector == "pooled":  # query x pooled keys of the earlier blocks, forward only
            flops += 2.0 * hq * hd * (seq_len / att.block_size) / 2
        elif kind == "B":
            # block-start index queries x every earlier key (max-pooled), forward only; the KL
            # target's dense scores for the sampled query blocks are a bounded extra, not counted
            flops += 2.0 * cfg.num_kv_heads * att.indexer_heads * att.indexer_dim * (seq_len / 2) / att.block_size
    return flops + visual_fraction * vision_encoder_flops(cfg, visual_block_len)


def summary(cfg: ModelConfig, seq_len: int = 4096) -> dict[str, float]:
    """The figures a preset is described by."""
    return {
        "params": num_params(cfg),
        "active_params": num_active_params(cfg),
        "non_embedding_active_params": num_active_params(cfg) - 2 * cfg.vocab_size * cfg.dim,
        "flops_per_token": flops_per_token(cfg, seq_len),
        "vision_encoder_params": vision_encoder_params(cfg),
    }
