"""OmniModel: the decoder-only sparse-attention MoE over the unified token stream.

Legend: B batch, S sequence, D width, V vocab, T = B*S tokens, P patch positions, E experts,
M = 5 modalities, L_moe MoE layers.

    x = embed(tokens, patches)                              # patches replace <|patch|> embeddings
                                                            # (late fusion: encoded first, vision_encoder.py)
    for each layer: x += attn(rmsnorm(x)); x += ffn(rmsnorm(x))   # ffn: dense SwiGLU or MoE
    loss = CE(head(rmsnorm(x)), lse in fp32) + z-loss (+ aux, router z)

The model runs on one device; sharding, compile and activation checkpointing are applied from
outside to `model.layers`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from omniloom.kernels.ops import get_ops
from omniloom.kernels.reference import head_dtype, head_logits

from . import accounting
from .attention import AttnContext, Attention, check_backend
from .config import ModelConfig
from .embeddings import MultimodalEmbedding, data_dependent_shapes_are_free, mrope_angles
from .indexer import index_rope_angles
from .masks import BatchLayout, batch_layout, build_mask_info
from .moe import NUM_MODALITIES, MoE, SwiGLUMLP
from .vision_encoder import VisionEncoder

IGNORE_INDEX = -100


def is_indexer_param(name: str) -> bool:
    """A parameter of a B layer's index branch (trained only by the indexer loss)."""
    return ".indexer." in f".{name}"


@dataclass
class ModelOutput:
    """What one forward returns. Loss terms are the values added to `loss` (coefficients applied);
    the per-modality sums, counts, expert counts and output RMS are detached, for logging (sum
    them across ranks before dividing). The modality of a loss term is that of the target token."""

    loss: torch.Tensor  # scalar: ce_loss + z_loss + aux_loss + router_z_loss
    ce_loss: torch.Tensor  # mean CE over tokens with a label
    z_loss: torch.Tensor  # z_loss_coef * mean logsumexp^2
    aux_loss: torch.Tensor  # aux_loss_coef * mean over MoE layers (0 when off)
    router_z_loss: torch.Tensor  # router_z_loss_coef * mean over MoE layers (0 when off)
    ce_sum_by_modality: torch.Tensor  # [5] fp32 CE summed per target modality
    tokens_by_modality: torch.Tensor  # [5] int64 tokens with a label per target modality
    expert_counts: torch.Tensor  # [L_moe, 5, E] int64 routed tokens per layer, modality, expert
    output_rms: torch.Tensor  # scalar RMS of the last layer's output (before the final norm)
    logits: torch.Tensor | None = None  # [B, S, V] fp32 when return_logits
    # B layers' selector statistics (model/indexer.py), present when computed (indexer training,
    # or `measure_attention=True`): the indexer loss term (coefficient applied, with gradient, in
    # `loss`), its KL per B layer [nB] and the coverage of the dense attention per B layer [nB]
    indexer_loss: torch.Tensor | None = None
    indexer_kl: torch.Tensor | None = None
    block_coverage: torch.Tensor | None = None


