"""One training step of a tiny OmniModel with expert parallelism, checked against a 1-process model
with the same weights on the same global batch. Run under torchrun (gloo, CPU):

    python -m torch.distributed.run --nproc_per_node 2 tests/support/ep_parity_worker.py OUT EP [DISPATCH [text-groups]]

`text-groups`: modality groups (text experts first, visual experts last) and text-only batches, so
the ranks holding only visual experts receive no rows at all.

Every rank builds the same model (same seed), keeps a full copy as the reference, shards the
experts with `parallelize_experts`, runs its slice of the global batch and backpropagates its share
of the global mean loss (x world size, as the trainer does under DDP). Data-parallel gradients are
averaged over ranks by hand (what DDP does); expert gradients go through `ExpertParallel.sync_grads`.
Rank 0 writes OUT/result.json with the largest relative errors.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.synthetic import random_packed_batch
from omniloom.pretrain.train.expert_parallel import parallelize_experts

ROWS_PER_RANK = 2


def tiny_cfg(ep: int, dispatch: str, groups: bool = False) -> ModelConfig:
    return ModelConfig(
        dim=32, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=64, patch_token_id=63, pad_token_id=0,
        rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24, kernels="reference",
        attention=AttentionConfig(backend="blocksparse", pattern="LBG", window=12, block_size=8, num_selected_blocks=2),
        moe=MoEConfig(num_experts=8, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32,
                      dispatch=dispatch, expert_parallel=ep, modality_groups=groups),
    )


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def main() -> None:
    out_dir, ep = sys.argv[1], int(sys.argv[2])
    dispatch = sys.argv[3] if len(sys.argv) > 3 else "auto"
    groups = len(sys.argv) > 4 and sys.argv[4] == "text-groups"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    cfg = tiny_cfg(ep, dispatch, groups)
    model = OmniModel(cfg)
    ref = copy.deepcopy(model)
    plan = parallelize_experts(model, ep)
    assert plan is not None and plan.expert_numel() * ep == sum(
        p.numel() for n, p in ref.named_parameters() if n.split(".")[-1] in ("w_gate", "w_up", "w_down"))

    batches = [random_packed_batch(cfg, batch_size=ROWS_PER_RANK, seq_len=48, seed=10 + r, visual=not groups)
               for r in range(world)]
    local = batches[rank]
    n_local = float((local["labels"] != -100).sum())
    n_global = sum(float((b["labels"] != -100).sum()) for b in batches)

    out = model(**local)
    share = out.loss * (n_local / n_global)
    (share * world).backward()  # DDP averages over ranks: scale by the world size, as the trainer does
    dense = [p for n, p in model.named_parameters() if n not in plan.expert_params]
    for p in dense:
        dist.all_reduce(p.grad)
        p.grad /= world
    plan.sync_grads()
    loss = share.detach().clone()
    dist.all_reduce(loss)
    counts = out.expert_counts.clone()
    dist.all_reduce(counts)

    glob = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    ref_out = ref(**glob)
    ref_out.loss.backward()

    lo, hi = plan.expert_range
    ref_params = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        if name in plan.expert_params:
            want = want[lo:hi]
        errs[name] = rel_err(p.grad, want)
    # router-bias balancing from the global counts moves every rank's bias like the reference's
    model.update_router_biases(counts)
    ref.update_router_biases(ref_out.expert_counts)
    bias_err = max(float((a - b).abs().max()) for (n, a), (_, b) in zip(model.named_buffers(), ref.named_buffers())
                   if n.endswith("router_bias"))
    worst = torch.tensor([max(errs.values()), bias_err, float(counts.ne(ref_out.expert_counts).sum())])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        worst_name = max(errs, key=errs.get)
        with open(os.path.join(out_dir, "result.json"), "w") as fh:
            json.dump({"loss": float(loss), "want": float(ref_out.loss.detach()), "grad_err": float(worst[0]),
                       "worst_param": worst_name, "bias_err": float(worst[1]), "count_mismatch": float(worst[2]),
                       "num_params": len(errs), "world": world, "ep": ep}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
