"""CPU attention over document spans: the L and G layers of the sdpa and blocksparse backends.

Legend: B batch, S sequence, H query heads, K key/value heads, D head dim. A span is
(row, q0, q1, k0, k1, mask): queries [q0, q1) of one row attend keys [k0, k1) under a bool mask
[q1 - q0, k1 - k0], or, with mask None, plain causal attention (attention.AttnContext._spans builds
them per document and window chunk).
"""

from __future__ import annotations

import torch

# Spans with at most this many queries and keys are batched: padded to a multiple of PAD_TO and
# run as one kernel call per padded shape (SpanPlan). The demo's packed rows hold ~17 documents of
# 29-75 tokens each; one call per document cost ~90 us of overhead for ~5 us of work.
SMALL_QUERIES, SMALL_KEYS, PAD_TO = 128, 256, 16


class SpanPlan:
    """How one forward's spans run (built once per forward and layer kind, shared by its layers):

    - `large`: spans bigger than SMALL_QUERIES x SMALL_KEYS, or alone in their padded shape: one
      kernel call each on contiguous slices (no copy);
    - `buckets`: the small spans grouped by padded shape (queries and keys rounded up to PAD_TO),
      each group gathered into [n, H, Lq, Lk]-shaped problems and run as one call. A padded key is
      masked out (-inf); a padded query row sees every key of its problem (finite softmax) and
      its output is dropped, so its gradient is zero and adds nothing to any key's.

    A bucket is (q_idx [n * Lq], k_idx [n * Lk], allowed [n, 1, Lq, Lk], dst, src): rows of the
    flattened [B * S] token axis to gather (padding repeats a span's first row), the bool mask,
    and the real queries' rows (`dst`) with their places in the bucket (`src`). No dtype: the
    additive masks are made per call (one op per bucket), so one plan serves fp32 and autocast."""

    def __init__(self, spans, seq_len: int, device: torch.device):
        self.spans, self.seq_len = spans, seq_len
        groups: dict[tuple[int, int], list] = {}
        large = []
        for span in spans:
            _, q0, q1, k0, k1, _ = span
            if q1 - q0 <= SMALL_QUERIES and k1 - k0 <= SMALL_KEYS:
                groups.setdefault((_round_up(q1 - q0), _round_up(k1 - k0)), []).append(span)
            else:
                large.append(span)
        self.buckets = []
        for (Lq, Lk), group in groups.items():
            if len(group) == 1:
                large.extend(group)
            else:
                self.buckets.append(_bucket(group, Lq, Lk, seq_len, device))
        self.large = large


