"""The learned B-layer selector (model.attention.selector=indexer): its loss trains only the index
branch and falls, coverage means what it says, the dense warm-up is G attention, and the
trainer logs the switch and the per-layer statistics and clips the index branches apart. (The
selection itself against an independent float64 reference: tests/model/test_indexer_reference.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.indexer import sampled_query_blocks
from omniloom.model.synthetic import random_packed_batch
from omniloom.pretrain.bench.selector import recall_batch


def cfg_for(selector="indexer", pattern="LB", num_selected=3, warmup=0, **att) -> ModelConfig:
    return ModelConfig(
        dim=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2, vocab_size=1024, patch_token_id=1000,
        rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24,
        attention=AttentionConfig(backend="blocksparse", pattern=pattern, window=16, block_size=8, num_selected_blocks=num_selected,
                                  selector=selector, indexer_dim=8, dense_warmup_steps=warmup, **att),
        moe=MoEConfig(num_experts=0, dense_dim=64, num_dense_layers=len(pattern)),
    )


def _fields(batch):
    return {k: v for k, v in batch.items() if k != "recall_mask"}


def test_indexer_loss_trains_only_the_index_branch():
    torch.manual_seed(0)
    model = OmniModel(cfg_for())
    batch = random_packed_batch(model.cfg, batch_size=2, seq_len=96, seed=1)
    out = model(**batch)
    assert out.indexer_loss is not None and out.indexer_kl.shape == (1,) and out.block_coverage.shape == (1,)
    grads = torch.autograd.grad(out.indexer_loss, [p for _, p in model.named_parameters()], allow_unused=True)
    for (name, _), g in zip(model.named_parameters(), grads):
        if ".indexer." in name:
            assert g is not None and g.abs().sum() > 0, name
        else:  # the index branch reads its input detached: no push on the language model
            assert g is None or not g.any(), name


def test_kl_falls_when_the_index_branch_learns_a_fixed_attention():
    """With the language model frozen and its B layer's attention made sharp, training only the
    index branch on recall rows drives its KL to the dense block mass well down."""
    torch.manual_seed(0)
    model = OmniModel(cfg_for(num_selected=2, indexer_sample_blocks=8))
    with torch.no_grad():
        model.layers[1].attn.wq.weight.mul_(8.0)  # sharp dense attention: a target worth matching
    params = [p for n, p in model.named_parameters() if ".indexer." in n]
    for n, p in model.named_parameters():
        p.requires_grad_(".indexer." in n)
    opt = torch.optim.Adam(params, lr=1e-2)
    g = torch.Generator().manual_seed(0)
    batches = [recall_batch(2, 256, 16, g) for _ in range(4)]
    kls = []
    for step in range(60):
        out = model(**_fields(batches[step % 4]))
        out.indexer_loss.backward()
        opt.step()
        opt.zero_grad()
        kls.append(float(out.indexer_kl[0]))
    first, last = sum(kls[:4]) / 4, sum(kls[-4:]) / 4
    assert last < 0.5 * first, (first, last)


def test_coverage_is_one_when_every_block_is_selected_and_below_one_otherwise():
    torch.manual_seed(0)
    batch = random_packed_batch(cfg_for(), batch_size=2, seq_len=128, docs_per_row=1, visual=False, pad=0, seed=3)
    full = OmniModel(cfg_for(selector="pooled", num_selected=64))
    full.measure_attention = True
    with torch.no_grad():
        cov = full(**batch).block_coverage
    torch.testing.assert_close(cov, torch.ones(1))
    sparse = OmniModel(cfg_for(selector="pooled", num_selected=2))
    sparse.load_state_dict(full.state_dict())
    sparse.measure_attention = True
    with torch.no_grad():
        cov = float(sparse(**batch).block_coverage[0])
    assert 0.2 < cov < 1.0


@pytest.mark.parametrize("pad", [40, 37])  # 5 blocks of padding from a block start, and from inside a block
def test_padding_is_no_query_of_the_kl_target_or_coverage(pad):
    """Issue 27 item 17: a row's trailing padding is a pseudo-document to the mask rule, but its
    tokens are no queries of the indexer's KL target or of coverage (as the docstring says). The
    last block, always sampled, is all padding here; changing only the padding's queries and keys
    (its positions: all 0 as packed, so its attention is uniform) must leave both as they are."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(cfg_for(num_selected=2, indexer_sample_blocks=6), pad_token_id=3)
    model = OmniModel(cfg)
    batch = random_packed_batch(cfg, batch_size=2, seq_len=96, docs_per_row=1, pad=pad, seed=4)
    assert (batch["input_ids"][:, -pad:] == 3).all() and (batch["input_ids"][:, :-pad] != 3).all()
    model.measure_attention = True
    with torch.no_grad():
        before = model(**batch)
        batch["positions"][:, :, -pad:] = torch.arange(pad, dtype=batch["positions"].dtype) * 7
        after = model(**batch)
    assert float(before.indexer_kl[0]) > 0 and 0 < float(before.block_coverage[0]) < 1
    torch.testing.assert_close(after.indexer_kl, before.indexer_kl, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(after.block_coverage, before.block_coverage, rtol=1e-6, atol=1e-7)


def test_dense_block_mass_in_query_chunks_equals_one_pass(monkeypatch):
    """The KL target and coverage are computed in chunks of query rows (bounded memory at long
    context): a chunk of one row at a time gives what one pass over all rows gives, on a packed
    batch with documents, an image and a video, and padding."""
    import omniloom.model.indexer as ix

    torch.manual_seed(0)
    cfg = cfg_for()
    model = OmniModel(cfg)
    batch = random_packed_batch(cfg, batch_size=2, seq_len=96, seed=5)
    captured = {}
    real = ix.dense_block_mass

    def spy(info, q, k, blocks):
        captured["args"] = (info, q.detach().clone(), k.detach().clone(), blocks)
        return real(info, q, k, blocks)

    monkeypatch.setattr(ix, "dense_block_mass", spy)
    model.measure_attention = True
    with torch.no_grad():
        model(**batch)
    info, q, k, blocks = captured["args"]
    whole = real(info, q, k, blocks)
    monkeypatch.setattr(ix, "MASS_CHUNK_BYTES", 1)  # one query row per chunk
    chunked = real(info, q, k, blocks)
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=1e-7)
    assert whole.shape[2] == blocks.numel() * cfg.attention.block_size and whole.shape[2] > 1


