"""The trainer with a tiny real OmniModel (and the stand-in data stream), for the expert-parallel
trainer tests. Launched with `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml`:

    ep_train_worker.py fit OUT key=value ...     train (Trainer.fit); write OUT/result_rank{r}.json
                                                 and OUT/full_params.pt (every expert, gathered)
    ep_train_worker.py step OUT key=value ...    one _train_step on fixed batches, checked against a
                                                 1-process model on the global batch: OUT/step.json

`fit-fsdp2` and `step-fsdp2` do the same under FSDP2 (`fit-fsdp2-bf16`: with FSDP2's bf16
MixedPrecisionPolicy): accelerate turns an FSDP config into plain
data parallelism when the Accelerator is made with cpu=True (FSDP needs a GPU type in its state),
so these modes switch the state to FSDP with the plugin of configs/accelerate/fsdp2.yaml right
after the trainer makes its Accelerator. The trainer's FSDP2 path then runs on CPU over gloo:
apply_parallelism, accelerate's _prepare_fsdp2, and save_state / load_state through
torch.distributed.checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("standin", Path(__file__).with_name("train_standin.py"))
standin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(standin)

MODEL = ["model.dim=32", "model.num_layers=3", "model.num_heads=4", "model.num_kv_heads=2", "model.rope_sections=[2,2,4]",
         "model.patch_dim=4", "model.tubelet_dim=8", "model.kernels=reference", "model.attention.backend=sdpa",
         "model.attention.pattern=LG", "model.attention.window=8", "model.moe.num_experts=4",
         "model.moe.num_experts_per_token=2", "model.moe.expert_dim=16", "model.moe.dense_dim=32",
         "model.moe.num_dense_layers=1", "optim.lr=3e-3",
         # the vocabulary of tokenizers.testing.make_tiny_tokenizer (the export part needs a real
         # tokenizer); a patch id the stand-in tokens (< 64) never use
         "model.vocab_size=512", "model.patch_token_id=511"]


def as_full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def fsdp2_on_cpu(mixed_precision: str | None = None) -> None:
    """Make the trainer's Accelerator an FSDP2 one (see the module docstring); `mixed_precision`
    "bf16" sets the plugin's MixedPrecisionPolicy as `mixed_precision: bf16` does on GPUs."""
    import yaml
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    import omniloom.pretrain.train.loop as train
    from omniloom.pretrain.config.run import presets_dir

    conf = yaml.safe_load((presets_dir() / "accelerate" / "fsdp2.yaml").read_text())["fsdp_config"]
    make = train.make_accelerator

    def make_fsdp2(cfg):
        acc = make(cfg)
        acc.state.fsdp_plugin = FullyShardedDataParallelPlugin(
            fsdp_version=conf["fsdp_version"], state_dict_type=conf["fsdp_state_dict_type"],
            reshard_after_forward=conf["fsdp_reshard_after_forward"], auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=[conf["fsdp_transformer_layer_cls_to_wrap"]])
        # both shared states: a later AcceleratorState() copies PartialState's over its own
        acc.state.distributed_type = PartialState().distributed_type = DistributedType.FSDP
        assert acc.is_fsdp2
        if mixed_precision:
            acc.state.fsdp_plugin.set_mixed_precision(mixed_precision)
        return acc

    train.make_accelerator = make_fsdp2


def build_model(cfg, expert_range=None):
    """The trainer builds only its rank's experts with expert parallelism (expert_range)."""
    from omniloom.model import OmniModel

    return OmniModel(cfg.model, expert_range=expert_range)


def make_trainer(out: str, overrides: list[str], num_workers: int = 0):
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train.loop import Trainer

    cfg = load_config(None, standin.base_overrides(out) + MODEL + [f"data.num_workers={num_workers}"] + overrides)
    loader = standin.standin_builders(num_workers=num_workers)[1]
    return Trainer(cfg, build_model=build_model, build_loader=loader, progress=False)


