"""Trainer pieces in one process: schedules, parameter groups, checkpoints, guards, metrics, and the
loop itself with tiny stand-ins for the model and stream (tests/support/train_standin.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
import torch

from omniloom.pretrain.checkpoint import manager as ckpt_mod
from omniloom.pretrain.config.run import OptimConfig, load_config
from omniloom.pretrain.train.guards import NonFiniteError, NonFiniteGuard, SpikeDetector
from omniloom.pretrain.train.metrics import expert_balance, per_modality_losses
from omniloom.pretrain.rundir import read_metrics
from omniloom.pretrain.train.optim import build_optimizer, lr_factor, param_groups
from omniloom.pretrain.train.parallel import apply_activation_checkpointing

_spec = importlib.util.spec_from_file_location("train_standin", (Path(__file__).resolve().parents[1] / "support" / "train_standin.py"))
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    yield
    standin.reset_accelerate()


_trainer = standin.standin_trainer


# ---- schedules and optimizer -------------------------------------------------------------------
def test_warmup_cosine_and_wsd_shapes():
    cos = OptimConfig(warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    f = [lr_factor(s, cos, 100) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(f[:10], f[1:10]))  # warmup rises
    assert all(a >= b for a, b in zip(f[10:], f[11:]))  # cosine falls
    assert f[55] == pytest.approx(0.1 + 0.9 * 0.5, abs=1e-9)  # midpoint of the cosine
    assert lr_factor(100, cos, 100) == pytest.approx(0.1)
    wsd = OptimConfig(warmup_steps=10, schedule="wsd", decay_fraction=0.2, min_lr_ratio=0.0)
    g = [lr_factor(s, wsd, 100) for s in range(101)]
    assert g[10:80] == [1.0] * 70  # stable phase
    assert g[90] == pytest.approx(0.5) and g[100] == pytest.approx(0.0)
    assert lr_factor(50, OptimConfig(warmup_steps=10, schedule="constant"), 100) == 1.0


def test_no_weight_decay_on_norms_embeddings_biases():
    model = standin.StandinModel()
    model.layers[0].extra = torch.nn.Linear(4, 4, bias=True)
    groups = param_groups(model, 0.1)
    decay = next(g for g in groups if g["weight_decay"] > 0)["names"]
    no_decay = next(g for g in groups if g["weight_decay"] == 0)["names"]
    assert "head.weight" in decay and "layers.0.up.weight" in decay
    for name in ("embed.weight", "prev_embed.weight", "final_norm.weight", "layers.0.norm.weight",
                 "layers.0.extra.bias"):
        assert name in no_decay, name
    assert not set(decay) & set(no_decay)
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1))
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))


def test_real_model_param_groups_decay_matrices_only():
    from omniloom.model import OmniModel
    from omniloom.model.config import ModelConfig

    model = OmniModel(ModelConfig(dim=32, num_heads=2, num_kv_heads=1, num_layers=2, vocab_size=40,
                                  rope_sections=(4, 6, 6)))
    groups = param_groups(model, 0.1)
    decay = set(next(g for g in groups if g["weight_decay"] > 0)["names"])
    no_decay = set(next(g for g in groups if g["weight_decay"] == 0)["names"])
    assert {"embed.tok.weight", "norm", "layers.0.attn_norm", "layers.1.ffn_norm", "layers.0.attn.q_norm"} <= no_decay
    assert {"head.weight", "layers.0.attn.wq.weight", "layers.1.ffn.w_gate", "layers.1.ffn.w_down"} <= decay
    assert all(p.ndim >= 2 for n, p in model.named_parameters() if n in decay)
    assert decay | no_decay == {n for n, _ in model.named_parameters()}


# ---- checkpoints --------------------------------------------------------------------------------
def _fake_complete(ckpt_dir: Path, step: int) -> Path:
    d = ckpt_dir / ckpt_mod.checkpoint_name(step)
    d.mkdir(parents=True)
    (d / "trainer.pt").write_bytes(b"x")
    (d / ckpt_mod.MARKER).write_text(json.dumps({"step": step, "files": ["trainer.pt"], "world_size": 1}))
    return d


@pytest.mark.parametrize("saved_sharded,run_fsdp", [(True, False), (False, True)])
def test_resume_refuses_a_sharded_checkpoint_without_fsdp_and_the_reverse(tmp_path, saved_sharded, run_fsdp):
    """An FSDP2 (torch.distributed.checkpoint) checkpoint loads on any number of processes, but
    only in an FSDP run; a replicated one only without FSDP: the error says which config to use."""
    import json
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from omniloom.pretrain.checkpoint.manager import MARKER, CheckpointManager

    ckpt = tmp_path / "checkpoints" / "step_00000002"
    (ckpt / "accelerate").mkdir(parents=True)
    if saved_sharded:
        (ckpt / "accelerate" / "pytorch_model_fsdp_0").mkdir()
    (ckpt / MARKER).write_text(json.dumps({"step": 2, "files": [], "world_size": 2}))
    acc = SimpleNamespace(num_processes=4, is_main_process=True, process_index=0, wait_for_everyone=lambda: None,
                          distributed_type=DistributedType.FSDP if run_fsdp else DistributedType.MULTI_GPU)
    manager = CheckpointManager(tmp_path / "checkpoints", acc)
    match = "an FSDP checkpoint: resume it with an FSDP accelerate config" if saved_sharded else "resume it without FSDP"
    with pytest.raises(ValueError, match=match):
        manager.load(ckpt)


def test_resume_auto_never_picks_a_folder_cut_off_mid_write(tmp_path):
    good = _fake_complete(tmp_path, 8)
    (tmp_path / ".tmp-step_00000012").mkdir()  # killed while writing
    partial = tmp_path / "step_00000016"  # renamed by hand, no marker
    partial.mkdir()
    (partial / "trainer.pt").write_bytes(b"x")
    lying = _fake_complete(tmp_path, 20)  # marker lists a file that is gone
    (lying / ckpt_mod.MARKER).write_text(json.dumps({"step": 20, "files": ["trainer.pt", "accelerate/model.safetensors"]}))
    assert ckpt_mod.latest_checkpoint(tmp_path) == good
    assert ckpt_mod.resolve_resume("auto", tmp_path) == good
    assert ckpt_mod.resolve_resume("", tmp_path) is None
    with pytest.raises(ValueError, match="incomplete"):
        ckpt_mod.resolve_resume(str(partial), tmp_path)
    with pytest.raises(FileNotFoundError, match="auto"):
        ckpt_mod.resolve_resume(str(tmp_path / "nope"), tmp_path)
    assert ckpt_mod.resolve_resume("auto", tmp_path / "empty") is None


def test_incomplete_checkpoint_message_names_the_missing_file(tmp_path):
    """Issue 14 item 18: a marker that lists a file no longer there is not 'no valid marker'."""
    lying = _fake_complete(tmp_path, 20)
    (lying / ckpt_mod.MARKER).write_text(json.dumps({"step": 20, "files": ["trainer.pt", "accelerate/model.safetensors"]}))
    with pytest.raises(ValueError, match=r"accelerate/model\.safetensors listed in its COMPLETE marker is missing") as err:
        ckpt_mod.resolve_resume(str(lying), tmp_path)
    assert "no valid" not in str(err.value)
    unmarked = tmp_path / "step_00000024"
    unmarked.mkdir()
    with pytest.raises(ValueError, match="no COMPLETE marker"):
        ckpt_mod.resolve_resume(str(unmarked), tmp_path)
    from omniloom.pretrain.checkpoint.offline import resolve_checkpoint

    with pytest.raises(ValueError, match=r"accelerate/model\.safetensors listed"):
        resolve_checkpoint(lying)


def test_resume_auto_and_export_name_the_newer_incomplete_checkpoints_they_skip(tmp_path, caplog):
    """Issue 14 item 18 beyond an explicit step_N: `--resume auto` skipped a checkpoint whose marker
    lists a missing file with an INFO line, and started from step 0 when it was the only one;
    `omniloom export RUN` said 'none with a COMPLETE marker' though the marker was there."""
    from omniloom.pretrain.checkpoint.offline import resolve_checkpoint

    ckpts = tmp_path / "run" / "checkpoints"
    ckpts.mkdir(parents=True)
    lying = _fake_complete(ckpts, 20)
    (lying / ckpt_mod.MARKER).write_text(json.dumps({"step": 20, "files": ["trainer.pt", "accelerate/model.safetensors"]}))
    missing = r"step_00000020 \(accelerate/model\.safetensors listed in its COMPLETE marker is missing"
    with pytest.raises(ValueError, match=r"checkpoint.resume=auto: .* holds no complete checkpoint, only " + missing):
        ckpt_mod.resolve_resume("auto", ckpts)
    with pytest.raises(ValueError, match=r"holds no complete checkpoint yet: only " + missing) as err:
        resolve_checkpoint(tmp_path / "run")
    assert "none with a" not in str(err.value)
    good = _fake_complete(ckpts, 8)
    with caplog.at_level("WARNING"):
        assert ckpt_mod.resolve_resume("auto", ckpts) == good
        assert resolve_checkpoint(tmp_path / "run") == good
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 2 and all(re.search(missing, w) and "step_00000008" in w for w in warned), warned
    lying.rename(ckpts / ".tmp-step_00000020")  # a temporary folder is never read, and never reported
    caplog.clear()
    assert ckpt_mod.resolve_resume("auto", ckpts) == good and not caplog.records


def test_checkpoint_files_honour_the_umask(tmp_path):
    """Issue 14 item 20: accelerate's model.safetensors came out 0600 beside 0644 files."""
    import os

    old = os.umask(0o027)
    try:
        _trainer(tmp_path, "train.num_steps=1", "checkpoint.every=0").fit()
    finally:
        os.umask(old)
    files = [p for p in ckpt_mod.latest_checkpoint(tmp_path / "checkpoints").rglob("*") if p.is_file()]
    assert any(p.name.endswith(".safetensors") for p in files)
    assert {p.name: oct(os.stat(p).st_mode & 0o777) for p in files} == {p.name: oct(0o640) for p in files}