class Block(nn.Module):
    """Pre-norm transformer block: attention of one kind, then a dense or MoE feed-forward."""

    def __init__(self, cfg: ModelConfig, layer: int, kind: str, ops, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.ops, self.eps = ops, cfg.norm_eps
        self.attn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.attn = Attention(
            dim=cfg.dim, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, kind=kind,
            qk_norm=cfg.attention.qk_norm, norm_eps=cfg.norm_eps, ops=ops,
            indexer_heads=cfg.attention.indexer_heads if cfg.attention.selector == "indexer" else 0,
            indexer_dim=cfg.attention.indexer_dim, indexer_rope_dim=cfg.attention.indexer_rope_dim,
        )
        self.ffn_norm = nn.Parameter(torch.ones(cfg.dim))
        self.is_moe = cfg.is_moe_layer(layer)
        self.ffn = MoE(cfg, ops, expert_range) if self.is_moe else SwiGLUMLP(cfg.dim, cfg.moe.dense_dim, ops)

    def forward(self, x_BSD, cos_BSd, sin_BSd, ctx: AttnContext, modality_BS, real_BS=None):
        """(x_BSD out, the MoE's statistics or None, the attention's selector statistics or None).
        Statistics leave through the outputs: the block writes nothing into `ctx` or other shared
        state, so a checkpointed block compiles whole."""
        a_BSD, selector_stats = self.attn(self.ops.rms_norm(x_BSD, self.attn_norm, self.eps), cos_BSd, sin_BSd, ctx)
        x_BSD = x_BSD + a_BSD
        h = self.ops.rms_norm(x_BSD, self.ffn_norm, self.eps)
        if self.is_moe:
            y, moe_stats = self.ffn(h, modality_BS, real_BS)
            return x_BSD + y, moe_stats, selector_stats
        return x_BSD + self.ffn(h), None, selector_stats


class OmniModel(nn.Module):
    """The sparse-attention MoE decoder. Takes PackedBatch fields as plain tensors."""

    def __init__(self, cfg: ModelConfig, *, expert_range: tuple[int, int] | None = None):
        """`expert_range` [lo, hi): every MoE layer holds only those routed experts, with the
        values the full model would give them for the same seed (expert parallelism builds a
        rank's shard so, never the whole model: pretrain/train/expert_parallel.py)."""
        super().__init__()
        cfg.validate()
        check_backend(cfg.attention.backend)
        self.cfg = cfg
        self.ops = get_ops(cfg.kernels)
        self.embed = MultimodalEmbedding(
            vocab_size=cfg.vocab_size, dim=cfg.dim, patch_dim=cfg.patch_dim,
            tubelet_dim=cfg.tubelet_dim, patch_token_id=cfg.patch_token_id, visual_pos_max=cfg.visual_pos_max,
            patch_stem=cfg.patch_stem,
            conv_stem_width=cfg.conv_stem_width, conv_stem_video=cfg.conv_stem_video,
            visual_dim=cfg.vision_encoder.resolved(cfg).dim if cfg.vision_encoder.enabled else 0,
        )
        # late fusion (model.vision_encoder): patches through an encoder of their own before the decoder
        self.vision = VisionEncoder(cfg, self.ops) if cfg.vision_encoder.enabled else None
        self.layers = nn.ModuleList(Block(cfg, i, kind, self.ops, expert_range)
                                    for i, kind in enumerate(cfg.layer_kinds()))
        self.norm = nn.Parameter(torch.ones(cfg.dim))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        # B layers attend densely (as G) during model.attention.dense_warmup_steps: see set_step
        self.dense_b_layers = False
        # compute the B layers' selector statistics in every forward (eval sets it; indexer
        # training computes them regardless)
        self.measure_attention = False
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, init_std) everywhere, output projections (attention wo, MLP and expert w_down)
        scaled by 1/sqrt(2 * num_layers) so the residual stream's variance does not grow with
        depth; norms at 1, balancing biases at 0."""
        std = self.cfg.init_std
        out_std = std / math.sqrt(2 * self.cfg.num_layers)
        vision_out_std = std / math.sqrt(2 * self.vision.enc.num_layers) if self.vision is not None else std
        # the B layers' index branches and the vision encoder last: with the same seed, a model
        # with selector=indexer starts from the same language-model weights as one with
        # selector=pooled
        params = sorted(self.named_parameters(), key=lambda item: (item[0].startswith("vision."), is_indexer_param(item[0])))
        for name, p in params:
            owner, _, leaf = name.rpartition(".")
            shard = getattr(self.get_submodule(owner), "expert_range", None) if leaf in ("w_gate", "w_up", "w_down") else None
            if shard is not None and p.shape[0] != self.cfg.moe.num_experts:
                # this rank's experts only: draw the full tensor (the same random stream as the
                # whole model), keep the slice; one full tensor at a time
                full = torch.empty((self.cfg.moe.num_experts, *p.shape[1:]), dtype=p.dtype, device=p.device)
                nn.init.normal_(full, std=out_std if leaf == "w_down" else std)
                p.copy_(full[shard[0]:shard[1]])
                del full
            elif p.dim() == 1:
                p.fill_(1.0)  # RMSNorm and QK-norm weights
            elif "_stem.conv" in name:
                nn.init.kaiming_normal_(p, nonlinearity="relu")  # the patch stem's convolutions keep their scale
            elif name.endswith("wo.weight") or "w_down" in name:
                nn.init.normal_(p, std=vision_out_std if name.startswith("vision.") else out_std)
            else:
                nn.init.normal_(p, std=std)
        for layer in self.layers:
            if layer.is_moe:
                layer.ffn.router_bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        positions: torch.Tensor,
        doc_ids: torch.Tensor,
        block_ids: torch.Tensor,
        modality: torch.Tensor,
        patches: torch.Tensor,
        patch_kind: torch.Tensor,
        *,
        return_logits: bool = False,
        layout: BatchLayout | None = None,
    ) -> ModelOutput:
        """Loss and metrics for one PackedBatch (fields as in docs/data-format.md section 5).

        `layout`: `self.batch_layout(doc_ids, block_ids)` computed on the CPU copies before the
        batch moves to the device; with it (and the flex backend, or sdpa/blocksparse), forward
        and backward make no host sync. Without it, the attention derives it from the device."""
        cfg = self.cfg
        B, S = input_ids.shape
        for name, t in (("labels", labels), ("doc_ids", doc_ids), ("block_ids", block_ids), ("modality", modality)):
            if tuple(t.shape) != (B, S):
                raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(B, S)} like input_ids")
        if tuple(positions.shape) != (B, 3, S):
            raise ValueError(f"positions has shape {tuple(positions.shape)}, expected {(B, 3, S)}")
        if layout is None and self.vision is not None and patches is not None and patches.shape[0]:
            layout = self.batch_layout(doc_ids, block_ids)  # the encoder needs the visual blocks' extents on the host
        x_BSD = self.embed_inputs(input_ids, patches, patch_kind, positions, doc_ids, block_ids, layout=layout)
        cos_BSd, sin_BSd = self.rope(positions)
        info = build_mask_info(doc_ids, block_ids, block_size=cfg.attention.block_size, window=cfg.attention.window)
        att = cfg.attention
        real_BS = input_ids != cfg.pad_token_id if cfg.pad_token_id >= 0 else None
        ctx = AttnContext(info, att.backend, att.num_selected_blocks, x_BSD.device, layout, dense_b=self.dense_b_layers,
                          measure=self.measure_attention, sample_blocks=att.indexer_sample_blocks, real_BS=real_BS)
        ctx.index_rope = self.index_rope(positions)
        # shared masks and lazy choices made here, not inside a (checkpointed, compiled) block
        ctx.prepare(cfg.layer_kinds())
        for layer in self.layers:
            if layer.is_moe:
                layer.ffn.prepare(x_BSD)
        moe_stats, b_stats = [], []
        for layer in self.layers:
            x_BSD, stats, sel_stats = layer(x_BSD, cos_BSd, sin_BSd, ctx, modality, real_BS)
            if stats is not None:
                moe_stats.append(stats)
            if sel_stats is not None:
                b_stats.append(sel_stats)
        output_rms = x_BSD.detach().float().pow(2).mean().sqrt()
        h_TD = self.ops.rms_norm(x_BSD, self.norm, cfg.norm_eps).reshape(B * S, -1)
        labels_T = labels.reshape(-1)
        # head GEMM in the compute dtype, log-sum-exp / CE / z in fp32; [T, V] logits never held whole
        valid_T = labels_T != IGNORE_INDEX
        rows_K = valid_T.nonzero().squeeze(1) if data_dependent_shapes_are_free(h_TD) else None
        if rows_K is not None and rows_K.numel():
            # the head on the labelled rows only (patches and padding have none); with the patch
            # rows' own-kind projection (MultimodalEmbedding) the demo's CPU training ran 14% faster
            ce_K, zsq_K = self.ops.linear_cross_entropy(h_TD.index_select(0, rows_K), self.head.weight, labels_T.index_select(0, rows_K),
                                                        ignore_index=IGNORE_INDEX)
            ce_T = ce_K.new_zeros(labels_T.shape[0]).index_copy(0, rows_K, ce_K)
            zsq_T = zsq_K.new_zeros(labels_T.shape[0]).index_copy(0, rows_K, zsq_K)
        else:
            ce_T, zsq_T = self.ops.linear_cross_entropy(h_TD, self.head.weight, labels_T, ignore_index=IGNORE_INDEX)
        n_valid = valid_T.sum().clamp(min=1)
        ce_loss = ce_T.sum() / n_valid
        z_loss = cfg.z_loss_coef * zsq_T.sum() / n_valid
        zero = ce_loss.new_zeros(())
        aux = sum((s["aux_loss"] for s in moe_stats if "aux_loss" in s), zero)
        rz = sum((s["router_z_loss"] for s in moe_stats if "router_z_loss" in s), zero)
        n_moe = max(len(moe_stats), 1)
        aux_loss = cfg.moe.aux_loss_coef * aux / n_moe
        router_z_loss = cfg.moe.router_z_loss_coef * rz / n_moe
        loss = ce_loss + z_loss + aux_loss + router_z_loss
        indexer_loss = indexer_kl = block_coverage = None
        if b_stats:
            block_coverage = torch.stack([st["coverage"] for st in b_stats])
            if "kl" in b_stats[0]:
                kl = torch.stack([st["kl"] for st in b_stats])
                indexer_kl = kl.detach()
                indexer_loss = att.indexer_loss_coef * kl.mean()
                loss = loss + indexer_loss

        # the modality of a loss term is the target's: token i predicts token i + 1. Sums by
        # scatter-add into fixed-size buffers: no boolean indexing, no host sync (ce is 0 where
        # there is no label).
        target_mod_T = torch.roll(modality, -1, dims=1).reshape(-1).long()
        ce_by_mod = torch.zeros(NUM_MODALITIES, dtype=torch.float32, device=ce_T.device)
        ce_by_mod = ce_by_mod.index_add(0, target_mod_T, ce_T.detach().float())
        tokens_by_mod = torch.zeros(NUM_MODALITIES, dtype=torch.int64, device=ce_T.device)
        tokens_by_mod = tokens_by_mod.index_add(0, target_mod_T, valid_T.long())
        E = max(cfg.moe.num_experts, 1)
        expert_counts = (
            torch.stack([s["counts_ME"] for s in moe_stats])
            if moe_stats
            else torch.zeros(0, NUM_MODALITIES, E, dtype=torch.int64, device=ce_T.device)
        )
        logits = None
        if return_logits:
            # the head in the compute dtype, logits in fp32 (as the loss reads them)
            w = self.head.weight
            dt = head_dtype(h_TD, w)
            logits = head_logits(h_TD.to(dt), w.to(dt)).view(B, S, -1)
        return ModelOutput(
            loss=loss, ce_loss=ce_loss, z_loss=z_loss, aux_loss=aux_loss, router_z_loss=router_z_loss,
            ce_sum_by_modality=ce_by_mod, tokens_by_modality=tokens_by_mod, expert_counts=expert_counts,
            output_rms=output_rms, logits=logits, indexer_loss=indexer_loss, indexer_kl=indexer_kl,
            block_coverage=block_coverage,
        )

    def embed_inputs(self, input_ids, patches, patch_kind, positions, doc_ids, block_ids, *,
                     layout: BatchLayout | None = None) -> torch.Tensor:
        """The decoder's input [B, S, D]: token embeddings, and at `<|patch|>` positions the patch
        stem's embeddings (early fusion) or, with model.vision_encoder, the stem's embeddings
        encoded within their visual block and projected (late fusion). The encoder reads the
        blocks' extents from `layout` (host-side; computed here from the batch when absent, a
        device read on an accelerator)."""
        encode = None
        if self.vision is not None:
            def encode(x_PE):
                if not x_PE.shape[0]:
                    return self.vision(x_PE, positions, ())
                lay = layout if layout is not None and layout.visual else self.batch_layout(doc_ids, block_ids)
                return self.vision(x_PE, positions, lay.visual)
        return self.embed(input_ids, patches, patch_kind, positions, encode=encode)

    def rope(self, positions_B3S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention's rotary (cos, sin) [B, S, head_dim / 2] for these (t, h, w) positions,
        in the model's `rope_layout`."""
        cfg = self.cfg
        return mrope_angles(positions_B3S, head_dim=cfg.head_dim, sections=cfg.rope_sections, base=cfg.rope_base,
                            layout=cfg.rope_layout)

    def index_rope(self, positions_B3S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The B-layer index branches' RoPE angles for these positions (None without them)."""
        att = self.cfg.attention
        if not (self.cfg.has_indexer and att.indexer_rope_dim):
            return None
        return index_rope_angles(positions_B3S, att.indexer_rope_dim, layout=self.cfg.rope_layout)

    def set_step(self, step: int) -> bool:
        """Tell the model the training step about to run: B layers attend densely while
        step < model.attention.dense_warmup_steps. Returns True when this call switched them."""
        dense = step < self.cfg.attention.dense_warmup_steps
        changed = dense != self.dense_b_layers
        self.dense_b_layers = dense
        return changed

    def batch_layout(self, doc_ids: torch.Tensor, block_ids: torch.Tensor) -> BatchLayout:
        """The host-side BatchLayout of a batch for this model's attention settings: call it on
        the CPU tensors (before the host-to-device copy) and pass it to forward."""
        a = self.cfg.attention
        return batch_layout(doc_ids, block_ids, block_size=a.block_size, window=a.window, num_selected=a.num_selected_blocks)

    @torch.no_grad()
    def update_router_biases(self, expert_counts: torch.Tensor) -> None:
        """Move every MoE layer's balancing bias toward even load; call after each optimizer step
        with ModelOutput.expert_counts [L_moe, 5, E] (summed over micro-batches and ranks)."""
        moe_layers = [layer.ffn for layer in self.layers if layer.is_moe]
        if expert_counts.shape[0] != len(moe_layers):
            raise ValueError(f"expert_counts has {expert_counts.shape[0]} layers, the model has {len(moe_layers)} MoE layers")
        for moe, counts_ME in zip(moe_layers, expert_counts):
            moe.update_bias(counts_ME.sum(0))

    def num_params(self) -> int:
        """Total parameters, from the config (equals sum of numel)."""
        return accounting.num_params(self.cfg)

    def num_active_params(self) -> int:
        """Parameters one text token uses, from the config (the vision encoder not included:
        `accounting.vision_encoder_params`)."""
        return accounting.num_active_params(self.cfg)

    def flops_per_token(self, seq_len: int, *, visual_fraction: float = 0.0, visual_block_len: int = 0) -> float:
        """Training FLOPs per token (forward + backward), from the config; with a vision encoder,
        `visual_fraction` of the tokens are patches in blocks of `visual_block_len`."""
        return accounting.flops_per_token(self.cfg, seq_len, visual_fraction=visual_fraction,
                                          visual_block_len=visual_block_len)

    def visual_flops(self, layout: BatchLayout | None) -> float:
        """Training FLOPs of the vision encoder on one batch, from its host-side layout's visual
        blocks (0 without an encoder): what the trainer adds to flops_per_token x tokens for MFU."""
        if self.vision is None or layout is None:
            return 0.0
        return accounting.vision_encoder_batch_flops(self.cfg, [e - s for row in layout.visual for s, e in row])
