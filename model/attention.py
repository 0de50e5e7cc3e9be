"""Attention: the layer (QK-norm, GQA, M-RoPE) and four backends behind one mask rule (masks.py).

Legend: B batch, S sequence, Sp padded to the block size bs, H query heads, K kv heads,
G = H / K, D head dim, Q query blocks, N gathered key-block slots per query block.

Backends (chosen once at construction by `check_backend`):
- sdpa: the reference on any device: L and G layers per document on contiguous slices (causal
  `is_causal` attention, or a mask of the document's own length), B layers one dense masked pass.
- blocksparse: L and G layers per document (L in quarter-window query chunks over the keys their
  window reaches), B layers gather for each query block only the key blocks it may see: cost
  grows with the window and the selection, not the sequence. CPU training uses it.
- flex: FlexAttention with a BlockMask built from the same rule (CUDA only).
- flash: flash_attn_varlen_func with a window for L/G layers on text-only batches; B layers and
  batches with visual blocks (bidirectional spans flash cannot express) go through blocksparse.
"""

from __future__ import annotations

import importlib.util
import itertools
import logging

import torch
import torch.nn as nn
import torch.nn.functional as F

from .indexer import BlockIndexer, indexer_block_scores, selector_stats
from .masks import (BatchLayout, MaskInfo, Selection, batch_layout, block_ranges, dense_mask, select_blocks_compact,
                    selected_block_slots, token_mask)
from .span_attention import SpanAttention, SpanPlan

log = logging.getLogger(__name__)
BACKENDS = ("sdpa", "blocksparse", "flex", "flash")
DENSE_FRACTION = 0.5  # blocksparse runs dense when a query block would gather more of the key blocks
# L layers (sdpa / blocksparse): query chunks of window / this (at least a block). A quarter:
# 62 ms against 73 at a half for one layer at 4k tokens, window 512, on CPU; an eighth gave the
# same whole training step (0.4% apart)
L_CHUNK_DIVISOR = 4
G_VISUAL_CHUNK = 256  # G layers over a document with visual blocks (sdpa / blocksparse, CPU): queries per span (432 ms vs 460 at 512, 497 at 1024, 853 as one masked pass: 4k tokens, 10 heads x 64)