def test_activation_checkpointing_reuses_the_kl_target_and_keeps_every_gradient(monkeypatch):
    """Under activation checkpointing a B layer runs again in backward; its KL target (the dense
    attention of the sampled query blocks) is reused, not recomputed: one dense pass per B layer
    and step, as without checkpointing, with the same loss, statistics and gradients."""
    import omniloom.model.indexer as ix
    from omniloom.pretrain.train.parallel import apply_activation_checkpointing

    torch.manual_seed(0)
    cfg = cfg_for(pattern="LBLB")
    plain = OmniModel(cfg)
    ckpt = OmniModel(cfg)
    ckpt.load_state_dict(plain.state_dict())
    assert apply_activation_checkpointing(ckpt) == 4
    batch = random_packed_batch(cfg, batch_size=2, seq_len=96, seed=5)
    calls = []
    real = ix.dense_block_mass
    monkeypatch.setattr(ix, "dense_block_mass", lambda *args: calls.append(1) or real(*args))
    results = []
    for model in (plain, ckpt):
        calls.clear()
        out = model(**batch)
        (out.loss + out.indexer_loss).backward()
        results.append((out, dict((n, p.grad) for n, p in model.named_parameters()), len(calls)))
    (a, grads_a, calls_a), (b, grads_b, calls_b) = results
    assert calls_a == calls_b == 2  # once per B layer (it was twice per B layer with checkpointing)
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(b.indexer_kl, a.indexer_kl)
    torch.testing.assert_close(b.block_coverage, a.block_coverage)
    assert any(".indexer." in n and g is not None and g.abs().sum() > 0 for n, g in grads_b.items())
    for name, g in grads_a.items():
        if g is None:
            assert grads_b[name] is None or not grads_b[name].any(), name
        else:
            torch.testing.assert_close(grads_b[name], g, msg=name)


