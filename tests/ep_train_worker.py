"""The trainer with a tiny real OmniModel (and the stand-in data stream), for the expert-parallel
trainer tests. Launched with `accelerate launch --config_file configs/accelerate/cpu_2proc.yaml`:

    ep_train_worker.py fit OUT key=value ...     train (Trainer.fit); write OUT/result_rank{r}.json
                                                 and OUT/full_params.pt (every expert, gathered)
    ep_train_worker.py step OUT key=value ...    one _train_step on fixed batches, checked against a
                                                 1-process model on the global batch: OUT/step.json
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("standin", Path(__file__).with_name("test_train_standin.py"))
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


def build_model(cfg):
    from omniloom.model import OmniModel

    return OmniModel(cfg.model)


def make_trainer(out: str, overrides: list[str], num_workers: int = 0):
    from omniloom.pretrain.config import load_config
    from omniloom.pretrain.train import Trainer

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
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(state, os.path.join(out, "full_params.pt"))
    with open(os.path.join(out, f"result_rank{rank}.json"), "w") as fh:
        json.dump({"world_size": trainer.acc.num_processes, "step": result.step,
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
            assert p.grad is None or not p.grad.any(), name
            continue
        if trainer.ep is not None and name in trainer.ep.expert_params:
            want = want[lo:hi]
        want = want * scale
        err = max(err, float((p.grad - want).abs().max() / want.abs().max().clamp(min=1e-12)))
    err_t = torch.tensor([err])
    dist.all_reduce(err_t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(os.path.join(out, "step.json"), "w") as fh:
            json.dump({"err": float(err_t), "loss": stats["loss"], "want": float(out_ref.loss.detach()),
                       "grad_norm": stats["grad_norm"], "want_norm": float(ref_norm), "clip_scale": scale}, fh)


def _full_state(trainer, model):
    full = trainer.ep.full_state_dict() if trainer.ep is not None else torch.no_grad()
    with full:
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


if __name__ == "__main__":
    import logging

    logging.basicConfig(level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    mode, out, *overrides = sys.argv[1:]
    {"fit": fit, "step": step}[mode](out, overrides)
    from omniloom.pretrain.train import close_process_group

    close_process_group()