def check_backend(name: str) -> None:
    """Raise ValueError when `name` cannot run here, saying what to choose instead."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend '{name}'; choose one of {', '.join(BACKENDS)}")
    if name in ("flex", "flash") and not torch.cuda.is_available():
        raise ValueError(
            f"model.attention.backend={name} needs CUDA (no CPU backward); choose blocksparse (CPU training) or sdpa"
        )
    if name == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise ValueError("model.attention.backend=flash needs flash-attn (pip install flash-attn); choose flex or blocksparse")


def gathered_mask(
    info: MaskInfo, kind: str, kv_idx: torch.Tensor, valid: torch.Tensor, sel: Selection | None = None
) -> torch.Tensor:
    """The rule evaluated on the gathered keys: [B, 1 or K, Q, bs, N * bs] bool.

    kv_idx/valid: [B, 1 or K, Q, N] key-block slots (masks.block_ranges / selected_block_slots)."""
    B, Ki, Q, N = kv_idx.shape
    bs, Sp = info.block_size, info.padded_len
    tok_j = (kv_idx.unsqueeze(-1) * bs + torch.arange(bs, device=kv_idx.device)).view(B, Ki, Q, N * bs)
    flat = tok_j.reshape(B, Ki, -1)
    doc_k = info.doc_BS.unsqueeze(1).expand(B, Ki, Sp).gather(2, flat).view(B, Ki, Q, 1, N * bs)
    vis_k = info.vis_BS.unsqueeze(1).expand(B, Ki, Sp).gather(2, flat).view(B, Ki, Q, 1, N * bs)
    idx_q = torch.arange(Sp, device=kv_idx.device).view(1, 1, Q, bs, 1)
    doc_q = info.doc_BS.view(B, 1, Q, bs, 1)
    vis_q = info.vis_BS.view(B, 1, Q, bs, 1)
    mask = token_mask(doc_q, vis_q, idx_q, doc_k, vis_k, tok_j.unsqueeze(3), kind, info.window)
    mask = mask & valid.repeat_interleave(bs, dim=-1).unsqueeze(3)
    if sel is not None:  # a B layer: each token's own choice among its query block's slots
        mask = mask & sel.at_slots(kv_idx.expand(B, sel.hit_BKQn.shape[1], Q, N)).repeat_interleave(bs, dim=-1)
    return mask


CHUNK_TOKENS_CPU = 4096  # blocksparse query tokens per chunk on CPU (gathered keys stay in cache)


def _gather_index(kv_idx: torch.Tensor, width: int) -> torch.Tensor:
    """kv_idx [B, K, n, N] as a gather index over [B, K, nb, width] key blocks."""
    B, K, n, N = kv_idx.shape
    return kv_idx.reshape(B, K, n * N, 1).expand(B, K, n * N, width)


def _attend_gathered(q, kg, vg, N: int, mask, G: int):
    """sdpa of q [B, H, n * bs, D] over gathered kg/vg [B, K, n * N, bs * D] under
    mask [B, K, n, bs, N * bs]. Every (batch, kv head, query block) is one small attention
    problem over its N blocks: sdpa's fused CPU/GPU kernels run them ~10x faster than einsum +
    softmax here."""
    B, H, T, D = q.shape
    K, n = kg.shape[1], mask.shape[2]
    bs = T // n
    qb = q.reshape(B, K, G, n, bs, D).permute(0, 1, 3, 2, 4, 5).reshape(B * K * n, G, bs, D)
    out = F.scaled_dot_product_attention(qb, kg.view(B * K * n, 1, N * bs, D), vg.view(B * K * n, 1, N * bs, D),
                                         attn_mask=mask.reshape(B * K * n, 1, bs, N * bs), enable_gqa=True)
    return out.view(B, K, n, G, bs, D).permute(0, 1, 3, 2, 4, 5).reshape(B, H, n * bs, D)


def _gathered_core(q, k_blocks, v_blocks, kv_idx, mask, G: int):
    """q [B, H, n * bs, D] over the key blocks kv_idx [B, K, n, N] picks from k_blocks/v_blocks
    [B, K, nb, bs * D]."""
    idx = _gather_index(kv_idx, k_blocks.shape[-1])
    return _attend_gathered(q, k_blocks.gather(2, idx), v_blocks.gather(2, idx), kv_idx.shape[3], mask, G)


class _ChunkedGatheredAttention(torch.autograd.Function):
    """gathered attention in chunks of query blocks, each chunk's gather and sdpa kept in cache.

    Autograd over the unchunked op would materialize all N-fold gathered keys at once (9x the
    keys at N = 9), and chunking it under plain autograd pays a full-size zero-filled key
    gradient per chunk (the backward of each gather). Here every chunk's small graph starts at
    detached gathered leaves; the backward runs the chunks one by one and scatter-adds their key
    gradients into one buffer. Same saved tensors as the unchunked op, no recomputation: 1.4x
    faster at 32k tokens on CPU and 1.9-2.05x per doubling from 4k to 32k (BENCHMARKS.md)."""

    @staticmethod
    def forward(ctx, q, k_blocks, v_blocks, kv_idx, mask, G: int, chunk: int):
        Q = kv_idx.shape[2]
        bs = q.shape[2] // Q
        kd, vd = k_blocks.detach(), v_blocks.detach()
        ctx.parts, outs = [], []
        for c0 in range(0, Q, chunk):
            c1 = min(Q, c0 + chunk)
            idx = _gather_index(kv_idx[:, :, c0:c1], kd.shape[-1])
            with torch.enable_grad():
                qc = q[:, :, c0 * bs:c1 * bs].detach().requires_grad_()
                kg = kd.gather(2, idx).requires_grad_()
                vg = vd.gather(2, idx).requires_grad_()
                out = _attend_gathered(qc, kg, vg, kv_idx.shape[3], mask[:, :, c0:c1], G)
            ctx.parts.append((c0, c1, qc, kg, vg, out))
            outs.append(out.detach())
        ctx.save_for_backward(kv_idx)
        ctx.shapes = (q.shape, q.dtype, k_blocks.shape, k_blocks.dtype, bs)
        return torch.cat(outs, 2)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (kv_idx,) = ctx.saved_tensors
        q_shape, q_dtype, kb_shape, kb_dtype, bs = ctx.shapes  # (under autocast grad's dtype differs)
        dq = grad.new_empty(q_shape, dtype=q_dtype)
        dk = grad.new_zeros(kb_shape, dtype=kb_dtype)
        dv = grad.new_zeros(kb_shape, dtype=kb_dtype)
        for c0, c1, qc, kg, vg, out in ctx.parts:
            gq, gk, gv = torch.autograd.grad(out, (qc, kg, vg), grad[:, :, c0 * bs:c1 * bs])
            dq[:, :, c0 * bs:c1 * bs] = gq
            idx = _gather_index(kv_idx[:, :, c0:c1], kb_shape[-1])
            dk.scatter_add_(2, idx, gk)
            dv.scatter_add_(2, idx, gv)
        ctx.parts = None
        return dq, dk, dv, None, None, None, None


def gathered_attention(
    q_BHSD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    block_size: int,
    kv_idx: torch.Tensor,
    mask: torch.Tensor,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Blocksparse core: attention of each query block over its gathered key blocks only.

    kv_idx [B, 1 or K, Q, N] key-block slots, mask [B, 1 or K, Q, bs, N * bs] (gathered_mask).
    Returns [B, H, S, D]. Memory and time scale with Q * N * bs^2, not S^2. `chunk_tokens`:
    query tokens per chunk (default CHUNK_TOKENS_CPU on CPU; on CUDA one chunk, unmeasured
    otherwise)."""
    B, H, S, D = q_BHSD.shape
    K = k_BKSD.shape[1]
    G, bs = H // K, block_size
    Q, N = kv_idx.shape[2], kv_idx.shape[3]
    pad = Q * bs - S
    q = F.pad(q_BHSD, (0, 0, 0, pad))
    k = F.pad(k_BKSD, (0, 0, 0, pad)).reshape(B, K, Q, bs * D)
    v = F.pad(v_BKSD, (0, 0, 0, pad)).reshape(B, K, Q, bs * D)
    kv_idx = kv_idx.expand(B, K, Q, N)
    mask = mask.expand(B, K, Q, bs, N * bs)
    if chunk_tokens is None:
        chunk_tokens = CHUNK_TOKENS_CPU if q.device.type == "cpu" else Q * bs
    chunk = max(1, chunk_tokens // bs)
    if chunk >= Q or torch.compiler.is_compiling():
        out = _gathered_core(q, k, v, kv_idx, mask, G)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _ChunkedGatheredAttention.apply(q, k, v, kv_idx, mask, G, chunk)
    else:
        out = torch.cat([_gathered_core(q[:, :, c0 * bs:(c0 + chunk) * bs], k, v, kv_idx[:, :, c0:c0 + chunk],
                                        mask[:, :, c0:c0 + chunk], G) for c0 in range(0, Q, chunk)], 2)
    return out[:, :, :S]


def flex_slot_bucket(slots: int, num_blocks: int) -> int:
    """The key-block slot count a flex B layer's BlockMask is built with: `slots` rounded up to a
    power of two, at most `num_blocks` (few distinct shapes, so few flex recompiles)."""
    return min(num_blocks, 1 << max(0, int(slots) - 1).bit_length())


_FLEX_PARTIAL_KV_INDICES = None


def flex_partial_kv_indices() -> bool:
    """Whether this torch's `BlockMask.from_kv_blocks` takes key-block indices with fewer slots
    than there are key blocks. Older torch (2.11, the H200 image's, among them) derives the
    query-side blocks the backward walks by scattering into a [Q, slots + 1] buffer indexed by block
    id, so any id at or past the slot count writes out of bounds (an IndexError on CPU, a device
    assert or a silently wrong mask on CUDA); torch that passes the column count to
    `_ordered_to_dense` does not. Unknown internals count as "no": full width is right on every
    version."""
    global _FLEX_PARTIAL_KV_INDICES
    if _FLEX_PARTIAL_KV_INDICES is None:
        import inspect

        try:
            from torch.nn.attention import flex_attention as fa

            _FLEX_PARTIAL_KV_INDICES = "num_cols" in inspect.signature(fa._ordered_to_dense).parameters
        except (ImportError, AttributeError, TypeError, ValueError):
            _FLEX_PARTIAL_KV_INDICES = False
    return _FLEX_PARTIAL_KV_INDICES


_FLEX_COMPILED = None
FLEX_RECOMPILE_LIMIT = 64  # (layer kind x shape) variants one process may compile


def _flex_attention():
    """flex_attention compiled once per process. Compiled it is the fused kernel; eager it
    materializes the whole score matrix (a 32 GiB allocation at 16k tokens), so hitting dynamo's
    recompile limit must be an error, never the silent eager fallback torch uses by default."""
    global _FLEX_COMPILED
    if _FLEX_COMPILED is None:
        import torch._dynamo
        from torch.nn.attention.flex_attention import flex_attention

        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):  # the name changed across torch versions
            if hasattr(cfg, name):
                setattr(cfg, name, max(getattr(cfg, name), FLEX_RECOMPILE_LIMIT))
        if hasattr(cfg, "fail_on_recompile_limit_hit"):
            cfg.fail_on_recompile_limit_hit = True
        else:  # older torch: no switch to raise; say so once rather than pretend
            log.warning("this torch cannot make a flex_attention recompile-limit hit an error; watch for dynamo warnings")
        _FLEX_COMPILED = torch.compile(flex_attention, dynamic=False, fullgraph=True)
    return _FLEX_COMPILED


