"""Expert parallelism under FSDP2 (issue 16): a tiny OmniModel with its experts sharded over expert
groups (`parallelize_experts`) and everything else sharded over all ranks by `fully_shard`
(`pretrain.parallel.apply_fsdp2`: with one replica the expert shards stay out of FSDP, with
several each is sharded again over its replica group), trained with AdamW and the trainer's
global-norm clip (`ExpertParallel.clip_grad_norm_`) against a 1-process model on the same global
batches. Run under torchrun (gloo, CPU):

    python -m torch.distributed.run --nproc_per_node 4 tests/support/ep_fsdp_worker.py OUT EP RESUME_EP

Steps 1-20 train; the first step's loss and every gradient are compared before the update, the
losses of every step and all weights after step 20. At step 10 the model and optimizer are saved
the way accelerate's FSDP2 SHARDED_STATE_DICT saves them (torch.distributed.checkpoint of
get_model_state_dict / get_optimizer_state_dict, inside `ExpertParallel.sharded_state_dict`:
every expert shard a DTensor, nothing gathered), then
loaded into a fresh model sharded with expert parallelism RESUME_EP (same world size), which
trains steps 11-20 again. Rank 0 writes OUT/result.json and OUT/saved_full.pt (the full
weights at the save, for the test to read the checkpoint folder against, as export does).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys

import torch
import torch.distributed as dist

from ep_parity_worker import ROWS_PER_RANK, rel_err, tiny_cfg  # noqa: E402 (tests/ is sys.path[0])
from omniloom.model import OmniModel
from omniloom.model.synthetic import random_packed_batch
from omniloom.pretrain.config.run import OptimConfig
from omniloom.pretrain.train.expert_parallel import parallelize_experts
from omniloom.pretrain.train.optim import build_optimizer
from omniloom.pretrain.train.parallel import apply_fsdp2

STEPS, SAVE_AT, CLIP = 20, 10, 0.5
OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


class NoExpertParallel:
    """What the worker needs of an ExpertParallel when expert_parallel is 1 (plain FSDP2)."""

    expert_params: dict = {}
    expert_range = (0, None)

    def sync_grads(self):
        pass

    def clip_grad_norm_(self, params, max_norm):
        return full(torch.nn.utils.clip_grad_norm_(params, max_norm))

    def full_state_dict(self):
        return contextlib.nullcontext()

    sharded_state_dict = full_state_dict

    def attach_optimizer(self, opt):
        pass

    def close(self):
        pass

    def expert_numel(self):
        return None


def build(cfg, ep: int, ref_state: dict | None = None, seed: int = 0):
    torch.manual_seed(seed)
    model = OmniModel(cfg)
    if ref_state is not None:
        model.load_state_dict(ref_state)
    plan = parallelize_experts(model, ep)
    apply_fsdp2(model, expert_plan=plan)
    plan = plan or NoExpertParallel()
    opt = build_optimizer(model, OPTIM)
    plan.attach_optimizer(opt)
    return model, plan, opt


def global_batches(cfg, step: int, world: int) -> list[dict]:
    return [random_packed_batch(cfg, batch_size=ROWS_PER_RANK, seq_len=48, seed=1000 * step + r) for r in range(world)]


def train_step(model, plan, opt, batches, rank: int, world: int, *, grads_out: dict | None = None):
    """One step on this rank's slice, as the trainer does it; returns the global loss."""
    local = batches[rank]
    n_local = float((local["labels"] != -100).sum())
    n_global = sum(float((b["labels"] != -100).sum()) for b in batches)
    out = model(**local)
    share = out.loss * (n_local / n_global)
    (share * world).backward()  # FSDP2 averages the sharded gradients over the world, as DDP does
    plan.sync_grads()
    norm = plan.clip_grad_norm_(list(model.parameters()), CLIP)
    if grads_out is not None:
        for name, p in model.named_parameters():
            grads_out[name] = full(p.grad).clone()
    opt.step()
    opt.zero_grad(set_to_none=True)
    counts = out.expert_counts.clone()
    dist.all_reduce(counts)
    model.update_router_biases(counts)
    loss = share.detach().clone()
    dist.all_reduce(loss)
    return float(loss), float(norm), counts


def ref_step(ref, ref_opt, batches):
    glob = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    out = ref(**glob)
    out.loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    ref_opt.step()
    ref_opt.zero_grad(set_to_none=True)
    ref.update_router_biases(out.expert_counts)
    return float(out.loss.detach()), float(norm), grads, out.expert_counts


def weights_err(model, plan, ref) -> tuple[float, str]:
    """Largest relative error of any weight (experts: this rank's slice of the reference's)."""
    lo, hi = plan.expert_range
    ref_params = dict(ref.named_parameters())
    errs = {}
    for name, p in model.named_parameters():
        want = ref_params[name].detach()
        if name in plan.expert_params:
            want = want[lo:hi]
        errs[name] = rel_err(full(p.detach()), want)
    worst = max(errs, key=errs.get)
    return errs[worst], worst


