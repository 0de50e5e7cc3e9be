"""`omniloom bench train`: training throughput and where a step's time goes.

Runs the real Trainer (model, optimizer, guards, router-bias update) for warmup + N steps in this
process and reports tokens/s and the data / forward / backward / optimizer split. The reference
measured in the same run is a forward-only pass (no grad) over the same kind of batches, so the
printed ratio says what training costs relative to inference-style evaluation on this machine.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
import time

import torch

log = logging.getLogger(__name__)

# Used only when the preset has no data.tokenizer: what the synthetic batches need from it.
_SYNTHETIC_VOCAB, _SYNTHETIC_PATCH_ID = 1024, 8


class SyntheticLoader:
    """Random PackedBatch-shaped batches (text, code, an image and a video block per row when the
    row has room: none at seq_len 64) from omniloom.model.synthetic, for benchmarking without
    shards. Deterministic per batch index.

    The first `pool` batches are built ahead of time (pinned when CUDA is there) and then cycled:
    building a batch on the CPU inside the timed step cost 400-500 ms of a 1 s H200 step, which
    measured the batch builder, not training."""

    def __init__(self, cfg, rank: int, pool: int = 8):
        from omniloom.data.batch import PackedBatch
        from omniloom.model.synthetic import random_packed_batch

        self.cfg, self.rank, self.index = cfg, rank, 0
        self.pool = []
        for i in range(pool):
            fields = random_packed_batch(cfg.model, batch_size=cfg.data.batch_size, seq_len=cfg.data.seq_len,
                                         docs_per_row=4, seed=cfg.data.seed * 100_003 + rank * 10_007 + i)
            batch = PackedBatch(**fields)
            self.pool.append(batch.pin_memory() if torch.cuda.is_available() else batch)

    def __iter__(self):
        while True:
            batch = self.pool[self.index % len(self.pool)]
            self.index += 1
            yield batch

    def state_dict(self) -> dict:
        return {"index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = int(state["index"])

def synthetic_config(cfg):
    """`cfg` made to train on SyntheticLoader batches: a vocabulary and <|patch|> id without a
    tokenizer, and no DataLoader workers (the synthetic batches are built in this process, so there
    are no workers to leave cores for: pretrain/runtime/threads.py would take one thread per worker away)."""
    from omniloom.pretrain.train import build as B

    model_cfg = cfg.model
    if not cfg.data.tokenizer:
        model_cfg = dataclasses.replace(model_cfg, vocab_size=model_cfg.vocab_size or _SYNTHETIC_VOCAB,
                                        patch_token_id=max(model_cfg.patch_token_id, _SYNTHETIC_PATCH_ID))
    cfg = dataclasses.replace(cfg, model=model_cfg, data=dataclasses.replace(cfg.data, num_workers=0))
    return B.resolve_model_config(cfg)


def bench_trainer(preset: str, overrides: list[str], *, run_dir: str, num_steps: int):
    """A Trainer for benchmarking `preset`: no checkpoints, evaluation or TensorBoard, a fresh start
    in `run_dir`; with no data.sources it trains on SyntheticLoader batches (synthetic_config)."""
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.train import build as B
    from omniloom.pretrain.train.loop import Trainer

    cfg = load_config(preset, list(overrides) + [
        f"train.run_dir={run_dir}", f"train.num_steps={num_steps}", "checkpoint.every=0",
        "logging.trackers=[]", "train.eval_every=0", "checkpoint.resume="])
    kwargs = {}
    if not cfg.data.sources:
        cfg = synthetic_config(cfg)
        kwargs = dict(build_model=B.build_model,
                      build_loader=lambda c, split, rank, world: SyntheticLoader(c, rank) if split == "train" else None)
    return Trainer(cfg, progress=False, **kwargs)


def bench_train(preset: str, overrides: list[str], *, steps: int = 10, warmup: int = 2, figures: dict | None = None) -> str:
    """Time `steps` training steps of `preset` after `warmup` and return the printable report
    (and fill `figures`, when given, with seq_len, step_s and tokens_per_s)."""
    from omniloom.pretrain.train import build as B
    from omniloom.pretrain.train.metrics import StepTimer, mfu, peak_flops_per_device

    if steps < 1 or warmup < 0:
        raise ValueError("--steps must be >= 1 and --warmup >= 0")
    with tempfile.TemporaryDirectory(prefix="omniloom-bench-") as tmp:
        trainer = bench_trainer(preset, overrides, run_dir=tmp, num_steps=warmup + steps)
        cfg = trainer.cfg
        synthetic = not cfg.data.sources
        trainer.timer = StepTimer(sync=True)
        t_warm = time.perf_counter()
        for _ in range(warmup):
            trainer.run_step()
        warm_s = time.perf_counter() - t_warm  # with train.compile: mostly compiling
        # The reference, forward only without grad on one held batch, is timed between the
        # training steps so both see the same machine load (shared CPUs vary a lot minute to minute).
        ref_batch, ref_layout, _ = trainer._next_batch()
        with torch.no_grad():
            B.forward(trainer.model, ref_batch, layout=ref_layout)
        trainer.timer.pop()
        tokens, wall, fwd_only, visual_flops = trainer.tokens_seen, 0.0, 0.0, 0.0
        for _ in range(steps):
            t0 = time.perf_counter()
            out = trainer.run_step()
            wall += time.perf_counter() - t0
            if out is not None:  # a vision encoder's FLOPs, counted per batch from its visual blocks (all ranks)
                visual_flops += float(out[0]["visual_flops"])
            t1 = time.perf_counter()
            with torch.no_grad():
                B.forward(trainer.model, ref_batch, layout=ref_layout)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            fwd_only += time.perf_counter() - t1
        fwd_only /= steps
        phases = trainer.timer.pop()
        tokens = trainer.tokens_seen - tokens
        step_s = wall / steps
        world = trainer.acc.num_processes
        tps = tokens / wall
        peak = peak_flops_per_device(trainer.device)
        visual_per_s = visual_flops / wall / world  # per device, as the trainer's MFU counts it
        model_flops_per_s = trainer.flops_per_token * tps / world + visual_per_s
        u = mfu(trainer.flops_per_token, tps / world, peak, visual_per_s)
        model = trainer.acc.unwrap_model(trainer.model)
        dense_b = bool(trainer.b_layers) and bool(getattr(model, "dense_b_layers", False))
        n_params = sum(p.numel() for p in model.parameters())
        threads = torch.get_num_threads()
        compiling = cfg.train.compile or cfg.model.kernels == "compiled"
        n_active = model.num_active_params() if hasattr(model, "num_active_params") else n_params

    lines = [
        f"bench train: preset={preset} device={trainer.device} world_size={world} "
        f"data={'synthetic (random PackedBatch; data wait not representative)' if synthetic else 'shards'}"
        + (f" torch_threads={threads}" if trainer.device.type == "cpu" else ""),
        f"  model: {n_params / 1e6:.2f}M params, {n_active / 1e6:.2f}M active; batch {cfg.data.batch_size} x "
        f"seq {cfg.data.seq_len} x accum {cfg.train.grad_accum_steps}; {steps} timed steps after {warmup} warmup",
        f"  tokens/s: {tps:,.0f} ({tps / world:,.0f} per device)" + (f"; MFU {100 * u:.1f}%" if u is not None else
                                                                    "; MFU omitted (no peak-FLOPs entry, e.g. CPU)"),
        f"  model FLOP/s: {model_flops_per_s:.3g} per device"
        + (f" ({100 * visual_per_s / model_flops_per_s:.1f}% in the vision encoder)" if visual_per_s else ""),
        f"  step time: {1000 * step_s:.1f} ms" + (f" (the {warmup} warm-up step{'s' if warmup > 1 else ''} took "
                                                  f"{warm_s:.1f} s{', compile included' if compiling else ''})"
                                                  if warmup else ""),
    ]
    for name in ("data", "forward", "backward", "optimizer"):
        sec = phases.get(name, 0.0) / steps
        lines.append(f"    {name:<10} {1000 * sec:9.1f} ms  {100 * sec / step_s:5.1f}% of step")
    other = max(0.0, step_s - sum(phases.values()) / steps)
    lines.append(f"    {'other':<10} {1000 * other:9.1f} ms  {100 * other / step_s:5.1f}% of step")
    lines.append(f"  reference (same run, interleaved): forward-only {1000 * fwd_only:.1f} ms per batch; "
                 f"train step / forward-only = {step_s / max(fwd_only, 1e-12):.2f}x")
    if figures is not None:
        figures.update(seq_len=cfg.data.seq_len, step_s=step_s, tokens_per_s=tps, model_flops_per_s=model_flops_per_s,
                       encoder_flops_per_s=visual_per_s)
    if dense_b:  # the timed steps fall in the dense warm-up: the B layers ran as G layers
        lines.append(f"  note: B layers {trainer.b_layers} were in their dense warm-up (model.attention.dense_warmup_steps="
                     f"{cfg.model.attention.dense_warmup_steps}) and attended as G layers; add "
                     "model.attention.dense_warmup_steps=0 to time them sparse")
    return "\n".join(lines)


def bench_train_lengths(preset: str, overrides: list[str], seq_lens: list[int], *, steps: int, warmup: int) -> str:
    """`bench_train` at each sequence length in turn (a fresh trainer each, in this process), then
    a table of step time and tokens/s per length with the step-time ratio per step up in length
    (about 2x per doubling when the cost is linear in the sequence)."""
    import gc

    reports, rows = [], []
    for seq_len in seq_lens:
        fig: dict = {}
        reports.append(bench_train(preset, list(overrides) + [f"data.seq_len={seq_len}"], steps=steps, warmup=warmup, figures=fig))
        rows.append(fig)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    lines = ["", f"step time by sequence length ({preset}, same overrides, one process):",
             f"  {'seq':>7} {'step ms':>10} {'tokens/s':>11} {'ratio to previous':>18}"]
    for i, r in enumerate(rows):
        ratio = ""
        if i:
            prev = rows[i - 1]
            ratio = f"{r['step_s'] / prev['step_s']:.2f}x for {r['seq_len'] / prev['seq_len']:g}x tokens"
        lines.append(f"  {r['seq_len']:>7} {1000 * r['step_s']:>10.1f} {r['tokens_per_s']:>11,.0f} {ratio:>18}")
    return "\n\n".join(reports) + "\n" + "\n".join(lines)