def fit(out: str, overrides: list[str]) -> None:
    trainer = make_trainer(out, overrides)
    result = trainer.fit()
    rank = trainer.acc.process_index
    model = trainer.acc.unwrap_model(trainer.model)
    full = trainer.ep.full_state_dict() if trainer.ep is not None else torch.no_grad()
    with full:
        state = {k: as_full(v).detach().cpu().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(state, os.path.join(out, "full_params.pt"))
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as fh:
        json.dump({"world_size": trainer.acc.num_processes, "step": result.step, "fsdp2": trainer.acc.is_fsdp2,
                   "ep": trainer.ep.size if trainer.ep is not None else 1,
                   "expert_numel": trainer.ep.expert_numel() if trainer.ep is not None else None}, fh)


def step(out: str, overrides: list[str]) -> None:
    import torch.distributed as dist

    trainer = make_trainer(out, overrides + ["train.grad_accum_steps=2", "checkpoint.every=0"])
    rank, world = trainer.acc.process_index, trainer.acc.num_processes

    def batches(r):
        got = [standin.make_batch(3, r, i, 4, 16) for i in range(2)]
        if r == 1:
            got[0].labels[:, 3:] = -100  # uneven label counts across ranks and micro-batches
        return got

    trainer.train_iter = iter(batches(rank))
    model = trainer.acc.unwrap_model(trainer.model)
    ref = build_model(trainer.cfg)  # same seed as the trainer's model: the same full weights
    ref.load_state_dict(_full_state(trainer, model))
    vec, _ = trainer._train_step()
    stats = trainer._unpack(vec)
    every = [b for r in range(world) for b in batches(r)]
    fields = ("input_ids", "labels", "positions", "doc_ids", "block_ids", "modality")
    out_ref = ref(**{f: torch.cat([getattr(b, f) for b in every]) for f in fields},
                  patches=every[0].patches, patch_kind=every[0].patch_kind)
    out_ref.loss.backward()
    ref_grads = dict((n, p.grad) for n, p in ref.named_parameters())
    ref_norm = torch.sqrt(sum(g.pow(2).sum() for g in ref_grads.values() if g is not None))
    clip = trainer.cfg.optim.grad_clip  # the trainer clips by the global norm: scale the reference alike
    scale = float((clip / (ref_norm + 1e-6)).clamp(max=1.0)) if clip > 0 else 1.0
    lo, hi = trainer.ep.expert_range if trainer.ep is not None else (0, None)
    err = 0.0
    for name, p in model.named_parameters():
        want = ref_grads[name]
        if want is None:  # (the patch projections when a batch has no patches)
            assert p.grad is None or not as_full(p.grad).any(), name
            continue
        if trainer.ep is not None and name in trainer.ep.expert_params:
            want = want[lo:hi]
        want = want * scale
        err = max(err, float((as_full(p.grad) - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    err_t = torch.tensor([err])
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(os.path.join(out, "step.json"), "w") as fh:
            json.dump({"err": float(err_t), "fsdp2": trainer.acc.is_fsdp2, "loss": stats["loss"], "want": float(out_ref.loss.detach()),
                       "grad_norm": stats["grad_norm"], "want_norm": float(ref_norm), "clip_scale": scale}, fh)


def _full_state(trainer, model):
    full = trainer.ep.full_state_dict() if trainer.ep is not None else torch.no_grad()
    with full:
        return {k: as_full(v).detach().cpu().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    mode, out, *overrides = sys.argv[1:]
    if "-fsdp2" in mode:  # fit-fsdp2, step-fsdp2, fit-fsdp2-bf16
        mode, _, mp = mode.partition("-fsdp2")
        fsdp2_on_cpu(mp.lstrip("-") or None)
    {"fit": fit, "step": step}[mode](out, overrides)
    from omniloom.pretrain.train.main import close_process_group

    close_process_group()
