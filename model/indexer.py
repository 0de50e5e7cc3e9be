"""The learned block selector of `B` layers (model.attention.selector=indexer) and the statistics
that train and judge any selector: the indexer's KL loss and the coverage of the dense attention.

Legend: B batch, S sequence, Sp padded to the block size bs, K kv heads (GQA groups), Hi index
heads per group, d index width, Q = Sp / bs query blocks, nb = Sp / bs key blocks, ns sampled
query blocks, H query heads, G = H / K, D head dim.

Scoring (MSA / DeepSeek-V3.2 style, per GQA group):

    score(query block q, key block n) = mean_h  max_{j in block n}  iq_h(q) . ik(j) / sqrt(d)

where iq_h(q) is index head h's query at the first token of query block q and ik(j) the group's
index key of token j. Every token of a block's first (block, document) run shares that choice, as
with the pooled selector (masks.select_blocks), so the choice depends only on the past of every
query that uses it. The index branch reads the layer's normed input *detached*: it learns only
from its KL loss, never pushes on the language model.

KL loss (stop-gradient target): for `ns` sampled query blocks, the dense attention this layer
would compute as a `G` layer (documents, causality, visual blocks) is summed per key block,
averaged over the block's real first-run queries (the ones its choice serves) and the group's
heads, restricted to the candidate blocks (those the selector chooses among) and normalized: t(n). The indexer's distribution is
the softmax of its block scores over the same candidates: s(n). Loss: KL(t || s), averaged over
the sampled (row, block, group) triples that have a candidate.

Coverage: the share of that dense attention mass (all blocks, not only candidates) that the
blocks a query actually attends hold, averaged over the sampled blocks' real tokens and all heads.
Real: neither the block padding past S nor the row's padding pseudo-document (`real_BS`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .masks import PAD_DOC, MaskInfo, Selection, token_mask

SCORE_CHUNK_ELEMENTS = 1 << 26  # block scoring is chunked over query blocks to cap the [.., Q, Sp] scores
CAUSAL_CHUNKS = 8  # causal scoring: this many query chunks, each against only the keys before it
CAUSAL_MIN_CHUNK = 16  # ... but no smaller than this many query blocks (small rows: one pass)


class BlockIndexer(nn.Module):
    """Index query heads (`heads` per kv head) and one index key head per kv head, width `dim_idx`."""

    def __init__(self, *, dim: int, num_kv_heads: int, heads: int, dim_idx: int, rope_dim: int = 0):
        super().__init__()
        self.num_kv_heads, self.heads, self.dim_idx, self.rope_dim = num_kv_heads, heads, dim_idx, rope_dim
        self.wq = nn.Linear(dim, num_kv_heads * heads * dim_idx, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * dim_idx, bias=False)

    def queries(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """Index queries of the given tokens: [B, K, Hi, S, d]."""
        B, S, _ = x_BSD.shape
        return self.wq(x_BSD).view(B, S, self.num_kv_heads, self.heads, self.dim_idx).permute(0, 2, 3, 1, 4)

    def keys(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """Index keys of the given tokens: [B, K, S, d]."""
        B, S, _ = x_BSD.shape
        return self.wk(x_BSD).view(B, S, self.num_kv_heads, self.dim_idx).transpose(1, 2)

    def forward(self, x_BSD: torch.Tensor, block_size: int,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries of every block's first token [B, K, Hi, Q, d], keys of every token [B, K, S, d]).
        `rope`: (cos, sin) [B, S, rope_dim / 2] from `index_rope_angles` (rope_dim > 0)."""
        q, k = self.queries(x_BSD[:, ::block_size]), self.keys(x_BSD)
        if self.rope_dim:
            if rope is None:
                raise ValueError("this index branch rotates by position (indexer_rope_dim > 0): pass its angles")
            cos, sin = rope
            q = rotate_index(q, cos[:, None, None, ::block_size], sin[:, None, None, ::block_size])
            k = rotate_index(k, cos[:, None], sin[:, None])
        return q, k


INDEX_ROPE_BASE = 10000.0


def index_rope_angles(positions: torch.Tensor, rope_dim: int, base: float = INDEX_ROPE_BASE,
                      layout: str = "sections") -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [B, S, rope_dim / 2] fp32 of the positions, plain 1-D RoPE frequencies over the
    index's rotated dims. `positions`: [B, 3, S] (t, h, w), or [B, S] temporal positions.

    Layout `sections` (models trained before `interleaved` existed) rotates by the temporal
    position t alone, as those models were trained. `interleaved` rotates as the attention does (`omniloom.model.embeddings.rope_axes`, the index's frequencies split evenly
    between t, h and w), so the index sees an image's rows and columns too. Text (t = h = w) gets
    the same angles under every layout."""
    from .embeddings import _axis_table

    n = rope_dim // 2
    inv = base ** (-torch.arange(0, rope_dim, 2, device=positions.device, dtype=torch.float32) / rope_dim)
    if positions.dim() == 2 or layout == "sections":
        t_BS = positions if positions.dim() == 2 else positions[:, 0]
        ang = t_BS.float().unsqueeze(-1) * inv
    else:
        axis_n = _axis_table(n, (n - 2 * (n // 3), n // 3, n // 3), layout, positions.device)
        ang = positions.float().index_select(1, axis_n).transpose(1, 2) * inv
    return ang.cos(), ang.sin()


def rotate_index(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x [..., S, d] (half-split pairs), the rest as is.
    cos/sin broadcast to [..., S, r / 2]; computed in fp32, returned in x's dtype."""
    h = cos.shape[-1]
    x1, x2, rest = x[..., :h].float(), x[..., h:2 * h].float(), x[..., 2 * h:]
    rot = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rot, rest], dim=-1)


