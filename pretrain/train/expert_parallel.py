"""Expert parallelism (issue 16): the routed experts of every MoE layer split over the ranks of an
expert group, tokens exchanged with `all_to_all_single`. The only place that communicates for it.

Legend: W world size, N ranks per expert group (`model.moe.expert_parallel`), R = W / N replicas
of each expert shard, E experts per layer, El = E / N experts per rank, D width, rows = routed
(token, expert) pairs sorted by expert (what `moe_permute` gives).

Layout: rank w is rank `w % N` of expert group `w // N` (consecutive ranks, so one group sits on
one node's fast links) and holds experts [(w % N) * El, (w % N + 1) * El) of every MoE layer. The
ranks holding the same shard, {w % N, w % N + N, ...}, form its replica group. Everything else
(attention, embeddings, router, shared experts, dense layers) stays data-parallel.

Per MoE layer and forward: one all_to_all of the per-expert counts, one host read of the split
sizes (inherent to all_to_all_single), one all_to_all of the rows there and one back; backward
runs the two row exchanges in reverse with the same splits (no further host read).

Gradients: the expert shard's gradient on a rank already sums the contributions of every token
its expert group routed to it. `ExpertParallel.sync_grads` sums it over the replica group and
divides by W, which is exactly what DDP's averaging does to the data-parallel parameters (the
trainer scales each rank's loss by W). `clip_grad_norm_` clips by the global norm.

FSDP2 (pretrain/train/parallel.py: apply_fsdp2, then `ExpertParallel.apply_fsdp2`): everything else is
sharded over all W ranks by `fully_shard`, each block a unit. With R = 1 the expert shards stay
plain tensors outside FSDP, synced as above. With R > 1 each MoE layer's experts become an FSDP
unit over their replica group (each rank keeps 1/R of its expert group's shard, 1/W of the
experts; gradients reduce-scattered over the group and divided by W), its shared expert a unit
over the world, and its router (E x D) stays out of FSDP, replicated and summed over the world by
`sync_grads` (torchtitan's dp_mod_ep layout, but for the router). The clip adds the DTensor
shards' squared norms over the world. Checkpoints: `full_state_dict` (gathered, for DDP's rank-0
files) or `sharded_state_dict` (DTensors over the (expert shard, expert replica) mesh, for
FSDP2's DCP folders).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import math
import time
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

log = logging.getLogger(__name__)

EXPERT_PARAM_NAMES = ("w_gate", "w_up", "w_down")


class _ExchangeTimer:
    """Wall time of the all_to_all calls while `enabled` (for pretrain/bench/expert_parallel.py); synchronises
    CUDA around each call when asked, so the time includes waiting for the other ranks."""

    def __init__(self):
        self.enabled, self.sync, self.seconds = False, False, 0.0

    def reset(self, sync: bool = False) -> None:
        self.enabled, self.sync, self.seconds = True, sync, 0.0

    @contextlib.contextmanager
    def __call__(self):
        if not self.enabled:
            yield
            return
        if self.sync:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        yield
        if self.sync:
            torch.cuda.synchronize()
        self.seconds += time.perf_counter() - t0


EXCHANGE_TIMER = _ExchangeTimer()


class _AllToAll(torch.autograd.Function):
    """all_to_all_single of rows with uneven splits; backward sends the gradients back the other way."""

    @staticmethod
    def forward(ctx, x_RD, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        out = x_RD.new_empty((sum(out_splits), *x_RD.shape[1:]))
        with EXCHANGE_TIMER():
            dist.all_to_all_single(out, x_RD.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g_RD):
        out = g_RD.new_empty((sum(ctx.in_splits), *g_RD.shape[1:]))
        with EXCHANGE_TIMER():
            dist.all_to_all_single(out, g_RD.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


def is_moe_module(module: nn.Module) -> bool:
    """A routed-expert layer (omniloom.model.moe.MoE or anything shaped like it)."""
    return hasattr(module, "expert_dispatcher") and all(isinstance(getattr(module, n, None), nn.Parameter)
                                                        for n in EXPERT_PARAM_NAMES)


def check_expert_parallel(ep_size: int, world_size: int, num_experts: int, *, distributed_type: str = "",
                          fsdp_version: int | None = None) -> None:
    """ValueError with what to change when `model.moe.expert_parallel` cannot run on this launch."""
    if ep_size < 1:
        raise ValueError(f"model.moe.expert_parallel must be >= 1, got {ep_size}")
    if ep_size == 1:
        return
    if world_size % ep_size:
        raise ValueError(f"model.moe.expert_parallel={ep_size} must divide the number of processes ({world_size}); "
                         f"launch with --num_processes a multiple of {ep_size} or lower model.moe.expert_parallel")
    if num_experts % ep_size:
        raise ValueError(f"model.moe.expert_parallel={ep_size} must divide model.moe.num_experts={num_experts}")
    if "DEEPSPEED" in distributed_type or "MEGATRON" in distributed_type:
        raise ValueError(f"model.moe.expert_parallel={ep_size} runs with DDP (configs/accelerate/multi_gpu.yaml, "
                         f"ep_8gpu.yaml) or FSDP2 (fsdp2.yaml, ep_fsdp2_8gpu.yaml); {distributed_type} with expert "
                         f"parallelism is not supported")
    if "FSDP" in distributed_type and fsdp_version not in (None, 2):
        raise ValueError(f"model.moe.expert_parallel={ep_size} needs FSDP2 (fsdp_version: 2 in the accelerate config, "
                         f"as configs/accelerate/fsdp2.yaml); FSDP1 would flatten the expert shards with the rest")


def expert_group_ranks(world_size: int, ep_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """(expert groups, replica groups) as lists of global ranks (see the module docstring)."""
    groups = [list(range(g * ep_size, (g + 1) * ep_size)) for g in range(world_size // ep_size)]
    replicas = [list(range(r, world_size, ep_size)) for r in range(ep_size)]
    return groups, replicas


class ExpertParallel:
    """The communication of expert parallelism: the dispatcher every MoE layer calls, the expert
    gradient sync and the global-norm clipping. Build with `parallelize_experts`."""

    def __init__(self, *, ep_size: int, rank: int, world_size: int, num_experts: int,
                 group, replica_group, expert_params: dict[str, nn.Parameter]):
        self.size, self.rank, self.world_size = ep_size, rank, world_size
        self.ep_rank = rank % ep_size
        self.num_experts, self.num_local = num_experts, num_experts // ep_size
        self.group, self.replica_group = group, replica_group
        self.num_replicas = world_size // ep_size
        self.expert_params = expert_params  # qualified name -> this rank's shard
        self.moe_modules: list[tuple[str, nn.Module]] = []  # (qualified name, MoE layer), set by parallelize_experts
        # FSDP2 with several replicas (apply_fsdp2): the expert shards sharded further over their
        # replica group by fully_shard, the routers left out of FSDP and synced here
        self.fsdp_experts = False
        self.router_params: dict[str, nn.Parameter] = {}

    @property
    def expert_range(self) -> tuple[int, int]:
        """[first, last) expert index this rank holds in every MoE layer."""
        return shard_range(self.num_experts, self.size, self.rank)

    # ---- the dispatcher the MoE layers call ------------------------------------------------
    @torch.compiler.disable  # communication and a host read: compiled blocks run it eagerly, between graphs
    def __call__(self, x_ND: torch.Tensor, counts_E: torch.Tensor,
                 run_experts: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Rows sorted by expert (all E experts) -> the experts' outputs in the same order, the
        rows of experts held elsewhere computed on their owners."""
        N, El, E = self.size, self.num_local, self.num_experts
        assert counts_E.numel() == E, (counts_E.shape, E)
        # counts first: rank s learns how many rows of each of its experts every rank sends it
        recv_counts = torch.empty_like(counts_E)
        with EXCHANGE_TIMER():
            dist.all_to_all_single(recv_counts, counts_E.contiguous(), group=self.group)
            both = torch.cat([counts_E, recv_counts]).tolist()  # the one host read per layer and step
        send_c, recv_c = both[:E], both[E:]  # send_c by expert; recv_c by (source rank, local expert)
        in_splits = [sum(send_c[r * El:(r + 1) * El]) for r in range(N)]
        out_splits = [sum(recv_c[s * El:(s + 1) * El]) for s in range(N)]
        x_recv = _AllToAll.apply(x_ND, out_splits, in_splits, self.group)
        counts_local = recv_counts.view(N, El).sum(0)
        if El == 1:  # rows already grouped by the single local expert
            y_recv = run_experts(x_recv, counts_local)
        else:
            # (source, expert) chunks -> (expert, source): each local expert's rows contiguous
            chunks = x_recv.split(recv_c)
            by_expert = [s * El + e for e in range(El) for s in range(N)]
            y_local = run_experts(torch.cat([chunks[i] for i in by_expert]), counts_local)
            y_chunks = y_local.split([recv_c[i] for i in by_expert])
            y_recv = torch.cat([y_chunks[e * N + s] for s in range(N) for e in range(El)])
        return _AllToAll.apply(y_recv, in_splits, out_splits, self.group)

    def close(self) -> None:
        """Destroy this plan's process groups, its device mesh's too (at exit; idempotent)."""
        # in the same order on every rank (a set's order differs between processes)
        groups = [g for g in (self.group, self.replica_group) if g is not None]
        if self._mesh is not None:
            for dim in range(self._mesh.ndim):
                with contextlib.suppress(Exception):
                    g = self._mesh.get_group(dim)
                    if g is not dist.GroupMember.WORLD and all(g is not h for h in groups):
                        groups.append(g)
        for g in groups:
            with contextlib.suppress(Exception):  # already gone with the default group
                dist.destroy_process_group(g)
        self.group = self.replica_group = self._mesh = None

    # ---- gradients ---------------------------------------------------------------------------
    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.expert_params.values() if p.grad is not None]

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Average the expert gradients as DDP averages the others: sum over the replica group
        (the ranks holding the same shard), divide by the world size. Call after the last
        backward of a step, before clipping. Under FSDP2 with several replicas, FSDP has done
        that for the expert shards (reduce-scatter over the replica group, divided by the world
        size); the routers, outside FSDP, are summed over the world here."""
        if self.fsdp_experts:
            self._reduce([p.grad for p in self.router_params.values() if p.grad is not None], None)
            return
        self._reduce(self.grads(), self.replica_group if self.num_replicas > 1 else False)

    def _reduce(self, grads: list[torch.Tensor], group) -> None:
        """Sum `grads` over `group` (None: the world; False: nowhere), divide by the world size."""
        if not grads:
            return
        if group is not False:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
        torch._foreach_div_(grads, float(self.world_size))

    # ---- FSDP2 ------------------------------------------------------------------------------
    def expert_mesh(self, device_type: str):
        """The (expert shard, expert replica) device mesh: rank g * N + e sits at [e, g], so
        mesh["expert_replica"] is this rank's replica group and dimension 0 its expert group."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(self.world_size).view(self.num_replicas, self.size).t().contiguous()
            self._mesh = DeviceMesh(device_type, ranks, mesh_dim_names=("expert_shard", "expert_replica"))
        return self._mesh

    def apply_fsdp2(self, fully_shard_kwargs: dict) -> set[nn.Parameter]:
        """Prepare the MoE layers for FSDP2 (called by pretrain.parallel.apply_fsdp2 before it
        shards the blocks; collective). One replica: the expert shards stay plain, left out of
        FSDP (returned, for the blocks to ignore). Several: each shared expert becomes an FSDP
        unit over the world, then the experts of each MoE layer a unit sharded over their
        replica group (gradients summed over it and divided by the world size, as sync_grads
        does), the router left out of both and synced by sync_grads. Returns the parameters the
        block and root units must ignore."""
        from torch.distributed.fsdp import fully_shard

        if self.num_replicas == 1:
            return set(self.expert_params.values())
        device_type = next(iter(self.expert_params.values())).device.type
        replica_mesh = self.expert_mesh(device_type)["expert_replica"]
        kwargs = {k: v for k, v in fully_shard_kwargs.items() if k not in ("mesh", "ignored_params")}
        for prefix, moe in self.moe_modules:
            if getattr(moe, "shared", None) is not None:
                fully_shard(moe.shared, mesh=fully_shard_kwargs.get("mesh"), **kwargs)
            fully_shard(moe, mesh=replica_mesh, ignored_params={moe.router}, **kwargs)
            moe.set_gradient_divide_factor(float(self.world_size))
            if dist.get_backend() == "gloo":  # no PREMUL_SUM there: sum, then divide
                moe.set_force_sum_reduction_for_comms(True)
            for n in EXPERT_PARAM_NAMES:  # fully_shard replaced them with DTensor parameters
                self.expert_params[f"{prefix}.{n}" if prefix else n] = getattr(moe, n)
            self.router_params[f"{prefix}.router" if prefix else "router"] = moe.router
        self.fsdp_experts = True
        return set(self.router_params.values())


    @torch.no_grad()
    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip every gradient by the global L2 norm and return the norm before clipping, as
        torch.nn.utils.clip_grad_norm_ does. Data-parallel gradients are the same on every rank
        (DDP), or sharded over every rank (FSDP2: DTensor, its squared norm summed over the
        world); plain expert shards add up over the expert group."""
        from torch.distributed.tensor import DTensor

        expert_ids = {id(p) for p in self.expert_params.values()}
        dense, sharded, expert = [], [], []
        for p in parameters:
            g = p.grad
            if g is None:
                continue
            if isinstance(g, DTensor):
                # FSDP2 shards: over the world, or (experts) over the replica group of an expert
                # group's shard; either way the world's local squares add up to the whole
                if any(not pl.is_shard() for pl in g.placements):
                    raise ValueError(f"a gradient with placements {g.placements}: only FSDP2's Shard placements "
                                     f"are supported with expert parallelism")
                sharded.append(g._local_tensor)
            elif id(p) in expert_ids:
                expert.append(g)
            else:
                dense.append(g)
        ref = (dense or sharded or expert)[0]
        dtype = torch.promote_types(ref.dtype, torch.float32)  # bf16 gradients: an fp32 sum
        sq = torch.zeros(3, dtype=dtype, device=ref.device)
        for i, gs in enumerate((dense, sharded, expert)):
            if gs:
                sq[i] = torch.stack([n.to(dtype) for n in torch._foreach_norm(gs)]).pow(2).sum()
        if self.world_size > 1 and dist.is_initialized():
            shard_sq = sq[1:2].clone()
            dist.all_reduce(shard_sq)  # FSDP2 shards over the whole world
            expert_sq = sq[2:3].clone()
            dist.all_reduce(expert_sq, group=self.group)
            total = (sq[0] + shard_sq[0] + expert_sq[0]).sqrt()
        else:
            total = sq.sum().sqrt()
        if math.isfinite(max_norm):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(dense + sharded + expert, coef.to(ref.dtype))
        return total

    # ---- checkpoints: full (unsharded) or DTensor state dicts ----------------------------------
    @contextlib.contextmanager
    def full_state_dict(self):
        """Inside, `model.state_dict()` and the attached optimizer's `state_dict()` hold every
        expert (gathered over the expert group, one layer at a time, onto the CPU): collective,
        every rank must take them in the same order (accelerate's save_state does). Outside they
        hold this rank's shard. Loading takes any of the three: a full tensor is sliced to this
        rank's shard, so a checkpoint resumes with any expert-parallel degree, and export reads
        it as is. For checkpoints written by one process (DDP: rank 0 saves)."""
        with self._state_dict_mode("full"):
            yield

    @contextlib.contextmanager
    def sharded_state_dict(self):
        """Inside, the state dicts hold each expert tensor as a DTensor of the whole shape over the
        (expert shard, expert replica) mesh, sharded along the experts over the expert group (and
        over the replicas, when FSDP2 shards them there): nothing is gathered. For
        torch.distributed.checkpoint (FSDP2's sharded checkpoints): it writes every shard once
        (from one replica) with the full shape in its metadata, and loads any layout back, so a
        checkpoint resumes with another expert-parallel degree, and export consolidates it."""
        with self._state_dict_mode("dtensor"):
            yield

    @contextlib.contextmanager
    def _state_dict_mode(self, mode: str):
        self._mode = mode
        try:
            yield
        finally:
            self._mode = None

    _mode: str | None = None  # None: this rank's shard; "full": gathered; "dtensor": see sharded_state_dict
    _mesh = None

    def _gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(parts, shard.contiguous(), group=self.group)
        return torch.cat(parts).cpu()

    def _export(self, value: torch.Tensor):
        """A rank's expert shard (plain, or a DTensor sharded over its replica group by FSDP2)
        as the state-dict mode wants it: whole on the CPU, or a DTensor of the whole shape."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        fsdp = isinstance(value, DTensor)
        if self._mode == "full":
            return self._gather_full(value.full_tensor() if fsdp else value)
        local = value.to_local() if fsdp else value.detach()
        shape = (self.num_experts, *value.shape[1:])
        stride = torch.empty(shape, device="meta").stride()
        # along the experts over the expert group; then over the replicas: sharded by FSDP, or replicated
        placements = [Shard(0), Shard(0) if fsdp else Replicate()]
        return DTensor.from_local(local, self.expert_mesh(local.device.type), placements, run_check=False,
                                  shape=shape, stride=stride)

    def _to_shard(self, t, param: torch.Tensor):
        """What a state dict holds for an expert tensor (whole, this rank's shard, or a DTensor
        from sharded_state_dict's template) -> what `param` (plain shard, or FSDP2's DTensor over
        the replica group) loads."""
        from torch.distributed.tensor import DTensor

        if not torch.is_tensor(t) or t.dim() == 0:
            return t
        fsdp = isinstance(param, DTensor)
        if isinstance(t, DTensor):
            if fsdp and t.device_mesh == param.device_mesh:
                return t
            local = t.to_local()  # sharded_state_dict's template, filled for this very layout
            want = param.to_local().shape if fsdp else param.shape
            if tuple(local.shape) != tuple(want):
                raise ValueError(f"an expert DTensor of local shape {tuple(local.shape)} for a shard of {tuple(want)}")
        else:
            lo, hi = self.expert_range
            if t.shape[0] == self.num_experts and self.num_local != self.num_experts \
                    and tuple(t.shape[1:]) == tuple(param.shape[1:]):
                t = t[lo:hi]  # the whole tensor: this rank's experts
            if not fsdp:
                return t
            chunks = torch.chunk(t, self.num_replicas, dim=0)  # FSDP2's split over the replica group
            g = self.rank // self.size
            local = chunks[g] if g < len(chunks) else t[:0]
        if not fsdp:
            return local
        return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())

    def _module_state_dict_hook(self, module, state_dict, prefix, local_metadata):
        if self._mode is not None:
            for n in EXPERT_PARAM_NAMES:
                if prefix + n in state_dict:
                    state_dict[prefix + n] = self._export(state_dict[prefix + n])

    def _module_load_hook(self, module, state_dict, prefix, *args):
        for n in EXPERT_PARAM_NAMES:
            if prefix + n in state_dict:
                state_dict[prefix + n] = self._to_shard(state_dict[prefix + n], getattr(module, n))

    def _expert_keys(self, optimizer, state_dict) -> dict:
        """State-dict key -> expert parameter: keys are the optimizer's own indices (torch numbers
        parameters across the groups in order) or FQNs (torch.distributed.checkpoint's
        set_optimizer_state_dict), paired with the live parameters group by group."""
        expert_ids = {id(p) for p in self.expert_params.values()}
        out = {}
        for saved, live in zip(state_dict["param_groups"], optimizer.param_groups):
            for key, p in zip(saved["params"], live["params"]):
                if id(p) in expert_ids:
                    out[key] = p
        return out

    def _optimizer_state_dict_hook(self, optimizer, state_dict):
        if self._mode is None:
            return None
        state = dict(state_dict["state"])
        for key, p in self._expert_keys(optimizer, state_dict).items():
            if key in state:  # copies: the packed state shares its per-parameter dicts with the live optimizer
                state[key] = {k: self._export(v) if torch.is_tensor(v) and v.shape == p.shape else v
                              for k, v in state[key].items()}
        return {**state_dict, "state": state}

    def _optimizer_load_hook(self, optimizer, state_dict):
        state = dict(state_dict["state"])
        for key, p in self._expert_keys(optimizer, state_dict).items():
            if key in state:
                state[key] = {k: self._to_shard(v, p) for k, v in state[key].items()}
        return {**state_dict, "state": state}

    def attach_optimizer(self, optimizer) -> None:
        """Full/sliced expert moments in `optimizer`'s state dicts, as for the model's."""
        optimizer.register_state_dict_post_hook(lambda *a: self._optimizer_state_dict_hook(*a))
        optimizer.register_load_state_dict_pre_hook(lambda *a: self._optimizer_load_hook(*a))

    # ---- accounting --------------------------------------------------------------------------
    def expert_numel(self) -> int:
        """Expert parameters held by this rank (its FSDP2 slice of them, when sharded further)."""
        from torch.distributed.tensor import DTensor

        return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in self.expert_params.values())

    def describe(self) -> str:
        lo, hi = self.expert_range
        n = self.expert_numel()
        whole = sum(p.numel() for p in self.expert_params.values()) * self.size
        share = f"1/{self.size}" if not self.fsdp_experts else \
            f"1/{self.size} sharded over {self.num_replicas} replicas by FSDP2: {n / whole:.3g}"
        return (f"expert parallel {self.size} x {self.num_replicas} replicas: this rank holds experts [{lo}, {hi}) "
                f"of {self.num_experts} per MoE layer, {n:,} expert parameters ({whole:,} unsharded, {share})")