@pytest.mark.slow
def test_compiled_checkpointed_b_block_has_no_graph_break():
    """train.compile with train.activation_checkpointing: a B block with the learned selector
    compiles whole (its selector statistics leave through the block's outputs, nothing is stored
    into the shared attention context) and gives the eager model's loss, KL, coverage and
    gradients. fp32, so the two agree closely. About three minutes of inductor on CPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from omniloom.pretrain.train.parallel import apply_activation_checkpointing, apply_compile

    torch.manual_seed(0)
    cfg = cfg_for(pattern="B")
    eager, compiled = OmniModel(cfg), OmniModel(cfg)
    compiled.load_state_dict(eager.state_dict())
    assert apply_activation_checkpointing(compiled) == 1 and apply_compile(compiled) == 1
    batch = random_packed_batch(cfg, batch_size=2, seq_len=96, seed=5)
    layout = eager.batch_layout(batch["doc_ids"], batch["block_ids"])
    torch._dynamo.reset()
    counters.clear()
    outs = []
    for model in (eager, compiled):
        out = model(**_fields(batch), layout=layout)
        out.loss.backward()
        outs.append(out)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    a, b = outs
    assert a.indexer_kl is not None and a.indexer_kl.shape == (1,)
    for name in ("loss", "indexer_kl", "block_coverage"):
        torch.testing.assert_close(getattr(b, name), getattr(a, name), rtol=1e-4, atol=1e-6, msg=name)
    grads = dict(eager.named_parameters())
    for name, p in compiled.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-3, atol=1e-5, msg=name)
    assert any(".indexer." in n and p.grad.abs().sum() > 0 for n, p in compiled.named_parameters())


def test_dense_warmup_is_g_attention_then_switches():
    torch.manual_seed(0)
    batch = random_packed_batch(cfg_for(), batch_size=2, seq_len=96, seed=2)
    warm = OmniModel(cfg_for(warmup=5)).eval()
    dense = OmniModel(dataclasses.replace(cfg_for(pattern="LG"))).eval()
    dense.load_state_dict(warm.state_dict(), strict=False)  # G has no index branch
    assert warm.set_step(0) and warm.dense_b_layers
    assert not warm.set_step(4)
    with torch.no_grad():
        torch.testing.assert_close(warm(**batch, return_logits=True).logits, dense(**batch, return_logits=True).logits)
    assert warm.set_step(5) and not warm.dense_b_layers
    with torch.no_grad():
        assert not torch.allclose(warm(**batch, return_logits=True).logits, dense(**batch, return_logits=True).logits)


def test_sampled_query_blocks_are_spread_and_include_the_last():
    assert sampled_query_blocks(4, 16).tolist() == [0, 1, 2, 3]
    assert sampled_query_blocks(100, 5).tolist() == [0, 24, 49, 74, 99]
    assert sampled_query_blocks(100, 1).tolist() == [99]
    got = sampled_query_blocks(512, 16).tolist()
    assert len(set(got)) == 16 and got[0] == 0 and got[-1] == 511


def test_index_rope_scores_depend_on_relative_position_only():
    """With indexer_rope_dim the index query . key depends on the two positions only through
    their distance (what lets the selector learn recency), and a rope_dim of 0 leaves it as is."""
    from omniloom.model.indexer import index_rope_angles, rotate_index

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, generator=g, dtype=torch.float64), torch.randn(8, generator=g, dtype=torch.float64)

    def score(tq, tk, rope_dim=4):
        cq, sq = index_rope_angles(torch.tensor([[tq]]), rope_dim)
        ck, sk = index_rope_angles(torch.tensor([[tk]]), rope_dim)
        return float((rotate_index(q.view(1, 1, 8), cq, sq) * rotate_index(k.view(1, 1, 8), ck, sk)).sum())

    assert score(100, 40) == pytest.approx(score(1060, 1000), rel=1e-5)
    assert score(100, 40) != pytest.approx(score(100, 90), rel=1e-3)
    assert score(100, 40, rope_dim=0) == pytest.approx(float(q @ k))
    with pytest.raises(ValueError, match="indexer_rope_dim"):
        cfg_for(indexer_rope_dim=10).validate()  # more than indexer_dim 8


def _indexer_trainer(tmp_path, *overrides):
    from omniloom.pretrain.train import build as B
    from omniloom.pretrain.bench.train import SyntheticLoader
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train.loop import Trainer

    cfg = load_config("tiny", [
        f"train.run_dir={tmp_path}", "checkpoint.every=0", "logging.trackers=[]", "train.eval_every=0",
        "model.vocab_size=512", "model.patch_token_id=8", "data.seq_len=96", "data.batch_size=2",
        "model.attention.backend=blocksparse", "model.attention.pattern=LB", "model.attention.block_size=8",
        "model.attention.num_selected_blocks=3", "model.attention.selector=indexer", "model.attention.indexer_dim=8",
        "model.attention.indexer_rope_dim=4", "logging.every=1", *overrides])
    return Trainer(cfg, build_model=B.build_model, progress=False,
                   build_loader=lambda c, split, rank, world: SyntheticLoader(c, rank) if split == "train" else None)


def test_trainer_logs_the_indexer_switch_and_per_layer_statistics(tmp_path, caplog):
    import json
    import logging

    trainer = _indexer_trainer(tmp_path, "train.num_steps=4", "model.attention.dense_warmup_steps=2")
    with caplog.at_level(logging.INFO, logger="omniloom.train"):
        result = trainer.fit()
    assert result.step == 4
    text = caplog.text
    assert "attend densely until step 2" in text and "dense warm-up over" in text
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r]
    b = trainer.b_layers[0]
    assert len(train) == 4 and all(f"indexer/kl_layer{b}" in r and "indexer/loss" in r for r in train)
    assert all(0.0 <= r[f"attn/coverage_layer{b}"] <= 1.0 + 1e-6 for r in train)


def test_index_branch_is_clipped_by_its_own_norm(tmp_path):
    """A large indexer gradient must not scale down the language model's step: the trainer clips
    the index branches separately and reports the language model's norm."""
    from omniloom.model.decoder import is_indexer_param

    trainer = _indexer_trainer(tmp_path, "train.num_steps=1", "optim.grad_clip=1.0")
    model = trainer.model
    for name, p in model.named_parameters():
        p.grad = torch.full_like(p, 1e3 if is_indexer_param(name) else 1e-4)
    lm = {n: p.grad.clone() for n, p in model.named_parameters() if not is_indexer_param(n)}
    norm = trainer._clip_gradients()
    want = torch.sqrt(sum((g.double() ** 2).sum() for g in lm.values()))
    assert float(norm) == pytest.approx(float(want), rel=1e-4) and float(norm) < 1.0  # fp32 sums
    for name, p in model.named_parameters():
        if not is_indexer_param(name):
            assert torch.equal(p.grad, lm[name]), name  # below the limit: untouched
    index_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for n, p in model.named_parameters() if is_indexer_param(n)))
    assert float(index_norm) == pytest.approx(1.0, rel=1e-4)


def test_index_branch_leaves_the_language_model_init_unchanged():
    """Same seed, selector pooled or indexer: the same language-model weights (the index branch is
    built and initialised off the main RNG stream), so a comparison of selectors compares selection."""
    torch.manual_seed(0)
    pooled = OmniModel(cfg_for(selector="pooled")).state_dict()
    torch.manual_seed(0)
    indexed = OmniModel(cfg_for(selector="indexer")).state_dict()
    extra = [k for k in indexed if k not in pooled]
    assert extra and all(".indexer." in k for k in extra)
    assert all(torch.equal(pooled[k], indexed[k]) for k in pooled)
