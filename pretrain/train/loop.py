"""The training entry point and loop.

    accelerate launch --config_file configs/accelerate/cpu_2proc.yaml \
        -m omniloom.pretrain.train --config configs/tiny.yaml train.num_steps=50
    omniloom train tiny data.sources='[{path: shards/train}]'          # one process

The loop (`Trainer.fit`) reads top to bottom: get micro-batches, forward, backward, clip, guard,
step, update MoE router biases, log, checkpoint, evaluate, stop on a signal. Every rank runs the
same code; values that decide a branch (loss finiteness, the stop flag) are all-reduced first so
the ranks never disagree.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import inspect
import json
import logging
import os
import time
import weakref
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.tensor import DTensor

from omniloom.model.decoder import is_indexer_param
from omniloom.pretrain.checkpoint.fit import ShapeMismatch
from omniloom.pretrain.checkpoint.manager import CheckpointManager, checkpoint_name, resolve_resume
from omniloom.pretrain.config.io import to_dict
from omniloom.pretrain.config.run import RunConfig, check_resume_positions, to_yaml
from omniloom.pretrain.rundir import CHECKPOINTS, DATA_TRACE, TENSORBOARD
from omniloom.pretrain.runtime.lifeline import arm_if_launched
from omniloom.pretrain.runtime.signals import GracefulShutdown, StopRequested
from omniloom.pretrain.runtime.threads import configure_threads, end_tuning, tuned

from . import build as B
from .expert_parallel import find_plan, shard_range
from .guards import NonFiniteGuard, SpikeDetector
from .init_from import check_init_from, load_init_weights
from .metrics import MetricsLogger, StepTimer, peak_flops_per_device, per_modality_losses
from .optim import build_optimizer, build_scheduler
from .parallel import apply_parallelism, check_launch, seed_everything, set_deterministic
from .preflight import check_sources, check_step_memory, warn_ignored_settings
from .resume_batch import keep_global_batch
from .runlock import claim_collective
from .trackers import check_installed
from .window import Window, rank_loader_metrics, window_metrics

log = logging.getLogger("omniloom.train")

# One all-reduced vector per step: the MEAN_KEYS (weighted per micro-batch so that their sum over
# micro-batches and ranks is the step's mean), the SUM_KEYS, then the per-modality CE sums and
# label counts (summed), then per B layer the indexer's KL and the selection's coverage (means).
MEAN_KEYS = ("loss", "ce_loss", "z_loss", "aux_loss", "router_z_loss", "out_norm", "indexer_loss")
SUM_KEYS = ("stop", "tokens", "visual_flops")
_NSCALAR = len(MEAN_KEYS) + len(SUM_KEYS)
_STOP = len(MEAN_KEYS) + SUM_KEYS.index("stop")
_TOKENS = len(MEAN_KEYS) + SUM_KEYS.index("tokens")
_VISUAL_FLOPS = len(MEAN_KEYS) + SUM_KEYS.index("visual_flops")
_WINDOW_KEYS = tuple(k for k in MEAN_KEYS if k != "loss")  # what a logging window sums (its loss is per modality)


@dataclasses.dataclass
class TrainResult:
    step: int
    tokens_seen: int
    stopped_by: str  # "done", "signal"
    last_checkpoint: str | None
    losses: list[float]


_close_registered: list[bool] = []


def make_accelerator(cfg: RunConfig):
    """An Accelerator for this run: cpu=True without CUDA (multi-process launches then use gloo),
    bf16 autocast on GPU unless configured otherwise (the trackers start in MetricsLogger)."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs, ProjectConfiguration

    cpu = not torch.cuda.is_available()
    mp = cfg.train.mixed_precision
    if mp == "auto":
        mp = "no" if cpu else "bf16"
    if cpu and mp != "no":
        log.warning("train.mixed_precision=%s ignored on CPU: training in fp32", mp)
        mp = "no"
    run_dir = Path(cfg.train.run_dir)
    acc = Accelerator(
        cpu=cpu,
        mixed_precision=mp,
        project_config=ProjectConfiguration(project_dir=str(run_dir), logging_dir=str(run_dir / TENSORBOARD)),
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=cfg.train.find_unused_parameters)],
        step_scheduler_with_optimizer=False,
    )
    if acc.num_processes > 1 and not _close_registered:
        _close_registered.append(True)
        # Any script that builds a Trainer (not only `main`) must tear the process group down
        # before interpreter exit; see close_process_group.
        atexit.register(close_process_group)
    return acc


