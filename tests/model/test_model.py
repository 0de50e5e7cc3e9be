"""The whole decoder: accounting, backend parity, masks end to end, outputs, overfitting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from omniloom.model import OmniModel, accounting
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.synthetic import random_packed_batch


def tiny_cfg(backend="blocksparse", pattern="LBG", **kw) -> ModelConfig:
    base = dict(
        dim=32, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=64, patch_token_id=63,
        rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24,
        attention=AttentionConfig(backend=backend, pattern=pattern, window=12, block_size=8, num_selected_blocks=2),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32),
    )
    base.update(kw)
    return ModelConfig(**base)


def run(model, batch, **kw):
    return model(**batch, **kw)


@pytest.mark.parametrize(
    "cfg",
    [
        tiny_cfg(),
        tiny_cfg(moe=MoEConfig(num_experts=6, num_experts_per_token=2, expert_dim=8, num_shared_experts=0, num_dense_layers=0, modality_groups=True)),
        tiny_cfg(moe=MoEConfig(num_experts=0, dense_dim=40), attention=AttentionConfig(qk_norm=False)),
        tiny_cfg(pattern="LBGB", num_layers=4,
                 attention=AttentionConfig(pattern="LBGB", selector="indexer", indexer_dim=6, indexer_heads=3)),
    ],
)
def test_param_count_from_config_equals_numel(cfg):
    model = OmniModel(cfg)
    assert accounting.num_params(cfg) == sum(p.numel() for p in model.parameters()) == model.num_params()
    assert model.num_active_params() <= model.num_params()


def test_flops_follow_each_layer_kind_sparsity():
    long_cfg = tiny_cfg(pattern="L", num_layers=4)
    glob_cfg = tiny_cfg(pattern="G", num_layers=4)
    # a window layer's cost per token stops growing with the sequence; a global layer's does not
    grow_l = accounting.flops_per_token(long_cfg, 8192) - accounting.flops_per_token(long_cfg, 4096)
    grow_g = accounting.flops_per_token(glob_cfg, 8192) - accounting.flops_per_token(glob_cfg, 4096)
    assert grow_l < 1e-3 * grow_g
    dense = dataclasses.replace(tiny_cfg(), moe=MoEConfig(num_experts=0, dense_dim=32))
    assert accounting.num_active_params(dense) == accounting.num_params(dense) - (12 + 24) * 32


@pytest.mark.parametrize("selector", ["pooled", "indexer", "indexer+rope"])
def test_sdpa_and_blocksparse_models_agree_forward_and_backward(selector):
    torch.manual_seed(0)
    batch = random_packed_batch(tiny_cfg(), batch_size=2, seq_len=100, seed=1)
    assert (batch["patch_kind"] == 3).any() and (batch["patch_kind"] == 2).any()

    def cfg(backend):
        return tiny_cfg(backend, attention=AttentionConfig(backend=backend, pattern="LBG", window=12, block_size=8,
                                                           num_selected_blocks=3, selector=selector.split("+")[0],
                                                           indexer_dim=8, indexer_rope_dim=4 if "+rope" in selector else 0))

    ref = OmniModel(cfg("sdpa"))
    other = OmniModel(cfg("blocksparse"))
    other.load_state_dict(ref.state_dict())
    outs = []
    for model in (ref, other):
        out = run(model, batch, return_logits=True)
        out.loss.backward()
        outs.append((out, {n: p.grad for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b.logits, a.logits)
    torch.testing.assert_close(b.loss, a.loss)
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module", params=["pooled", "indexer", "indexer+rope"])
def masked_setup(request):
    """The mask tests run through the whole model with either B-layer selector (the indexer also
    with positions: per-document positions must keep documents apart)."""
    torch.manual_seed(0)
    att = AttentionConfig(backend="blocksparse", pattern="LBG", window=12, block_size=8, num_selected_blocks=3,
                          selector=request.param.split("+")[0], indexer_dim=8,
                          indexer_rope_dim=4 if request.param.endswith("+rope") else 0)
    model = OmniModel(tiny_cfg(attention=att)).eval()
    batch = random_packed_batch(tiny_cfg(), batch_size=1, seq_len=120, docs_per_row=2, seed=2)
    with torch.no_grad():
        logits = run(model, batch, return_logits=True).logits
    return model, batch, logits


def _logits(model, batch):
    with torch.no_grad():
        return run(model, batch, return_logits=True).logits


def test_later_text_token_leaves_earlier_logits_unchanged(masked_setup):
    model, batch, logits = masked_setup
    text = ((batch["modality"][0] <= 1) & (batch["doc_ids"][0] == 0)).nonzero().flatten()
    i = int(text[len(text) // 2])
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0, i] = (changed["input_ids"][0, i] + 1) % 50
    new = _logits(model, changed)
    torch.testing.assert_close(new[0, :i], logits[0, :i])
    assert not torch.allclose(new[0, i], logits[0, i])


def test_changing_document_a_leaves_document_b_unchanged(masked_setup):
    model, batch, logits = masked_setup
    doc = batch["doc_ids"][0]
    changed = {k: v.clone() for k, v in batch.items()}
    a_text = (doc == 1) & (batch["modality"][0] <= 1)
    changed["input_ids"][0, a_text] = (changed["input_ids"][0, a_text] + 7) % 50
    # patch rows follow the <|patch|> positions in row-major order
    patch_doc = doc[batch["input_ids"][0] == 63]
    assert (patch_doc == 1).any() and (patch_doc == 0).any()
    changed["patches"][patch_doc == 1] += 1.0
    new = _logits(model, changed)
    torch.testing.assert_close(new[0, doc == 0], logits[0, doc == 0])
    assert not torch.allclose(new[0, doc == 1], logits[0, doc == 1])


def test_later_patch_changes_earlier_patch_of_same_image(masked_setup):
    model, batch, logits = masked_setup
    blk = batch["block_ids"][0]
    first_block = blk[blk >= 0].min()
    where = (blk == first_block).nonzero().flatten()
    changed = {k: v.clone() for k, v in batch.items()}
    changed["patches"][int(where.numel()) - 1] += 3.0  # the last patch of the first visual block
    new = _logits(model, changed)
    assert not torch.allclose(new[0, where[0]], logits[0, where[0]])  # its first patch sees it
    torch.testing.assert_close(new[0, : where[0]], logits[0, : where[0]])  # text before does not


def test_output_fields_and_per_modality_sums():
    cfg = tiny_cfg()
    model = OmniModel(cfg)
    batch = random_packed_batch(cfg, batch_size=2, seq_len=96, seed=4)
    out = run(model, batch)
    assert out.logits is None and out.loss.dim() == 0
    n_valid = int((batch["labels"] != -100).sum())
    assert int(out.tokens_by_modality.sum()) == n_valid
    torch.testing.assert_close(out.ce_sum_by_modality.sum() / n_valid, out.ce_loss.detach())
    assert out.tokens_by_modality[4] > 0 and out.tokens_by_modality[2:4].sum() == 0  # no loss on patches
    assert out.expert_counts.shape == (cfg.num_moe_layers, 5, cfg.moe.num_experts)
    assert int(out.expert_counts[0].sum()) == 2 * 96 * cfg.moe.num_experts_per_token
    assert out.expert_counts[0, 2:4].sum() > 0  # visual tokens are routed too
    assert out.output_rms > 0 and not out.output_rms.requires_grad
    torch.testing.assert_close(out.loss, out.ce_loss + out.z_loss + out.aux_loss + out.router_z_loss)
    model.update_router_biases(out.expert_counts)
    with pytest.raises(ValueError, match="MoE layers"):
        model.update_router_biases(out.expert_counts[:0])


def test_user_errors_are_clear():
    with pytest.raises(ValueError, match="vocab_size"):
        OmniModel(tiny_cfg(vocab_size=0))
    with pytest.raises(ValueError, match="rope_sections"):
        OmniModel(tiny_cfg(rope_sections=(2, 2, 2)))
    with pytest.raises(ValueError, match="pattern"):
        OmniModel(tiny_cfg(pattern="LXG"))
    model = OmniModel(tiny_cfg())
    batch = random_packed_batch(tiny_cfg(), batch_size=1, seq_len=64, seed=0)
    batch["patches"] = batch["patches"][1:]
    with pytest.raises(RuntimeError, match="patch rows"):  # a device assert: no host sync in forward
        run(model, batch)


def test_same_seed_same_loss():
    losses = []
    for _ in range(2):
        torch.manual_seed(5)
        model = OmniModel(tiny_cfg())
        batch = random_packed_batch(tiny_cfg(), batch_size=1, seq_len=64, seed=0)
        losses.append(run(model, batch).loss.item())
    assert losses[0] == losses[1]


def test_tiny_model_overfits_one_batch():
    torch.manual_seed(0)
    cfg = tiny_cfg(pattern="BG", num_layers=2)
    model = OmniModel(cfg)
    batch = random_packed_batch(cfg, batch_size=1, seq_len=64, docs_per_row=2, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(40):
        out = run(model, batch)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        model.update_router_biases(out.expert_counts)
        first = first if first is not None else out.ce_loss.item()
    assert first > 3.5 and out.ce_loss.item() < 0.3, (first, out.ce_loss.item())


def test_bench_command_runs_tiny(capsys):
    from omniloom.pretrain.cli import main

    argv = ["bench", "model", "--seq-lens", "128,256", "--window", "64", "--block-size", "32", "--selected", "2",
            "--moe-seq-len", "64", "--moe-batch", "1", "--moe-dim", "64", "--moe-experts", "4", "--iters", "1", "--warmup", "0",
            "--stem-rows", "16"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "grouped / loop" in out and "blocksparse speedup over sdpa" in out and "x" in out.split("per doubling")[1]
    packed = out.split("packed documents")[1]  # part 3: both span modes on CPU, the stem both ways
    assert "spans batched" in packed and "spans per span" in packed and "batched speedup" in packed
    assert "16 patches" in packed and "channels-last" in packed and "NCHW" in packed
    assert main(["bench", "model", "--kinds", "X"]) == 2


@pytest.mark.parametrize("visual", [False, True])
@pytest.mark.parametrize("dispatch", ["grouped", "loop"])
def test_every_parameter_gets_a_gradient_every_step(visual, dispatch):
    # what lets DDP run with find_unused_parameters=False: a text-only batch, and experts that
    # receive no token, still give every parameter a gradient
    cfg = tiny_cfg(moe=MoEConfig(num_experts=16, num_experts_per_token=1, expert_dim=16, num_dense_layers=1,
                                 dense_dim=32, dispatch=dispatch))
    model = OmniModel(cfg)
    batch = random_packed_batch(cfg, batch_size=1, seq_len=24, docs_per_row=1, visual=visual, seed=0)
    out = run(model, batch)
    out.loss.backward()
    assert int((out.expert_counts.sum(1) == 0).sum()) > 0  # some expert got no token
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []


@pytest.mark.parametrize("selector", ["pooled", "indexer"])
def test_chunked_blocksparse_under_activation_checkpointing_matches_sdpa(selector, monkeypatch):
    """Long rows on CPU run the gathered attention in query chunks (a custom autograd Function
    holding a small graph per chunk); activation checkpointing recomputes it in backward."""
    from omniloom.model import attention
    from omniloom.pretrain.train.parallel import apply_activation_checkpointing

    monkeypatch.setattr(attention, "CHUNK_TOKENS_CPU", 16)  # 2 query blocks per chunk
    torch.manual_seed(0)
    batch = random_packed_batch(tiny_cfg(), batch_size=2, seq_len=100, seed=2)

    def cfg(backend):
        return tiny_cfg(backend, attention=AttentionConfig(backend=backend, pattern="LBG", window=12, block_size=8,
                                                           num_selected_blocks=3, selector=selector, indexer_dim=8))

    ref, other = OmniModel(cfg("sdpa")), OmniModel(cfg("blocksparse"))
    other.load_state_dict(ref.state_dict())
    assert apply_activation_checkpointing(other) == 3
    grads = []
    for model in (ref, other):
        out = run(model, batch)
        out.loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], msg=lambda m, n=name: f"{n}: {m}")
