"""train.init_from=EXPORT (issue 26): a run starts from an export's weights, with a new optimizer."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.pretrain.config.run import RunConfig
from omniloom.pretrain.train.init_from import check_init_from, load_init_weights


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return d


def run_cfg(tok_dir, **model) -> RunConfig:
    from omniloom.data.config import DataConfig
    from omniloom.tokenizers.text import Tokenizer

    tok = Tokenizer.load(tok_dir)
    cfg = ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size,
                      patch_token_id=tok.patch_id, pad_token_id=3, rope_sections=(2, 2, 4), patch_dim=tok.patch_dim,
                      tubelet_dim=tok.tubelet_dim,
                      attention=AttentionConfig(backend="sdpa", pattern="LB", window=12, block_size=8),
                      moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32))
    return RunConfig(model=dataclasses.replace(cfg, **model), data=DataConfig(tokenizer=str(tok_dir)))


@pytest.fixture(scope="module")
def export(tok_dir, tmp_path_factory):
    from omniloom.pretrain.export.write import save_export

    cfg = run_cfg(tok_dir)
    torch.manual_seed(1)
    model = OmniModel(cfg.model)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if t.is_floating_point() and t.dim() == 1:
                t.add_(torch.randn_like(t) * 0.1)  # norms and router biases away from their init
        for layer in model.layers:
            if layer.is_moe:  # balancing keeps the biases centred
                layer.ffn.router_bias.sub_(layer.ffn.router_bias.mean())
    out = tmp_path_factory.mktemp("exp") / "export"
    save_export(model, tok_dir, out)
    return out, model


def test_weights_come_from_the_export_and_other_settings_from_the_run(tok_dir, export, caplog):
    folder, source = export
    cfg = run_cfg(tok_dir, attention=AttentionConfig(backend="blocksparse", pattern="LB", window=16, block_size=8))
    torch.manual_seed(2)
    model = OmniModel(cfg.model)
    with caplog.at_level(logging.WARNING, logger="omniloom.pretrain.train.init_from"):
        load_init_weights(model, check_init_from(str(folder)), cfg)
    for name, t in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], t), name
    assert "model.attention.window (12 in the export, 16 here)" in caplog.text and "backend" not in caplog.text


def test_an_expert_parallel_rank_takes_its_slice(tok_dir, export):
    folder, source = export
    cfg = run_cfg(tok_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe,
                                                                                                expert_parallel=2)))
    model = OmniModel(cfg.model, expert_range=(2, 4))
    load_init_weights(model, folder, cfg, expert_range=(2, 4))
    assert torch.equal(model.layers[1].ffn.w_gate, source.layers[1].ffn.w_gate[2:4])
    assert torch.equal(model.layers[1].ffn.router_bias, source.layers[1].ffn.router_bias)


def test_refusals_name_the_problem(tok_dir, export, tmp_path):
    folder, _ = export
    with pytest.raises(ValueError, match="train.init_from=.*has no config.json"):
        check_init_from(str(tmp_path))
    wider = run_cfg(tok_dir, dim=64, rope_sections=(4, 4, 8))
    with pytest.raises(ValueError, match="its weights do not fit this run's model"):
        load_init_weights(OmniModel(wider.model), folder, wider)
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    cfg["tokenizer"]["model_sha256"] = "0" * 64
    (other / "config.json").write_text(json.dumps(cfg))
    (other / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    cfg = run_cfg(tok_dir)
    with pytest.raises(ValueError, match="another tokenizer"):
        load_init_weights(OmniModel(cfg.model), other, cfg)

    # issue 29: an export trained before rope_layout existed (its config.json has no key) trained
    # with the sections layout; today's default would rotate its weights otherwise, silently
    old = tmp_path / "old"
    old.mkdir()
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["model"]["rope_layout"]
    (old / "config.json").write_text(json.dumps(cfg))
    (old / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes())
    now = run_cfg(tok_dir, rope_layout="interleaved")
    with pytest.raises(ValueError, match=r"init_from=.* was trained with model.rope_layout=sections .*use model.rope_layout=sections"):
        load_init_weights(OmniModel(now.model), old, now)
    then = run_cfg(tok_dir, rope_layout="sections")
    load_init_weights(OmniModel(then.model), old, then)


def test_the_trainer_starts_from_the_export_with_a_fresh_optimizer(tok_dir, export, tmp_path):
    """Through the real Trainer: with lr 0 and no bias updates, the step-1 checkpoint holds the
    export's weights exactly, and its optimizer state is one step old."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from omniloom.pretrain.checkpoint.offline import read_checkpoint_weights
    from omniloom.pretrain.train.loop import Trainer

    folder, source = export
    cfg = run_cfg(tok_dir)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=dataclasses.replace(cfg.model.moe,
                                                                                                bias_update_rate=0.0)))
    cfg.train.run_dir, cfg.train.num_steps, cfg.train.init_from = str(tmp_path / "run"), 1, str(folder)
    cfg.optim.lr, cfg.checkpoint.every, cfg.logging.trackers = 0.0, 1, []

    def loader(cfg, split, rank, world_size):
        from omniloom.model.synthetic import random_packed_batch

        if split != "train":
            return None
        batch = random_packed_batch(cfg.model, batch_size=1, seq_len=32, docs_per_row=1, seed=0)
        return _Repeat(batch)

    try:
        Trainer(cfg, build_loader=loader, progress=False).fit()
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
    got = read_checkpoint_weights(tmp_path / "run" / "checkpoints" / "step_00000001")
    for name, t in source.named_parameters():
        assert torch.equal(got[name], t), name
    buffers = set(source.state_dict()) - {n for n, _ in source.named_parameters()}
    for name in buffers:  # the balancing biases: re-centred after the step (rounding only, at rate 0)
        torch.testing.assert_close(got[name], source.state_dict()[name], rtol=0, atol=1e-7)
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_00000001" / "trainer.pt", weights_only=True)
    assert state["step"] == 1


class _Repeat:
    """The same PackedBatch forever (a loader with the state the trainer saves)."""

    def __init__(self, batch):
        from omniloom.data.batch import PackedBatch

        self.batch = PackedBatch(**batch) if isinstance(batch, dict) else batch

    def __iter__(self):
        while True:
            yield self.batch

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass
