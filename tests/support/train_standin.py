"""Tiny stand-ins for the model and the data stream, used by the trainer tests only.

They follow the contracts the trainer codes against (pretrain/train/build.py): a model taking the
PackedBatch fields as keyword arguments and returning `loss` plus per-modality CE sums/counts and
expert counts, with `update_router_biases`; a loader with `state_dict`/`load_state_dict` that uses a
real torch DataLoader with worker processes.

Run as a script it trains with them, so the multi-process tests can `accelerate launch` it:

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml tests/support/train_standin.py \
        --out DIR [--sleep S] [--sigterm-at K] [--stall-at K] key=value ...

Legend: B batch, S sequence, V vocab, D width, E experts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

VOCAB = 64
NUM_EXPERTS = 4


@dataclasses.dataclass
class Batch:
    input_ids: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor
    doc_ids: torch.Tensor
    block_ids: torch.Tensor
    modality: torch.Tensor
    patches: torch.Tensor
    patch_kind: torch.Tensor

    def to(self, device, non_blocking=False):
        return Batch(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
                        for f in dataclasses.fields(self)})


def make_batch(seed: int, rank: int, index: int, batch_size: int, seq_len: int) -> Batch:
    """A learnable batch: each row counts up by a row-specific stride mod VOCAB, so the next token
    follows from the previous two; half the tokens are 'text', a quarter 'code', a quarter 'special'."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + index)
    start_B1 = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    stride_B1 = torch.randint(1, 4, (batch_size, 1), generator=g)
    ids_BS = (start_B1 + stride_B1 * torch.arange(seq_len + 1)) % VOCAB
    modality_BS = torch.zeros(batch_size, seq_len, dtype=torch.uint8)
    modality_BS[:, seq_len // 2:] = 1
    modality_BS[:, -seq_len // 4:] = 4
    return Batch(
        input_ids=ids_BS[:, :-1].contiguous(), labels=ids_BS[:, 1:].contiguous(),
        positions=torch.arange(seq_len, dtype=torch.int32).expand(batch_size, 3, seq_len).contiguous(),
        doc_ids=torch.zeros(batch_size, seq_len, dtype=torch.int32),
        block_ids=torch.full((batch_size, seq_len), -1, dtype=torch.int32),
        modality=modality_BS, patches=torch.zeros(0, 8), patch_kind=torch.zeros(0, dtype=torch.uint8))


class _Dataset(torch.utils.data.Dataset):
    def __init__(self, seed, rank, batch_size, seq_len, start, length, sleep, stall_at=None):
        self.args = (seed, rank, batch_size, seq_len)
        self.start, self.length, self.sleep, self.stall_at = start, length, sleep, stall_at

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        if self.sleep:
            time.sleep(self.sleep)
        if self.stall_at is not None and self.start + i + 1 == self.stall_at:
            time.sleep(3600)  # a batch that takes "forever" to build
        seed, rank, bs, sl = self.args
        return make_batch(seed, rank, self.start + i, bs, sl)


def _ignore_sigterm(worker_id):
    """Loader workers leave SIGTERM/SIGINT to the trainer process: torchrun, SLURM and Ctrl-C signal
    the whole process group, and a worker that dies first would fail the trainer's next batch before
    it can save. (torch installs a dying SIGTERM handler in workers; worker_init_fn runs after it.)
    And, as the stream's workers do, a tensor hand-over the stopping trainer broke off is a debug
    line, not a traceback from the worker's resource-sharer thread."""
    from omniloom.data.stream.worker import _quiet_handover_errors

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _quiet_handover_errors()


class StandinLoader:
    """Batches `index = consumed, consumed+1, ...` for this rank through a DataLoader with workers;
    the state is the number of batches handed to the trainer (not the number prefetched)."""

    def __init__(self, seed, rank, batch_size, seq_len, num_workers=2, sleep=0.0, sigterm_at=None, length=10_000,
                 stall_at=None):
        self.seed, self.rank, self.bs, self.sl = seed, rank, batch_size, seq_len
        self.num_workers, self.sleep, self.sigterm_at, self.length = num_workers, sleep, sigterm_at, length
        self.stall_at = stall_at
        self.consumed = 0

    def __iter__(self):
        ds = _Dataset(self.seed, self.rank, self.bs, self.sl, self.consumed, self.length - self.consumed, self.sleep,
                      self.stall_at)
        dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=self.num_workers,
                                         collate_fn=lambda b: b, persistent_workers=False,
                                         worker_init_fn=_ignore_sigterm if self.num_workers else None)
        for batch in dl:
            self.consumed += 1
            if self.sigterm_at is not None and self.consumed == self.sigterm_at:
                os.kill(os.getpid(), signal.SIGTERM)
            yield batch

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = int(state["consumed"])

    def metrics(self):
        return {"skipped_samples": 0, "batches": self.consumed}


@dataclasses.dataclass
class StandinOutput:
    """A dataclass like the real ModelOutput (DDP looks for output tensors inside dataclasses)."""

    loss: torch.Tensor
    ce_loss: torch.Tensor
    z_loss: torch.Tensor
    ce_sum_by_modality: torch.Tensor
    tokens_by_modality: torch.Tensor
    expert_counts: torch.Tensor
    output_rms: torch.Tensor


class StandinBlock(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = torch.nn.RMSNorm(dim)
        self.router = torch.nn.Linear(dim, NUM_EXPERTS, bias=False)
        self.up = torch.nn.Linear(dim, 2 * dim, bias=False)
        self.down = torch.nn.Linear(2 * dim, dim, bias=False)
        self.register_buffer("expert_bias", torch.zeros(NUM_EXPERTS))

    def forward(self, x_BSD):
        h_BSD = self.norm(x_BSD)
        scores_BSE = torch.sigmoid(self.router(h_BSD).float())
        # As in bias-balanced MoE: the bias picks the expert, the unbiased score gates it.
        choice_BS = (scores_BSE + self.expert_bias).argmax(-1)
        gate_BS1 = scores_BSE.gather(-1, choice_BS[..., None])
        return x_BSD + gate_BS1 * self.down(F.silu(self.up(h_BSD))), choice_BS


class StandinModel(torch.nn.Module):
    """Embedding (current + previous token), blocks with a fake router, untied head."""

    def __init__(self, dim=32, num_layers=2, nan_at_call=None, sigterm_at_call=None):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, dim)
        self.prev_embed = torch.nn.Embedding(VOCAB, dim)
        self.layers = torch.nn.ModuleList(StandinBlock(dim) for _ in range(num_layers))
        self.final_norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, VOCAB, bias=False)
        self.nan_at_call = set(nan_at_call or ())
        self.sigterm_at_call = sigterm_at_call
        self.calls = 0
        self.bias_updates = 0

    def forward(self, input_ids, labels, positions, doc_ids, block_ids, modality, patches, patch_kind):
        self.calls += 1
        if self.calls == self.sigterm_at_call:  # a stop that arrives while a step computes
            os.kill(os.getpid(), signal.SIGTERM)
        prev_BS = torch.roll(input_ids, 1, dims=1)
        x_BSD = self.embed(input_ids) + self.prev_embed(prev_BS)
        counts = []
        for layer in self.layers:
            x_BSD, choice_BS = layer(x_BSD)
            idx = modality.long() * NUM_EXPERTS + choice_BS
            counts.append(torch.bincount(idx.flatten(), minlength=5 * NUM_EXPERTS).view(5, NUM_EXPERTS))
        h_BSD = self.final_norm(x_BSD)
        logits_BSV = self.head(h_BSD).float()
        ce_BS = F.cross_entropy(logits_BSV.transpose(1, 2), labels, ignore_index=-100, reduction="none")
        valid_BS = labels != -100
        z_BS = torch.logsumexp(logits_BSV, -1) ** 2
        ce = ce_BS[valid_BS].mean()
        z_loss = 1e-4 * z_BS[valid_BS].mean()
        loss = ce + z_loss
        if self.calls in self.nan_at_call:
            loss = loss * float("nan")
        mod_BS = modality.long()
        ce_sum = torch.zeros(5, device=loss.device).index_add_(0, mod_BS[valid_BS], ce_BS[valid_BS].detach())
        count = torch.bincount(mod_BS[valid_BS], minlength=5).float()
        return StandinOutput(loss=loss, ce_loss=ce.detach(), z_loss=z_loss.detach(), ce_sum_by_modality=ce_sum,
                               tokens_by_modality=count, expert_counts=torch.stack(counts),
                               output_rms=x_BSD.detach().pow(2).mean().sqrt())

    @torch.no_grad()
    def update_router_biases(self, counts_LME):
        self.bias_updates += 1
        load_LE = counts_LME.sum(1).float()
        for layer, load_E in zip(self.layers, load_LE):
            layer.expert_bias += 1e-3 * torch.sign(load_E.mean() - load_E)

    def flops_per_token(self, seq_len):
        return 6 * sum(p.numel() for p in self.parameters())


def standin_builders(sleep=0.0, sigterm_at=None, nan_at_call=None, num_workers=2, sigterm_at_call=None,
                     stall_at=None):
    """(build_model, build_loader) for Trainer."""

    def build_model(cfg):
        return StandinModel(nan_at_call=nan_at_call, sigterm_at_call=sigterm_at_call)

    def build_loader(cfg, split, rank, world_size):
        if split == "eval":
            return StandinLoader(cfg.data.seed + 777, rank, cfg.data.batch_size, cfg.data.seq_len,
                                 num_workers=0, length=cfg.train.eval_steps)
        return StandinLoader(cfg.data.seed, rank, cfg.data.batch_size, cfg.data.seq_len,
                             num_workers=num_workers, sleep=sleep, sigterm_at=sigterm_at, stall_at=stall_at)

    return build_model, build_loader


def reset_accelerate() -> None:
    """Each Trainer makes an Accelerator; accelerate keeps process-wide singletons between them."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def standin_trainer(run_dir, *overrides, overwrite=False, build_model=None, build_loader=None, **builder_kwargs):
    """A Trainer over the stand-ins in this process (no DataLoader workers), with extra overrides."""
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train.loop import Trainer

    cfg = load_config(None, base_overrides(run_dir) + ["data.num_workers=0"] + list(overrides))
    bm, bl = standin_builders(num_workers=0, **builder_kwargs)
    return Trainer(cfg, build_model=build_model or bm, build_loader=build_loader or bl, progress=False,
                   overwrite=overwrite)


def base_overrides(run_dir) -> list[str]:
    return [f"train.run_dir={run_dir}", "data.seq_len=16", "data.batch_size=4", "data.num_workers=2",
            "optim.lr=1e-2", "optim.warmup_steps=2", "logging.every=2", "logging.trackers=[]",
            "train.deterministic=true", "model.vocab_size=64"]


def main(argv=None) -> int:
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train.loop import Trainer

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--stall-at", type=int, default=None, help="building this batch (1-based) takes an hour")
    p.add_argument("--sigterm-at", type=int, default=None)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args(argv)
    cfg = load_config(None, base_overrides(args.out) + args.overrides)
    build_model, build_loader = standin_builders(args.sleep, args.sigterm_at, num_workers=cfg.data.num_workers,
                                                 stall_at=args.stall_at)
    from omniloom.pretrain.console import USER_ERRORS
    from omniloom.pretrain.console import is_disk_full
    from omniloom.pretrain.train.main import report_failure

    trainer = None
    try:  # a user error is one line and exit 2, as `omniloom train` says it (once, under `omniloom launch`)
        trainer = Trainer(cfg, build_model=build_model, build_loader=build_loader, progress=False)
        rank = trainer.acc.process_index
        with open(os.path.join(args.out, f"pid_rank{rank}"), "w") as fh:
            fh.write(str(os.getpid()))
        result = trainer.fit()
    except (*USER_ERRORS, OSError) as err:
        if isinstance(err, OSError) and not isinstance(err, USER_ERRORS):
            if not is_disk_full(err):
                raise
            err = f"disk full: {err}"  # outside a checkpoint save (metrics.jsonl)
        if trainer is not None:
            trainer.train_iter = None  # shuts the loader workers down: they ignore the SIGTERM exit sends them
        return report_failure(f"omniloom train: error: {err}", 2)
    model = trainer.acc.unwrap_model(trainer.model)
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, os.path.join(args.out, f"params_rank{rank}.pt"))
    with open(os.path.join(args.out, f"result_rank{rank}.json"), "w") as fh:
        json.dump({"world_size": trainer.acc.num_processes, "step": result.step, "stopped_by": result.stopped_by,
                   "last_checkpoint": result.last_checkpoint, "bias_updates": model.bias_updates}, fh)
    return 0


if __name__ == "__main__":
    sys.exit(main())