def test_save_interrupted_before_rename_leaves_nothing_visible(tmp_path, monkeypatch):
    trainer = _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=0", "checkpoint.keep_last=2")
    trainer.fit()
    ckpts = tmp_path / "checkpoints"
    assert [p.name for p in ckpt_mod.list_checkpoints(ckpts)] == ["step_00000002"]

    def boom(src, dst):
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ckpt_mod.os, "replace", boom)
    trainer.step = 3
    with pytest.raises(KeyboardInterrupt):
        trainer.save()
    monkeypatch.undo()
    assert ckpt_mod.latest_checkpoint(ckpts).name == "step_00000002"
    assert (ckpts / ".tmp-step_00000003").exists()
    for step in (4, 5, 6):
        trainer.step = step
        trainer.save()
    assert [p.name for p in ckpt_mod.list_checkpoints(ckpts)] == ["step_00000005", "step_00000006"]  # keep_last=2


def test_keep_last_never_prunes_the_newest_save_for_a_higher_step_beside_it(tmp_path):
    trainer = _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=1", "checkpoint.keep_last=1")
    old = _fake_complete(tmp_path / "checkpoints", 100)  # e.g. a run resumed from an older checkpoint
    trainer.fit()
    names = [p.name for p in ckpt_mod.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_00000002", old.name]  # the new run's newest survives pruning


# ---- guards and metrics -------------------------------------------------------------------------
def test_nonfinite_guard_counts_and_stops_naming_step_and_checkpoint():
    g = NonFiniteGuard(3)
    assert g.check(1, 2.0, 1.0, None)
    assert not g.check(2, float("nan"), 1.0, None)
    assert g.check(3, 2.0, 1.0, None) and g.in_a_row == 0
    assert not g.check(4, 2.0, float("inf"), "ck/step_3")
    assert not g.check(5, float("nan"), 1.0, "ck/step_3")
    with pytest.raises(NonFiniteError, match=r"step 6.*ck/step_3"):
        g.check(6, float("nan"), float("nan"), "ck/step_3")
    assert g.total_skipped == 4


def test_spike_detector_flags_only_outliers():
    det = SpikeDetector(window=16, sigma=6.0)
    vals = [3.0 + 0.01 * math.sin(i) for i in range(16)]
    assert all(det.update(v) is None for v in vals)
    assert det.update(3.0) is None
    assert det.update(5.0) > 6.0
    det2 = SpikeDetector(window=16)
    det2.load_state_dict(det.state_dict())
    assert list(det2.values) == list(det.values)


def test_expert_balance_and_modality_losses():
    counts = torch.zeros(2, 5, 4)
    counts[1, 0] = torch.tensor([10.0, 10.0, 10.0, 10.0])
    counts[1, 2] = torch.tensor([40.0, 0.0, 0.0, 0.0])
    out = expert_balance(counts)
    assert "moe/max_over_mean/layer0" not in out  # dense layer: no counts
    assert out["moe/max_over_mean/layer1/text"] == 1.0
    assert out["moe/max_over_mean/layer1/image"] == 4.0
    assert out["moe/max_over_mean/layer1"] == pytest.approx(50 / 20)
    losses = per_modality_losses(torch.tensor([4.0, 0, 9.0, 0, 0]), torch.tensor([2.0, 0, 3.0, 0, 0]), "loss")
    assert losses == {"loss/text": 2.0, "loss/image": 3.0}


def test_activation_checkpointing_keeps_keys_and_gradients():
    torch.manual_seed(0)
    a, b = standin.StandinModel(), standin.StandinModel()
    b.load_state_dict(a.state_dict())
    assert apply_activation_checkpointing(b) == 2
    assert list(a.state_dict()) == list(b.state_dict())
    batch = standin.make_batch(0, 0, 0, 2, 8)
    fields = {f: getattr(batch, f) for f in ("input_ids", "labels", "positions", "doc_ids", "block_ids",
                                              "modality", "patches", "patch_kind")}
    a(**fields).loss.backward()
    b(**fields).loss.backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(pa.grad, pb.grad, msg=name)


# ---- the loop ----------------------------------------------------------------------------------
def test_loss_falls_and_metrics_are_logged(tmp_path):
    trainer = _trainer(tmp_path, "train.num_steps=20", "checkpoint.every=0", "train.eval_every=10",
                       "train.eval_steps=2", "train.grad_accum_steps=2", "logging.every=5")
    result = trainer.fit()
    assert result.step == 20 and result.stopped_by == "done"
    assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5 - 0.5
    rows = read_metrics(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, 21))
    full = [r for r in train_rows if "tokens_per_s" in r]
    assert [r["step"] for r in full] == [5, 10, 15, 20]
    for key in ("loss/text", "loss/code", "loss/special", "z_loss", "grad_norm", "lr", "final_out_rms",
                "data_wait_fraction", "time/forward_s", "time/backward_s", "time/optimizer_s",
                "moe/max_over_mean", "data/skipped_samples"):
        assert key in full[-1], key
    assert "mfu" not in full[-1]  # no peak on CPU
    assert full[-1]["tokens_seen"] == 20 * 2 * 4 * 16
    evals = [r for r in rows if "eval/loss/text" in r]
    assert [r["step"] for r in evals] == [0, 10, 20]  # step 0: the untrained baseline
    assert evals[2]["eval/loss"] < evals[1]["eval/loss"] < evals[0]["eval/loss"]
    assert trainer.acc.unwrap_model(trainer.model).bias_updates == 20
    assert ckpt_mod.latest_checkpoint(tmp_path / "checkpoints").name == "step_00000020"


def test_training_logs_progress_lines_with_tokens_per_second(tmp_path, caplog):
    """Issue 15.6: without a terminal the loop itself reports progress (a periodic line; the last
    step always), with the step, the loss, the learning rate and tokens/s; issue 28.7: and the mean
    step time since the last line and the peak memory (RSS on CPU)."""
    import logging

    trainer = _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=0", "logging.progress_seconds=0.000001")
    with caplog.at_level(logging.INFO, logger="omniloom.pretrain.train.metrics"):
        trainer.fit()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 1/2 (50%), loss ") and "left ~" in lines[0]
    assert re.match(r"step 2/2 \(100%\), loss [\d.]+, lr [\d.e-]+, tok/s [\d,]+, step time [\d.]+s, "
                    r"peak mem [\d.]+ GiB \(RSS\), elapsed \d+s$", lines[1]), lines[1]


def test_ddp_does_not_search_for_unused_parameters_by_default(tmp_path):
    """Every parameter gets a gradient each step (tests/model/test_model.py), so DDP runs without the
    extra autograd traversal of find_unused_parameters=True, in every preset."""
    from omniloom.pretrain.config.run import list_presets
    from omniloom.pretrain.train.loop import make_accelerator

    for preset in [None, *list_presets()]:
        assert load_config(preset).train.find_unused_parameters is False, preset
    acc = make_accelerator(load_config(None, standin.base_overrides(tmp_path)))
    assert acc.ddp_handler.find_unused_parameters is False


