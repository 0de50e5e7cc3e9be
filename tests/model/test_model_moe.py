"""MoE: dispatch equals a per-expert reference, bias balancing evens load, modality groups."""

from __future__ import annotations

import pytest
import torch

from omniloom.kernels.ops import get_ops
from omniloom.model.config import ModelConfig, MoEConfig
from omniloom.model.moe import MoE


def make_moe(dispatch="auto", **kw) -> MoE:
    moe = MoEConfig(**{"num_experts": 6, "num_experts_per_token": 2, "expert_dim": 16, "num_shared_experts": 1, "dispatch": dispatch, **kw})
    cfg = ModelConfig(dim=32, vocab_size=10, moe=moe)
    torch.manual_seed(0)
    layer = MoE(cfg, get_ops("reference"))
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    return layer


def naive_moe(layer: MoE, x_TD, modality_T):
    """Token by token: route, run each chosen expert, weight, add the shared expert."""
    idx_TK, w_TK, _, _ = layer.route(x_TD, modality_T)
    out = []
    for t in range(x_TD.shape[0]):
        y = layer.shared(x_TD[t]) if layer.shared is not None else 0
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            h = torch.nn.functional.silu(x_TD[t] @ layer.w_gate[e]) * (x_TD[t] @ layer.w_up[e])
            y = y + w_TK[t, k] * (h @ layer.w_down[e])
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_grouped_and_loop_dispatch_equal_per_expert_reference(score_func):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 24, 32, generator=g)
    mod = torch.randint(0, 5, (2, 24), generator=g)
    results = []
    for dispatch in ("grouped", "loop"):
        layer = make_moe(dispatch, score_func=score_func)
        assert layer.use_grouped(x.device) == (dispatch == "grouped")
        xi = x.clone().requires_grad_(True)
        y, stats = layer(xi, mod)
        ref = naive_moe(layer, xi.view(-1, 32), mod.view(-1)).view_as(y)
        torch.testing.assert_close(y, ref)
        y.sum().backward()  # expanded grad: grouped_mm needs it made contiguous
        results.append((y, xi.grad, layer.w_gate.grad, layer.w_down.grad, layer.router.grad))
        assert int(stats["counts_ME"].sum()) == 48 * 2
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)


def test_bias_changes_choice_not_gate_weights():
    layer = make_moe()
    x = torch.randn(16, 32)
    mod = torch.zeros(16, dtype=torch.long)
    _, _, _, probs = layer.route(x, mod)
    layer.router_bias[3] = 10.0
    idx, w, _, probs2 = layer.route(x, mod)
    assert (idx == 3).any(dim=1).all()  # every token now picks expert 3
    torch.testing.assert_close(probs2, probs)
    chosen = probs.gather(1, idx)
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True))


def test_bias_balancing_evens_a_skewed_router():
    layer = make_moe(bias_update_rate=1e-2)
    with torch.no_grad():
        layer.router[0] += 0.2  # a router that prefers experts 0 and 1 for most tokens
        layer.router[1] += 0.12
    x = torch.randn(512, 32, generator=torch.Generator().manual_seed(2)).abs()
    mod = torch.zeros(512, dtype=torch.long)

    def imbalance():
        idx, *_ = layer.route(x, mod)
        load = torch.bincount(idx.flatten(), minlength=6).float()
        return (load.max() / load.mean()).item(), load

    before, _ = imbalance()
    late = []
    for step in range(300):
        ratio, load = imbalance()
        layer.update_bias(load)
        if step >= 250:
            late.append(ratio)
    after = sum(late) / len(late)  # sign updates oscillate around balance: judge the last 50
    assert before > 2.0 and after < 1.25, (before, after, load)
    assert abs(float(layer.router_bias.sum())) < 1e-4  # re-centred


