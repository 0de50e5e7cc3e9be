"""One mask description for every attention backend, built once per forward from PackedBatch fields.

Legend: B batch, S sequence, Sp S padded to a multiple of the block size bs, H query heads,
K kv heads, G = H / K, D head dim, Q = Sp / bs query blocks, nb = Sp / bs key blocks,
N key-block slots gathered per query block.

The rule, for query i and key j of one row (every backend enforces exactly this):

    allowed(i, j) = doc[i] == doc[j]
                    and (j <= i  or  (vis[i] >= 0 and vis[i] == vis[j]))   # text causal, a visual block bidirectional
                    and kind rule:  L: |i - j| < window
                                    G: nothing more
                                    B: key block j // bs is selected for query i (see `select_blocks`)

Documents and visual blocks are contiguous runs of one id in a row (PackedBatch packs them so);
the gathered-block backends rely on it. The diagonal is always allowed, so no row is empty (padding tokens included). Nothing here
depends on a query's absolute position beyond `idx`, so a KV-cache decoder can evaluate the same
rule with an offset and keep only `window` keys for L layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

PAD_DOC = -(2**40)  # doc id of internal padding tokens: equal to no real document


@dataclass
class MaskInfo:
    """Per-token facts the rule needs, padded to Sp (a multiple of block_size)."""

    doc_BS: torch.Tensor  # int64 document id
    vis_BS: torch.Tensor  # int64 visual block id, -1 for text
    doc_start_BS: torch.Tensor  # int64 index of the first token of the token's document
    vis_start_BS: torch.Tensor  # int64 [start, end) of the token's visual block; (i, i+1) for text
    vis_end_BS: torch.Tensor
    seq_len: int  # S, unpadded
    block_size: int
    window: int

    @property
    def padded_len(self) -> int:
        return self.doc_BS.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.padded_len // self.block_size


def _run_starts(change_BS: torch.Tensor) -> torch.Tensor:
    """Index of the first token of each token's run, where change_BS marks run starts."""
    idx_S = torch.arange(change_BS.shape[1], device=change_BS.device)
    return torch.where(change_BS, idx_S, torch.zeros_like(idx_S)).cummax(dim=1).values


