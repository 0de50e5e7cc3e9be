"""Expert parallelism (issue 16): config checks, the rank layout, and multi-process parity of one
step (loss, every gradient, router-bias update) against a 1-process model on the same global batch."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import ModelConfig, MoEConfig
from omniloom.pretrain.train.expert_parallel import check_expert_parallel, expert_group_ranks, parallelize_experts

WORKER = (Path(__file__).resolve().parents[1] / "support" / "ep_parity_worker.py")
_spec = importlib.util.spec_from_file_location("hf_check", (Path(__file__).resolve().parents[1] / "support" / "hf_check.py"))
hf_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_check)


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_torchrun(cmd, timeout=240) -> str:
    """Run a launcher; on a timeout kill its whole process group (the ranks too), then fail."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"timed out after {timeout}s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-6000:]
    return out


def test_config_rejects_expert_parallel_that_does_not_divide_the_experts():
    with pytest.raises(ValueError, match="must divide model.moe.num_experts=6"):
        ModelConfig(vocab_size=64, moe=MoEConfig(num_experts=6, expert_parallel=4)).validate()
    with pytest.raises(ValueError, match="needs MoE layers"):
        ModelConfig(vocab_size=64, moe=MoEConfig(num_experts=0, expert_parallel=2)).validate()
    with pytest.raises(ValueError, match=">= 1"):
        ModelConfig(vocab_size=64, moe=MoEConfig(expert_parallel=0)).validate()
    ModelConfig(vocab_size=64, moe=MoEConfig(num_experts=8, expert_parallel=4)).validate()


def test_launch_checks_name_what_to_change():
    with pytest.raises(ValueError, match="must divide the number of processes \\(6\\)"):
        check_expert_parallel(4, 6, 8)
    with pytest.raises(ValueError, match="DDP .* or FSDP2"):
        check_expert_parallel(2, 4, 8, distributed_type="DistributedType.DEEPSPEED")
    with pytest.raises(ValueError, match="fsdp_version: 2"):
        check_expert_parallel(2, 4, 8, distributed_type="DistributedType.FSDP", fsdp_version=1)
    check_expert_parallel(2, 4, 8, distributed_type="DistributedType.FSDP", fsdp_version=2)
    check_expert_parallel(1, 3, 5)  # expert_parallel 1: anything goes
    check_expert_parallel(2, 4, 8, distributed_type="DistributedType.MULTI_GPU")


def test_one_process_refuses_expert_parallel():
    import torch.nn as nn

    with pytest.raises(ValueError, match="needs several processes"):
        parallelize_experts(nn.Linear(2, 2), 2)
    assert parallelize_experts(nn.Linear(2, 2), 1) is None


def test_a_model_built_with_an_expert_range_holds_the_full_models_slice():
    """What a rank builds under expert parallelism (no full model first): every weight equals the
    full model's for the same seed, the experts their slice."""
    from omniloom.pretrain.train.expert_parallel import shard_range

    cfg = ModelConfig(dim=32, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=64, rope_sections=(2, 2, 4),
                      patch_dim=12, tubelet_dim=24, moe=MoEConfig(num_experts=8, num_experts_per_token=2,
                                                                  expert_dim=16, num_dense_layers=1, dense_dim=32))
    torch.manual_seed(3)
    full = OmniModel(cfg).state_dict()
    assert shard_range(8, 4, 6) == (4, 6)  # rank 6 is rank 2 of its expert group of 4
    torch.manual_seed(3)
    part = OmniModel(cfg, expert_range=(4, 6))
    assert part.layers[1].ffn.w_gate.shape[0] == 2 and part.layers[1].ffn.expert_range == (4, 6)
    for k, v in part.state_dict().items():
        want = full[k][4:6] if k.split(".")[-1] in ("w_gate", "w_up", "w_down") else full[k]
        assert torch.equal(v, want), k
    with pytest.raises(ValueError, match="not within the 8 experts"):
        OmniModel(cfg, expert_range=(6, 10))


def test_rank_layout_groups_consecutive_ranks_and_replicates_across_groups():
    groups, replicas = expert_group_ranks(8, 4)
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert expert_group_ranks(2, 2) == ([[0, 1]], [[0], [1]])