def shard_range(num_experts: int, ep_size: int, rank: int) -> tuple[int, int]:
    """[first, last) expert that global rank `rank` holds (see the module docstring)."""
    per = num_experts // ep_size
    return (rank % ep_size) * per, (rank % ep_size + 1) * per


def parallelize_experts(model: nn.Module, ep_size: int, *, rank: int | None = None,
                        world_size: int | None = None) -> ExpertParallel | None:
    """Shard the routed experts of every MoE layer of a built model over expert groups of
    `ep_size` ranks and attach the dispatcher. Collective (creates process groups): every rank
    calls it, after building the same model (same seed) and before wrapping it in DDP. A model
    built with this rank's experts only (`OmniModel(cfg, expert_range=shard_range(...))`) keeps
    them; a full one is sliced. Returns None for ep_size 1 (nothing changes)."""
    if ep_size == 1:
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"model.moe.expert_parallel={ep_size} needs several processes: launch with accelerate "
                         f"launch / omniloom launch and --num_processes a multiple of {ep_size}")
    rank = dist.get_rank() if rank is None else rank
    world_size = dist.get_world_size() if world_size is None else world_size
    moe_modules = [(name, m) for name, m in model.named_modules() if is_moe_module(m)]
    if not moe_modules:
        raise ValueError("model.moe.expert_parallel > 1 but the model has no MoE layers")
    num_experts = getattr(moe_modules[0][1], "num_experts", moe_modules[0][1].w_gate.shape[0])
    check_expert_parallel(ep_size, world_size, num_experts)
    groups, replicas = expert_group_ranks(world_size, ep_size)
    # every rank creates every group, in the same order (new_group is collective)
    my_group = my_replica = None
    for ranks in groups:
        g = dist.new_group(ranks)
        if rank in ranks:
            my_group = g
    for ranks in replicas:
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if rank in ranks:
            my_replica = g
    lo, hi = shard_range(num_experts, ep_size, rank)
    expert_params: dict[str, nn.Parameter] = {}
    for prefix, moe in moe_modules:
        if getattr(moe, "num_experts", moe.w_gate.shape[0]) != num_experts:
            raise ValueError(f"{prefix} has {moe.num_experts} experts, the first MoE layer {num_experts}")
        # built with this rank's experts only (OmniModel(cfg, expert_range=...)): keep them
        prebuilt = getattr(moe, "expert_range", None) is not None and moe.w_gate.shape[0] != num_experts
        if prebuilt and tuple(moe.expert_range) != (lo, hi):
            raise ValueError(f"{prefix} was built with experts {moe.expert_range}, but rank {rank} of expert "
                             f"parallelism {ep_size} holds [{lo}, {hi})")
        for n in EXPERT_PARAM_NAMES:
            if prebuilt:
                shard = getattr(moe, n)
            else:
                shard = nn.Parameter(getattr(moe, n).detach()[lo:hi].clone(), requires_grad=getattr(moe, n).requires_grad)
                setattr(moe, n, shard)
            expert_params[f"{prefix}.{n}" if prefix else n] = shard
        moe.expert_range = (lo, hi)  # for checkpoint and export code that reads the module
    plan = ExpertParallel(ep_size=ep_size, rank=rank, world_size=world_size, num_experts=num_experts,
                          group=my_group, replica_group=my_replica, expert_params=expert_params)
    plan.moe_modules = moe_modules
    # gloo subgroups left to the interpreter's teardown can abort the process at exit ("terminate
    # called without an active exception"): destroy them first
    atexit.register(plan.close)
    for _, moe in moe_modules:
        moe.expert_dispatcher = plan
        # torch tags hooks with an attribute: plain functions, not bound methods
        moe.register_state_dict_post_hook(lambda *a: plan._module_state_dict_hook(*a))
        moe.register_load_state_dict_pre_hook(lambda *a: plan._module_load_hook(*a))
    # DDP must neither broadcast the shards from rank 0 at wrap time nor average them over every rank
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(expert_params))
    return plan


def find_plan(model: nn.Module) -> ExpertParallel | None:
    """The ExpertParallel a model was parallelized with (through any wrapper), or None."""
    for m in model.modules():
        plan = getattr(m, "expert_dispatcher", None)
        if isinstance(plan, ExpertParallel):
            return plan
    return None