def test_grad_accum_loss_is_the_mean_over_all_labels_not_a_mean_of_means(tmp_path):
    # Two micro-batches with very different label counts (a patch-heavy row has few labels): the
    # step's gradient and logged loss must be those of one batch holding both, mean over its labels.
    import copy

    trainer = _trainer(tmp_path, "train.num_steps=1", "checkpoint.every=0", "train.grad_accum_steps=2",
                       "optim.grad_clip=0")
    a = standin.make_batch(1, 0, 0, 4, 16)
    b = standin.make_batch(1, 0, 1, 4, 16)
    b.labels[:, 2:] = -100  # 8 labels against 64
    trainer.train_iter = iter([a, b])
    ref = copy.deepcopy(trainer.acc.unwrap_model(trainer.model))
    cat = standin.Batch(**{f: torch.cat([getattr(a, f), getattr(b, f)]) for f in
                           ("input_ids", "labels", "positions", "doc_ids", "block_ids", "modality")},
                        patches=a.patches, patch_kind=a.patch_kind)
    out = ref(**{f: getattr(cat, f) for f in ("input_ids", "labels", "positions", "doc_ids", "block_ids",
                                              "modality", "patches", "patch_kind")})
    out.loss.backward()
    vec, _ = trainer._train_step()
    stats = trainer._unpack(vec)
    assert stats["loss"] == pytest.approx(out.loss.item(), rel=1e-5)
    assert stats["ce_loss"] == pytest.approx(out.ce_loss.item(), rel=1e-5)
    got = dict(trainer.acc.unwrap_model(trainer.model).named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_eval_loss_is_a_token_mean_over_batches(tmp_path):
    trainer = _trainer(tmp_path, "train.num_steps=1", "checkpoint.every=0", "train.eval_steps=2")
    a = standin.make_batch(2, 0, 0, 4, 16)
    b = standin.make_batch(2, 0, 1, 4, 16)
    b.labels[:, 1:] = -100  # 4 labels against 64
    trainer._build_loader = lambda cfg, split, rank, world: [a, b]
    cat = {f: torch.cat([getattr(a, f), getattr(b, f)]) for f in
           ("input_ids", "labels", "positions", "doc_ids", "block_ids", "modality")}
    model = trainer.acc.unwrap_model(trainer.model)
    with torch.no_grad():
        want = model(**cat, patches=a.patches, patch_kind=a.patch_kind).loss.item()
    assert trainer.evaluate()["eval/loss"] == pytest.approx(want, rel=1e-5)


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path):
    # Forward calls 3 and 4 return NaN: both updates are skipped, training continues.
    trainer = _trainer(tmp_path, "train.num_steps=6", "checkpoint.every=2", "train.max_bad_steps=3",
                       nan_at_call={3, 4})
    result = trainer.fit()
    assert result.step == 6 and trainer.guard.total_skipped == 2
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert rows[-1]["skipped_updates"] == 2 and all(math.isfinite(p.sum().item()) for p in trainer.model.parameters())
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True), GradientState._reset_state(), PartialState._reset_state()
    run2 = tmp_path / "run2"
    trainer = _trainer(run2, "train.num_steps=10", "checkpoint.every=2", "train.max_bad_steps=3",
                       nan_at_call={5, 6, 7})
    with pytest.raises(NonFiniteError, match=r"step 7: 3 steps in a row.*step_00000006"):
        trainer.fit()


@pytest.mark.parametrize("when", ["forward", "batch read"])
def test_sigterm_finishes_step_saves_and_returns(tmp_path, when):
    """A signal while a step computes: the step finishes, is saved, the run returns. A signal while
    a step's batches are being read (issue 27 item 4: a batch can take long to build): nothing of
    that step has been trained, so the wait ends there and the step before it is saved."""
    if when == "forward":
        trainer = _trainer(tmp_path, "train.num_steps=50", "checkpoint.every=0", sigterm_at_call=3)
        want_step = 3
    else:
        # the loader signals as it yields its 4th batch: batches are staged one step ahead, so
        # that is while step 3 reads its batches
        trainer = _trainer(tmp_path, "train.num_steps=50", "checkpoint.every=0", sigterm_at=4)
        want_step = 2
    result = trainer.fit()
    assert result.stopped_by == "signal" and result.step == want_step
    assert trainer.train_loader.consumed == 4  # the staged batch was read ...
    latest = ckpt_mod.latest_checkpoint(tmp_path / "checkpoints")
    assert latest.name == f"step_{want_step:08d}" and ckpt_mod.is_complete(latest)
    state = torch.load(latest / "data_rank00000.pt", weights_only=True)
    assert state == {"consumed": want_step}  # ... but the checkpoint resumes at the first batch not trained on


def _forget_checksums(ckpt):
    """COMPLETE without its checksums: a checkpoint from before they were recorded, or one whose
    tamperer rewrote the record too. The files' own checks must still refuse what is unsafe."""
    info = json.loads((ckpt / ckpt_mod.MARKER).read_text())
    info.pop("sha256", None)
    (ckpt / ckpt_mod.MARKER).write_text(json.dumps(info))


class _Payload:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True), GradientState._reset_state(), PartialState._reset_state()