def save(model, plan, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    with plan.sharded_state_dict():  # what Trainer.save wraps around accelerator.save_state under FSDP2
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=os.path.join(path, "pytorch_model_fsdp_0"))
        dcp.save({"optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=os.path.join(path, "optimizer_0"))


def load(model, plan, opt, path: str) -> None:
    """accelerate's load_fsdp_model / load_fsdp_optimizer (templates from the live objects, filled
    by DCP, set back), inside sharded_state_dict as Trainer._restore does under FSDP2."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    with plan.sharded_state_dict():
        sd = {"model": get_model_state_dict(model)}
        dcp.load(sd, checkpoint_id=os.path.join(path, "pytorch_model_fsdp_0"))
        set_model_state_dict(model, sd["model"])
        osd = {"optimizer": get_optimizer_state_dict(model, opt)}
        dcp.load(osd, checkpoint_id=os.path.join(path, "optimizer_0"))
        set_optimizer_state_dict(model, opt, osd["optimizer"])


def main() -> None:
    from torch.distributed.tensor import DTensor

    out_dir, ep, resume_ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # float64: in fp32, the rounding differences of 20 AdamW steps (FSDP2 reduce-scatters in
    # another order than one process sums) flipped a near-tie top-k routing at step 18, after
    # which the runs legitimately part; in float64 the losses stay equal to ~1e-11
    torch.set_default_dtype(torch.float64)
    cfg = tiny_cfg(ep, "auto")
    torch.manual_seed(0)
    ref = OmniModel(cfg)
    init = copy.deepcopy(ref.state_dict())
    ref_opt = build_optimizer(ref, OPTIM)
    model, plan, opt = build(cfg, ep, init)

    # what is sharded: with one replica, the experts are this rank's plain shard and everything
    # else a DTensor over the world; with several, the experts are DTensors over their replica
    # group and the routers plain
    mesh = {n: p.device_mesh.size() if isinstance(p, DTensor) else 0 for n, p in model.named_parameters()}
    replicas = world // ep
    for n, size in mesh.items():
        want = (replicas if replicas > 1 else 0) if n in plan.expert_params else \
            (0 if replicas > 1 and n.endswith(".router") else world)
        assert size == want, (n, size, want)
    groups = [(g["weight_decay"] > 0, {mesh[n] for n in g["names"]}) for g in opt.param_groups]
    assert all(len(kind) == 1 for _, kind in groups) and len(groups) == 4, groups  # one kind per group
    sharded = [p for n, p in model.named_parameters() if n not in plan.expert_params and isinstance(p, DTensor)]
    local_dense = sum(p.to_local().numel() for p in sharded)
    replicated = sum(p.numel() for n, p in model.named_parameters()
                     if n not in plan.expert_params and not isinstance(p, DTensor))
    dense_sum_max = torch.tensor([local_dense, local_dense], dtype=torch.int64)
    dist.all_reduce(dense_sum_max[:1])
    dist.all_reduce(dense_sum_max[1:], op=dist.ReduceOp.MAX)
    full_dense = sum(p.numel() for p in sharded)

    ckpt = os.path.join(out_dir, "ckpt")
    losses, ref_losses, norms, ref_norms, first, routing_flips = [], [], [], [], {}, []
    step1_err = 0.0
    for step in range(1, STEPS + 1):
        batches = global_batches(cfg, step, world)
        grads = {} if step == 1 else None
        loss, norm, counts = train_step(model, plan, opt, batches, rank, world, grads_out=grads)
        rl, rn, rgrads, ref_counts = ref_step(ref, ref_opt, batches)
        if not torch.equal(counts, ref_counts):  # a near-tie routed one token differently
            routing_flips.append(step)
        if step == 1:
            lo, hi = plan.expert_range
            for name, g in grads.items():
                want = rgrads[name]  # clipped already, as the model's
                if name in plan.expert_params:
                    want = want[lo:hi]
                step1_err = max(step1_err, rel_err(g, want))
            first = {"loss": loss, "want": rl, "norm": norm, "want_norm": rn}
        losses.append(loss)
        ref_losses.append(rl)
        norms.append(norm)
        ref_norms.append(rn)
        if step == SAVE_AT:
            save(model, plan, opt, ckpt)
            with plan.full_state_dict():
                saved_full = {k: full(v).detach().cpu().clone() for k, v in model.state_dict().items()}
    final_err, final_worst = weights_err(model, plan, ref)

    # resume at step 10 with RESUME_EP, train 11-20 on the same batches
    plan.close()
    model2, plan2, opt2 = build(tiny_cfg(resume_ep, "auto"), resume_ep, seed=1)  # other weights: the load must replace them
    load(model2, plan2, opt2, ckpt)
    with plan2.full_state_dict():
        loaded_full = {k: full(v).detach().cpu() for k, v in model2.state_dict().items()}
    load_err = max(rel_err(loaded_full[k], saved_full[k]) for k in saved_full)
    resumed = []
    for step in range(SAVE_AT + 1, STEPS + 1):
        resumed.append(train_step(model2, plan2, opt2, global_batches(cfg, step, world), rank, world)[0])
    resumed_err, _ = weights_err(model2, plan2, ref)

    worst = torch.tensor([step1_err, final_err, load_err, resumed_err])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        torch.save(saved_full, os.path.join(out_dir, "saved_full.pt"))  # the test reads the DCP folder against it
        with open(os.path.join(out_dir, "result.json"), "w") as fh:
            json.dump({"world": world, "ep": ep, "resume_ep": resume_ep, "first": first,
                       "step1_grad_err": float(worst[0]), "final_weight_err": float(worst[1]),
                       "load_err": float(worst[2]), "resumed_weight_err": float(worst[3]),
                       "losses": losses, "ref_losses": ref_losses, "norms": norms, "ref_norms": ref_norms,
                       "resumed_losses": resumed, "final_worst_param": final_worst, "routing_flips": routing_flips,
                       "expert_numel": plan.expert_numel(), "dense_sum": int(dense_sum_max[0]),
                       "dense_max": int(dense_sum_max[1]),
                       "full_dense": full_dense, "replicated": replicated}, fh)
    plan2.close()


if __name__ == "__main__":
    import gc

    from omniloom.pretrain.train.main import close_process_group

    main()
    # the models' DTensors hold their meshes' gloo groups: free them while the interpreter is
    # whole, then the default group, letting gloo's threads finish (see close_process_group: a
    # gloo thread still running in the interpreter's teardown aborts the process)
    gc.collect()
    dist.barrier()
    close_process_group()
