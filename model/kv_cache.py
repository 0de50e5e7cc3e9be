"""Incremental decoding with a KV cache that keeps each layer kind's attention rule (masks.py).

Legend: B batch (1 for generation), S new tokens, T cached keys, H query heads, K kv heads,
G = H / K, D head dim, nc completed key blocks, V vocab.

The decoder reuses the model's own code: every layer runs its unchanged `Block.forward`
(projections, QK-norm, M-RoPE, MoE) with an attention *context* in place of `AttnContext`:

- prefill: the model's own backend over the whole prompt (`AttnContext.attend`), recording each
  layer's keys and values (and, for B layers, what the next token's block selection needs);
- step: one new token attends to the cache.

What each layer kind keeps (the rule for query i and key j of one document, masks.py):

- `L` (window): `i - j < window`, so the cache keeps only the last `window` keys (the new one
  included); older keys are dropped and memory stays flat however long the generation runs.
- `G` (global): every key of the document.
- `B` (block top-k): every key, because any earlier block may be selected later, but a step
  *reads* only the blocks training would give it: its own block, the document's first block, and
  the best `num_selected_blocks - 1` other completed blocks. The choice is made once per block,
  when its first token arrives, exactly as `masks.select_blocks` makes it for a causal text query:
  - pooled selector: the block's first query (summed over the group) against each block's mean
    key, computed once when a block completes and kept;
  - indexer selector: the layer's index queries of the block's first token against the index
    keys of every earlier token, max-pooled per block (the cache keeps the index keys, width
    `indexer_dim` per kv head, next to the keys and values).
  So cached decoding computes the same attention as the full forward.
  With `offload_b=True` a B layer's keys and values live in host memory and only the blocks a
  query block chose are copied to the model's device (once per query block); the device keeps
  the index keys / block means and that working set.

Generated tokens are text (causal); visual blocks come only from the prompt (with a vision
encoder, `prefill` encodes them once; a step embeds its token alone and never runs the encoder). One document per
row: the prompt starts at position 0 and attention never needs a document mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import AttnContext
from .indexer import indexer_block_scores
from .masks import build_mask_info, top_blocks


@dataclass
class LayerCache:
    """Keys/values of one layer plus their absolute token indices. `keep`: how many of the most
    recent keys survive (None: all). Unbounded caches grow by doubling a preallocated buffer, so
    a step copies one key, not the whole cache."""

    kind: str
    keep: int | None
    n: int = 0  # keys held
    _k: torch.Tensor | None = None  # [B, K, capacity, D]
    _v: torch.Tensor | None = None
    _idx: torch.Tensor | None = None  # [capacity] int64 absolute index of every cached key
    # B layers only: mean key of every completed block [B, K, nc, D] fp32 (pooled selector) or
    # the index key of every token [B, K, T, d] (indexer selector), and the blocks the current
    # query block reads [B, K, n] (chosen when its first token arrived)
    kmean_BKnD: torch.Tensor | None = None
    blocks_BKn: torch.Tensor | None = None
    _ik: torch.Tensor | None = None  # [B, K, capacity, d] index keys, in the model's dtype
    n_ik: int = 0
    # B layers: the working set of the current query block, its chosen blocks' keys/values on
    # the model's device [B, K, n * bs, D] (gathered once per block; from host memory with
    # CachedDecoder(offload_b=True)), their token indices [B, K, n * bs], and which slot holds
    # the query's own block (filled in token by token)
    ws_k: torch.Tensor | None = None
    ws_v: torch.Tensor | None = None
    ws_tok: torch.Tensor | None = None
    own_slot: int = 0

    @property
    def num_keys(self) -> int:
        return self.n

    @property
    def k_BKTD(self) -> torch.Tensor:
        return self._k[:, :, : self.n]

    @property
    def v_BKTD(self) -> torch.Tensor:
        return self._v[:, :, : self.n]

    @property
    def idx_T(self) -> torch.Tensor:
        return self._idx[: self.n]

    @property
    def ik_BKTd(self) -> torch.Tensor | None:
        """Index keys of every token so far (indexer selector), None otherwise."""
        return None if self._ik is None else self._ik[:, :, : self.n_ik]

    def append_index(self, ik_BKSd: torch.Tensor) -> None:
        """Append index keys, growing by doubling like the keys (a step copies one, not all).
        Kept in the layer's dtype: training scores bf16 index keys in fp32 the same way."""
        self._ik = _grow(self._ik, self.n_ik, ik_BKSd.shape[2], ik_BKSd)
        self._ik[:, :, self.n_ik: self.n_ik + ik_BKSd.shape[2]] = ik_BKSd
        self.n_ik += ik_BKSd.shape[2]

    def append(self, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, idx_S: torch.Tensor) -> None:
        S = k_BKSD.shape[2]
        if self.keep is not None:
            # window layers: keep the last `keep` keys; a copy of at most `keep` keys per step
            k = k_BKSD if self._k is None else torch.cat([self.k_BKTD, k_BKSD], dim=2)
            v = v_BKSD if self._v is None else torch.cat([self.v_BKTD, v_BKSD], dim=2)
            idx = idx_S if self._idx is None else torch.cat([self.idx_T, idx_S])
            self._k, self._v, self._idx = (k[:, :, -self.keep:].contiguous(), v[:, :, -self.keep:].contiguous(),
                                           idx[-self.keep:].contiguous())
            self.n = self._k.shape[2]
            return
        need = self.n + S
        if self._k is None or need > self._k.shape[2]:
            self._k = _grow(self._k, self.n, S, k_BKSD)
            self._v = _grow(self._v, self.n, S, v_BKSD)
            idx = idx_S.new_empty(self._k.shape[2])
            if self.n:
                idx[: self.n] = self.idx_T
            self._idx = idx
        self._k[:, :, self.n:need] = k_BKSD
        self._v[:, :, self.n:need] = v_BKSD
        self._idx[self.n:need] = idx_S
        self.n = need

    def store_bytes(self) -> int:
        """Bytes of the keys/values held (not the spare capacity)."""
        return 0 if self._k is None else 2 * self.k_BKTD.numel() * self._k.element_size()

    def nbytes(self) -> int:
        """store_bytes() plus the block means, index keys and working set."""
        extras = (self.kmean_BKnD, self.ik_BKTd, self.ws_k, self.ws_v)
        return self.store_bytes() + sum(t.numel() * t.element_size() for t in extras if t is not None)