@pytest.mark.parametrize("tamper, match", [
    ("optimizer_payload", r"refusing to resume from .*: accelerate/optimizer\.bin holds pickled objects"),
    ("trainer_payload", r"refusing to resume from .*: trainer\.pt holds pickled objects"),
    ("rng_payload", r"refusing to resume from .*: accelerate/random_states_0\.pkl holds pickled objects"),
    ("rng_truncated", r"cannot resume from .*: accelerate/random_states_0\.pkl is unreadable"),
    ("rng_wrong_keys", r"cannot resume from .*: accelerate/random_states_0\.pkl is unreadable"),
])
def test_resume_refuses_unsafe_or_corrupt_state_in_one_line(tmp_path, tamper, match):
    """Issue 14 item 4: a pickle payload ended in a raw UnpicklingError (with torch's hint to use
    weights_only=False), and an unreadable RNG file was skipped with an INFO line, so the resumed
    run silently stopped being exact. Both are now a ValueError (one line, exit 2 in the CLI)."""
    _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=2").fit()
    ckpt = ckpt_mod.latest_checkpoint(tmp_path / "checkpoints")
    _reset_accelerate()
    resumed = _trainer(tmp_path, "train.num_steps=3", f"checkpoint.resume={ckpt}")  # the untouched one resumes
    assert resumed.step == 2
    _reset_accelerate()
    marker = tmp_path / "pwned"
    rng = ckpt / "accelerate" / "random_states_0.pkl"
    if tamper == "optimizer_payload":
        torch.save({"state": _Payload(marker)}, ckpt / "accelerate" / "optimizer.bin")
    elif tamper == "trainer_payload":
        torch.save({"step": _Payload(marker)}, ckpt / "trainer.pt")
    elif tamper == "rng_payload":
        torch.save({"random_state": _Payload(marker)}, rng)
    elif tamper == "rng_truncated":
        rng.write_bytes(rng.read_bytes()[:100])
    else:
        torch.save({"step": 2}, rng)
    with pytest.raises(ValueError, match="does not match the checksum recorded when it was saved"):
        _trainer(tmp_path, "train.num_steps=3", f"checkpoint.resume={ckpt}")  # issue 27 item 6
    _reset_accelerate()
    _forget_checksums(ckpt)
    with pytest.raises(ValueError, match=match) as err:
        _trainer(tmp_path, "train.num_steps=3", f"checkpoint.resume={ckpt}")
    assert "weights_only=False" not in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("tampered_rank", [0, 1])
def test_resume_on_another_world_size_refuses_an_unsafe_rng_file_of_any_rank(tmp_path, tampered_rank):
    """Issue 14 item 4, on another world size: the RNG files were checked only when the process
    count matched, so a pickle payload in `random_states_0.pkl` of a 2-process checkpoint resumed
    on 1 process was skipped with an INFO line. Every saved rank's file is now checked by every
    rank, whether or not this run restores it."""
    import json
    import shutil

    _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=2").fit()
    ckpt = ckpt_mod.latest_checkpoint(tmp_path / "checkpoints")
    info = json.loads((ckpt / ckpt_mod.MARKER).read_text())  # make it a 2-process checkpoint
    info["world_size"] = 2
    (ckpt / ckpt_mod.MARKER).write_text(json.dumps(info))
    shutil.copy(ckpt / "data_rank00000.pt", ckpt / "data_rank00001.pt")
    shutil.copy(ckpt / "accelerate" / "random_states_0.pkl", ckpt / "accelerate" / "random_states_1.pkl")
    _reset_accelerate()
    # untouched, the RNG files pass and the resume gets as far as this stand-in loader's own refusal
    with pytest.raises(ValueError, match="cannot resume on another world size"):
        _trainer(tmp_path, "train.num_steps=3", f"checkpoint.resume={ckpt}")
    _reset_accelerate()
    marker = tmp_path / "pwned"
    torch.save({"random_state": _Payload(marker)}, ckpt / "accelerate" / f"random_states_{tampered_rank}.pkl")
    _forget_checksums(ckpt)
    with pytest.raises(ValueError, match=rf"refusing to resume from .*: accelerate/random_states_{tampered_rank}\.pkl "
                                         "holds pickled objects") as err:
        _trainer(tmp_path, "train.num_steps=3", f"checkpoint.resume={ckpt}")
    assert "\n" not in str(err.value) and not marker.exists()


# ---- CLI -----------------------------------------------------------------------------------------
SMALL_MODEL = ["model.dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.rope_sections=[8,12,12]",
               "model.attention.window=32", "model.attention.block_size=16", "model.moe.expert_dim=32",
               "model.moe.dense_dim=64", "model.num_layers=2", "data.seq_len=64", "data.batch_size=1"]


def test_bench_train_prints_throughput_and_breakdown(capsys):
    from omniloom.pretrain.cli import main

    assert main(["-qq", "bench", "train", "--steps", "2", "--warmup", "1", "tiny", *SMALL_MODEL]) == 0
    out = capsys.readouterr().out
    assert "tokens/s:" in out and "MFU omitted" in out and "data=synthetic" in out
    for phase in ("data", "forward", "backward", "optimizer", "other"):
        assert f"    {phase}" in out, phase
    assert "train step / forward-only =" in out and "dense warm-up" not in out
    assert "(the 1 warm-up step took " in out and "compile included" not in out
    # synthetic batches are built in-process: the tiny preset's 2 DataLoader workers take no cores
    from omniloom.pretrain.runtime.threads import choose_threads

    assert f"torch_threads={choose_threads(0, num_workers=0).threads}" in out


def test_bench_train_counts_the_vision_encoder_in_the_model_flops(capsys):
    from omniloom.pretrain.bench.train import bench_train

    plain, late = {}, {}
    model = [*SMALL_MODEL, "data.seq_len=256"]  # room for the synthetic rows' visual blocks
    bench_train("tiny", model, steps=1, warmup=0, figures=plain)
    out = bench_train("tiny", [*model, "model.vision_encoder.enabled=true"], steps=1, warmup=0, figures=late)
    assert plain["encoder_flops_per_s"] == 0 and late["encoder_flops_per_s"] > 0
    assert late["model_flops_per_s"] > late["encoder_flops_per_s"]
    assert "% in the vision encoder)" in out and "in the vision encoder" not in capsys.readouterr().out


