"""Expert parallelism (issue 16): config checks, the rank layout, and multi-process parity of one
step (loss, every gradient, router-bias update) against a 1-process model on the same global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from omniloom.model.config import ModelConfig, MoEConfig
from omniloom.pretrain.expert_parallel import check_expert_parallel, expert_group_ranks, parallelize_experts

WORKER = Path(__file__).with_name("ep_parity_worker.py")


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_torchrun(cmd, timeout=240) -> None:
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
    with pytest.raises(ValueError, match="DDP"):
        check_expert_parallel(2, 4, 8, distributed_type="DistributedType.FSDP")
    check_expert_parallel(1, 3, 5)  # expert_parallel 1: anything goes
    check_expert_parallel(2, 4, 8, distributed_type="DistributedType.MULTI_GPU")


def test_one_process_refuses_expert_parallel():
    import torch.nn as nn

    with pytest.raises(ValueError, match="needs several processes"):
        parallelize_experts(nn.Linear(2, 2), 2)
    assert parallelize_experts(nn.Linear(2, 2), 1) is None


def test_rank_layout_groups_consecutive_ranks_and_replicates_across_groups():
    groups, replicas = expert_group_ranks(8, 4)
    assert groups == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert replicas == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert expert_group_ranks(2, 2) == ([[0, 1]], [[0], [1]])


def _parity(tmp_path, nproc: int, ep: int, dispatch: str = "auto") -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(WORKER), str(tmp_path), str(ep), dispatch]
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
@pytest.mark.parametrize("nproc,ep,dispatch", [(2, 2, "loop"), (4, 2, "auto"), (4, 4, "loop")])
def test_ep_with_data_parallel_equals_one_process_model(tmp_path, nproc, ep, dispatch):
    """EP 2 x DP 2 (replica groups average the expert shards) and EP 4 over 4 processes."""
    _parity(tmp_path, nproc, ep, dispatch)