class Trainer:
    """Owns the prepared model, optimizer, scheduler, loaders and the small units the loop calls.

    `build_model(cfg) -> nn.Module` and `build_loader(cfg, split, rank, world_size)` default to
    the real model and data stream (pretrain/train/build.py); tests pass their own.

    The run folder is locked from construction to the end of `fit` (or `close`): one training per
    folder (pretrain/train/runlock.py). A folder that holds an earlier run needs `checkpoint.resume` or
    `overwrite=True` (which deletes that run's outputs)."""

    def __init__(self, cfg: RunConfig, *, build_model: Callable | None = None,
                 build_loader: Callable | None = None, progress: bool = True, overwrite: bool = False):
        if build_loader is None and not cfg.data.sources:  # fail before minutes of model setup
            raise ValueError("data.sources is empty: point it at shards made by `omniloom data build`, e.g. "
                             "data.sources=shards/train data.tokenizer=tok")
        # Checked before any setup too: a bad resume path is a user mistake worth failing fast on.
        resume = resolve_resume(cfg.checkpoint.resume, Path(cfg.train.run_dir) / CHECKPOINTS)
        init_from = check_init_from(cfg.train.init_from)
        check_installed(cfg.logging.trackers)
        arm_if_launched()  # a rank stops (saving) when its launcher dies
        configure_threads(cfg.train.num_threads, num_workers=cfg.data.num_workers,
                          quiet=int(os.environ.get("LOCAL_RANK", "0")) != 0, tune=not cfg.train.deterministic)
        self.acc = make_accelerator(cfg)
        # the main process locks the run folder before anything in it is read, removed or written
        self._run_lock = claim_collective(self.acc, cfg.train.run_dir, resume=cfg.checkpoint.resume,
                                          overwrite=overwrite, has_checkpoint=resume is not None)
        self._release = weakref.finalize(self, _release_lock, self._run_lock)  # also when __init__ fails
        self.ckpt = CheckpointManager(Path(cfg.train.run_dir) / CHECKPOINTS, self.acc, cfg.checkpoint.keep_last)
        resume_note = ""
        if resume is not None:
            # verified first (with resume=auto a damaged one gives way to the one before), so that
            # the global batch below is planned from the checkpoint whose weights and data load
            resume = self.ckpt.first_verified(resume, auto=cfg.checkpoint.resume == "auto")
            # batch_size is per rank: keep the global batch on another process count
            cfg, resume_note = keep_global_batch(cfg, resume, self.acc.num_processes)
        if self.acc.device.type == "cpu" and cfg.train.cpu_malloc == "keep":
            from omniloom.pretrain.runtime.malloc import keep_freed_memory

            keep_freed_memory()  # before the model and the first batches are allocated
        set_deterministic(cfg.train.deterministic)
        self._build_loader = build_loader or B.build_loader
        if build_model is None:
            cfg = B.resolve_model_config(cfg)
            check_step_memory(cfg, self.acc.device)  # before minutes of setup and workers that grow without bound
            warn_ignored_settings(cfg.model, quiet=not self.acc.is_main_process)
            build_model = B.build_model
        # the training stream before the model: a mistyped or unreadable source fails here, not after
        # minutes of model setup, and its sources are resolved once (no workers start until iter)
        self.train_loader = self._build_loader(cfg, "train", self.acc.process_index, self.acc.num_processes)
        if build_loader is None:
            check_sources(cfg.data.eval_sources)  # built at each evaluation; a bad one is said now too
        self.cfg = cfg
        self.run_dir = Path(cfg.train.run_dir)
        self.device = self.acc.device
        # Same seed on every rank: identical initial weights without relying on a broadcast.
        seed_everything(cfg.train.seed)
        ep = cfg.model.moe.expert_parallel
        if ep > 1 and "expert_range" in inspect.signature(build_model).parameters:
            # only this rank's experts, never the whole model (the same values for the same seed)
            check_launch(self.acc, ep, cfg.model.moe.num_experts)
            held = shard_range(cfg.model.moe.num_experts, ep, self.acc.process_index)
            model = build_model(cfg, expert_range=held)
            log.info("built only experts [%d, %d) of %d per MoE layer on this rank", *held, cfg.model.moe.num_experts)
        else:
            model, held = build_model(cfg), None
        if init_from is not None and resume is None:
            load_init_weights(model, init_from, cfg, expert_range=held)
        elif init_from is not None:
            log.info("train.init_from=%s ignored: resuming from %s", init_from, resume)
        self.flops_per_token = B.model_flops_per_token(model, cfg.data.seq_len)
        self._flops_model = model  # unwrapped: its visual_flops(layout) counts a vision encoder's per batch
        kinds = model.cfg.layer_kinds() if hasattr(getattr(model, "cfg", None), "layer_kinds") else []
        self.b_layers = [i for i, kind in enumerate(kinds) if kind == "B"]  # B-layer statistics are logged per layer
        self.has_indexer = bool(getattr(model.cfg, "has_indexer", False)) if kinds else False
        model = apply_parallelism(model, cfg.train, self.acc, expert_parallel=cfg.model.moe.expert_parallel)
        self.ep = find_plan(model)  # the expert-parallel plan, None without expert parallelism
        self._param_split = None  # (language-model parameters, index-branch parameters), for clipping
        model = model.to(self.device)
        n_held = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in model.parameters())
        log.info("model: %s parameters on this rank%s", f"{n_held:,}", f"; {self.ep.describe()}" if self.ep is not None else "")
        # FSDP2: the routed experts in optimizer groups of their own, at every expert-parallel degree
        optimizer = build_optimizer(model, cfg.optim, separate_experts=bool(getattr(self.acc, "is_fsdp2", False)))
        if self.ep is not None:
            self.ep.attach_optimizer(optimizer)
        self.model, self.optimizer = self.acc.prepare(model, optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.num_steps)
        self.guard = NonFiniteGuard(cfg.train.max_bad_steps)
        self.spikes = {"loss": SpikeDetector(cfg.logging.spike_window, cfg.logging.spike_sigma),
                       "grad_norm": SpikeDetector(cfg.logging.spike_window, cfg.logging.spike_sigma)}
        self.shutdown = GracefulShutdown()
        self.timer = StepTimer()
        self.step, self.tokens_seen, self.last_checkpoint = 0, 0, None
        self.progress = progress
        self.peak_flops = peak_flops_per_device(self.device)

        # Resume before the loader exists, so the loader starts from the restored position.
        data_states = None
        if cfg.checkpoint.resume == "auto" and resume is None:
            log.info("checkpoint.resume=auto: no complete checkpoint in %s, starting fresh", self.ckpt.dir)
        if resume is not None:
            data_states = self._restore(resume, resume_note)
        if data_states is not None and cfg.checkpoint.resume_data == "restart":
            if hasattr(self.train_loader, "start_at_step"):  # source schedules count from the run's step
                self.train_loader.start_at_step(self.step)
            log.info("checkpoint.resume_data=restart: the model, optimizer, schedule and step %d come from %s; the "
                     "data stream starts anew (every source from its beginning, data.seed %d; source schedules "
                     "count from step %d)", self.step, self.last_checkpoint, cfg.data.seed, self.step)
        elif data_states is not None:
            try:
                self._load_data_states(data_states, cfg.checkpoint.resume_data)
            except ValueError as err:
                raise ValueError(f"cannot resume from {self.last_checkpoint}: {err}") from err
            data_step = getattr(self.train_loader, "step", self.step)
            if data_step != self.step:  # the sources' schedules (data.text_first_steps) follow the stream's count
                log.warning("the data stream resumed at training step %s but the checkpoint is at step %s: "
                            "source schedules (start_step, end_step) follow the stream's count", data_step, self.step)
        with torch.random.fork_rng(devices=[]):  # see _next_host_batch
            self.train_iter = iter(self.train_loader)
        self._staged = None  # the batch staged one step ahead (_next_batch)
        self._step_pieces: list = []  # the documents of this step's batches (logging.data_trace)
        self._data_state = None  # the loader's state as of the last batch handed to a step
        self._copy_stream = None

    # ---- the loop -------------------------------------------------------------------------
    def fit(self) -> TrainResult:
        cfg, acc = self.cfg, self.acc
        logger = MetricsLogger(acc, self.run_dir, total_steps=cfg.train.num_steps, start_step=self.step,
                               trackers=cfg.logging.trackers, project=cfg.logging.project,
                               run_name=cfg.logging.run_name or self.run_dir.name,
                               hparams=to_dict(cfg), progress=self.progress,
                               progress_seconds=cfg.logging.progress_seconds)
        self.shutdown.install()
        losses: list[float] = []
        window = Window(_WINDOW_KEYS)
        stopped_by = "done"
        try:
            if cfg.train.eval_every > 0 and self.step == 0:
                logger.log(self.evaluate(), 0)  # the untrained baseline the held-out curves start from
            while self.step < cfg.train.num_steps:
                t_step = time.perf_counter()
                with tuned():  # the first steps time 1 thread against the count from the cores (threads.py)
                    done = self.run_step()
                if done is None:  # a stop signal came while this step's batches were still being read
                    stopped_by = "signal"
                    self._stop_before_step()
                    break
                stats, counts_LME, lr = done
                self._trace_step()
                losses.append(stats["loss"])
                window.add(stats, counts_LME, time.perf_counter() - t_step, self.timer.pop())

                record = {"loss": stats["loss"], "grad_norm": stats["grad_norm"],
                          "lr": lr, "tokens_seen": self.tokens_seen,
                          "skipped_updates": self.guard.total_skipped}
                for name, det in self.spikes.items():
                    z = det.update(stats[name])
                    if z is not None:
                        record[f"spike/{name}_z"] = z
                        if acc.is_main_process:  # the statistics are all-reduced: every rank sees the same spike
                            log.warning("step %d: %s spike, z-score %.1f (window %d)", self.step, name, z, det.window)
                if self.step % cfg.logging.every == 0 or self.step == cfg.train.num_steps:
                    record.update(self._window_metrics(window))
                    window = Window(_WINDOW_KEYS)
                logger.log(record, self.step)
                logger.progress(self.step, {"loss": stats["loss"], "lr": record["lr"]}, tokens_seen=self.tokens_seen)

                stop = stats["stop"] > 0  # a signal reached some rank during this step
                if stop or self._due(cfg.checkpoint.every) or self.step == cfg.train.num_steps:
                    self.save()
                if stop:
                    stopped_by = "signal"
                    log.warning("stopped by %s at step %d; resume with checkpoint.resume=auto",
                                self.shutdown.signal_name or "a signal on another rank", self.step)
                    break
                if self._due(cfg.train.eval_every):
                    logger.log(self.evaluate(), self.step)
        finally:
            self.shutdown.restore()
            logger.close()
            self.close()
        return TrainResult(self.step, self.tokens_seen, stopped_by, self.last_checkpoint, losses)

    def close(self) -> None:
        """Release the run folder and end the thread-count timing (fit does both when it ends)."""
        end_tuning()
        self._release()

    def run_step(self) -> tuple[dict, torch.Tensor | None, float] | None:
        """One optimizer step: micro-batches, guard, update, router biases, schedule. Returns the
        step's all-reduced statistics, the expert counts and the learning rate it used; None when a
        stop signal reached some rank before the step's batches were read (nothing was trained)."""
        self._attention_schedule()
        step_vec, counts_LME = self._train_step()
        if step_vec is None:
            return None
        stats = self._unpack(step_vec)
        ok = self.guard.check(self.step + 1, stats["loss"], stats["grad_norm"], self.last_checkpoint)
        if ok:
            with self.timer.phase("optimizer"):
                self.optimizer.step()
                self._update_router_biases(counts_LME)
        self.optimizer.zero_grad(set_to_none=True)
        lr = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        self.scheduler.step()
        self.step += 1
        self.tokens_seen += int(stats["tokens"])
        return stats, counts_LME, lr

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward/backward over `grad_accum_steps` micro-batches and clip; return the all-reduced
        step vector and the expert counts summed over micro-batches and ranks.

        The loss is the mean over every labelled token of the global batch (all micro-batches, all
        ranks), not a mean of per-micro-batch means: micro-batch i's per-token loss (a mean over
        its n_i labels) is weighted by n_i / N with N all-reduced before any backward, times the
        world size because data parallelism averages gradients over ranks. Rows heavy in patches
        (few labels) thus weigh what their labels weigh. The per-batch MoE losses get 1 / accum."""
        cfg, acc = self.cfg, self.acc
        accum, world = cfg.train.grad_accum_steps, acc.num_processes
        self.model.train()
        with self.timer.phase("data"):
            handed = (self._data_state, len(self._step_pieces))
            staged = self._read_step_batches(accum)
            n_local = [n for _, _, n in staged] if staged is not None else [0]  # counted on the host copy
            if world > 1:  # the label count, and whether some rank was stopped while reading
                agreed = acc.reduce(torch.tensor([float(sum(n_local)), float(staged is None)], device=self.device),
                                    reduction="sum").tolist()
                n_global, stopped = agreed[0], agreed[1] > 0
            else:
                n_global, stopped = float(sum(n_local)), staged is None
        if stopped:  # every rank drops the step; the data state and trace go back to the last trained step
            self._data_state, self._step_pieces = handed[0], self._step_pieces[:handed[1]]
            self._staged = None  # whatever was read ahead is dropped with the iterator
            return None, None
        nb_layers = len(self.b_layers)
        acc_vec = torch.zeros(_NSCALAR + 2 * B.NUM_MODALITIES + 2 * nb_layers, device=self.device)
        attn_at = _NSCALAR + 2 * B.NUM_MODALITIES
        counts_LME = None
        for micro, (batch, layout, _) in enumerate(staged):
            w_tok = n_local[micro] / n_global if n_global > 0 else 0.0  # this micro-batch's share of the labels
            # Only the last micro-batch all-reduces gradients.
            sync = contextlib.nullcontext() if micro == accum - 1 else acc.no_sync(self.model)
            with sync:
                with self.timer.phase("forward"):
                    out = B.forward(self.model, batch, layout=layout)
                    loss, st = B.read_output(out)
                    tok_loss, batch_loss = B.split_loss(out, loss)
                with self.timer.phase("backward"):
                    acc.backward(tok_loss * (w_tok * world) + batch_loss / accum)
            # summed over micro-batches and ranks below: token terms by label share, the rest averaged
            tok = torch.stack([tok_loss.detach().float(), st.ce_loss, st.z_loss]).to(self.device) * w_tok
            idx_loss = st.indexer_loss if st.indexer_loss is not None else torch.zeros((), device=self.device)
            per_batch = torch.stack([batch_loss.detach().float(), st.aux_loss, st.router_z_loss,
                                     st.out_norm, idx_loss.to(self.device)]).to(self.device) / (accum * world)
            means = torch.stack([tok[0] + per_batch[0], tok[1], tok[2], per_batch[1], per_batch[2], per_batch[3],
                                 per_batch[4]])
            acc_vec[: len(MEAN_KEYS)] += means
            acc_vec[_TOKENS] += float(batch.input_ids.numel())  # a scalar argument: no host-to-device copy
            acc_vec[_VISUAL_FLOPS] += B.model_visual_flops(self._flops_model, layout)  # host-side, from the layout
            acc_vec[_NSCALAR:attn_at] += torch.cat([st.ce_sum_M.to(self.device), st.count_M.to(self.device)])
            if nb_layers and st.indexer_kl is not None:
                acc_vec[attn_at:attn_at + nb_layers] += st.indexer_kl.to(self.device) / (accum * world)
            if nb_layers and st.block_coverage is not None:
                acc_vec[attn_at + nb_layers:] += st.block_coverage.to(self.device) / (accum * world)
            if st.expert_counts_LME is not None:
                counts_LME = st.expert_counts_LME if counts_LME is None else counts_LME + st.expert_counts_LME
        with self.timer.phase("optimizer"):
            grad_norm = self._clip_gradients()
            acc_vec[_STOP] = 1.0 if self.shutdown.requested else 0.0
            reduced = acc.reduce(acc_vec, reduction="sum")
            if counts_LME is not None:
                counts_LME = acc.reduce(counts_LME.to(self.device), reduction="sum")
        # the gradient norm travels with the step vector: one device-to-host read per step
        norm = grad_norm if isinstance(grad_norm, torch.Tensor) else torch.tensor(float("nan") if grad_norm is None else grad_norm)
        return torch.cat([reduced, norm.detach().float().reshape(1).to(reduced.device)]), counts_LME

    def _read_step_batches(self, accum: int) -> list | None:
        """This step's micro-batches, or None when a stop signal came while they were being read
        (a batch can take long to build: slow storage, huge rows): the wait is abandoned there. The
        ranks then agree to drop the step (`_train_step`), so a checkpoint saved now resumes
        exactly at the last trained step."""
        try:
            with self.shutdown.interruptible():
                return [self._next_batch() for _ in range(accum)]
        except StopRequested:
            return None

    def _stop_before_step(self) -> None:
        """Every rank agreed to stop before step `self.step + 1` was trained: save the last trained
        step unless it is saved already (or nothing was trained in this run)."""
        saved = self.last_checkpoint is not None and Path(self.last_checkpoint).name == checkpoint_name(self.step)
        if self.step > 0 and not saved:
            self.save()
        log.warning("stopped by %s while the batches of step %d were being read; %s; resume with "
                    "checkpoint.resume=auto", self.shutdown.signal_name or "a signal on another rank", self.step + 1,
                    f"last checkpoint {self.last_checkpoint}" if self.last_checkpoint else "nothing was trained yet")

    def _attention_schedule(self) -> None:
        """model.attention.dense_warmup_steps: B layers attend densely before that step, sparsely
        from it on (OmniModel.set_step); the switch is logged."""
        model = self.acc.unwrap_model(self.model)
        set_step = getattr(model, "set_step", None)
        if not callable(set_step) or not self.b_layers or not set_step(self.step):
            return
        warmup = model.cfg.attention.dense_warmup_steps
        if model.dense_b_layers:
            log.info("step %d: B layers %s attend densely until step %d (model.attention.dense_warmup_steps); "
                     "the %s selector learns meanwhile", self.step + 1, self.b_layers, warmup, model.cfg.attention.selector)
        else:
            log.info("step %d: dense warm-up over: B layers %s now attend only their selected blocks (%s selector)",
                     self.step + 1, self.b_layers, model.cfg.attention.selector)

    def _clip_gradients(self) -> torch.Tensor | float | None:
        """Clip by the global gradient norm and return it. With expert parallelism the expert
        shards' gradients are first averaged over their replica group (DDP averages the rest)
        and the norm adds up the shards of the expert group.

        The B layers' index branches (selector=indexer) are clipped by their own norm: they learn
        from their own loss only, and a large indexer gradient must not scale down the language
        model's step (nor the other way round). The returned norm is the language model's."""
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        if self._param_split is None:
            lm, index = [], []
            for name, p in self.model.named_parameters():
                (index if is_indexer_param(name) else lm).append(p)
            self._param_split = (lm, index)
        lm, index = self._param_split
        if self.ep is None:
            norm = self.acc.clip_grad_norm_(lm, max_norm)  # unscales every gradient first (fp16)
            if isinstance(norm, DTensor):  # FSDP2: the norm of sharded gradients, replicated
                norm = norm.full_tensor()
        else:
            self.ep.sync_grads()
            self.acc.unscale_gradients()  # fp16 loss scaling; a no-op otherwise
            norm = self.ep.clip_grad_norm_(lm, max_norm)
        if index:
            torch.nn.utils.clip_grad_norm_(index, max_norm)
        return norm

    def _next_batch(self):
        """(batch on the device, its host-side attention layout or None, labelled tokens).

        Batches are staged one step ahead: while this batch trains, the next one is already read,
        its layout and label count taken from the host copy, and (on CUDA) copied from pinned
        memory on a side stream, so the step neither reads device memory for them nor waits for a
        copy. The data state a checkpoint saves is the loader's state as of the batch handed out
        here, not of the one staged ahead, so a resume neither skips nor repeats a batch."""
        if self._staged is None:
            self._staged = self._stage()
        batch, layout, n, state, copy_stream, pieces = self._staged
        self._step_pieces += pieces
        if copy_stream is not None:  # this step's kernels wait for the side-stream copy, not the host
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(copy_stream)
            for t in vars(batch).values():
                if isinstance(t, torch.Tensor):
                    t.record_stream(current)
        self._data_state = state
        self._staged = self._stage()
        return batch, layout, n

    def _stage(self):
        batch = self._next_host_batch()
        state = self.train_loader.state_dict() if hasattr(self.train_loader, "state_dict") else None
        pieces = list(getattr(self.train_loader, "last_pieces", None) or [])
        model = self.acc.unwrap_model(self.model)
        make_layout = getattr(model, "batch_layout", None)
        layout = make_layout(batch.doc_ids, batch.block_ids) if callable(make_layout) else None
        n = B.num_targets(batch)
        if self.device.type != "cuda":
            return batch.to(self.device), layout, n, state, None, pieces
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._copy_stream):
            on_device = batch.to(self.device, non_blocking=True)
        return on_device, layout, n, state, self._copy_stream, pieces

    def _next_host_batch(self):
        # Loading may draw from torch's global RNG (a DataLoader draws its base seed when its
        # workers start); forking keeps the training RNG stream independent of when that happens,
        # which differs between an uninterrupted and a resumed run.
        with torch.random.fork_rng(devices=[]):
            try:
                batch = next(self.train_iter)
            except StopIteration:
                # A finite stream ran out: start another pass (the stream decides its own order).
                log.info("train data exhausted at step %d: starting another pass", self.step)
                self.train_iter = iter(self.train_loader)
                batch = next(self.train_iter)
        return batch

    def _unpack(self, vec: torch.Tensor) -> dict:
        v = vec.detach().double().cpu()
        m = B.NUM_MODALITIES
        out = {k: float(v[i]) for i, k in enumerate(MEAN_KEYS + SUM_KEYS)}
        n = len(self.b_layers)
        at = _NSCALAR + 2 * m
        out.update(ce_sum_M=v[_NSCALAR:_NSCALAR + m], count_M=v[_NSCALAR + m:at],
                   indexer_kl=v[at:at + n], coverage=v[at + n:at + 2 * n], grad_norm=float(v[at + 2 * n]))
        return out

    def _update_router_biases(self, counts_LME: torch.Tensor | None) -> None:
        model = self.acc.unwrap_model(self.model)
        fn = getattr(model, "update_router_biases", None)
        if counts_LME is not None and callable(fn):
            with torch.no_grad():
                fn(counts_LME)

    def _trace_step(self) -> None:
        """logging.data_trace: one line per step and rank, the pieces its batches held."""
        pieces, self._step_pieces = self._step_pieces, []
        if not self.cfg.logging.data_trace:
            return
        path = self.run_dir / DATA_TRACE / f"rank{self.acc.process_index:05d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps({"step": self.step, "pieces": pieces}) + "\n")

    def _due(self, every: int) -> bool:
        return every > 0 and self.step % every == 0

    def _window_metrics(self, w: Window) -> dict:
        """Averages over the steps since the last log line, and the loader's counters."""
        out = window_metrics(w, num_processes=self.acc.num_processes, flops_per_token=self.flops_per_token,
                             peak_flops=self.peak_flops,
                             indexer_layers=self.b_layers if self.has_indexer else None)
        out.update(self._loader_metrics())
        return out

    def _loader_metrics(self) -> dict:
        return rank_loader_metrics(self.train_loader, self.acc.num_processes)  # a collective with several ranks

    # ---- units the loop calls ---------------------------------------------------------------
    def save(self) -> None:
        trainer_state = {"step": self.step, "tokens_seen": self.tokens_seen,
                         "scheduler": self.scheduler.state_dict(), "guard": self.guard.state_dict(),
                         "spikes": {k: d.state_dict() for k, d in self.spikes.items()}}
        with self._expert_state_dicts():
            path = self.ckpt.save(self.step, trainer_state=trainer_state, data_state=self._data_state if self._data_state is not None else self.train_loader.state_dict(),
                                  config_yaml=to_yaml(self.cfg))
        self.last_checkpoint = str(path)

    def _expert_state_dicts(self):
        """With expert parallelism, checkpoints hold every expert, so they resume with any
        expert-parallel degree and export as they are: DDP (rank 0 writes) gathers them onto the
        CPU one layer at a time; FSDP2 (torch.distributed.checkpoint, each rank writes its part)
        hands them over as DTensors sharded along the experts, gathering nothing."""
        if self.ep is None:
            return contextlib.nullcontext()
        return self.ep.sharded_state_dict() if self.ckpt.sharded() else self.ep.full_state_dict()

    def _load_data_states(self, states: list, sources: str = "exact") -> None:
        """The data states of every saved rank: a loader that pools them (the stream: it resumes on
        another world size x workers, or on another mix of sources with `sources="keep_unchanged"`,
        logging one line) gets them all, another its own rank's."""
        if any(st is None for st in states):
            return  # saved by a loader without state
        if getattr(self.train_loader, "pools_rank_states", False):
            if sources == "exact":
                self.train_loader.load_state_dict(states)
            else:
                self.train_loader.load_state_dict(states, sources=sources)
        elif len(states) == self.acc.num_processes:
            self.train_loader.load_state_dict(states[self.acc.process_index])
        else:
            raise ValueError(f"this run's data loader ({type(self.train_loader).__name__}) cannot resume on another "
                             f"world size; launch with --num_processes {len(states)}")

    def _restore(self, path: Path, note: str = "") -> list:
        # FSDP2 loads through state_dict() templates: with expert parallelism they must describe
        # the whole expert tensors (DTensors), whatever layout wrote the checkpoint
        with self._expert_state_dicts() if self.ckpt.sharded() else contextlib.nullcontext():
            try:
                trainer_state, data_state = self.ckpt.load(path, note=note)
            except ShapeMismatch as err:  # say which model settings differ, when config.yaml tells
                raise err.explained(self.cfg.model) from err
        # the weights fit; settings that no weight's shape shows must match too
        check_resume_positions(self.cfg, path)
        self.step = int(trainer_state["step"])
        self.tokens_seen = int(trainer_state["tokens_seen"])
        self.scheduler.load_state_dict(trainer_state["scheduler"])
        self.guard.load_state_dict(trainer_state["guard"])
        for k, d in self.spikes.items():
            d.load_state_dict(trainer_state["spikes"][k])
        self.last_checkpoint = str(path)
        return data_state

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out loss per modality over `train.eval_steps` batches (all ranks, all-reduced).
        Runs under a forked RNG so evaluating never changes the training trajectory."""
        with torch.random.fork_rng(devices=[]):
            loader = self._build_loader(self.cfg, "eval", self.acc.process_index, self.acc.num_processes)
            if loader is None:
                log.warning("train.eval_every is set but data.eval_sources is empty: no evaluation")
                return {}
            self.model.eval()
            m, nb_layers = B.NUM_MODALITIES, len(self.b_layers)
            unwrapped = self.acc.unwrap_model(self.model)
            if nb_layers:
                unwrapped.measure_attention = True  # the B layers' coverage of the dense attention
            vec = torch.zeros(2 * m + 2 + nb_layers + 1, device=self.device)
            for i, batch in enumerate(self._lockstep(loader)):
                if i >= self.cfg.train.eval_steps:
                    break
                model = self.acc.unwrap_model(self.model)
                layout = model.batch_layout(batch.doc_ids, batch.block_ids) if hasattr(model, "batch_layout") else None
                _, st = B.read_output(B.forward(self.model, batch.to(self.device), layout=layout))
                # eval/loss weighs each batch by its labels (a token mean, as in training), not 1 per batch
                n = st.count_M.sum().to(self.device)
                vec[: 2 * m + 2] += torch.cat([st.ce_sum_M.to(self.device), st.count_M.to(self.device),
                                               torch.stack([st.loss.to(self.device) * n, n])])
                if nb_layers and st.block_coverage is not None:
                    vec[2 * m + 2:-1] += st.block_coverage.to(self.device)
                    vec[-1] += 1.0
            unwrapped.measure_attention = False
            self.model.train()
        vec = self.acc.reduce(vec, reduction="sum").double().cpu()
        out = per_modality_losses(vec[:m], vec[m:2 * m], "eval/loss")
        if vec[2 * m + 1] > 0:
            out["eval/loss"] = float(vec[2 * m] / vec[2 * m + 1])
        if nb_layers and vec[-1] > 0:
            cov = vec[2 * m + 2:-1] / vec[-1]
            for layer, c in zip(self.b_layers, cov.tolist()):
                out[f"eval/coverage_layer{layer}"] = c
            out["eval/coverage"] = float(cov.mean())
        log.info("eval at step %d: %s", self.step, {k: round(v, 4) for k, v in out.items()})
        return out

    def _lockstep(self, loader):
        """The loader's batches; with expert parallelism every forward is collective, so all ranks
        stop at the first batch some rank does not have (one tiny all-reduce per batch)."""
        if self.ep is None:
            yield from loader
            return
        it = iter(loader)
        while True:
            batch = next(it, None)
            have = torch.tensor([0.0 if batch is None else 1.0], device=self.device)
            if float(self.acc.reduce(have, reduction="sum")) < self.acc.num_processes:
                return
            yield batch


def _release_lock(lock) -> None:
    if lock is not None:
        lock.release()


def run(cfg: RunConfig, **kwargs) -> TrainResult:
    """Build a Trainer for `cfg` and train. Raises NonFiniteError when the guard stops the run."""
    return Trainer(cfg, **kwargs).fit()



def close_process_group() -> None:
    """Destroy the process group and let gloo's worker threads finish before interpreter exit.

    A gloo worker thread drops its last reference to a finished collective after the caller's
    wait() returned; when Python already dropped the tensor, that decref needs the GIL. If the
    main thread is finalizing by then, Python ends the worker thread with a forced unwind through
    a noexcept destructor: "terminate called without an active exception", exit -6 on a rank that
    had finished (core dump: AsyncAllreduceWork::~AsyncAllreduceWork in ProcessGroupGloo::runLoop).
    destroy_process_group alone does not join those threads while a DDP module still holds the
    group, so the GIL is released for a moment here: 4 of 10 two-process runs of the
    gradient check aborted before, 0 of 20 after. Registered with atexit for any script that
    builds a Trainer, and called by `main`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        time.sleep(0.05)