def indexer_block_scores(iq_BKHQd: torch.Tensor, ik_BKSd: torch.Tensor, block_size: int, causal: bool = False) -> torch.Tensor:
    """Max-pooled block scores [B, K, Q', nb] (fp32) of Q' index queries against every key block.

    Keys past S (padding of the last block) score -inf, so a block's max is over its real keys.
    Chunked over the queries: the [.., Q', Sp] token scores never exceed SCORE_CHUNK_ELEMENTS.
    `causal`: query i is block i's (Q' = nb, the training path) and only strictly earlier blocks
    are scored (the rest are -inf; no block at or after its own is ever a candidate): each
    chunk of queries multiplies against the keys before it only, about half the work."""
    B, K, Hi, Qn, d = iq_BKHQd.shape
    S = ik_BKSd.shape[2]
    bs = block_size
    nb = -(-S // bs)
    Sp = nb * bs
    k = F.pad(ik_BKSd.float(), (0, 0, 0, Sp - S))
    real = torch.arange(Sp, device=k.device) < S
    q = iq_BKHQd.float() * (1.0 / math.sqrt(d))
    step = max(1, SCORE_CHUNK_ELEMENTS // max(1, B * K * Hi * Sp))
    if causal:
        assert Qn == nb, "causal block scores need one index query per block"
        step = min(step, max(CAUSAL_MIN_CHUNK, -(-Qn // CAUSAL_CHUNKS)))
    out = []
    for c0 in range(0, Qn, step):
        c1 = min(Qn, c0 + step)
        kb = c1 if causal else nb  # key blocks this chunk can see
        s = torch.einsum("bkhqd,bksd->bkhqs", q[:, :, :, c0:c1], k[:, :, : kb * bs])
        if Sp > S:  # only the last block has padding keys
            s = s.masked_fill(~real[: kb * bs], float("-inf"))
        s = s.view(B, K, Hi, c1 - c0, kb, bs).amax(-1).mean(2)
        if causal:
            earlier = torch.arange(kb, device=k.device) < torch.arange(c0, c1, device=k.device).unsqueeze(1)
            s = F.pad(s.masked_fill(~earlier, float("-inf")), (0, nb - kb), value=float("-inf"))
        out.append(s)
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def sampled_query_blocks(num_blocks: int, num_samples: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Query blocks whose dense attention the statistics compute: `num_samples` evenly spaced
    over the row (block i * (nb - 1) // (ns - 1)), the first and the last always among them
    (later blocks have the most candidates). Made on the device from shapes alone: no copy, no
    device read."""
    if num_samples >= num_blocks:
        return torch.arange(num_blocks, device=device)
    if num_samples == 1:
        return torch.full((1,), num_blocks - 1, device=device)
    return torch.arange(num_samples, device=device) * (num_blocks - 1) // (num_samples - 1)


# Bytes of fp32 scores dense_block_mass holds at once: the sampled query rows go in chunks, so
# at long_64k (8 heads, 16 x 128 sampled rows, 65,536 keys) the transient is this, not 4.3 GB
# of scores and as much again of probabilities per B layer.
MASS_CHUNK_BYTES = 256 * 2**20


def dense_block_mass(info: MaskInfo, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """The dense (G-rule) attention probability of each sampled query token summed per key
    block, no gradient: [B, H, ns * bs, nb] fp32. Rows of padding queries are garbage (callers
    weigh them out). Computed for chunks of query rows (MASS_CHUNK_BYTES of scores at a time),
    each key head shared by its group of query heads without copies."""
    bs, Sp, nb = info.block_size, info.padded_len, info.num_blocks
    B, H, S, D = q_BHSD.shape
    K = k_BKSD.shape[1]
    G = H // K
    dev = q_BHSD.device
    with torch.no_grad():
        tok = (blocks[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)
        q = F.pad(q_BHSD.detach().float(), (0, 0, 0, Sp - S)).index_select(2, tok)
        q = q.view(B, K, G, len(tok), D)
        k = F.pad(k_BKSD.detach().float(), (0, 0, 0, Sp - S))  # [B, K, Sp, D]
        idx = torch.arange(Sp, device=dev)
        doc, vis = info.doc_BS, info.vis_BS
        rows = max(1, MASS_CHUNK_BYTES // (4 * B * H * Sp))
        out = torch.empty(B, H, len(tok), nb, device=dev, dtype=torch.float32)
        for a in range(0, len(tok), rows):
            t = tok[a:a + rows]
            scores = torch.einsum("bkgqd,bksd->bkgqs", q[:, :, :, a:a + rows], k) * (1.0 / math.sqrt(D))
            allowed = token_mask(doc[:, t, None], vis[:, t, None], t[None, :, None],
                                 doc[:, None, :], vis[:, None, :], idx[None, None, :], "G", info.window)
            scores.masked_fill_(~allowed[:, None, None], float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[:, :, a:a + len(t)] = probs.reshape(B, H, len(t), nb, bs).sum(-1)
        return out


def selector_stats(
    info: MaskInfo,
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    sel: Selection,
    num_samples: int,
    index: tuple[torch.Tensor, torch.Tensor] | None = None,
    cached: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    real_BS: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """`coverage` (detached scalar) of a B layer's selection `sel` and, with `index` = the
    indexer's (block-start queries [B, K, Hi, Q, d], keys [B, K, S, d]) carrying gradient, its
    `kl` loss (scalar with gradient). Both over `sampled_query_blocks(Q, num_samples)`.

    The KL's detached target is returned too, as `target` = (coverage, target, weight); passing
    it back as `cached` (activation checkpointing's recomputation of the same layer and batch)
    skips the dense attention it comes from, the costly part, and rebuilds only the KL's graph.

    `real_BS` [B, S] bool marks the tokens that are not padding: the row's trailing padding
    pseudo-document (a document to the mask rule) is left out of the coverage and the target
    like the block padding past S; the last block, always sampled, is often all padding."""
    bs, nb = info.block_size, info.num_blocks
    B, H, S, _ = q_BHSD.shape
    K = k_BKSD.shape[1]
    G = H // K
    dev = q_BHSD.device
    blk = sampled_query_blocks(nb, num_samples, dev)
    ns = blk.shape[0]
    if cached is not None and index is not None:
        coverage, target, weight = cached
        cand = sel.cand_BQn.index_select(1, blk)
        return {"coverage": coverage, "target": cached, "kl": _indexer_kl(index, blk, bs, cand, target, weight)}
    tok = (blk[:, None] * bs + torch.arange(bs, device=dev)).reshape(-1)  # [ns * bs]
    mass = dense_block_mass(info, q_BHSD, k_BKSD, blk)  # [B, H, ns*bs, nb]
    real = (info.doc_BS[:, tok] != PAD_DOC) & (tok < S)  # [B, ns*bs]
    if real_BS is not None:
        real = real & F.pad(real_BS, (0, info.padded_len - S), value=False).index_select(1, tok)
    with torch.no_grad():
        chosen = sel.at(tok).repeat_interleave(G, dim=1)  # [B, H, ns*bs, nb]
        held = (mass * chosen).sum(-1)  # [B, H, ns*bs]
        w = real.unsqueeze(1).float()
        coverage = (held * w).sum() / (w.sum() * H).clamp(min=1.0)
    out = {"coverage": coverage}
    if index is None:
        return out
    cand = sel.cand_BQn.index_select(1, blk)  # [B, ns, nb]
    first_BS = sel.first_BS
    with torch.no_grad():
        # the target: mass of the block's first-run queries, mean over them and the group's heads
        run = (first_BS[:, tok] & real).view(B, 1, ns, bs).float()  # [B, 1, ns, bs]
        m = mass.view(B, K, G, ns, bs, nb).mean(2)  # [B, K, ns, bs, nb]
        m = (m * run.unsqueeze(-1)).sum(3) * cand.unsqueeze(1)  # [B, K, ns, nb]
        total = m.sum(-1, keepdim=True)
        target = m / total.clamp(min=1e-30)
        weight = (cand.any(-1).unsqueeze(1) & (run.sum(3) > 0)).float()  # [B, K?=1, ns]
        weight = weight.expand(B, K, ns)
    out["target"] = (coverage, target, weight)
    out["kl"] = _indexer_kl(index, blk, bs, cand, target, weight)
    return out


def _indexer_kl(index, blk, bs: int, cand, target, weight) -> torch.Tensor:
    """KL(target || the indexer's block distribution) on the sampled query blocks, weighted mean."""
    iq_BKHQd, ik_BKSd = index
    scores = indexer_block_scores(iq_BKHQd.index_select(3, blk), ik_BKSd, bs)  # [B, K, ns, nb] with grad
    logp = torch.log_softmax(scores.masked_fill(~cand.unsqueeze(1), float("-inf")), dim=-1)
    logp = torch.where(cand.unsqueeze(1), logp, torch.zeros_like(logp))
    kl_BKs = (torch.xlogy(target, target) - target * logp).sum(-1)
    return (kl_BKs * weight).sum() / weight.sum().clamp(min=1.0)