def _grow(buf: torch.Tensor | None, n: int, extra: int, like_BKSx: torch.Tensor) -> torch.Tensor:
    """`buf` [B, K, capacity, x] with room for `extra` more after its first `n`: the same buffer
    when it fits, else one of at least twice the capacity holding the first `n`."""
    if buf is not None and n + extra <= buf.shape[2]:
        return buf
    cap = max(n + extra, 2 * (0 if buf is None else buf.shape[2]), 64)
    B, K, _, x = like_BKSx.shape
    new = like_BKSx.new_empty(B, K, cap, x)
    if n:
        new[:, :, :n] = buf[:, :, :n]
    return new


class _PrefillContext(AttnContext):
    """The model's own attention over the prompt, recording each layer's keys and values."""

    def __init__(self, decoder: "CachedDecoder", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decoder = decoder
        self.layer = -1

    def attend_stats(self, q_BHSD, k_BKSD, v_BKSD, kind, index=None, layer_key=None):
        out, stats = super().attend_stats(q_BHSD, k_BKSD, v_BKSD, kind, index=index)
        self.decoder._record_prefill(self.layer, q_BHSD, k_BKSD, v_BKSD, index)
        return out, stats


class _StepContext:
    """Stands in for AttnContext during a decode step: the new token attends to the cache."""

    def __init__(self, decoder: "CachedDecoder", index: int, index_rope=None):
        self.decoder, self.index, self.layer = decoder, index, -1
        self.block_size = decoder.block_size
        self.index_rope = index_rope

    def attend_stats(self, q_BHSD, k_BKSD, v_BKSD, kind, index=None, layer_key=None):
        return self.decoder._attend_step(self.layer, self.index, q_BHSD, k_BKSD, v_BKSD, index), None


class CachedDecoder:
    """KV-cached incremental decoding for an `OmniModel` (one document per batch row).

        dec = CachedDecoder(model)
        logits_BV = dec.prefill(input_ids, positions, modality, block_ids, patches, patch_kind)
        logits_BV = dec.step(next_ids_B, modality_code)      # one token, position = last + 1

    Prompt tensors are PackedBatch fields of a single document without padding (doc_ids all 0).
    Logits come from the fp32 head, like `OmniModel.forward(return_logits=True)`."""

    def __init__(self, model, offload_b: bool = False):
        self.model = model
        # B layers' keys and values in host memory, the chosen blocks copied to the model's
        # device once per query block: the device then holds only index keys / block means and
        # (num_selected + 1) blocks per B layer (docs/sparse-attention.md, "Generation")
        self.offload_b = offload_b
        self.host = torch.device("cpu")
        cfg = model.cfg
        self.cfg = cfg
        att = cfg.attention
        self.window, self.block_size, self.num_selected = att.window, att.block_size, att.num_selected_blocks
        self.kinds = [layer.attn.kind for layer in model.layers]
        self.caches: list[LayerCache] = []
        self.length = 0  # tokens in the sequence so far
        self.next_position = 0  # (t = h = w) position of the next text token

    # ---- public API ----------------------------------------------------------------------------
    def reset(self) -> None:
        self.caches = [LayerCache(kind, self.window if kind == "L" else None) for kind in self.kinds]
        self.length, self.next_position = 0, 0

    @torch.no_grad()
    def prefill(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        modality: torch.Tensor,
        block_ids: torch.Tensor,
        patches: torch.Tensor,
        patch_kind: torch.Tensor,
    ) -> torch.Tensor:
        """Run the prompt (B, S) through the model with its configured attention backend, fill the
        cache, and return the logits [B, V] (fp32) for the token after the prompt."""
        model, cfg = self.model, self.cfg
        B, S = input_ids.shape
        if S < 1:
            raise ValueError("the prompt is empty: it needs at least the bos token")
        if int(block_ids[:, -1].max()) >= 0:
            raise ValueError("the prompt ends inside a visual block; end it with the block's close tag")
        if B > 1 and not bool((positions[:, :, -1] == positions[:1, :1, -1]).all()):
            raise ValueError("batched prompts must share one layout (same length and last position); decode them one by one")
        self._check_offload()
        self.reset()
        doc_ids = torch.zeros_like(input_ids, dtype=torch.int32)
        # with a vision encoder the prompt's visual blocks are encoded here, once: steps add text only
        x_BSD = model.embed_inputs(input_ids, patches, patch_kind, positions, doc_ids, block_ids)
        cos_BSd, sin_BSd = model.rope(positions)
        info = build_mask_info(doc_ids, block_ids, block_size=self.block_size, window=self.window)
        ctx = _PrefillContext(self, info, cfg.attention.backend, self.num_selected, x_BSD.device,
                              dense_b=model.dense_b_layers)
        ctx.index_rope = model.index_rope(positions)
        for i, layer in enumerate(model.layers):
            ctx.layer = i
            x_BSD, _, _ = layer(x_BSD, cos_BSd, sin_BSd, ctx, modality)
        self.length = S
        # the last prompt token is text or a close tag, where t == h == w
        self.next_position = int(positions[0, 0, -1]) + 1
        return self._logits(x_BSD[:, -1:])

    @torch.no_grad()
    def step(self, token_ids_B: torch.Tensor, modality_code: int | torch.Tensor = 0) -> torch.Tensor:
        """Append one token per row (text or special, never a patch) and return the logits [B, V]
        of the token after it. `modality_code`: 0 text, 1 code, 4 special (routes the MoE), one
        for every row or a [B] tensor of one per row."""
        if not self.caches or self.length == 0:
            raise ValueError("call prefill() with the prompt before step()")
        self._check_offload()
        model, cfg = self.model, self.cfg
        ids_B1 = token_ids_B.reshape(-1, 1).to(next(model.parameters()).device)
        B = ids_B1.shape[0]
        pos = self.next_position
        positions_B31 = torch.full((B, 3, 1), pos, dtype=torch.int32, device=ids_B1.device)
        if isinstance(modality_code, torch.Tensor):
            modality_B1 = modality_code.reshape(B, 1).to(device=ids_B1.device, dtype=torch.uint8)
        else:
            modality_B1 = torch.full((B, 1), modality_code, dtype=torch.uint8, device=ids_B1.device)
        empty = torch.zeros(0, max(cfg.patch_dim, cfg.tubelet_dim), device=ids_B1.device)
        x_B1D = model.embed(ids_B1, empty, torch.zeros(0, dtype=torch.uint8, device=ids_B1.device))
        cos, sin = model.rope(positions_B31)
        ctx = _StepContext(self, self.length, model.index_rope(positions_B31))
        for i, layer in enumerate(model.layers):
            ctx.layer = i
            x_B1D, _, _ = layer(x_B1D, cos, sin, ctx, modality_B1)
        self.length += 1
        self.next_position += 1
        return self._logits(x_B1D)

    def cache_bytes(self) -> int:
        """Memory held by the cache (keys, values, block means, index keys), wherever it lies."""
        return sum(c.nbytes() for c in self.caches)

    def device_bytes(self) -> int:
        """The part of cache_bytes() kept on the model's device: all of it without offload_b;
        with it, the B layers' index keys or block means and their working sets only (their keys
        and values stay in host memory; on a CPU-only machine both tiers are the same memory and
        this counts the device tier)."""
        return sum(c.nbytes() - c.store_bytes() if self._offloaded(c) else c.nbytes() for c in self.caches)

    def _check_offload(self) -> None:
        if self.offload_b and self.model.dense_b_layers:
            raise ValueError("offload_b keeps B layers' keys in host memory and reads only their chosen blocks, but the "
                             "model's B layers attend densely (dense warm-up): decode without offload_b")

    def _offloaded(self, cache: LayerCache) -> bool:
        return self.offload_b and cache.kind == "B"

    # ---- internals -----------------------------------------------------------------------------
    def _logits(self, x_B1D: torch.Tensor) -> torch.Tensor:
        model = self.model
        h = model.ops.rms_norm(x_B1D, model.norm, self.cfg.norm_eps)
        return (h[:, -1].float() @ model.head.weight.float().t())

    def _record_prefill(self, layer: int, q_BHSD, k_BKSD, v_BKSD, index) -> None:
        cache = self.caches[layer]
        S = k_BKSD.shape[2]
        store = self.host if self._offloaded(cache) else k_BKSD.device
        cache.append(k_BKSD.to(store), v_BKSD.to(store), torch.arange(S, device=store))
        if cache.kind != "B":
            return
        bs = self.block_size
        n_done = S // bs
        B, K, _, D = k_BKSD.shape
        if index is None:
            cache.kmean_BKnD = k_BKSD[:, :, : n_done * bs].float().reshape(B, K, n_done, bs, D).mean(3)
        else:
            cache.append_index(index[1])
        cache.blocks_BKn = None
        if S % bs:  # the next token falls in a started block: choose that block's reads now
            rep = n_done * bs
            rep_q = index[0][:, :, :, n_done] if index is not None else _group_sum(q_BHSD[:, :, rep], K)
            cache.blocks_BKn = self._choose_blocks(cache, n_done, rep_q)
            self._load_working_set(cache, k_BKSD.device)

    def _load_working_set(self, cache: LayerCache, dev: torch.device) -> None:
        """Gather the chosen blocks' keys and values into one [B, K, n * bs, D] working set on
        `dev`, once per query block (from host memory with offload_b): the steps of the block
        read it without gathering again. Slots of the own block past the newest token are filled
        as its tokens arrive (and masked until then)."""
        bs = self.block_size
        tok = (cache.blocks_BKn.unsqueeze(-1) * bs + torch.arange(bs, device=cache.blocks_BKn.device)).flatten(2)
        at = tok.to(cache.k_BKTD.device).clamp(max=cache.n - 1).unsqueeze(-1).expand(-1, -1, -1, cache.k_BKTD.shape[-1])
        cache.ws_k = cache.k_BKTD.gather(2, at).to(dev)
        cache.ws_v = cache.v_BKTD.gather(2, at).to(dev)
        cache.ws_tok = tok

    def _attend_step(self, layer: int, i: int, q_BH1D, k_BK1D, v_BK1D, index) -> torch.Tensor:
        cache = self.caches[layer]
        dev = q_BH1D.device
        bs = self.block_size
        offloaded = self._offloaded(cache)
        store = self.host if offloaded else dev
        cache.append(k_BK1D.to(store), v_BK1D.to(store), torch.tensor([i], device=store))
        B, H, _, D = q_BH1D.shape
        K = k_BK1D.shape[1]
        G = H // K
        if cache.kind == "B" and index is not None:
            cache.append_index(index[1])
        if cache.kind == "B" and not self.model.dense_b_layers:
            if i % bs == 0:  # a new query block: choose the blocks it reads, from its first query
                rep_q = index[0][:, :, :, 0] if index is not None else _group_sum(q_BH1D[:, :, 0], K)
                cache.blocks_BKn = self._choose_blocks(cache, i // bs, rep_q)
                self._load_working_set(cache, dev)
            else:  # the own block's next token joins the working set
                at = cache.own_slot * bs + i % bs
                cache.ws_k[:, :, at:at + 1] = k_BK1D
                cache.ws_v[:, :, at:at + 1] = v_BK1D
            # read only the chosen blocks' keys, gathered once per query block
            k, v, allowed_BKT = cache.ws_k, cache.ws_v, cache.ws_tok <= i
        else:
            k, v, idx_T = cache.k_BKTD, cache.v_BKTD, cache.idx_T
            allowed_BKT = (idx_T <= i).view(1, 1, -1).expand(B, K, -1)
            if cache.kind == "L":
                allowed_BKT = allowed_BKT & (i - idx_T < self.window).view(1, 1, -1)
        q = q_BH1D.reshape(B, K, G, D)
        scores_BKGT = torch.einsum("bkgd,bktd->bkgt", q, k) * (1.0 / math.sqrt(D))
        scores_BKGT = scores_BKGT.masked_fill(~allowed_BKT.unsqueeze(2), float("-inf"))
        probs = torch.softmax(scores_BKGT, dim=-1, dtype=torch.float32).to(v.dtype)
        out_BKGD = torch.einsum("bkgt,bktd->bkgd", probs, v)
        if cache.kind == "B" and index is None and (i + 1) % bs == 0:
            # block i // bs is complete: keep its mean key for later selections
            blk = cache.k_BKTD[:, :, -bs:].float().mean(2, keepdim=True).to(dev)
            cache.kmean_BKnD = blk if cache.kmean_BKnD is None else torch.cat([cache.kmean_BKnD, blk], dim=2)
        return out_BKGD.reshape(B, H, 1, D)

    def _choose_blocks(self, cache: LayerCache, qb: int, rep_q) -> torch.Tensor:
        """[B, K, n] key blocks query block `qb` reads (masks.select_blocks' rule for a text query
        of a single document): qb itself, block 0 (the document's first) and the best
        `num_selected - 1` of the completed blocks 1..qb-1. `rep_q`: the block's first query,
        [B, K, D] group sum (pooled) or [B, K, Hi, d] index queries (indexer)."""
        bs = self.block_size
        B, K = rep_q.shape[:2]
        dev = rep_q.device
        forced = [qb] if qb == 0 else [0, qb]
        cache.own_slot = forced.index(qb)
        base = torch.tensor(forced, device=dev).expand(B, K, len(forced))
        n_pick = min(self.num_selected - 1, qb - 1)
        if n_pick <= 0:
            return base
        if cache.ik_BKTd is not None:  # indexer: max over each candidate block's index keys
            scores = indexer_block_scores(rep_q.unsqueeze(3), cache.ik_BKTd[:, :, bs : qb * bs], bs)[:, :, 0]
        else:
            scores = torch.einsum("bkd,bknd->bkn", rep_q, cache.kmean_BKnD[:, :, 1:qb])
        top = top_blocks(scores, n_pick) + 1  # ties to the later block, as in the full forward
        return torch.cat([base, top], dim=-1)


def _group_sum(q_BHD: torch.Tensor, K: int) -> torch.Tensor:
    """Queries summed over each kv head's group in fp32, as select_blocks scores them."""
    B, H, D = q_BHD.shape
    return q_BHD.float().view(B, K, H // K, D).sum(2)
