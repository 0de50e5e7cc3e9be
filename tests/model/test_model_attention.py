"""Attention: every CPU backend matches the dense sdpa reference; the mask rule holds per kind."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from omniloom.model import attention as attention_mod
from omniloom.model import span_attention as span_attention_mod
from omniloom.model.attention import AttnContext, check_backend
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.masks import batch_layout, build_mask_info, dense_mask, select_blocks
from omniloom.model.synthetic import random_packed_batch


def tiny_cfg(**att) -> ModelConfig:
    return ModelConfig(
        dim=32, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=64, patch_token_id=63,
        rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24,
        attention=AttentionConfig(**{"window": 12, "block_size": 8, "num_selected_blocks": 3, **att}),
        moe=MoEConfig(num_experts=0, dense_dim=32),
    )


def dense_reference(q, k, v, info, kind, sel=None):
    """The rule as one dense [B, 1|K, S, S] mask with K/V repeated per group: the plain reference
    every backend is checked against (the backends themselves run per document or per block)."""
    G = q.shape[1] // k.shape[1]
    mask = dense_mask(info, kind, sel).repeat_interleave(G, dim=1) if sel is not None else dense_mask(info, kind)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1), attn_mask=mask
    )


def batch_fields(seq_len=90, seed=0):
    batch = random_packed_batch(tiny_cfg(), batch_size=2, seq_len=seq_len, docs_per_row=3, seed=seed)
    return batch["doc_ids"], batch["block_ids"]


@pytest.mark.parametrize("chunk_tokens", [None, 16])
@pytest.mark.parametrize("kind", ["L", "G", "B"])
def test_blocksparse_matches_sdpa_forward_and_backward(kind, chunk_tokens, monkeypatch):
    if chunk_tokens:  # 2 query blocks per chunk: the chunked autograd path (long rows on CPU)
        monkeypatch.setattr(attention_mod, "CHUNK_TOKENS_CPU", chunk_tokens)
    doc, blk = batch_fields()  # 90 tokens: not a multiple of the block size (padding path)
    assert (blk >= 0).any() and doc.max() >= 2
    info = build_mask_info(doc, blk, block_size=8, window=12)
    g = torch.Generator().manual_seed(1)
    B, S = doc.shape
    q = torch.randn(B, 4, S, 16, generator=g, requires_grad=True)
    k = torch.randn(B, 2, S, 16, generator=g, requires_grad=True)
    v = torch.randn(B, 2, S, 16, generator=g, requires_grad=True)
    w = torch.randn(B, 4, S, 16, generator=g)
    sel = select_blocks(info, q, k, 3) if kind == "B" else None
    ref = dense_reference(q, k, v, info, kind, sel)
    results = [(ref, *torch.autograd.grad((ref * w).sum(), (q, k, v)))]
    for backend in ("sdpa", "blocksparse"):
        out = AttnContext(info, backend, 3, q.device).attend(q, k, v, kind)
        results.append((out, *torch.autograd.grad((out * w).sum(), (q, k, v))))
    for got_sdpa, got_bs, want in zip(results[1], results[2], results[0]):
        torch.testing.assert_close(got_sdpa, want)
        torch.testing.assert_close(got_bs, want)
    with torch.no_grad():  # inference: chunks without any graph
        torch.testing.assert_close(AttnContext(info, "blocksparse", 3, q.device).attend(q, k, v, kind), ref)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("visual_known", [True, False])
@pytest.mark.parametrize("kind", ["L", "G"])
def test_cpu_span_attention_matches_the_dense_reference_in_float64_and_under_autocast(kind, visual_known, batched, monkeypatch):
    """L and G layers on CPU run their per-document spans through SpanAttention (torch's CPU
    flash kernel called directly, one output and one gradient buffer): packed rows with several
    documents, images and videos, window chunks that share one mask, G query chunks over
    documents with visual blocks (each against the keys up to its end or its visual blocks' end),
    float64 against the dense reference; bf16 autocast against the per-span sdpa path it
    replaces. Without the layout's visual blocks, a visual document is one span (G) or every
    chunk looks a window ahead (L). `batched`: small spans gathered into one padded call per
    shape (span_attention.SpanPlan, the default), or (thresholds 0) every span its own call."""
    monkeypatch.setattr(attention_mod, "G_VISUAL_CHUNK", 8)  # several G chunks per visual document
    if not batched:
        monkeypatch.setattr(span_attention_mod, "SMALL_QUERIES", 0)
    doc, blk = batch_fields(seq_len=96)
    info = build_mask_info(doc, blk, block_size=4, window=12)  # documents longer than the window: L chunks
    layout = batch_layout(doc, blk, block_size=4, window=12, num_selected=3)
    assert any(len(row) > 1 for row in layout.visual)
    if not visual_known:
        layout = dataclasses.replace(layout, visual=())
    used = []
    real = attention_mod.SpanAttention.apply
    monkeypatch.setattr(attention_mod.SpanAttention, "apply", lambda *a: used.append(len(a[3])) or real(*a))
    g = torch.Generator().manual_seed(3)
    B, S = doc.shape
    # q as the layer makes it: a [B, S, H, D] buffer seen as [B, H, S, D]
    q = torch.randn(B, S, 4, 8, generator=g, dtype=torch.float64).transpose(1, 2).requires_grad_()
    k = torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, 2, S, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(B, 4, S, 8, generator=g, dtype=torch.float64)
    backend = "blocksparse" if kind == "L" else "sdpa"  # blocksparse gathers G blocks over short documents
    ctx = AttnContext(info, backend, 3, q.device, layout)
    out, ref = ctx.attend(q, k, v, kind), dense_reference(q, k, v, info, kind)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for got, want in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    spans = ctx.cache[f"spans{kind}"]
    assert used == [len(spans)] and sum(q1 - q0 for _, q0, q1, *_ in spans) == B * S  # every query once
    plan = ctx.cache[f"span_plan{kind}"]
    in_buckets = [len(bucket[3]) for bucket in plan.buckets]  # real queries per padded call
    assert sum(in_buckets) + sum(q1 - q0 for _, q0, q1, *_ in plan.large) == B * S
    if batched:  # several spans per call, padded queries among them (lengths not multiples of 16)
        assert plan.buckets and max(bucket[2].shape[0] for bucket in plan.buckets) > 1
        assert any(len(bucket[3]) < bucket[0].numel() for bucket in plan.buckets)
    else:
        assert not plan.buckets and len(plan.large) == len(spans)
    visual_docs = [(b, s0, e0) for b, row in enumerate(layout.segments) for s0, e0, vis in row if vis]
    if kind == "G":  # a visual document: chunks of 8 queries when its visual blocks are known
        for b, s0, e0 in visual_docs:
            starts = [q0 for row, q0, *_ in spans if row == b and s0 <= q0 < e0]
            assert starts == (list(range(s0, e0, 8)) if visual_known else [s0])
    elif visual_known:  # text chunks of a visual document stop at their own end (not only its last chunk)
        stop = [k1 == q1 for b, q0, q1, k0, k1, m in spans if any(b == row and s0 <= q0 < e0 for row, s0, e0 in visual_docs)]
        assert sum(stop) > len(visual_docs) and not all(stop)
    if kind == "L":  # window chunks: interior chunks of a text document share one mask tensor
        masks = [m for *_, m in spans if m is not None]
        assert len(masks) > len({id(m) for m in masks}) > 1
    with torch.no_grad():
        torch.testing.assert_close(AttnContext(info, backend, 3, q.device, layout).attend(q, k, v, kind), ref, rtol=1e-12, atol=1e-12)
    # bf16 autocast: the same as one sdpa call per span (the path off CPU / under compile)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    results = []
    for span_path in (True, False):
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: not span_path)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            qa, ka, va = (t.to(torch.bfloat16) for t in (qf, kf, vf))
            o = AttnContext(info, backend, 3, q.device, layout).attend(qa, ka, va, kind)
            grads = torch.autograd.grad((o.float() * w.float()).sum(), (qf, kf, vf))
        results.append((o, *grads))
    for got, want in zip(*results):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("backend", ["sdpa", "blocksparse"])
def test_prepare_builds_every_shared_mask_so_layers_store_nothing(backend):
    """OmniModel.forward calls ctx.prepare(kinds) before the layers: afterwards L and G layers (and
    B layers in their dense warm-up, which attend as G) only read the context's cache. A store
    from inside a layer would be a side effect in a checkpointed region, which torch.compile
    refuses (the block then runs uncompiled)."""
    doc, blk = batch_fields(seq_len=96)
    for seq_blocks in (4, 16):  # blocksparse G: gathered blocks over short documents, spans over long ones
        info = build_mask_info(doc, blk, block_size=seq_blocks, window=12)
        g = torch.Generator().manual_seed(0)
        B, S = doc.shape
        q, k, v = torch.randn(B, 4, S, 8, generator=g), torch.randn(B, 2, S, 8, generator=g), torch.randn(B, 2, S, 8, generator=g)
        ctx = AttnContext(info, backend, 3, q.device, dense_b=True)
        ctx.prepare(["L", "B", "L", "B"])
        built = dict(ctx.cache)
        assert built and {"spansL"} <= set(built) and any(key.endswith("G") for key in built)
        for kind in ("L", "G", "B"):
            ctx.attend(q, k, v, kind)
        assert ctx.cache.keys() == built.keys() and all(ctx.cache[key] is built[key] for key in built)


def test_blocksparse_global_layer_over_long_documents_runs_per_document_and_matches():
    # row 0: one long document with an image; row 1: a text document, then a second one
    doc = torch.zeros(2, 64, dtype=torch.int32)
    doc[1, 40:] = 1
    blk = torch.full((2, 64), -1, dtype=torch.int32)
    blk[0, 20:30] = 0
    info = build_mask_info(doc, blk, block_size=8, window=12)
    ctx = AttnContext(info, "blocksparse", 3, torch.device("cpu"))
    assert [[(s0, e0) for s0, e0, _ in row] for row in ctx.layout.segments] == [[(0, 64)], [(0, 40), (40, 64)]]
    q = torch.randn(2, 4, 64, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 64, 8, requires_grad=True), torch.randn(2, 2, 64, 8, requires_grad=True)
    out, ref = ctx.attend(q, k, v, "G"), dense_reference(q, k, v, info, "G")
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), torch.autograd.grad(ref.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want)
    assert "gatheredG" not in ctx.cache  # one span per document; only the image document needs a mask
    assert [(b, q0, q1, k0, k1, m is not None) for b, q0, q1, k0, k1, m in ctx.cache["spansG"]] == [
        (0, 0, 64, 0, 64, True), (1, 0, 40, 0, 40, False), (1, 40, 64, 40, 64, False)]
    out, ref = ctx.attend(q, k, v, "L"), dense_reference(q, k, v, info, "L")  # window layers run in chunks
    torch.testing.assert_close(out, ref)
    for got, want in zip(torch.autograd.grad(out.square().sum(), (q, k, v)), torch.autograd.grad(ref.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want)
    assert any(key.startswith("band:") for key in ctx.cache) and "gatheredL" not in ctx.cache


def test_mask_rule_documents_causality_visual_blocks_and_window():
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    blk = torch.tensor([[-1, 0, 0, 0, -1, -1, -1, 1, 1, -1]])
    info = build_mask_info(doc, blk, block_size=4, window=2)
    g = dense_mask(info, "G")[0, 0]
    assert g[5, 4] and not g[4, 5]  # text causal
    assert g[1, 3] and g[3, 1] and not g[0, 1]  # image bidirectional inside, text before it causal
    assert not g[6, 5] and not g[7, 2]  # documents isolated
    assert g[7, 8] and not g[6, 7]
    local = dense_mask(info, "L")[0, 0]
    assert local[5, 4] and not local[5, 3]  # window 2: |i - j| < 2
    assert torch.equal(local, g & ((torch.arange(10)[:, None] - torch.arange(10)[None]).abs() < 2))
    assert dense_mask(info, "G")[0, 0].diagonal().all()


def test_window_layer_ignores_keys_outside_the_window():
    doc = torch.zeros(1, 64, dtype=torch.int32)
    blk = torch.full((1, 64), -1, dtype=torch.int32)
    info = build_mask_info(doc, blk, block_size=8, window=12)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 64, 8, generator=g) for h in (2, 1, 1))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :40] += 5.0  # keys more than 11 tokens before query 51..63
    v2[:, :, :40] -= 3.0
    for backend in ("sdpa", "blocksparse"):
        ctx = AttnContext(info, backend, 3, q.device)
        a, b = ctx.attend(q, k, v, "L"), ctx.attend(q, k2, v2, "L")
        torch.testing.assert_close(a[:, :, 51:], b[:, :, 51:])
        assert not torch.allclose(a[:, :, 45:51], b[:, :, 45:51])


def test_block_selection_keeps_own_block_is_causal_and_bounded():
    doc, blk = batch_fields(seq_len=96)
    info = build_mask_info(doc, blk, block_size=8, window=12)
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 96, 16, generator=g), torch.randn(2, 2, 96, 16, generator=g)
    sel = select_blocks(info, q, k, num_selected=3)  # [B, K, Sp, nb]
    idx = torch.arange(96)
    assert sel[:, :, idx, idx // 8].all()  # own block always kept
    text = blk < 0
    # past-only choice for text: nothing after the own block
    later = sel & (torch.arange(sel.shape[-1]) > (idx // 8)[:, None])
    assert not later[:, :, :96][text[:, None].expand(-1, 2, -1)].any()
    # choice for a query does not move when a later key changes (causal scoring)
    k2 = k.clone()
    k2[:, :, 60:] = torch.randn(2, 2, 36, 16, generator=g) * 10
    sel2 = select_blocks(info, q, k2, num_selected=3)
    assert torch.equal(sel[:, :, :56], sel2[:, :, :56])


def test_backend_errors_say_what_to_choose():
    with pytest.raises(ValueError, match="choose one of"):
        check_backend("dense")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="blocksparse"):
            check_backend("flex")
        with pytest.raises(ValueError, match="CUDA"):
            check_backend("flash")


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["L", "G", "B"])
def test_flex_matches_sdpa_on_cuda(kind):
    doc, blk = batch_fields(seq_len=256)
    info = build_mask_info(doc.cuda(), blk.cuda(), block_size=16, window=40)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 256, 16, device="cuda", generator=g, requires_grad=True)
    k = torch.randn(2, 2, 256, 16, device="cuda", generator=g, requires_grad=True)
    v = torch.randn(2, 2, 256, 16, device="cuda", generator=g, requires_grad=True)
    results = []
    for backend in ("sdpa", "flex"):
        out = AttnContext(info, backend, 3, q.device).attend(q, k, v, kind)
        results.append((out, *torch.autograd.grad(out.square().sum(), (q, k, v))))
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, atol=2e-3, rtol=2e-3)


def test_flex_b_layer_block_mask_pads_its_slots_to_a_power_of_two_and_means_the_same(monkeypatch):
    """A flex B layer's BlockMask has a power-of-two slot count (few shapes, few recompiles of
    the compiled flex kernel across batches); padded slots lie past each row's count, so the
    mask is the same as with the layout's exact bound."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    assert [attention_mod.flex_slot_bucket(n, 512) for n in (1, 3, 16, 17, 33, 49, 65, 512)] == [1, 4, 16, 32, 64, 64, 128, 512]
    assert attention_mod.flex_slot_bucket(17, 20) == 20
    if not attention_mod.flex_partial_kv_indices():
        pytest.skip("this torch's BlockMask.from_kv_blocks needs full-width indices (the next test covers that path)")
    doc, blk = batch_fields(seq_len=96)
    info = build_mask_info(doc, blk, block_size=4, window=12)
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(2, 4, 96, 8, generator=g), torch.randn(2, 2, 96, 8, generator=g)
    bucket = attention_mod.flex_slot_bucket
    grew = []
    for num_selected in (2, 3, 5):
        ctx = AttnContext(info, "sdpa", num_selected, q.device)
        sel = ctx.select(q, k)
        mask_mod = ctx._flex_mask_mod("B", sel, 2)
        exact = ctx.layout.slots["B"]
        monkeypatch.setattr(attention_mod, "flex_slot_bucket", bucket)
        padded = ctx._flex_selected(sel, mask_mod, 4)
        assert padded.kv_indices.shape[-1] == bucket(exact, info.num_blocks) >= exact
        grew.append(padded.kv_indices.shape[-1] > exact)
        monkeypatch.setattr(attention_mod, "flex_slot_bucket", lambda slots, num_blocks: slots)
        plain = ctx._flex_selected(sel, mask_mod, 4)
        assert plain.kv_indices.shape[-1] == exact and isinstance(plain, flex.BlockMask)
        torch.testing.assert_close(padded.kv_num_blocks, plain.kv_num_blocks)
        used = torch.arange(exact) < plain.kv_num_blocks.unsqueeze(-1)  # the slots flex reads
        torch.testing.assert_close(padded.kv_indices[..., :exact][used], plain.kv_indices[used])
        # the transposed (query-side) blocks the backward walks are the same too
        torch.testing.assert_close(padded.q_num_blocks, plain.q_num_blocks)
        torch.testing.assert_close(padded.q_indices, plain.q_indices)
    assert any(grew)