class SpanAttention(torch.autograd.Function):
    """CPU: spans (disjoint query ranges, each against one contiguous key range, causal or masked)
    through torch's CPU flash kernel called directly, by `plan` (SpanPlan): the large spans one call
    each, the small ones gathered into one call per padded shape. The output is one buffer in
    [B, S, H, D] memory order (the layer's output projection reads it without a copy); backward
    writes each query's gradient once and adds key and value gradients into one buffer each.
    Per-span sdpa calls under autograd instead give every span a zero-filled full-size gradient
    that autograd then sums (O(spans x S) work), and a cat of the outputs: 11% of an L layer's
    forward + backward at 4k tokens (32 chunks). The kernel needs an additive mask of the
    query's dtype (a bool mask is refused, and a mask of another float dtype is misread): the
    plan's bool masks are converted once per call (one op per bucket)."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, q, k, v, spans, plan: SpanPlan):
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        B, H, S, D = q.shape
        if plan.spans is not spans:
            raise ValueError("SpanAttention: the plan was built for other spans")
        if S != plan.seq_len:
            raise ValueError(f"SpanPlan built for {plan.seq_len} tokens a row, the queries have {S}")
        out_BSHD = q.new_empty(B, S, H, D)
        out = out_BSHD.transpose(1, 2)
        lses = []
        large_masks = _additive_masks(plan.large, q.dtype)
        bucket_masks = [_additive(bucket[2], q.dtype) for bucket in plan.buckets]
        for (b, q0, q1, k0, k1, _), m in zip(plan.large, large_masks):
            o, lse = flash(q[b : b + 1, :, q0:q1], k[b : b + 1, :, k0:k1], v[b : b + 1, :, k0:k1], 0.0, m is None, attn_mask=m)
            out[b : b + 1, :, q0:q1] = o
            lses.append(lse)
        if plan.buckets:
            out_T = out_BSHD.view(B * S, H, D)
            flat = _rows(q), _rows(k), _rows(v)
            for bucket, mask in zip(plan.buckets, bucket_masks):
                qg, kg, vg = _gather(bucket, *flat)
                o, lse = flash(qg, kg, vg, 0.0, False, attn_mask=mask)
                out_T.index_copy_(0, bucket[3], _rows(o).index_select(0, bucket[4]))
                lses.append(lse)
        ctx.save_for_backward(q, k, v, out, *lses)
        ctx.plan, ctx.masks = plan, (large_masks, bucket_masks)
        return out

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad_out):
        flash_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        q, k, v, out, *lses = ctx.saved_tensors
        plan, (large_masks, bucket_masks) = ctx.plan, ctx.masks
        B, H, S, D = q.shape
        K = k.shape[1]
        grad_out = grad_out.to(q.dtype)
        dq_BSHD = q.new_empty(B, S, H, D)
        dk_BSKD, dv_BSKD = k.new_zeros(B, S, K, D), v.new_zeros(B, S, K, D)
        dq, dk, dv = dq_BSHD.transpose(1, 2), dk_BSKD.transpose(1, 2), dv_BSKD.transpose(1, 2)
        for (b, q0, q1, k0, k1, _), m, lse in zip(plan.large, large_masks, lses):
            r, kr = (slice(b, b + 1), slice(None), slice(q0, q1)), (slice(b, b + 1), slice(None), slice(k0, k1))
            gq, gk, gv = flash_bwd(grad_out[r], q[r], k[kr], v[kr], out[r], lse, 0.0, m is None, attn_mask=m)
            dq[r] = gq
            dk[kr] += gk
            dv[kr] += gv
        if plan.buckets:
            flat = _rows(q), _rows(k), _rows(v)
            go_T, out_T = _rows(grad_out), _rows(out)
            dq_T, dk_T, dv_T = dq_BSHD.view(B * S, H, D), dk_BSKD.view(B * S, K, D), dv_BSKD.view(B * S, K, D)
            for bucket, mask, lse in zip(plan.buckets, bucket_masks, lses[len(plan.large):]):
                q_idx, k_idx, _, dst, src = bucket
                qg, kg, vg = _gather(bucket, *flat)
                n, Lq = qg.shape[0], qg.shape[2]
                # padded query rows get a zero output gradient (their output was dropped), and
                # their gathered output (a copy of the span's first query's) then adds nothing
                go = go_T.new_zeros(n * Lq, H, D).index_copy_(0, src, go_T.index_select(0, dst))
                og = out_T.index_select(0, q_idx)
                gq, gk, gv = flash_bwd(_problems(go, n, Lq), qg, kg, vg, _problems(og, n, Lq), lse, 0.0, False, attn_mask=mask)
                dq_T.index_copy_(0, dst, _rows(gq).index_select(0, src))
                dk_T.index_add_(0, k_idx, _rows(gk))
                dv_T.index_add_(0, k_idx, _rows(gv))
        return dq, dk, dv, None, None


def _round_up(n: int) -> int:
    return -(-n // PAD_TO) * PAD_TO


def _rows(x_nHLD: torch.Tensor) -> torch.Tensor:
    """[n, H, L, D] (the batch's [B, H, S, D], or a bucket's problems) as [n * L, H, D] token rows:
    a view when x is an [n, L, H, D] buffer seen transposed, as q and the output are."""
    n, H, L, D = x_nHLD.shape
    return x_nHLD.transpose(1, 2).reshape(n * L, H, D)


def _problems(x_TD: torch.Tensor, n: int, L: int) -> torch.Tensor:
    """[n * L, H, D] rows as [n, H, L, D] problems."""
    return x_TD.view(n, L, *x_TD.shape[1:]).transpose(1, 2)


def _gather(bucket, q_T, k_T, v_T):
    q_idx, k_idx, mask = bucket[:3]
    n, _, Lq, Lk = mask.shape
    return (_problems(q_T.index_select(0, q_idx), n, Lq), _problems(k_T.index_select(0, k_idx), n, Lk),
            _problems(v_T.index_select(0, k_idx), n, Lk))


def _bucket(spans, Lq: int, Lk: int, seq_len: int, device: torch.device):
    """One padded shape's problems (SpanPlan)."""
    n = len(spans)
    b, q0, q1, k0, k1 = (torch.tensor([span[i] for span in spans], dtype=torch.long) for i in range(5))
    lq, lk = q1 - q0, k1 - k0
    qo, ko = torch.arange(Lq), torch.arange(Lk)
    q_real = qo[None, :] < lq[:, None]  # [n, Lq]
    # padding repeats the span's first row: an in-range index whose values never matter
    q_idx = b[:, None] * seq_len + q0[:, None] + torch.where(q_real, qo[None, :], 0)
    k_idx = b[:, None] * seq_len + k0[:, None] + torch.where(ko[None, :] < lk[:, None], ko[None, :], 0)
    allowed = torch.zeros(n, 1, Lq, Lk, dtype=torch.bool)
    for j, (_, s0, s1, t0, t1, m) in enumerate(spans):
        if m is None:  # plain causal (k0 = q0, k1 = q1)
            m = torch.ones(s1 - s0, t1 - t0, dtype=torch.bool).tril_()
        allowed[j, 0, : s1 - s0, : t1 - t0] = m
    allowed |= ~q_real[:, None, :, None]  # a padded query row sees every key (finite, dropped)
    # from the spans' own (host) numbers: no data-dependent shape for the host-sync checks to flag
    src = torch.cat([torch.arange(j * Lq, j * Lq + s1 - s0) for j, (_, s0, s1, *_) in enumerate(spans)])
    dst = torch.cat([torch.arange(row * seq_len + s0, row * seq_len + s1) for row, s0, s1, *_ in spans])
    return tuple(t.to(device) for t in (q_idx.reshape(-1), k_idx.reshape(-1), allowed, dst, src))


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _additive_masks(spans, dtype: torch.dtype) -> list:
    """Each span's bool mask as 0 / -inf of `dtype` (None stays None: causal), converting a mask
    shared by several spans once."""
    done: dict[int, torch.Tensor] = {}
    out = []
    for span in spans:
        m = span[5]
        if m is not None and id(m) not in done:
            done[id(m)] = _additive(m, dtype)
        out.append(None if m is None else done[id(m)])
    return out