def test_bench_train_at_several_sequence_lengths_prints_the_step_time_per_length(capsys):
    from omniloom.pretrain.cli import main

    model = [o for o in SMALL_MODEL if not o.startswith("data.seq_len")]
    assert main(["-qq", "bench", "train", "--steps", "1", "--warmup", "1", "--seq-lens", "32,64", "tiny", *model]) == 0
    out = capsys.readouterr().out
    assert out.count("tokens/s:") == 2 and "seq 32 x accum" in out and "seq 64 x accum" in out
    table = out.split("step time by sequence length")[1].splitlines()
    rows = [line.split() for line in table if line.strip() and line.split()[0].isdigit()]
    assert [r[0] for r in rows] == ["32", "64"] and rows[1][-3:] == ["for", "2x", "tokens"]
    assert main(["-qq", "bench", "train", "--seq-lens", "64,x", "tiny"]) == 2
    assert "--seq-lens takes comma-separated integers" in capsys.readouterr().err


def test_bench_train_says_when_b_layers_time_their_dense_warmup(capsys):
    from omniloom.pretrain.cli import main

    b_model = [*SMALL_MODEL, "model.attention.pattern=LB", "model.attention.num_selected_blocks=2"]
    for warmup_steps, said in ((100, True), (0, False)):
        assert main(["-qq", "bench", "train", "--steps", "1", "--warmup", "1", "tiny", *b_model,
                     f"model.attention.dense_warmup_steps={warmup_steps}"]) == 0
        out = capsys.readouterr().out
        assert ("B layers [1] were in their dense warm-up" in out) is said, out


def test_train_cli_user_errors_exit_2(tmp_path, capsys):
    from omniloom.pretrain.cli import main

    assert main(["train", "--run-dir", str(tmp_path), "tinyy"]) == 2
    assert "did you mean 'tiny'" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(tmp_path), "tiny", "model.vocab_size=64"]) == 2
    assert "data.sources is empty" in capsys.readouterr().err
    (tmp_path / "checkpoints" / "step_00000005").mkdir(parents=True)
    assert main(["train", "--run-dir", str(tmp_path), "--resume", str(tmp_path / "checkpoints" / "step_00000005"),
                 "tiny", "model.vocab_size=64", "data.sources=[{path: /no/such/shards}]"]) == 2
    assert "incomplete" in capsys.readouterr().err


def test_activation_checkpointing_on_the_real_model_gives_identical_gradients():
    from omniloom.model import OmniModel
    from omniloom.model.synthetic import random_packed_batch

    cfg = load_config("tiny", SMALL_MODEL + ["model.vocab_size=256", "model.patch_token_id=8",
                                             "model.patch_dim=48", "model.tubelet_dim=96"]).model
    torch.manual_seed(0)
    a, b = OmniModel(cfg), OmniModel(cfg)
    b.load_state_dict(a.state_dict())
    assert apply_activation_checkpointing(b) == cfg.num_layers
    batch = random_packed_batch(cfg, batch_size=2, seq_len=64)
    out_a, out_b = a(**batch), b(**batch)
    out_a.loss.backward()
    out_b.loss.backward()
    assert torch.equal(out_a.expert_counts, out_b.expert_counts)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.grad is not None:
            torch.testing.assert_close(pa.grad, pb.grad, msg=name)