def test_flex_b_layer_block_mask_at_full_width_means_the_same(monkeypatch):
    """Where torch's from_kv_blocks needs key-block indices at full width (torch 2.11: its
    query-side transpose indexes a [Q, slots + 1] buffer by block id), a flex B layer builds them
    with one slot per key block. The BlockMask then holds exactly the selection's block union,
    on the key side and on the query side the backward walks, checked against the union itself."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    monkeypatch.setattr(attention_mod, "flex_partial_kv_indices", lambda: False)
    doc, blk = batch_fields(seq_len=96)
    info = build_mask_info(doc, blk, block_size=4, window=12)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 96, 8, generator=g), torch.randn(2, 2, 96, 8, generator=g)
    H, nb = q.shape[1], info.num_blocks
    for num_selected in (2, 5):
        ctx = AttnContext(info, "sdpa", num_selected, q.device)
        sel = ctx.select(q, k)
        bm = ctx._flex_selected(sel, ctx._flex_mask_mod("B", sel, 2), H)
        assert bm.kv_indices.shape[-1] == nb
        union = sel.block_union().repeat_interleave(H // k.shape[1], dim=1)  # [B, H, Q, nb]
        torch.testing.assert_close(bm.kv_num_blocks, union.sum(-1).to(torch.int32))
        for b, h, i in itertools.product(range(union.shape[0]), range(H), range(nb)):
            n = int(bm.kv_num_blocks[b, h, i])
            assert bm.kv_indices[b, h, i, :n].tolist() == union[b, h, i].nonzero().flatten().tolist()
            qn = int(bm.q_num_blocks[b, h, i])  # query blocks that read key block i
            assert sorted(bm.q_indices[b, h, i, :qn].tolist()) == union[b, h, :, i].nonzero().flatten().tolist()


@pytest.mark.slow  # eager flex on CPU costs ~15 s of setup on the shared 2-core machine
@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
@pytest.mark.parametrize("kind", ["L", "G", "B"])
def test_flex_mask_mod_matches_sdpa_forward_on_cpu(kind):
    """flex needs CUDA for training; its eager forward runs on CPU and checks the mask_mod."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    doc, blk = batch_fields(seq_len=64)
    info = build_mask_info(doc, blk, block_size=8, window=12)
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(2, 4, 64, 16, generator=g), torch.randn(2, 2, 64, 16, generator=g), torch.randn(2, 2, 64, 16, generator=g)
    ref = AttnContext(info, "sdpa", 3, q.device).attend(q, k, v, kind)
    ctx = AttnContext(info, "sdpa", 3, q.device)
    sel = ctx.select(q, k) if kind == "B" else None  # B: the BlockMask comes from the selected kv blocks
    torch.testing.assert_close(ctx._flex(q, k, v, kind, sel), ref, atol=1e-5, rtol=1e-5)


def test_chunked_blocksparse_under_cpu_autocast_matches_one_chunk(monkeypatch):
    """Under autocast the chunks' outputs (and so the incoming gradient) are bf16 while q/k/v stay
    fp32: the chunked backward must hand back gradients in the inputs' dtypes."""
    doc, blk = batch_fields(seq_len=96)
    info = build_mask_info(doc, blk, block_size=8, window=12)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 96, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 96, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 96, 16, generator=g, requires_grad=True)
    results = []
    for chunk in (16, 1 << 30):
        monkeypatch.setattr(attention_mod, "CHUNK_TOKENS_CPU", chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = AttnContext(info, "blocksparse", 3, q.device).attend(q, k, v, "B")
        assert out.dtype == torch.bfloat16
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        assert all(gr.dtype == torch.float32 for gr in grads)
        results.append((out, *grads))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want)