class AttnContext:
    """The mask description of one forward, shared by every layer of the same kind: segment
    masks, gathered-block slots or flex BlockMasks are built on first use and reused. B layers
    build their selection per layer (it depends on that layer's queries and keys).

    `layout` (masks.BatchLayout, computed on the host from the CPU batch) sizes the sdpa,
    blocksparse and flash paths with no device read; without it, it is derived from the mask
    info on first use (a device sync on GPU: the trainer and eval always pass it).

    B layers: `dense_b` makes them attend as G (the dense warm-up). Their selector statistics
    (model/indexer.py: the indexer's KL loss when an index branch is passed, the coverage of the
    dense attention) are computed on `sample_blocks` query blocks, over their real tokens
    (`real_BS`: not the row's padding), when the indexer trains (grad enabled) or when `measure`
    is set, and returned by `attend_stats` to the calling layer, which returns them through its
    block's outputs: a layer writes nothing into this shared context
    (inside a checkpointed, compiled block such a store is a side effect dynamo refuses)."""

    def __init__(self, info: MaskInfo, backend: str, num_selected_blocks: int, device: torch.device, layout: BatchLayout | None = None,
                 *, dense_b: bool = False, measure: bool = False, sample_blocks: int = 16, real_BS: torch.Tensor | None = None):
        if backend in ("flex", "flash") and device.type != "cuda":
            raise ValueError(f"attention backend '{backend}' runs on CUDA only; move the model to a GPU or choose blocksparse")
        self.info, self.backend, self.num_selected = info, backend, num_selected_blocks
        self.dense_b, self.measure, self.sample_blocks = dense_b, measure, sample_blocks
        self.real_BS = real_BS  # [B, S] bool, False at padding: the selector statistics leave it out
        self.block_size = info.block_size
        self.index_rope: tuple[torch.Tensor, torch.Tensor] | None = None  # index RoPE angles (indexer_rope_dim > 0)
        # layer_key -> selector_stats' "target" (small), for eager activation checkpointing only
        self._kl_targets: dict[object, tuple] = {}
        self.cache: dict[str, object] = {}
        if layout is not None and layout.seq_len != info.seq_len:
            raise ValueError(f"BatchLayout is for seq_len {layout.seq_len}, the batch has {info.seq_len}")
        self._layout = layout

    @property
    def layout(self) -> BatchLayout:
        if self._layout is None:
            S = self.info.seq_len
            self._layout = batch_layout(
                self.info.doc_BS[:, :S], self.info.vis_BS[:, :S], block_size=self.info.block_size,
                window=self.info.window, num_selected=self.num_selected,
            )
        return self._layout

    def _cached(self, key: str, build):
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    def select(self, q_BHSD, k_BKSD, index=None) -> Selection:
        """A B layer's block choice (masks.Selection; `.dense()` is [B, K, Sp, nb]): by the
        indexer's scores when `index` (its block-start queries and keys, model/indexer.py) is
        given, else pooled."""
        scores = None
        if index is not None:
            with torch.no_grad():
                scores = indexer_block_scores(index[0], index[1], self.info.block_size, causal=True)
        return select_blocks_compact(self.info, q_BHSD, k_BKSD, self.num_selected, scores)

    def attend(self, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, kind: str,
               index: tuple[torch.Tensor, torch.Tensor] | None = None, layer_key=None) -> torch.Tensor:
        """Attention output [B, H, S, D] for one layer of `kind` (L, G or B); `attend_stats`
        also returns a B layer's selector statistics."""
        return self.attend_stats(q_BHSD, k_BKSD, v_BKSD, kind, index, layer_key)[0]

    def attend_stats(self, q_BHSD: torch.Tensor, k_BKSD: torch.Tensor, v_BKSD: torch.Tensor, kind: str,
                     index: tuple[torch.Tensor, torch.Tensor] | None = None,
                     layer_key=None) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """(attention output [B, H, S, D], selector statistics or None) for one layer of `kind`.
        The statistics (a B layer's, when the indexer trains or `measure` is set) are
        model/indexer.py's `selector_stats` without its cached target: `coverage`, and `kl` when
        `index` is given. `index`: a B layer's indexer queries and keys (BlockIndexer.forward),
        None for the pooled selector. `layer_key`: the calling layer's identity; under eager
        activation checkpointing, the recomputation of a B layer in backward reuses the KL target
        its forward computed (see selector_stats)."""
        info = self.info
        sel = stats = None
        if kind == "B":
            train_index = index is not None and torch.is_grad_enabled()
            if not self.dense_b or train_index or self.measure:
                sel = self.select(q_BHSD, k_BKSD, index)
            if train_index or self.measure:
                # activation checkpointing re-runs the layer inside backward: only the KL's graph
                # is needed again, on the same target. The cache is eager only: a compiled block
                # neither reads it (the check would be baked into its graph) nor writes it (a side
                # effect); it recomputes the target, which is deterministic
                eager = layer_key is not None and not torch.compiler.is_compiling()
                recompute = eager and torch._C._current_graph_task_id() != -1
                st = selector_stats(info, q_BHSD, k_BKSD, sel, self.sample_blocks, index,
                                    cached=self._kl_targets.get(layer_key) if recompute else None, real_BS=self.real_BS)
                target = st.pop("target", None)
                if eager and not recompute and target is not None:
                    self._kl_targets[layer_key] = target
                stats = st
            if self.dense_b:  # warm-up: attend as G; the indexer learns all the same
                kind, sel = "G", None
        return self._attend(q_BHSD, k_BKSD, v_BKSD, kind, sel), stats

    def _attend(self, q_BHSD, k_BKSD, v_BKSD, kind: str, sel: Selection | None) -> torch.Tensor:
        """The attention of one layer of `kind`, with a B layer's selection `sel`."""
        info = self.info
        backend = self._backend_for(kind)
        if backend == "sdpa":
            if sel is None:
                return self._segments(q_BHSD, k_BKSD, v_BKSD, kind)
            return self._sdpa(q_BHSD, k_BKSD, v_BKSD, dense_mask(info, kind, sel.dense()))
        if backend == "blocksparse":
            if sel is not None:
                kv_idx, valid = selected_block_slots(info, sel, self.layout.slots["B"])
                mask = gathered_mask(info, kind, kv_idx, valid, sel)
            else:
                if self._per_document(kind):
                    return self._segments(q_BHSD, k_BKSD, v_BKSD, kind)
                kv_idx, mask = self._shared(kind)
            return gathered_attention(q_BHSD, k_BKSD, v_BKSD, info.block_size, kv_idx, mask)
        if backend == "flex":
            return self._flex(q_BHSD, k_BKSD, v_BKSD, kind, sel)
        return self._flash(q_BHSD, k_BKSD, v_BKSD, kind)

    def _backend_for(self, kind: str) -> str:
        if self.backend == "flash" and (kind == "B" or any(seg[2] for row in self.layout.segments for seg in row)):
            log.debug("flash cannot express B layers or bidirectional visual blocks: this layer uses blocksparse")
            return "blocksparse"
        return self.backend

    def _shared(self, kind: str):
        """What every L or G layer (kind, selection None) of this forward shares, built on first
        use and cached: the document spans (sdpa; blocksparse L layers and G layers over long
        documents), the gathered (kv_idx, mask) (blocksparse G over short documents), the flex
        BlockMask, or flash's cumulative lengths."""
        backend = self._backend_for(kind)
        if backend == "sdpa" or (backend == "blocksparse" and self._per_document(kind)):
            if self.info.doc_BS.device.type == "cpu" and not torch.compiler.is_compiling():
                self._span_plan(kind)  # what SpanAttention runs by (CPU, eager)
            return self._spans(kind)
        if backend == "blocksparse":
            return self._cached(f"gathered{kind}", lambda: self._gathered(kind))
        if backend == "flex":
            return self._flex_block_mask(kind)
        return self._flash_cu()

    def _per_document(self, kind: str) -> bool:
        """blocksparse L layers, and G layers over long documents, run per document (and window
        chunk) on contiguous slices: the same rule without copying keys into gathered blocks
        (2.5-3x faster than gathering for L layers at 4k tokens on CPU)."""
        return kind == "L" or self.layout.slots[kind] > DENSE_FRACTION * self.info.num_blocks

    def prepare(self, kinds) -> None:
        """Build, before the layers run, what the L and G layers of this forward share (see
        _shared; B layers in their dense warm-up attend as G). Otherwise the first layer of a
        kind builds it and stores it here: under activation checkpointing with torch.compile that
        store is a side effect inside a checkpointed region, which dynamo refuses, and the block
        then runs uncompiled, in pieces. (B layers append their statistics here too: they still
        break there; see BENCHMARKS.md.)"""
        kinds = set(kinds)
        if "B" in kinds and self.dense_b:
            kinds.add("G")
        for kind in sorted(kinds & {"L", "G"}):
            self._shared(kind)

    def _gathered(self, kind):
        kv_idx, valid = block_ranges(self.info, kind, self.layout.slots[kind])
        return kv_idx, gathered_mask(self.info, kind, kv_idx, valid)

    def _segments(self, q, k, v, kind):
        """L and G layers one document at a time, on contiguous slices of q/k/v (no [S, S] mask,
        no K/V copies, GQA inside the kernel):
        - a text document under a G layer, or no longer than the window under an L layer, is
          plain causal attention (`is_causal`: the fused flash path on CPU and GPU);
        - a longer document under an L layer runs in query chunks, each against only the keys
          its window reaches (cost ~ S x 1.25 window, not S^2 / 2);
        - a document with visual blocks under a G layer gets a mask of its own length.
        On CPU (eager) the spans run through `span_attention.SpanAttention`; elsewhere one sdpa call each."""
        spans = self._spans(kind)
        if q.device.type == "cpu" and not torch.compiler.is_compiling() and q.dtype == k.dtype == v.dtype:
            return SpanAttention.apply(q, k, v, spans, self._span_plan(kind))
        rows = []
        for b, row_spans in itertools.groupby(spans, key=lambda span: span[0]):  # spans come in row order
            parts = []
            for _, c0, c1, k0, k1, mask in row_spans:
                qs, ks, vs = q[b : b + 1, :, c0:c1], k[b : b + 1, :, k0:k1], v[b : b + 1, :, k0:k1]
                if mask is None:
                    parts.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True))
                else:
                    parts.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True))
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)

    def _span_plan(self, kind: str) -> SpanPlan:
        """The spans of an L or G layer grouped for the CPU kernel (span_attention.SpanPlan)."""
        return self._cached(f"span_plan{kind}", lambda: SpanPlan(self._spans(kind), self.info.seq_len, self.info.doc_BS.device))

    def _spans(self, kind: str) -> tuple:
        """The attention of an L or G layer as disjoint query spans over the whole batch, in order:
        (row, q0, q1, k0, k1, mask) with the keys [k0, k1) a span's queries [q0, q1) may see and
        its bool mask [q1 - q0, k1 - k0], or None for plain causal attention (k0 = q0, k1 = q1).
        Built once per forward and layer kind."""
        return self._cached(f"spans{kind}", lambda: tuple(
            span for b, segs in enumerate(self.layout.segments) for s0, e0, has_vis in segs
            for span in self._doc_spans(b, s0, e0, has_vis, kind)))

    def _doc_spans(self, b: int, s0: int, e0: int, has_vis: bool, kind: str):
        n, W = e0 - s0, self.info.window
        if not has_vis and (kind == "G" or n <= W):
            return [(b, s0, e0, s0, e0, None)]
        runs = self._visual_runs(b, s0, e0) if has_vis else []
        if kind != "L":
            if runs is None:  # visual blocks not in the layout: one mask over the whole document
                return [(b, s0, e0, s0, e0, self._chunk_mask(b, s0, 0, n, 0, n, kind))]
            # a document with visual blocks under a G layer: query chunks, each against the keys
            # up to its own end, or to the end of a visual block it has tokens of (visual blocks
            # look ahead): about the causal half of the n x n work, not all of it
            spans = []
            for c0 in range(0, n, G_VISUAL_CHUNK):
                c1 = min(c0 + G_VISUAL_CHUNK, n)
                k1 = max([c1] + [e for s, e in runs if s < c1 and e > c0])
                spans.append((b, s0 + c0, s0 + c1, s0, s0 + k1, self._chunk_mask(b, s0, c0, c1, 0, k1, kind)))
            return spans
        # a longer document under an L layer: query chunks of a quarter window, each attending
        # keys [chunk start - window + 1, chunk end), and a chunk with visual tokens up to
        # window - 1 past its end inside their visual blocks (they look ahead there). A text
        # chunk's mask depends only on its shape, so the interior text chunks share one.
        C = max(self.info.block_size, W // L_CHUNK_DIVISOR)
        spans = []
        for c0 in range(0, n, C):
            c1 = min(c0 + C, n)
            k0 = max(0, c0 - W + 1)
            if runs is None:  # visual blocks not in the layout: every chunk may look ahead
                ends = [n]
            else:
                ends = [e for s, e in runs if s < c1 and e > c0]
            k1 = min(n, max([c1] + [min(e, c1 + W - 1) for e in ends]))
            if ends:
                mask = self._chunk_mask(b, s0, c0, c1, k0, k1, "L")
            else:
                mask = self._cached(f"band:{c1 - c0}:{k1 - k0}:{c0 - k0}", lambda: self._chunk_mask(b, s0, c0, c1, k0, k1, "L"))
            spans.append((b, s0 + c0, s0 + c1, s0 + k0, s0 + k1, mask))
        return spans

    def _visual_runs(self, b: int, s0: int, e0: int):
        """The visual blocks of row b's document [s0, e0) as document-relative (start, end), or
        None when the layout does not list them."""
        visual = self.layout.visual
        if not visual:
            return None
        return [(s - s0, e - s0) for s, e in visual[b] if s0 <= s < e0]

    def _chunk_mask(self, b: int, s0: int, c0: int, c1: int, k0: int, k1: int, kind: str) -> torch.Tensor:
        """masks.token_mask for queries [c0, c1) and keys [k0, k1) of the document starting at
        s0 (one document: the doc term is always true): [c1 - c0, k1 - k0] bool."""
        vis, doc = self.info.vis_BS[b], self.info.doc_BS[b]
        qi = torch.arange(c0, c1, device=vis.device)
        kj = torch.arange(k0, k1, device=vis.device)
        return token_mask(doc[s0 + c0 : s0 + c1, None], vis[s0 + c0 : s0 + c1, None], qi[:, None],
                          doc[None, s0 + k0 : s0 + k1], vis[None, s0 + k0 : s0 + k1], kj[None, :], kind, self.info.window)

    @staticmethod
    def _sdpa(q, k, v, mask_BKSS):
        """Dense masked attention (B layers under the sdpa reference backend): GQA in the kernel."""
        if mask_BKSS.shape[1] > 1:
            mask_BKSS = mask_BKSS.repeat_interleave(q.shape[1] // mask_BKSS.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask_BKSS, enable_gqa=True)

    def _flex_mask_mod(self, kind: str, sel, G: int):
        info = self.info
        bs, window = info.block_size, info.window
        doc, vis = info.doc_BS, info.vis_BS

        def mask_mod(b, h, q_idx, kv_idx):
            vq = vis[b, q_idx]
            m = (doc[b, q_idx] == doc[b, kv_idx]) & ((kv_idx <= q_idx) | ((vq >= 0) & (vq == vis[b, kv_idx])))
            if kind == "L":
                m = m & (q_idx - kv_idx < window) & (kv_idx - q_idx < window)
            if sel is not None:  # the Selection's rule, evaluated per (query, key) of a selected block
                qb, kb = q_idx // bs, kv_idx // bs
                forced = Selection.forced(kb, qb, info.doc_start_BS[b, q_idx] // bs, info.vis_start_BS[b, q_idx] // bs,
                                          (info.vis_end_BS[b, q_idx] - 1) // bs)
                m = m & (forced | (sel.hit_BKQn[b, h // G, qb, kb] & sel.first_BS[b, q_idx]))
            return m

        return mask_mod

    def _flex_block_mask(self, kind: str):
        """The BlockMask every L or G layer of this forward shares; on CUDA built on the GPU
        without an [S, S] tensor (create_block_mask with _compile=True)."""
        from torch.nn.attention.flex_attention import create_block_mask

        B, S = self.info.doc_BS.shape[0], self.info.seq_len
        dev = self.info.doc_BS.device
        return self._cached(f"flex{kind}", lambda: create_block_mask(
            self._flex_mask_mod(kind, None, 1), B, None, S, S, device=dev, _compile=dev.type == "cuda"))

    def _flex(self, q, k, v, kind, sel):
        H = q.shape[1]
        if sel is not None:
            block_mask = self._flex_selected(sel, self._flex_mask_mod(kind, sel, H // k.shape[1]), H)
        else:
            block_mask = self._flex_block_mask(kind)
        if q.device.type != "cuda":  # eager: only the forward, used by the CPU parity test of the mask_mod
            from torch.nn.attention.flex_attention import flex_attention

            return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        return _flex_attention()(q, k, v, block_mask=block_mask, enable_gqa=True)

    def _flex_selected(self, sel, mask_mod, H: int):
        """A B layer's BlockMask straight from its selected key blocks (BlockMask.from_kv_blocks):
        for each query block the union of its tokens' choices (selected_block_slots, sized by the
        host layout), every slot a partial block whose tokens the mask_mod decides. No [S, S]
        tensor and no S x S mask evaluation: the cost is Q x N blocks.

        N is the layout's bound rounded up to a power of two (at most the block count): the
        compiled flex kernel is specialised to the index tensor's shape, and the bound moves
        with each batch's documents and visual blocks (17, 33, 49, ... at long_64k), which would
        recompile it for each new value. The extra slots are past each row's count, which flex
        never reads. Where this torch needs the indices at full width (flex_partial_kv_indices),
        N is the block count: one shape for every batch, the same kernel work (flex walks each
        row's count only), Q x Q int32 indices per head."""
        from torch.nn.attention.flex_attention import BlockMask

        info = self.info
        slots = flex_slot_bucket(self.layout.slots["B"], info.num_blocks) if flex_partial_kv_indices() else info.num_blocks
        kv_idx, valid = selected_block_slots(info, sel, slots)  # [B, K, Q, N]
        G = H // kv_idx.shape[1]
        num = valid.sum(-1).to(torch.int32).repeat_interleave(G, dim=1)
        idx = kv_idx.to(torch.int32).repeat_interleave(G, dim=1).contiguous()
        S = info.seq_len
        return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=info.block_size, mask_mod=mask_mod, seq_lengths=(S, S))

    def _flash_cu(self):
        """flash's cumulative document lengths on the device, and the longest document."""
        def build():
            # document boundaries from the host layout: no nonzero / device read
            lens = [e0 - s0 for segs in self.layout.segments for s0, e0, _ in segs]
            cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
            dev = self.info.doc_BS.device
            return (cu.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else cu), max(lens)

        return self._cached("flash_cu", build)

    def _flash(self, q, k, v, kind):
        from flash_attn import flash_attn_varlen_func

        if q.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError("attention backend 'flash' needs bf16/fp16 activations (train with mixed precision) or choose flex")
        info = self.info
        B, H, S, D = q.shape
        cu, max_len = self._flash_cu()
        window = (info.window - 1, 0) if kind == "L" else (-1, -1)
        flat = lambda t: t.transpose(1, 2).reshape(B * S, t.shape[1], D)  # noqa: E731
        out = flash_attn_varlen_func(flat(q), flat(k), flat(v), cu, cu, max_len, max_len, causal=True, window_size=window)
        return out.view(B, S, H, D).transpose(1, 2)


class Attention(nn.Module):
    """One attention layer: projections without bias, QK-norm (RMSNorm per head), M-RoPE, GQA."""

    def __init__(self, *, dim: int, num_heads: int, num_kv_heads: int, kind: str, qk_norm: bool, norm_eps: float, ops,
                 indexer_heads: int = 0, indexer_dim: int = 0, indexer_rope_dim: int = 0):
        super().__init__()
        self.kind, self.ops, self.eps = kind, ops, norm_eps
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.wq = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(num_heads * self.head_dim, dim, bias=False)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        # B layers with selector=indexer: the learned block selector (reads the input detached)
        self.indexer = None
        if kind == "B" and indexer_heads > 0:
            with torch.random.fork_rng(devices=[]):  # building it leaves the RNG stream of the rest as is
                self.indexer = BlockIndexer(dim=dim, num_kv_heads=num_kv_heads, heads=indexer_heads, dim_idx=indexer_dim,
                                            rope_dim=indexer_rope_dim)

    def forward(self, x_BSD: torch.Tensor, cos_BSd: torch.Tensor, sin_BSd: torch.Tensor,
                ctx: AttnContext) -> tuple[torch.Tensor, dict[str, torch.Tensor] | None]:
        """(output [B, S, D], this layer's selector statistics or None: AttnContext.attend_stats)."""
        B, S, _ = x_BSD.shape
        # q, k and v in one GEMM over the concatenated weights (x read once, one wider matmul)
        qkv = F.linear(x_BSD, torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]))
        q, k, v = qkv.split([self.wq.out_features, self.wk.out_features, self.wv.out_features], dim=-1)
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            # QK-norm bounds attention logits: the main fix for multimodal logit growth (Chameleon);
            # then RoPE, in one pass over q and k with the Triton backend
            q = self.ops.qk_norm_rope(q, self.q_norm, cos_BSd, sin_BSd, self.eps)
            k = self.ops.qk_norm_rope(k, self.k_norm, cos_BSd, sin_BSd, self.eps)
        else:
            q = self.ops.apply_rope(q, cos_BSd, sin_BSd)
            k = self.ops.apply_rope(k, cos_BSd, sin_BSd)
        index = self.indexer(x_BSD.detach(), ctx.block_size, ctx.index_rope) if self.indexer is not None else None
        out_BHSD, stats = ctx.attend_stats(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.kind,
                                           index=index, layer_key=id(self))
        return self.wo(out_BHSD.transpose(1, 2).reshape(B, S, -1)), stats