def test_modality_groups_route_text_and_visual_apart():
    layer = make_moe(modality_groups=True, num_visual_experts=2)
    x = torch.randn(1, 40, 32)
    mod = torch.tensor([[0, 1, 2, 3, 4] * 8])
    y, stats = layer(x, mod)
    counts = stats["counts_ME"]
    assert counts[[0, 1, 4], 4:].sum() == 0 and counts[[2, 3], :4].sum() == 0
    assert counts[2:4, 4:].sum() == 16 * 2
    # balancing moves each group around its own mean
    layer.update_bias(counts.sum(0))
    assert abs(float(layer.router_bias[:4].sum())) < 1e-6 and abs(float(layer.router_bias[4:].sum())) < 1e-6


def test_aux_and_router_z_losses_are_differentiable():
    layer = make_moe(aux_loss_coef=0.01, router_z_loss_coef=1e-3)
    x = torch.randn(1, 20, 32)
    _, stats = layer(x, torch.zeros(1, 20, dtype=torch.long))
    (stats["aux_loss"] + stats["router_z_loss"]).backward()
    assert layer.router.grad is not None and layer.router.grad.abs().sum() > 0
    assert stats["aux_loss"] >= 1.0 - 1e-5  # E * sum f * P >= 1, equal at perfect balance


def test_grouped_dispatch_rejects_unaligned_dims():
    with pytest.raises(ValueError, match="multiples of 8"):
        make_moe("grouped", expert_dim=12)
    assert not make_moe("auto", expert_dim=12).use_grouped(torch.device("cpu"))
    assert make_moe("auto").use_grouped(torch.device("cpu"))


def test_padding_is_routed_but_not_counted_or_balanced():
    layer = make_moe(aux_loss_coef=0.01, router_z_loss_coef=1e-3)
    x = torch.randn(1, 20, 32)
    mod = torch.zeros(1, 20, dtype=torch.long)
    real = torch.ones(1, 20, dtype=torch.bool)
    real[0, 14:] = False  # six padding tokens at the end of the row
    y_all, stats_all = layer(x, mod)
    y, stats = layer(x, mod, real)
    torch.testing.assert_close(y, y_all)  # padding still goes through the experts (static shapes)
    assert int(stats["counts_ME"].sum()) == 14 * layer.top_k
    _, stats_real = layer(x[:, :14], mod[:, :14])  # the same as if padding were not there at all
    assert torch.equal(stats["counts_ME"], stats_real["counts_ME"])
    torch.testing.assert_close(stats["aux_loss"], stats_real["aux_loss"])
    torch.testing.assert_close(stats["router_z_loss"], stats_real["router_z_loss"])


def test_model_leaves_pad_tokens_out_of_expert_counts():
    from omniloom.model import OmniModel
    from omniloom.model.synthetic import random_packed_batch

    cfg = ModelConfig(dim=32, num_layers=2, num_heads=2, num_kv_heads=1, vocab_size=64, rope_sections=(4, 6, 6),
                      patch_dim=12, tubelet_dim=24, patch_token_id=8, pad_token_id=3, kernels="reference",
                      moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1))
    batch = random_packed_batch(cfg, batch_size=2, seq_len=64, pad=7)
    num_pad = int((batch["input_ids"] == 3).sum())
    assert num_pad >= 14
    out = OmniModel(cfg)(**batch)
    assert int(out.expert_counts.sum()) == (batch["input_ids"].numel() - num_pad) * 2  # one MoE layer, top-2


def test_auto_dispatch_loops_for_float64_on_cpu():
    # grouped_mm serves fp32/bf16/fp16 only: a float64 model (parity checks) must loop, not crash
    layer = make_moe("auto").double()
    x = torch.randn(1, 12, 32, dtype=torch.float64, requires_grad=True)
    y, _ = layer(x, torch.zeros(1, 12, dtype=torch.long))
    y.square().sum().backward()
    assert y.dtype == torch.float64 and x.grad is not None
    assert not layer.use_grouped(torch.device("cpu"), torch.float64) and layer.use_grouped(torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="fp32/bf16/fp16"):
        make_moe("grouped").double()(x, torch.zeros(1, 12, dtype=torch.long))
