"""Late fusion: a vision encoder over each visual block's patches, projected into the decoder.

Legend: P patch positions in the batch (row-major, as PackedBatch), E encoder width, D decoder
width, H encoder heads, hd = E / H, d = hd / 2 rotary frequencies, n segments of one length L.

    x_PE = stem(patches)                       # MultimodalEmbedding's stem, projecting to E
    for each layer: x += attn(rmsnorm(x)); x += swiglu(rmsnorm(x))   # attention inside one visual block
    x_PD = projector(rmsnorm(x))               # mlp: Linear GELU Linear (LLaVA-1.5), or linear

The decoder then reads x_PD where the patch embeddings were (OmniModel.embed_inputs).

Attention: bidirectional, and only among the patches of one visual block (a run of one block id
inside one document, `BatchLayout.visual`): never across blocks, documents or to text. The
blocks' extents are host-side facts (the trainer computes the layout from the CPU copy of the
batch), so the encoder sorts the patch rows once so that blocks of equal length sit side by
side and runs each group as one [n, H, L, hd] `scaled_dot_product_attention` with no mask at
all: exact, no padding, no host sync, the fused kernel of every device. Every other op is per
token, so the sorted order holds through all layers and is undone once at the end.

Positions: the decoder's own M-RoPE (`mrope_angles`, the model's `rope_layout` and base) over
each patch's (t, h, w) position in the batch, with the encoder's head dim split between the axes
(`VisionEncoderConfig.rope_sections`). RoPE sees only differences, so inside a block this is
the patch grid; a block's offset in the sequence changes nothing.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention
from .config import ModelConfig
from .embeddings import mrope_angles
from .moe import SwiGLUMLP


class SegmentPlan:
    """Where the patch rows go for block-local attention, from the visual blocks' extents.

    `runs`: per batch row, the (start, end) token range of every visual block, in order
    (`BatchLayout.visual`); the blocks' patches are the batch's patch rows in that order.
    `perm_P`: patch row of each sorted position (None when already sorted); `inverse_P` undoes it;
    `token_P`: the flat token index (row * S + column) of each sorted position; `groups`: per
    distinct block length L, (first sorted position, number of blocks n, L)."""

    def __init__(self, runs, seq_len: int, num_patches: int, device: torch.device):
        starts, lengths = [], []
        for b, row in enumerate(runs):
            for s, e in row:
                starts.append(b * seq_len + s)
                lengths.append(e - s)
        if sum(lengths) != num_patches:
            raise ValueError(f"the vision encoder found {sum(lengths)} tokens in visual blocks but {num_patches} patch rows: "
                             "every <|patch|> token must carry its block's id in block_ids (and nothing else may)")
        lengths_n = np.asarray(lengths, dtype=np.int64)
        order = np.argsort(lengths_n, kind="stable")  # blocks grouped by length, in batch order inside a group
        first_P = np.concatenate([[0], np.cumsum(lengths_n)[:-1]]).astype(np.int64) if lengths else np.zeros(0, np.int64)
        perm = np.concatenate([np.arange(first_P[i], first_P[i] + lengths_n[i]) for i in order]) if lengths else first_P
        tok = np.concatenate([np.arange(starts[i], starts[i] + lengths[i]) for i in order]) if lengths else first_P
        self.groups = []
        at = 0
        for length in np.unique(lengths_n):
            n = int((lengths_n == length).sum())
            self.groups.append((at, n, int(length)))
            at += n * int(length)
        sorted_already = bool((perm == np.arange(num_patches)).all())
        self.perm_P = None if sorted_already else _to_device(perm, device)
        self.inverse_P = None if sorted_already else _to_device(np.argsort(perm, kind="stable"), device)
        self.token_P = _to_device(tok, device)


def _to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host index array on `device` with no sync: pinned and copied asynchronously on CUDA
    (a copy from pageable memory waits for the device's queue)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class _BlockLocalContext:
    """Stands in for AttnContext inside the encoder: each group of equal-length visual blocks is
    one unmasked batched attention (SegmentPlan)."""

    block_size = 0
    index_rope = None

    def __init__(self, groups):
        self.groups = groups

    def attend_stats(self, q_BHSD, k_BKSD, v_BKSD, kind, index=None, layer_key=None):
        _, H, _, hd = q_BHSD.shape
        outs = []
        for at, n, L in self.groups:
            def seg(t):
                return t[0, :, at:at + n * L].reshape(t.shape[1], n, L, hd).transpose(0, 1)

            o = F.scaled_dot_product_attention(seg(q_BHSD), seg(k_BKSD), seg(v_BKSD), enable_gqa=True)  # [n, H, L, hd]
            outs.append(o.transpose(0, 1).reshape(H, n * L, hd))
        return torch.cat(outs, dim=1).unsqueeze(0), None


class EncoderBlock(nn.Module):
    """Pre-norm encoder layer: the decoder's Attention (QK-norm, rotary; bidirectional here,
    through _BlockLocalContext) and a dense SwiGLU."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, norm_eps: float, ops):
        super().__init__()
        self.ops, self.eps = ops, norm_eps
        self.attn_norm = nn.Parameter(torch.ones(dim))
        self.attn = Attention(dim=dim, num_heads=num_heads, num_kv_heads=num_heads, kind="G", qk_norm=True,
                              norm_eps=norm_eps, ops=ops)
        self.ffn_norm = nn.Parameter(torch.ones(dim))
        self.ffn = SwiGLUMLP(dim, ffn_dim, ops)

    def forward(self, x_1PE, cos, sin, ctx: _BlockLocalContext) -> torch.Tensor:
        a, _ = self.attn(self.ops.rms_norm(x_1PE, self.attn_norm, self.eps), cos, sin, ctx)
        x_1PE = x_1PE + a
        return x_1PE + self.ffn(self.ops.rms_norm(x_1PE, self.ffn_norm, self.eps))