def test_shipped_accelerate_configs_load_and_fsdp2_wraps_the_model_blocks():
    from accelerate.commands.config.config_args import load_config_from_file

    from omniloom.model import OmniModel
    from omniloom.pretrain.config.run import presets_dir
    from omniloom.pretrain.train.parallel import block_class_names

    paths = sorted((presets_dir() / "accelerate").glob("*.yaml"))
    names = {p.stem for p in paths}
    assert {"cpu_2proc", "single_gpu", "multi_gpu", "fsdp2", "multi_node", "ep_8gpu", "ep_fsdp2_8gpu"} <= names
    loaded = {p.stem: load_config_from_file(str(p)) for p in paths}
    assert loaded["cpu_2proc"].num_processes == 2 and loaded["cpu_2proc"].use_cpu
    fsdp = loaded["fsdp2"].fsdp_config
    assert fsdp["fsdp_version"] == 2 and fsdp["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
    assert loaded["ep_fsdp2_8gpu"].fsdp_config == fsdp  # the same FSDP2 settings, the trainer adds EP
    cfg = load_config("tiny", SMALL_MODEL + ["model.vocab_size=256", "model.patch_token_id=8"]).model
    assert block_class_names(OmniModel(cfg)) == [fsdp["fsdp_transformer_layer_cls_to_wrap"]]


def test_presets_have_the_advertised_active_sizes():
    from omniloom.model import accounting

    for name, lo, hi in (("small_100m", 70e6, 140e6), ("large_1b", 0.8e9, 1.3e9)):
        cfg = load_config(name, ["model.vocab_size=32768", "model.patch_token_id=8"]).model
        cfg.validate()
        assert lo <= accounting.num_active_params(cfg) <= hi, name


@pytest.mark.slow
def test_compiled_checkpointed_window_global_and_moe_blocks_have_no_graph_break():
    """train.compile with train.activation_checkpointing (bf16 autocast, as on a GPU): each L / G
    MoE block compiles whole. Its shared masks and the MoE's grouped-matmul choice are made
    before the blocks run, not stored from inside a checkpointed region (a side effect dynamo
    refuses there, running the block uncompiled). Same loss as eager. About a minute of inductor
    on CPU."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from omniloom.model import OmniModel
    from omniloom.model.synthetic import random_packed_batch
    from omniloom.pretrain.train.parallel import apply_activation_checkpointing, apply_compile

    cfg = load_config("tiny", SMALL_MODEL + ["model.vocab_size=256", "model.patch_token_id=8",
                                             "model.attention.pattern=LG", "model.attention.backend=blocksparse"]).model
    torch.manual_seed(0)
    eager, compiled = OmniModel(cfg), OmniModel(cfg)
    compiled.load_state_dict(eager.state_dict())
    assert apply_activation_checkpointing(compiled) == 2 and apply_compile(compiled) == 2
    assert any(layer.is_moe for layer in compiled.layers)
    batch = random_packed_batch(cfg, batch_size=2, seq_len=64, seed=3)
    layout = eager.batch_layout(batch["doc_ids"], batch["block_ids"])
    torch._dynamo.reset()
    counters.clear()
    losses = []
    for model in (eager, compiled):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**batch, layout=layout)
        out.loss.backward()
        losses.append(out.loss.detach())
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1
    torch.testing.assert_close(losses[1], losses[0], rtol=2e-3, atol=2e-3)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in compiled.parameters() if p.requires_grad)


@pytest.mark.slow
def test_compile_trains_and_checkpoints_with_plain_keys(tmp_path):
    """torch.compile per block (inductor needs a C++ compiler on CPU; minutes on a busy machine)."""
    trainer = _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=0", "train.compile=true",
                       "train.deterministic=false")
    result = trainer.fit()
    assert result.step == 2 and all(math.isfinite(x) for x in result.losses)
    from safetensors.torch import load_file

    saved = load_file(str(ckpt_mod.latest_checkpoint(tmp_path / "checkpoints") / "accelerate" / "model.safetensors"))
    assert set(saved) == set(standin.StandinModel().state_dict())


def test_loader_composition_is_over_every_rank_with_several_processes(monkeypatch):
    """data/token_share/* and data/padding_fraction sum the window's counts over ranks (this
    rank read text and images, the other only clips); skip and tokenizer counts are summed over
    ranks whatever their keys; the loader's rates stay this rank's. One process: its own figures,
    no collective."""
    from types import SimpleNamespace

    from omniloom.pretrain.train.loop import Trainer

    class Loader:
        last_window = None

        def metrics(self):
            self.last_window = {"tokens": [100, 0, 100, 0, 0], "padding": 0}
            return {"token_share/text": 0.5, "token_share/image": 0.5, "token_share/video": 0.0,
                    "padding_fraction": 0.0, "tokens_per_s": 7.0, "skipped_total": 3.0,
                    "skipped/undecodable": 2.0, "skipped/bad_doc_json": 1.0, "tokenizer/video_decode_errors": 4.0}

    other = ({"tokens": [0, 0, 0, 300, 0], "padding": 20},
             {"data/skipped_total": 5.0, "data/skipped/undecodable": 5.0, "data/tokenizer/dropped_no_frames": 1.0})
    gathered = []
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "gather_object", lambda objs: gathered.append(objs) or [*objs, other])
    fake = SimpleNamespace(train_loader=Loader(), acc=SimpleNamespace(num_processes=2))
    m = Trainer._loader_metrics(fake)
    assert m["data/token_share/video"] == pytest.approx(300 / 500) and m["data/token_share/text"] == pytest.approx(100 / 500)
    assert m["data/token_share/image"] == pytest.approx(100 / 500) and m["data/token_share/code"] == 0.0
    assert m["data/padding_fraction"] == pytest.approx(20 / 520)
    assert m["data/tokens_per_s"] == 7.0
    assert gathered == [[({"tokens": [100, 0, 100, 0, 0], "padding": 0},
                          {"data/skipped_total": 3.0, "data/skipped/undecodable": 2.0, "data/skipped/bad_doc_json": 1.0,
                           "data/tokenizer/video_decode_errors": 4.0})]]
    assert (m["data/skipped_total"], m["data/skipped/undecodable"], m["data/skipped/bad_doc_json"]) == (8.0, 7.0, 1.0)
    assert m["data/tokenizer/video_decode_errors"] == 4.0 and m["data/tokenizer/dropped_no_frames"] == 1.0
    fake.acc.num_processes = 1
    alone = Trainer._loader_metrics(fake)
    assert len(gathered) == 1, "one process: no collective"
    assert alone["data/token_share/video"] == 0.0 and alone["data/token_share/text"] == 0.5
    assert alone["data/skipped_total"] == 3.0


def test_tensorboard_has_one_run_holding_metrics_and_hyperparameters(tmp_path):
    """Issue 15.12: no extra `run/<timestamp>` run with only Accelerate's hyperparameters."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = _trainer(tmp_path, "logging.trackers=[tensorboard]", "train.num_steps=2", "logging.every=1")
    t.fit()
    tb = tmp_path / "tb"
    runs = sorted({p.parent for p in tb.rglob("events.out.tfevents*")})
    assert len(runs) == 1, runs
    assert not [p for p in runs[0].iterdir() if p.is_dir()], "a sub-run beside the main one"
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    assert {"train/loss", "loss/text"} <= set(acc.Tags()["scalars"])  # one-slash names (trackers.py)
    assert acc.Tags()["images"] == ["moe/expert_load"]
    plugins = acc.PluginTagToContent("hparams")
    assert "_hparams_/experiment" in plugins and "_hparams_/session_start_info" in plugins
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.HParamsPluginData.FromString(plugins["_hparams_/session_start_info"]).session_start_info
    assert info.hparams["train.num_steps"].number_value == 2


def test_data_states_of_every_saved_rank_reach_the_loader(tmp_path):
    """The trainer hands a pooling loader (the stream) every saved rank's data state; another loader
    gets its own rank's, and cannot resume on another world size."""
    trainer = _trainer(tmp_path, "train.num_steps=1")
    trainer._load_data_states([{"consumed": 3}])
    assert trainer.train_loader.consumed == 3
    with pytest.raises(ValueError, match="cannot resume on another world size; launch with --num_processes 2"):
        trainer._load_data_states([{"consumed": 1}, {"consumed": 1}])
    got = []
    trainer.train_loader.pools_rank_states = True
    trainer.train_loader.load_state_dict = got.append
    trainer._load_data_states([{"consumed": 1}, {"consumed": 2}])
    assert got == [[{"consumed": 1}, {"consumed": 2}]]


# ---- issue 28 item 3: the global batch across a resume on another number of processes -----------


def test_plan_keeps_the_global_batch_by_accumulation_or_refuses_naming_what_fits():
    from omniloom.pretrain.train.resume_batch import Batching, plan_accumulation

    saved = Batching(2, 4, 1)  # 8 rows
    assert plan_accumulation(saved, Batching(2, 4, 1), policy="keep", seq_len=512) == (1, "")
    accum, note = plan_accumulation(saved, Batching(1, 4, 1), policy="keep", seq_len=512)
    assert accum == 2 and "gradient accumulation 1 -> 2 keeps the global batch at 8 rows" in note and "4,096 tokens" in note
    assert plan_accumulation(Batching(1, 4, 2), Batching(2, 4, 2), policy="keep", seq_len=512)[0] == 1
    with pytest.raises(ValueError, match=r"on 3 process\(es\) x 4 rows no gradient accumulation gives 8 rows: launch "
                                         r"1, 2 process\(es\), or pass checkpoint.resume_global_batch=change"):
        plan_accumulation(saved, Batching(3, 4, 1), policy="keep", seq_len=512)
    accum, note = plan_accumulation(saved, Batching(3, 4, 1), policy="change", seq_len=512)
    assert accum == 1 and "changes from 8 rows" in note and "to 12 rows" in note
    # issue 41 item 5: a 1-process run of 2 rows resumed on 2 processes x 2 rows: the first refusal
    # names all three ways out, the smaller data.batch_size too (which then resumes)
    with pytest.raises(ValueError, match=r"launch 1 process\(es\), pass data.batch_size=1 \(2 x 1 rows x accumulation 1 "
                                         r"keeps it; .*\), or pass checkpoint.resume_global_batch=change"):
        plan_accumulation(Batching(1, 2, 1), Batching(2, 2, 1), policy="keep", seq_len=512)
    assert plan_accumulation(Batching(1, 2, 1), Batching(2, 1, 1), policy="keep", seq_len=512)[0] == 1



def test_plan_warns_when_it_overrides_an_accumulation_asked_for_and_names_a_changed_batch_size(caplog):
    # review of issue 28 item 3: the same layout with train.grad_accum_steps=3 was reverted to the
    # checkpoint's 1 with an INFO note only; a changed data.batch_size said "launch  process(es)"
    from omniloom.pretrain.train.resume_batch import Batching, plan_accumulation

    with caplog.at_level("WARNING", logger="omniloom.pretrain.train.resume_batch"):
        assert plan_accumulation(Batching(2, 4, 1), Batching(2, 4, 3), policy="keep", seq_len=512) == (1, "")
    assert "train.grad_accum_steps=3 ignored" in caplog.text and "resume_global_batch=change" in caplog.text
    with pytest.raises(ValueError, match=r"ran data.batch_size=4\): resume with data.batch_size=4"):
        plan_accumulation(Batching(2, 4, 1), Batching(2, 3, 1), policy="keep", seq_len=512)


def test_resume_on_fewer_processes_keeps_the_global_batch_and_says_so(tmp_path, monkeypatch, caplog):
    """A 2-process checkpoint (faked from a 1-process one) resumed on 1 process trained on with half
    the tokens per step; now the accumulation doubles, the resume line says so, and the steps after
    it see as many tokens as before. Another global batch needs checkpoint.resume_global_batch=change."""
    import logging
    import shutil

    _trainer(tmp_path, "train.num_steps=2", "checkpoint.every=2", "data.batch_size=2").fit()
    ckpt = ckpt_mod.latest_checkpoint(tmp_path / "checkpoints")
    before = torch.load(ckpt / "trainer.pt", weights_only=True)["tokens_seen"] / 2
    info = json.loads((ckpt / ckpt_mod.MARKER).read_text())
    info["world_size"] = 2
    (ckpt / ckpt_mod.MARKER).write_text(json.dumps(info))
    shutil.copy(ckpt / "data_rank00000.pt", ckpt / "data_rank00001.pt")
    shutil.copy(ckpt / "accelerate" / "random_states_0.pkl", ckpt / "accelerate" / "random_states_1.pkl")
    monkeypatch.setattr(standin.StandinLoader, "pools_rank_states", True, raising=False)
    monkeypatch.setattr(standin.StandinLoader, "load_state_dict", lambda self, states: None)
    _reset_accelerate()
    with caplog.at_level(logging.INFO, logger="omniloom.pretrain.checkpoint.manager"):
        trainer = _trainer(tmp_path, "train.num_steps=3", "data.batch_size=2", f"checkpoint.resume={ckpt}")
    assert trainer.cfg.train.grad_accum_steps == 2
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("resumed from"))
    assert "on 1 process(es) (saved on 2): gradient accumulation 1 -> 2 keeps the global batch at 4 rows" in line
    seen = trainer.tokens_seen
    trainer.fit()
    assert trainer.tokens_seen - seen == 2 * before  # the 2-process step's tokens, on one process
    _reset_accelerate()
    with pytest.raises(ValueError, match=r"global batch is 4 rows .* no number of processes x data.batch_size=3 rows "
                                         r"divides it \(the checkpoint ran data.batch_size=2\)"):
        _trainer(tmp_path, "train.num_steps=3", "data.batch_size=3", f"checkpoint.resume={ckpt}")
    _reset_accelerate()
    trainer = _trainer(tmp_path, "train.num_steps=3", "data.batch_size=3", f"checkpoint.resume={ckpt}",
                       "checkpoint.resume_global_batch=change")
    assert trainer.cfg.train.grad_accum_steps == 1