def build_mask_info(doc_ids_BS: torch.Tensor, block_ids_BS: torch.Tensor, *, block_size: int, window: int) -> MaskInfo:
    """Describe a batch's attention structure (documents, visual blocks) for every layer kind."""
    if doc_ids_BS.shape != block_ids_BS.shape or doc_ids_BS.dim() != 2:
        raise ValueError(f"doc_ids {tuple(doc_ids_BS.shape)} and block_ids {tuple(block_ids_BS.shape)} must both be [B, S]")
    B, S = doc_ids_BS.shape
    Sp = -(-S // block_size) * block_size
    doc = torch.full((B, Sp), PAD_DOC, dtype=torch.int64, device=doc_ids_BS.device)
    vis = torch.full((B, Sp), -1, dtype=torch.int64, device=doc_ids_BS.device)
    doc[:, :S] = doc_ids_BS
    vis[:, :S] = block_ids_BS
    vis = torch.where(vis >= 0, vis, torch.full_like(vis, -1))
    first = torch.zeros_like(doc, dtype=torch.bool)
    first[:, 0] = True
    doc_change = first.clone()
    doc_change[:, 1:] = doc[:, 1:] != doc[:, :-1]
    run_change = doc_change.clone()
    run_change[:, 1:] |= vis[:, 1:] != vis[:, :-1]
    idx = torch.arange(Sp, device=doc.device).expand(B, Sp)
    doc_start = _run_starts(doc_change)
    run_start = _run_starts(run_change)
    # run ends: the same scan from the right
    run_last = torch.zeros_like(run_change)
    run_last[:, :-1] = run_change[:, 1:]
    run_last[:, -1] = True
    # flipped, a run's last token is its first: p = Sp-1-e, so the exclusive end is Sp - p
    rev_start = torch.where(run_last.flip(1), idx, torch.zeros_like(idx)).cummax(dim=1).values
    run_end = Sp - rev_start.flip(1)
    is_vis = vis >= 0
    return MaskInfo(
        doc_BS=doc,
        vis_BS=vis,
        doc_start_BS=doc_start,
        vis_start_BS=torch.where(is_vis, run_start, idx),
        vis_end_BS=torch.where(is_vis, run_end, idx + 1),
        seq_len=S,
        block_size=block_size,
        window=window,
    )


def token_mask(doc_q, vis_q, idx_q, doc_k, vis_k, idx_k, kind: str, window: int) -> torch.Tensor:
    """The rule above on broadcastable tensors (without B's block selection)."""
    m = (doc_q == doc_k) & ((idx_k <= idx_q) | ((vis_q >= 0) & (vis_q == vis_k)))
    if kind == "L":
        m = m & ((idx_q - idx_k).abs() < window)
    return m


def dense_mask(info: MaskInfo, kind: str, sel_BKSn: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, 1, S, S] mask (or [B, K, S, S] with a B layer's selection) for sdpa."""
    S = info.seq_len
    doc, vis = info.doc_BS[:, :S], info.vis_BS[:, :S]
    idx = torch.arange(S, device=doc.device)
    m = token_mask(doc[:, :, None], vis[:, :, None], idx[:, None], doc[:, None, :], vis[:, None, :], idx[None, :], kind, info.window)
    m = m.unsqueeze(1)
    if sel_BKSn is not None:
        m = m & sel_BKSn[:, :, :S, :].index_select(-1, idx // info.block_size)
    return m


def _block_lo_hi(info: MaskInfo, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query block, the first and last key block any of its tokens may see: [B, Q] each."""
    bs, Sp = info.block_size, info.padded_len
    B = info.doc_BS.shape[0]
    idx = torch.arange(Sp, device=info.doc_BS.device).expand(B, Sp)
    lo, hi = info.doc_start_BS, torch.maximum(idx, info.vis_end_BS - 1)
    if kind == "L":
        lo = torch.maximum(lo, idx - info.window + 1)
        hi = torch.minimum(hi, idx + info.window - 1)
    return lo.view(B, -1, bs).min(-1).values // bs, hi.view(B, -1, bs).max(-1).values // bs


def block_ranges(info: MaskInfo, kind: str, num_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-block slots for L and G layers: every query block gets the contiguous run of key blocks
    that any of its tokens may see (its documents' past within the window, plus its visual blocks'
    future). Returns (kv_idx [B, 1, Q, N] long, valid [B, 1, Q, N] bool), N = the longest run:
    `num_slots` when the caller knows it from the host (BatchLayout; no device read), else read
    from the data."""
    lo_Q, hi_Q = _block_lo_hi(info, kind)
    n = num_slots if num_slots is not None else int((hi_Q - lo_Q).max()) + 1
    kv_idx = lo_Q.unsqueeze(-1) + torch.arange(n, device=lo_Q.device)
    valid = kv_idx <= hi_Q.unsqueeze(-1)
    return kv_idx.clamp(max=info.num_blocks - 1).unsqueeze(1), valid.unsqueeze(1)


@dataclass(frozen=True)
class BatchLayout:
    """Host-side facts of one batch's attention structure, computed from the CPU copies of
    doc_ids / block_ids before the batch moves to the device (`batch_layout`), so that attention
    can size its work with no device read in forward or backward.

    segments: per row, the (start, end, has_visual) token range of every document, in order.
    slots: key-block slots per query block that blocksparse gathers for each kind (L, G exact;
    B an upper bound of the union of the block choices, see `batch_layout`).
    visual: per row, the (start, end) token range of every visual block (a run of one block id
    inside one document), in order; empty when not computed (the CPU attention then treats a
    document with visual blocks as a whole)."""

    seq_len: int
    segments: tuple[tuple[tuple[int, int, bool], ...], ...]
    slots: dict
    visual: tuple[tuple[tuple[int, int], ...], ...] = ()


def batch_layout(
    doc_ids_BS: torch.Tensor, block_ids_BS: torch.Tensor, *, block_size: int, window: int, num_selected: int
) -> BatchLayout:
    """BatchLayout of a batch from its doc_ids / block_ids (read on the host: pass the CPU copies,
    as the trainer does before the host-to-device copy; a CUDA tensor is copied back, a sync)."""
    doc, blk = doc_ids_BS.detach().cpu(), block_ids_BS.detach().cpu()
    info = build_mask_info(doc, blk, block_size=block_size, window=window)
    B, S = doc.shape
    bs, Sp, nb = block_size, info.padded_len, info.num_blocks
    slots = {}
    for kind in ("L", "G"):
        lo_Q, hi_Q = _block_lo_hi(info, kind)
        slots[kind] = int((hi_Q - lo_Q).max()) + 1
    # B: a query block's union of choices is at most its own block, plus per document run in it
    # (the first block of the document + num_selected - 1 chosen blocks), plus the blocks of
    # each visual block in it
    idx = torch.arange(Sp)
    new_doc = torch.ones(B, Sp, dtype=torch.bool)
    new_doc[:, 1:] = (info.doc_BS[:, 1:] != info.doc_BS[:, :-1]) | (idx[1:] % bs == 0)
    is_vis = info.vis_BS >= 0
    new_vis = is_vis & (info.vis_start_BS == idx)  # a visual run's first token ...
    new_vis |= is_vis & (idx % bs == 0)  # ... or its first token in this block
    span = torch.where(new_vis, (info.vis_end_BS - 1) // bs - info.vis_start_BS // bs + 1, torch.zeros_like(idx))
    docs_Q = new_doc.view(B, nb, bs).sum(-1)
    vis_Q = span.view(B, nb, bs).sum(-1)
    slots["B"] = int(min(nb, int((1 + docs_Q * num_selected + vis_Q).max())))
    d = doc.numpy()
    vis_cum = np.concatenate([np.zeros((B, 1), np.int64), np.cumsum(blk.numpy() >= 0, axis=1)], axis=1)
    segments = []
    for b in range(B):
        starts = [0, *(np.flatnonzero(d[b, 1:] != d[b, :-1]) + 1).tolist()] if S else []
        ends = starts[1:] + [S]
        segments.append(tuple((s0, e0, bool(vis_cum[b, e0] > vis_cum[b, s0])) for s0, e0 in zip(starts, ends)))
    first_vis = (is_vis & (info.vis_start_BS == idx))[:, :S].numpy()
    vis_end = info.vis_end_BS[:, :S].numpy()
    visual = tuple(tuple((int(t), int(vis_end[b, t])) for t in np.flatnonzero(first_vis[b])) for b in range(B))
    return BatchLayout(seq_len=S, segments=tuple(segments), slots=slots, visual=visual)


def candidate_blocks(info: MaskInfo) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a B layer's selector chooses among, per query block: (cand [B, Q, nb] bool,
    first_run [B, Sp] bool).

    A query block's choice serves the tokens of its first (block, document) run, i.e. the tokens
    of the document its first token belongs to (`first_run`). Its candidates: the earlier key
    blocks lying wholly inside that document, other than the document's first block (always kept
    anyway). A document that starts inside the block has no such earlier block, so the tokens of
    later runs have no candidates and keep only the forced blocks."""
    bs, Sp, nb = info.block_size, info.padded_len, info.num_blocks
    dev = info.doc_BS.device
    doc_blocks = info.doc_BS.view(-1, nb, bs)
    block_doc_Bn = torch.where((doc_blocks == doc_blocks[:, :, :1]).all(-1), doc_blocks[:, :, 0],
                               torch.full_like(doc_blocks[:, :, 0], PAD_DOC))
    doc_Q = doc_blocks[:, :, 0]  # the document of each query block's first run
    first_block_Q = info.doc_start_BS.view(-1, nb, bs)[:, :, 0] // bs
    kb = torch.arange(nb, device=dev)
    cand = (kb[None, None, :] < kb[None, :, None]) & (block_doc_Bn[:, None, :] == doc_Q[:, :, None])
    cand &= (doc_Q != PAD_DOC)[:, :, None] & (kb[None, None, :] != first_block_Q[:, :, None])
    first_run = info.doc_BS == doc_Q.repeat_interleave(bs, dim=1)
    return cand, first_run


def pooled_block_scores(info: MaskInfo, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor) -> torch.Tensor:
    """The pooled selector's scores [B, K, Q, nb] fp32: each query block's first-token query
    (summed over the group) against each key block's mean key."""
    bs, Sp, nb = info.block_size, info.padded_len, info.num_blocks
    B, H, S, D = q_BHSD.shape
    K = k_BKSD.shape[1]
    q_BKQD = q_BHSD[:, :, ::bs].float().view(B, K, H // K, nb, D).sum(2)
    k = torch.zeros(B, K, Sp, D, dtype=torch.float32, device=k_BKSD.device)
    k[:, :, :S] = k_BKSD.float()
    return q_BKQD @ k.view(B, K, nb, bs, D).mean(3).transpose(-1, -2)


@dataclass
class Selection:
    """A B layer's block choice, held compactly (linear in S, plus [Q, nb] picks): a token's
    selected key blocks are its forced blocks (own block, its document's first block, the blocks
    of its visual block) plus, for tokens of its query block's first run, the block's picks.
    Evaluate it only where it is needed: `at` (some tokens), `at_slots` (gathered slots),
    `block_union` (per query block), `dense` ([B, K, Sp, nb], for the sdpa reference)."""

    info: MaskInfo
    hit_BKQn: torch.Tensor  # bool: the picks of each query block (first-run tokens only)
    first_BS: torch.Tensor  # bool: token is in its query block's first (block, document) run
    cand_BQn: torch.Tensor  # bool: the blocks each query block chose among (candidate_blocks)

    @staticmethod
    def forced(kb, own, first, vis_lo, vis_hi):
        """The forced rule on broadcastable block indices: key block `kb` is the query's own
        block, its document's first block, or inside its visual block's [vis_lo, vis_hi]."""
        return (kb == own) | (kb == first) | ((kb >= vis_lo) & (kb <= vis_hi))

    def token_blocks(self, tok_T: torch.Tensor | None = None):
        """(own, first, vis_lo, vis_hi) block indices of tokens `tok_T` ([T] own, [B, T] the rest),
        or of every padded token when None."""
        info, bs = self.info, self.info.block_size
        facts = (info.doc_start_BS, info.vis_start_BS, info.vis_end_BS - 1)
        if tok_T is None:
            tok_T = torch.arange(info.padded_len, device=info.doc_BS.device)
        else:
            facts = tuple(f[:, tok_T] for f in facts)
        return (tok_T // bs, *(f // bs for f in facts))

    def at(self, tok_T: torch.Tensor) -> torch.Tensor:
        """[B, K, T, nb] bool: the selection of tokens `tok_T` (padded indices)."""
        kb = torch.arange(self.info.num_blocks, device=tok_T.device)
        own, first, lo, hi = self.token_blocks(tok_T)
        forced = self.forced(kb, own[:, None], first[..., None], lo[..., None], hi[..., None])  # [B, T, nb]
        picks = self.hit_BKQn.index_select(2, own) & self.first_BS[:, tok_T].unsqueeze(1).unsqueeze(-1)
        return forced.unsqueeze(1) | picks

    def dense(self) -> torch.Tensor:
        return self.at(torch.arange(self.info.padded_len, device=self.hit_BKQn.device))

    def at_slots(self, kv_idx_BKQN: torch.Tensor) -> torch.Tensor:
        """[B, K, Q, bs, N] bool: every token's selection at its query block's gathered slots."""
        bs = self.info.block_size
        B, K, Q, N = kv_idx_BKQN.shape
        own, first, lo, hi = (t.reshape(-1, 1, Q, bs, 1) for t in self.token_blocks())
        forced = self.forced(kv_idx_BKQN.unsqueeze(3), own, first, lo, hi)
        picks = self.hit_BKQn.gather(3, kv_idx_BKQN).unsqueeze(3) & self.first_BS.view(B, 1, Q, bs, 1)
        return forced | picks

    def block_union(self) -> torch.Tensor:
        """[B, K, Q, nb] bool: the union of the choices of each query block's tokens (scatters
        over the tokens, no [Sp, nb] tensor)."""
        info, bs, nb = self.info, self.info.block_size, self.info.num_blocks
        B = info.doc_BS.shape[0]
        dev = self.hit_BKQn.device
        row = (torch.arange(info.padded_len, device=dev) // bs * (nb + 1)).expand(B, -1)
        marks = torch.zeros(B, nb * (nb + 1), dtype=torch.bool, device=dev)
        marks.scatter_(1, row + torch.arange(info.padded_len, device=dev) // bs, True)  # own block
        marks.scatter_(1, row + info.doc_start_BS // bs, True)  # the document's first block
        # visual spans [first block, last block]: +1 / -1 in a difference array, then a running sum
        diff = torch.zeros(B, nb * (nb + 1), dtype=torch.int32, device=dev)
        one = torch.ones(B, info.padded_len, dtype=torch.int32, device=dev)
        diff.scatter_add_(1, row + info.vis_start_BS // bs, one)
        diff.scatter_add_(1, row + (info.vis_end_BS - 1) // bs + 1, -one)
        span = diff.view(B, nb, nb + 1)[:, :, :nb].cumsum(-1) > 0
        forced = marks.view(B, nb, nb + 1)[:, :, :nb] | span
        return forced.unsqueeze(1) | self.hit_BKQn


def top_blocks(scores_Xn: torch.Tensor, n_pick: int) -> torch.Tensor:
    """Indices [..., n_pick] of the `n_pick` best-scoring blocks along the last dim, ties to the
    later block: the one rule of every B-layer choice (`select_blocks_compact`, hence every
    attention backend, and the KV cache's `_choose_blocks`). `topk` breaks ties as its kernel
    happens to, which differs between a top-k over all blocks and over a slice of them, so equal
    scores (equal tokens, an index without positions) picked other blocks when decoding. A stable
    descending sort of the reversed scores puts equal scores latest-block first."""
    n = scores_Xn.shape[-1]
    order = torch.sort(scores_Xn.flip(-1), dim=-1, descending=True, stable=True).indices[..., :n_pick]
    return (n - 1) - order


@torch.no_grad()
def select_blocks_compact(info: MaskInfo, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, num_selected: int,
                          scores_BKQn: torch.Tensor | None = None) -> Selection:
    """`select_blocks` as a compact Selection (what the attention backends use)."""
    nb = info.num_blocks
    B, K = q_BHSD.shape[0], k_BKSD.shape[1]
    dev = q_BHSD.device
    n_pick = min(num_selected - 1, nb)
    cand_BQn, first_BS = candidate_blocks(info)
    if n_pick <= 0:
        return Selection(info, torch.zeros(B, K, nb, nb, dtype=torch.bool, device=dev), first_BS, cand_BQn)
    if scores_BKQn is None:
        scores_BKQn = pooled_block_scores(info, q_BHSD, k_BKSD)
    scores = scores_BKQn.float().masked_fill(~cand_BQn.unsqueeze(1), float("-inf"))
    top = top_blocks(scores, n_pick)
    hit_BKQn = torch.zeros(B, K, nb, nb, dtype=torch.bool, device=dev).scatter_(-1, top, True) & cand_BQn.unsqueeze(1)
    return Selection(info, hit_BKQn, first_BS, cand_BQn)


@torch.no_grad()
def select_blocks(info: MaskInfo, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, num_selected: int,
                  scores_BKQn: torch.Tensor | None = None) -> torch.Tensor:
    """A B layer's key-block choice per query token and kv head: [B, K, Sp, nb] bool.

    Forced: the query's own block, the first block of its document (an attention sink) and the
    blocks of its visual block. Chosen by score: the best `num_selected - 1` of the candidate
    blocks (`candidate_blocks`: earlier blocks wholly inside the query's document, other than its
    first). Scores are one per (query block, key block): `scores_BKQn` from the learned indexer
    (model/indexer.py), or by default the pooled ones (`pooled_block_scores`). They come from the
    block's first token, so the choice depends only on the past of every query that uses it
    (text stays causal) and never on another document; all tokens of one run share one choice,
    which keeps the blocks a query block gathers few. No gradient flows through the choice.
    The backends use the same choice held compactly (`select_blocks_compact`, `Selection`)."""
    return select_blocks_compact(info, q_BHSD, k_BKSD, num_selected, scores_BKQn).dense()


def selected_block_slots(info: MaskInfo, sel: Selection, num_slots: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-block slots for a B layer: the union of its tokens' choices per query block,
    (kv_idx [B, K, Q, N], valid [B, K, Q, N]), in ascending block order. N is `num_slots` (the
    host-known bound of BatchLayout, checked by a device assert) or read from the data."""
    any_BKQn = sel.block_union()
    nb = any_BKQn.shape[-1]
    counts = any_BKQn.sum(-1)
    if num_slots is None:
        n = int(counts.max())
    else:
        n = min(num_slots, nb)
        torch._assert_async((counts <= n).all(), "B-layer block choice exceeds the BatchLayout bound (internal error)")
    # stable sort puts the selected blocks first, in ascending order
    order = torch.argsort((~any_BKQn).to(torch.int8), dim=-1, stable=True)[..., :n]
    valid = torch.arange(n, device=any_BKQn.device) < counts.unsqueeze(-1)
    return order, valid