class Projector(nn.Module):
    """Encoder width to decoder width: `mlp` fc1, GELU, fc2 (LLaVA-1.5) or `linear` fc1 alone."""

    def __init__(self, kind: str, enc_dim: int, dim: int):
        super().__init__()
        self.fc1 = nn.Linear(enc_dim, dim, bias=False)
        self.fc2 = nn.Linear(dim, dim, bias=False) if kind == "mlp" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        return self.fc2(F.gelu(x)) if self.fc2 is not None else x


class VisionEncoder(nn.Module):
    """`model.vision_encoder`: the encoder layers, their final norm and the projector."""

    def __init__(self, cfg: ModelConfig, ops):
        super().__init__()
        enc = cfg.vision_encoder.resolved(cfg)
        self.enc, self.ops, self.eps = enc, ops, cfg.norm_eps
        self.rope_base, self.rope_layout = cfg.rope_base, cfg.rope_layout
        self.layers = nn.ModuleList(EncoderBlock(enc.dim, enc.num_heads, enc.ffn_dim, cfg.norm_eps, ops)
                                    for _ in range(enc.num_layers))
        self.norm = nn.Parameter(torch.ones(enc.dim))
        self.projector = Projector(enc.projector, enc.dim, cfg.dim)
        self.out_dim = cfg.dim

    def forward(self, x_PE: torch.Tensor, positions_B3S: torch.Tensor, runs) -> torch.Tensor:
        """x_PD: the patch rows' stem embeddings x_PE encoded within their visual blocks and
        projected. `runs`: per batch row the (start, end) of every visual block (SegmentPlan);
        with no patch rows, an empty result that still puts every parameter in the graph (a
        zero gradient: DDP needs no unused-parameter search)."""
        P = x_PE.shape[0]
        if P == 0:
            idle = sum(p.reshape(-1)[:1].sum() for p in self.parameters()) * 0.0
            return x_PE.new_zeros(0, self.out_dim) + idle.to(x_PE.dtype)
        B, _, S = positions_B3S.shape
        plan = SegmentPlan(runs, S, P, x_PE.device)
        pos_3P = positions_B3S.transpose(0, 1).reshape(3, B * S).index_select(1, plan.token_P)
        cos, sin = mrope_angles(pos_3P.unsqueeze(0), head_dim=self.enc.head_dim, sections=self.enc.rope_sections,
                                base=self.rope_base, layout=self.rope_layout)
        x = (x_PE if plan.perm_P is None else x_PE.index_select(0, plan.perm_P)).unsqueeze(0)
        ctx = _BlockLocalContext(plan.groups)
        for layer in self.layers:
            x = layer(x, cos, sin, ctx)
        x_PD = self.projector(self.ops.rms_norm(x, self.norm, self.eps))[0]
        return x_PD if plan.inverse_P is None else x_PD.index_select(0, plan.inverse_P)