def _parity(tmp_path, nproc: int, ep: int, dispatch: str = "auto", variant: str = "") -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), str(tmp_path), str(ep), dispatch, *([variant] if variant else [])]
    run_torchrun(cmd)
    res = json.loads((tmp_path / "result.json").read_text())
    assert res["world"] == nproc and res["ep"] == ep and res["num_params"] > 40
    assert abs(res["loss"] - res["want"]) <= 1e-5 * res["want"], res
    assert res["grad_err"] < 1e-5, res  # every parameter, expert shards against the reference's slice
    assert res["count_mismatch"] == 0 and res["bias_err"] == 0, res
    return res


def test_ep2_over_two_processes_equals_one_process_model(tmp_path):
    _parity(tmp_path, 2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,ep,dispatch,variant", [(2, 2, "loop", ""), (4, 2, "auto", ""), (4, 4, "loop", ""),
                                                       (2, 2, "auto", "text-groups"), (2, 2, "loop", "text-groups")])
def test_ep_with_data_parallel_equals_one_process_model(tmp_path, nproc, ep, dispatch, variant):
    """EP 2 x DP 2 (replica groups average the expert shards), EP 4 over 4 processes, and a rank
    that receives no rows at all (text-only batches, its experts all visual)."""
    _parity(tmp_path, nproc, ep, dispatch, variant)


# ---- FSDP2 (fully_shard over gloo): non-expert parameters sharded over all ranks ---------------------
FSDP_WORKER = (Path(__file__).resolve().parents[1] / "support" / "ep_fsdp_worker.py")


def _fsdp(tmp_path, nproc: int, ep: int, resume_ep: int) -> dict:
    """20 AdamW steps with FSDP2 + expert parallelism against a 1-process model; a checkpoint at
    step 10 resumed with another expert-parallel degree (see tests/support/ep_fsdp_worker.py)."""
    from omniloom.pretrain.checkpoint.offline import read_dcp_state_dict

    run_torchrun([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                  str(FSDP_WORKER), str(tmp_path), str(ep), str(resume_ep)])
    res = json.loads((tmp_path / "result.json").read_text())
    assert (res["world"], res["ep"], res["resume_ep"]) == (nproc, ep, resume_ep)
    replicas = nproc // ep
    first = res["first"]
    assert abs(first["loss"] - first["want"]) <= 1e-9 * first["want"], first
    assert abs(first["norm"] - first["want_norm"]) <= 1e-9 * first["want_norm"], first
    assert first["norm"] > 0.5  # the clip (0.5) acted on step 1
    assert res["step1_grad_err"] < 1e-5, res  # every gradient, after the expert sync and the clip
    assert res["routing_flips"] == [], res  # (float64: no near-tie routing decision differs)
    assert len(res["losses"]) == 20 and res["losses"][-1] < res["losses"][0]
    for got, want in zip(res["losses"], res["ref_losses"]):
        assert got == pytest.approx(want, rel=1e-8)
    assert res["final_weight_err"] < 1e-4, res  # every weight after 20 steps (the router's fp32 logits: ~1e-6)
    # the step-10 checkpoint: loaded exactly, and steps 11-20 with the other EP degree repeat the run
    assert res["load_err"] == 0.0, res
    assert res["resumed_losses"] == pytest.approx(res["losses"][10:], rel=1e-12)
    assert res["resumed_weight_err"] < 1e-4, res
    # memory: the experts are 1/EP per rank, and with several replicas sharded over them too (so
    # 1/world); the rest 1/world but the routers (2 layers x 8 x 32), replicated when experts shard
    assert res["expert_numel"] * ep * replicas == 2 * 3 * 8 * 32 * 16  # 2 MoE layers x 3 matrices x 8 x 32 x 16
    assert res["replicated"] == (2 * 8 * 32 if replicas > 1 else 0), res
    assert res["dense_sum"] == res["full_dense"] and res["dense_max"] <= res["full_dense"] / nproc * 1.2, res
    # the checkpoint folder (accelerate's FSDP2 layout) holds every expert, written in EP shards
    # by the ranks that hold them (nothing gathered), and export reads them whole
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "ckpt" / "pytorch_model_fsdp_0")).read_metadata()
    chunks = meta.state_dict_metadata["model.layers.1.ffn.w_gate"].chunks
    pieces = ep * replicas  # with several replicas FSDP2 shards each expert shard over them
    assert sorted(c.offsets[0] for c in chunks) == [i * 8 // pieces for i in range(pieces)], chunks
    saved = torch.load(tmp_path / "saved_full.pt", weights_only=True)
    exported = read_dcp_state_dict(tmp_path / "ckpt" / "pytorch_model_fsdp_0")
    assert exported.keys() == saved.keys()
    for k in saved:
        assert torch.equal(exported[k], saved[k]), k
    assert exported["layers.1.ffn.w_gate"].shape[0] == 8
    return res


def test_fsdp2_with_ep2_trains_like_one_process_and_resumes_with_ep1(tmp_path):
    _fsdp(tmp_path, 2, 2, 1)


@pytest.mark.slow
@pytest.mark.parametrize("ep,resume_ep", [(2, 4), (4, 2)])
def test_fsdp2_with_ep_and_data_parallel_over_four_processes(tmp_path, ep, resume_ep):
    """EP 2 x DP 2 (FSDP2 over 4 ranks, each expert shard sharded again over its replica group of
    2) resumed with EP 4 (expert shards whole on their rank), and EP 4 resumed with EP 2 x DP 2."""
    _fsdp(tmp_path, 4, ep, resume_ep)


def test_expert_weights_get_their_own_optimizer_groups_only_under_fsdp2():
    """DDP keeps two groups (its checkpoints resume as before); FSDP2 splits the routed experts'
    weights off at every expert-parallel degree, so its checkpoints resume across degrees."""
    from omniloom.pretrain.train.optim import is_expert_param, param_groups

    model = OmniModel(ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=64,
                                  rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24,
                                  moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16,
                                                num_dense_layers=1, dense_dim=32)))
    groups = param_groups(model, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert is_expert_param("layers.1.ffn.w_gate") and not is_expert_param("layers.0.ffn.w_gate.weight")
    split = param_groups(model, 0.1, separate_experts=True)  # what the trainer asks for under FSDP2
    assert [g["weight_decay"] for g in split] == [0.1, 0.1, 0.1, 0.0]
    assert split[1]["names"] == ["layers.1.ffn.w_gate", "layers.1.ffn.w_up", "layers.1.ffn.w_down"]
    assert split[2]["names"] == ["layers.1.ffn.router"]
    assert sorted(n for g in split for n in g["names"]) == sorted(n for g in groups for n in g["names"])


# ---- the trainer under accelerate launch (DDP over gloo) ------------------------------------------
TRAIN_WORKER = (Path(__file__).resolve().parents[1] / "support" / "ep_train_worker.py")
ACCELERATE = Path(sys.executable).with_name("accelerate")


def _accelerate(mode: str, out: Path, *overrides: str, nproc: int = 2) -> str:
    from omniloom.pretrain.config.run import presets_dir

    cpu_2proc = presets_dir() / "accelerate" / "cpu_2proc.yaml"
    return run_torchrun([str(ACCELERATE), "launch", "--config_file", str(cpu_2proc), "--num_processes", str(nproc),
                         str(TRAIN_WORKER), mode, str(out), *overrides])


def _losses(run_dir: Path) -> dict[int, float]:
    from omniloom.pretrain.rundir import read_metrics

    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def _assert_losses(got: dict[int, float], want: dict[int, float], first: int, last: int) -> None:
    """`got` logged a loss at exactly steps first..last, each equal to `want`'s (fp32 tolerance)."""
    assert sorted(got) == list(range(first, last + 1)), sorted(got)
    for s in got:
        assert got[s] == pytest.approx(want[s], rel=1e-4), s


def _evals(run_dir: Path) -> dict[int, float]:
    from omniloom.pretrain.rundir import read_metrics

    return {r["step"]: r["eval/loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "eval/loss" in r}


@pytest.mark.slow
@pytest.mark.parametrize("nproc,extra", [(2, []), (2, ["train.activation_checkpointing=true"]), (4, [])])
def test_trainer_step_with_ep2_equals_one_process_model(tmp_path, nproc, extra):
    """Trainer._train_step under DDP with expert parallelism (2 micro-batches, uneven labels,
    clipping on): loss, every gradient after the expert sync and the global-norm clip, and the
    gradient norm equal a 1-process model's on the global batch. With activation checkpointing
    the exchange runs again in backward's recomputation; with 4 processes (EP 2 x DP 2) the expert
    shards are also averaged over their replica group. (train.compile=true passes too, checked by
    hand: a minute of CPU compilation.)"""
    _accelerate("step", tmp_path, "model.moe.expert_parallel=2", "optim.grad_clip=0.5", *extra, nproc=nproc)
    res = json.loads((tmp_path / "step.json").read_text())
    assert res["clip_scale"] < 1, res  # the clip did act
    assert res["err"] < 1e-5, res
    assert abs(res["loss"] - res["want"]) <= 1e-5 * res["want"], res
    assert abs(res["grad_norm"] - res["want_norm"]) <= 1e-5 * res["want_norm"], res


@pytest.mark.slow
def test_ep_training_matches_data_parallel_resumes_across_ep_degrees_and_exports_the_full_model(tmp_path):
    from safetensors.torch import load_file

    from omniloom.pretrain.export.write import export_checkpoint

    common = ["train.num_steps=20", "checkpoint.every=10", "checkpoint.keep_last=5", "train.eval_every=10",
              "train.eval_steps=2"]
    ep_run, dp_run, resumed = tmp_path / "ep2", tmp_path / "dp", tmp_path / "resumed"
    for d in (ep_run, dp_run, resumed):
        d.mkdir()
    log = _accelerate("fit", ep_run, *common, "model.moe.expert_parallel=2")
    # the rank built only its experts, and the start line gives its share of them
    assert "built only experts [0, 2) of 4 per MoE layer on this rank" in log, log[-3000:]
    assert "expert parallel 2 x 1 replicas: this rank holds experts [0, 2) of 4 per MoE layer, 6,144 expert " \
           "parameters (12,288 unsharded, 1/2)" in log, log[-3000:]
    _accelerate("fit", dp_run, *common)
    info = [json.loads((ep_run / f"result_rank{r}.json").read_text()) for r in (0, 1)]
    dp_info = json.loads((dp_run / "result_rank0.json").read_text())
    assert [i["ep"] for i in info] == [2, 2] and dp_info["ep"] == 1
    full = torch.load(ep_run / "full_params.pt", weights_only=True)
    n_experts = sum(v.numel() for k, v in full.items() if k.split(".")[-1] in ("w_gate", "w_up", "w_down"))
    assert info[0]["expert_numel"] * 2 == n_experts  # each rank holds half of the expert parameters

    ep_losses, dp_losses = _losses(ep_run), _losses(dp_run)
    _assert_losses(ep_losses, dp_losses, 1, 20)
    assert ep_losses[20] < ep_losses[1]
    ep_eval, dp_eval = _evals(ep_run), _evals(dp_run)  # evaluation runs every forward in lockstep
    assert sorted(ep_eval) == [0, 10, 20] and all(ep_eval[s] == pytest.approx(dp_eval[s], rel=1e-4) for s in ep_eval)

    # the EP 2 checkpoint of step 10 resumes with expert_parallel=1 (full checkpoint, resliced)
    _accelerate("fit", resumed, *common, f"checkpoint.resume={ep_run / 'checkpoints' / 'step_00000010'}")
    got = _losses(resumed)
    _assert_losses(got, ep_losses, 11, 20)

    # and the data-parallel checkpoint of step 10 resumes with expert_parallel=2 (full tensors sliced
    # to each rank's shard, the optimizer's moments too)
    resumed_ep = tmp_path / "resumed_ep"
    resumed_ep.mkdir()
    _accelerate("fit", resumed_ep, *common, "model.moe.expert_parallel=2",
                f"checkpoint.resume={dp_run / 'checkpoints' / 'step_00000010'}")
    got = _losses(resumed_ep)
    _assert_losses(got, dp_losses, 11, 20)

    # export of the EP checkpoint: the full model, equal to the gathered weights and to the
    # export of the same run without EP
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    tok = tmp_path / "tok"  # export loads (and hash-checks) a real tokenizer of the model's vocabulary
    make_tiny_tokenizer(tok, vocab_size=512)
    export_checkpoint(ep_run, tmp_path / "export_ep", tokenizer=tok)
    export_checkpoint(dp_run, tmp_path / "export_dp", tokenizer=tok)
    a = load_file(tmp_path / "export_ep" / "model.safetensors")
    b = load_file(tmp_path / "export_dp" / "model.safetensors")
    assert a.keys() == b.keys() == full.keys()
    for k in a:
        assert torch.equal(a[k], full[k]), k
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    cfg_ep = json.loads((tmp_path / "export_ep" / "config.json").read_text())
    cfg_dp = json.loads((tmp_path / "export_dp" / "config.json").read_text())
    assert cfg_ep["model"] == cfg_dp["model"] and cfg_ep["model"]["moe"]["expert_parallel"] == 1
    assert cfg_ep["num_params"] == cfg_dp["num_params"]
    # and Hugging Face loads it as it loads any export (issue 26)
    hf_check.assert_hf_logits_match(tmp_path / "export_ep", tmp_path / "hf_ep")


@pytest.mark.slow
def test_ep2_with_data_parallel_2_trains_20_steps_like_data_parallel_under_ddp(tmp_path):
    """EP 2 x DP 2 over 4 processes under DDP (accelerate launch): 20 optimizer steps give the
    losses and the final weights of plain data parallelism over the same 4 processes."""
    common = ["train.num_steps=20", "checkpoint.every=0"]
    ep_run, dp_run = tmp_path / "ep", tmp_path / "dp"
    for d in (ep_run, dp_run):
        d.mkdir()
    log = _accelerate("fit", ep_run, *common, "model.moe.expert_parallel=2", nproc=4)
    assert "expert parallel 2 x 2 replicas" in log, log[-3000:]
    _accelerate("fit", dp_run, *common, nproc=4)
    info = json.loads((ep_run / "result_rank0.json").read_text())
    assert info["world_size"] == 4 and info["ep"] == 2 and not info["fsdp2"]
    ep_losses, dp_losses = _losses(ep_run), _losses(dp_run)
    _assert_losses(ep_losses, dp_losses, 1, 20)
    assert ep_losses[20] < ep_losses[1]
    a = torch.load(ep_run / "full_params.pt", weights_only=True)
    b = torch.load(dp_run / "full_params.pt", weights_only=True)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,extra", [(2, ["model.moe.expert_parallel=2"]), (4, ["model.moe.expert_parallel=2"]),
                                         (2, [])])
def test_trainer_step_under_fsdp2_equals_one_process_model(tmp_path, nproc, extra):
    """Trainer._train_step under FSDP2 (accelerate's FSDP2 state, on CPU: see ep_train_worker.py):
    with expert parallelism (the trainer shards, leaving the expert shards out), EP 2 x DP 2, and
    accelerate's own FSDP2 wrapping without EP. Loss, every gradient and the norm equal a
    1-process model's on the global batch."""
    _accelerate("step-fsdp2", tmp_path, "optim.grad_clip=0.5", *extra, nproc=nproc)
    res = json.loads((tmp_path / "step.json").read_text())
    assert res["fsdp2"] and res["clip_scale"] < 1, res
    assert res["err"] < 1e-5, res
    assert abs(res["loss"] - res["want"]) <= 1e-5 * res["want"], res
    assert abs(res["grad_norm"] - res["want_norm"]) <= 1e-5 * res["want_norm"], res


@pytest.mark.slow
def test_fsdp2_ep_training_matches_data_parallel_resumes_with_ep1_and_exports(tmp_path):
    """The trainer under FSDP2 with EP 2: 20 steps like plain DDP without EP, its sharded (DCP)
    checkpoint of step 10 resumed under FSDP2 without EP, and exported: the full model."""
    from safetensors.torch import load_file

    from omniloom.pretrain.export.write import export_checkpoint
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    common = ["train.num_steps=20", "checkpoint.every=10", "checkpoint.keep_last=5"]
    fsdp_run, dp_run, resumed = tmp_path / "fsdp_ep2", tmp_path / "dp", tmp_path / "resumed"
    for d in (fsdp_run, dp_run, resumed):
        d.mkdir()
    log = _accelerate("fit-fsdp2", fsdp_run, *common, "model.moe.expert_parallel=2")
    assert "FSDP2 over 2 ranks on 3 Block blocks and the root; the expert shards stay out" in log, log[-3000:]
    _accelerate("fit", dp_run, *common)
    info = json.loads((fsdp_run / "result_rank0.json").read_text())
    assert info["fsdp2"] and info["ep"] == 2 and info["world_size"] == 2
    assert (fsdp_run / "checkpoints" / "step_00000010" / "accelerate" / "pytorch_model_fsdp_0").is_dir()
    ep_losses, dp_losses = _losses(fsdp_run), _losses(dp_run)
    _assert_losses(ep_losses, dp_losses, 1, 20)
    assert ep_losses[20] < ep_losses[1]

    _accelerate("fit-fsdp2", resumed, *common, f"checkpoint.resume={fsdp_run / 'checkpoints' / 'step_00000010'}")
    got = _losses(resumed)
    _assert_losses(got, ep_losses, 11, 20)

    tok = tmp_path / "tok"
    make_tiny_tokenizer(tok, vocab_size=512)
    export_checkpoint(fsdp_run, tmp_path / "export_fsdp", tokenizer=tok)
    export_checkpoint(dp_run, tmp_path / "export_dp", tokenizer=tok)
    a = load_file(tmp_path / "export_fsdp" / "model.safetensors")
    b = load_file(tmp_path / "export_dp" / "model.safetensors")
    full = torch.load(fsdp_run / "full_params.pt", weights_only=True)
    assert a.keys() == b.keys() == full.keys()
    for k in a:
        assert torch.equal(a[k], full[k]), k
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    hf_check.assert_hf_logits_match(tmp_path / "export_fsdp", tmp_path / "hf_fsdp")  # issue 26


@pytest.mark.slow
def test_fsdp2_ep_trains_under_bf16_mixed_precision(tmp_path):
    """FSDP2's bf16 MixedPrecisionPolicy (what mixed_precision: bf16 gives on GPUs) casts the
    sharded parameters: with EP 2 x DP 2 the expert units over their replica groups and the
    shared-expert units too, while the routers, outside FSDP, stay fp32 (the router computes in
    fp32 anyway). Six steps and a checkpoint run, the loss falls."""
    _accelerate("fit-fsdp2-bf16", tmp_path, "model.moe.expert_parallel=2", "train.num_steps=6", "checkpoint.every=3",
                nproc=4)
    losses = _losses(tmp_path)
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1], losses
    assert (tmp_path / "checkpoints" / "step_00000006" / "accelerate" / "pytorch_model_fsdp_0").is_dir()


@pytest.mark.slow
def test_bench_ep_prints_tokens_per_process_with_and_without_ep():
    cmd = [sys.executable, "-m", "omniloom.pretrain.bench.expert_parallel", "--worlds", "2", "--global-batch", "2", "--steps", "1",
           "--warmup", "1", "data.seq_len=64"]
    out = run_torchrun(cmd)
    lines = [ln for ln in out.splitlines() if ln.startswith("world 2")]
    assert len(lines) == 2 and "expert_parallel 1:" in lines[0] and "expert_parallel 2:" in lines[1], out[-2000:]
    assert all("tokens/s per process" in ln and "exchange" in ln for ln in lines)


@pytest.mark.slow
def test_bench_ep_build_memory_prints_whole_and_shard_builds():
    out = run_torchrun([sys.executable, "-m", "omniloom.pretrain.bench.expert_parallel", "--build-memory", "--preset", "tiny",
                        "--worlds", "2"])
    lines = [ln for ln in out.splitlines() if ln.startswith("tiny, ")]
    assert len(lines) == 2 and "whole model" in lines[0] and "rank 0 of expert_parallel 2" in lines[1], out[-2000:]
    assert "peak RSS" in lines[1] and "x the whole model's peak" in lines[1]
