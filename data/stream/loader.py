"""The unified stream: read -> mix -> shuffle -> tokenize -> best-fit pack -> PackedBatch, resumable.
StreamLoader and build_loader here; one slot's pipeline (WorkerStream, StreamDataset) in
data/stream/worker.py.

How work is split: each (rank, worker) pair is one *slot* reading its own contiguous range of
every source's shuffled epoch (data/stream/worker.py), so the stream is endless and every rank
yields a batch at every step. A finite pass (evaluation) is `max_batches` batches per rank.

Exact resume. A worker's whole state is a few integers plus *references* (WorkerStream.state_dict).
Each batch carries the producing worker's state to the main process;
`StreamLoader.state_dict()` holds, for each worker, the state as of the last batch the trainer
consumed, and which worker is next. On restore, buffered samples are re-read by manifest offset (not
replayed from the start of the epoch) and the DataLoader's round-robin is rotated so the next batch
comes from the right worker: the batches after a restore are identical to an uninterrupted run.

Elastic resume. A state saved with another world size or worker count is accepted when the states of
every saved rank are given: data/stream/elastic.py pools them and splits the unread rest of each source's
begun epochs, and the buffered documents, among the new slots. Every document is then still trained
on once per epoch (the order differs); see docs/resume.md. Another data config is refused, except
data.batch_size and what checkpoint.resume_data allows (data/stream/remix.py).
"""

from __future__ import annotations

import copy
import logging
import time
from collections import Counter
from collections.abc import Iterator

import numpy as np
import torch
import torch.utils.data

from omniloom.data.batch import PackedBatch
from omniloom.data.config import DataConfig, SourceConfig
from omniloom.tokenizers.layout import MODALITY_NAMES, TokenizedDoc

from .reader import ShardSet, resolve_source
from .schedule import SourceSchedule, StepClock
from .worker import STATE_VERSION, StreamDataError, StreamDataset, TokenizeFn, _signals_held, _worker_init
from .worker import WorkerStream  # noqa: F401 (callers and tests import it from here)

log = logging.getLogger(__name__)


def composition(tokens_by_modality, padding) -> dict[str, float]:
    """`padding_fraction` and `token_share/<modality>` from token counts by modality (padding
    excluded) and padding tokens: a rank's window, or every rank's summed."""
    tokens = [float(t) for t in tokens_by_modality]
    real = sum(tokens)
    slots = real + float(padding)
    out = {"padding_fraction": float(padding) / slots if slots else 0.0}
    for name, n in zip(MODALITY_NAMES, tokens):
        out[f"token_share/{name}"] = n / real if real else 0.0
    return out


class StreamLoader:
    """Iterates PackedBatch for one rank; `state_dict()`/`load_state_dict()` give exact resume.

    Iterating again continues where the last iteration stopped (it restarts the workers from the
    state). With `max_batches` the loader is finite: exactly that many batches on every rank.
    """

    pools_rank_states = True  # load_state_dict takes every saved rank's state (elastic resume)

    def __init__(self, sets: list[ShardSet], cfg: DataConfig, tokenize_fn: TokenizeFn, *, rank: int,
                 world_size: int, pad_id: int, patch_dim: int, max_batches: int | None = None,
                 pin_memory: bool = False, split: str = "train", schedule: SourceSchedule | None = None,
                 batches_per_step: int = 1):
        self.sets, self.cfg, self.tokenize_fn = sets, cfg, tokenize_fn
        # the fingerprint's sources, once: state_dict() runs for every batch the trainer stages, and
        # digesting the shard layout of a 100k-shard source took 110 ms
        self._source_entries = [[s.label, s.weight, s.num_samples, shard_layout(s)] for s in sets]
        self.schedule, self.batches_per_step = schedule, batches_per_step
        self.rank, self.world_size, self.pad_id, self.patch_dim = rank, world_size, pad_id, patch_dim
        self.max_batches, self.pin_memory, self.split = max_batches, pin_memory, split
        self.num_logical = max(cfg.num_workers, 1)
        self.reset()

    def reset(self) -> None:
        """Back to the start of the stream (as built: epoch 0 of every source)."""
        self._states: list[dict | None] = [None] * self.num_logical
        self.consumed = 0
        self._window_start = time.perf_counter()
        self._window = {"docs": 0, "tokens": np.zeros(5, np.int64), "padding": 0, "batches": 0}
        self._docs_seen = [0] * self.num_logical
        self._cache = [None] * self.num_logical  # each worker's last DocCache.stats(), when on
        self.last_window: dict | None = None  # the raw counts of the window `metrics` last reported
        self.last_pieces: list = []  # [[source, epoch, global index], piece] of each piece of the last batch
        self.resumed_from: tuple[int, int] | None = None  # (world_size, workers) of an elastic resume
        self.clock = StepClock(self.batches_per_step)  # training step of each batch (data/stream/schedule.py)

    @property
    def step(self) -> int:
        """The training step the next batch belongs to (batches counted in steps of `batches_per_step`)."""
        return self.clock.step_of(self.consumed)

    def start_at_step(self, step: int) -> None:
        """A fresh stream whose first batch belongs to training step `step`: the data starts anew
        under a resumed run (checkpoint.resume_data=restart), and the sources' schedules
        (start_step, end_step, data.text_first_steps) count from the run's step, not from 0."""
        if self.consumed:
            raise RuntimeError("start_at_step is for a stream that has handed out no batch yet")
        self.clock = StepClock(self.batches_per_step, int(step), 0)

    def __len__(self) -> int:
        if self.max_batches is None:
            raise TypeError("an endless stream has no length; build it with max_batches for a finite pass")
        return self.max_batches

    def __iter__(self) -> Iterator[PackedBatch]:
        if self.max_batches is not None and self.consumed >= self.max_batches:
            self.reset()  # a finished finite pass starts over, like a torch DataLoader epoch
        ds = StreamDataset(self.sets, self.cfg, self.tokenize_fn, rank=self.rank, world_size=self.world_size,
                           pad_id=self.pad_id, patch_dim=self.patch_dim, states=list(self._states),
                           consumed=self.consumed, max_batches=self.max_batches,
                           # an evaluation pass reads each document once: nothing to reuse
                           cache_mb=self.cfg.doc_cache_mb if self.split == "train" else 0,
                           schedule=self.schedule, clock=self.clock)
        if self.cfg.num_workers == 0:
            items: Iterator = iter(ds)
        else:
            # The workers start here. They inherit a signal mask that holds SIGTERM/SIGINT pending
            # until their guard takes them (see _guard_worker): a signal that reaches a worker
            # before that must not kill it.
            with _signals_held():
                items = iter(torch.utils.data.DataLoader(
                    ds, batch_size=None, num_workers=self.cfg.num_workers,
                    prefetch_factor=self.cfg.prefetch_factor, pin_memory=self.pin_memory, persistent_workers=False,
                    worker_init_fn=_worker_init))
        try:
            for batch, meta in items:
                assert meta["index"] == self.consumed, f"batch {meta['index']} arrived when {self.consumed} was due"
                self._states[meta["worker"]] = meta["state"]
                self.last_pieces = meta["pieces"]
                self.consumed += 1
                self._account(meta)
                if self.cfg.num_workers == 0 and self.pin_memory:
                    batch = batch.pin_memory()
                yield batch
        except StreamDataError as err:
            # torch re-raises a worker's error with the worker's whole traceback in its message;
            # the user needs its last line (the traceback stays on the chain for -v).
            last = str(err).strip().splitlines()[-1] if str(err).strip() else ""
            prefix = f"{StreamDataError.__module__}.{StreamDataError.__name__}: "
            for p in (prefix, f"{StreamDataError.__name__}: "):
                if last.startswith(p):
                    raise StreamDataError(last[len(p):]) from err
            raise
        finally:
            shutdown = getattr(items, "_shutdown_workers", None)
            if shutdown is not None:  # stop the workers now, not whenever the iterator is collected
                shutdown()

    # -- metrics -------------------------------------------------------------------------------
    def _account(self, meta: dict) -> None:
        w, counts = meta["worker"], meta["counts"]
        docs = meta["state"]["docs"]
        self._window["docs"] += docs - self._docs_seen[w]
        self._docs_seen[w] = docs
        if meta.get("cache") is not None:
            self._cache[w] = meta["cache"]
        self._window["tokens"] += np.asarray(counts["tokens_by_modality"], dtype=np.int64)
        self._window["padding"] += counts["padding"]
        self._window["batches"] += 1

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far on this rank, by reason (summed over workers)."""
        total: Counter = Counter()
        for state in self._states:
            if state is not None:
                total.update(state["skipped"])
        return dict(sorted(total.items()))

    def epochs(self) -> dict[str, int]:
        """Per source: the epoch every worker of this rank has reached (the minimum)."""
        out = {}
        for i, s in enumerate(self.sets):
            ep = [st["cursors"][i][0] for st in self._states if st is not None]
            out[s.label] = min(ep) if len(ep) == self.num_logical else 0
        return out

    def metrics(self, reset: bool = True) -> dict[str, float]:
        """Throughput and composition since the last call: samples/s, tokens/s (padding excluded),
        padding fraction, token share per modality, skipped samples by reason (cumulative)."""
        now = time.perf_counter()
        dt = max(now - self._window_start, 1e-9)
        win = self._window
        real = int(win["tokens"].sum())
        out: dict[str, float] = {
            "samples_per_s": win["docs"] / dt,
            "tokens_per_s": real / dt,
            **composition(win["tokens"].tolist(), win["padding"]),
        }
        epochs = self.epochs()
        out["epoch"] = float(min(epochs.values())) if epochs else 0.0
        skipped = self.skipped()
        out["skipped_total"] = float(sum(skipped.values()))
        for reason, n in skipped.items():
            out[f"skipped/{reason}"] = float(n)
        token_stats: Counter = Counter()
        for state in self._states:
            if state is not None:
                token_stats.update(state.get("token_stats", {}))
        for name, n in sorted(token_stats.items()):
            out[f"tokenizer/{name}"] = float(n)
        caches = [c for c in self._cache if c is not None]
        if caches:  # since the workers started (hits + misses = documents tokenized or replayed)
            hits, misses = sum(c[0] for c in caches), sum(c[1] for c in caches)
            out["doc_cache/hit_fraction"] = hits / max(hits + misses, 1)
            out["doc_cache/mb"] = sum(c[2] for c in caches) / 2**20
            out["doc_cache/full"] = float(any(c[4] for c in caches))
        # the window's raw counts, for a trainer that sums them over ranks (`composition`)
        self.last_window = {"tokens": win["tokens"].tolist(), "padding": int(win["padding"])}
        if reset:
            self._window_start = now
            self._window = {"docs": 0, "tokens": np.zeros(5, np.int64), "padding": 0, "batches": 0}
        return out

    # -- state ---------------------------------------------------------------------------------
    def _fingerprint(self) -> dict:
        c = self.cfg
        schedule = self.schedule.fingerprint() if self.schedule is not None else None
        return {
            "split": self.split,
            "sources": [list(e) for e in self._source_entries],
            "seq_len": c.seq_len, "batch_size": c.batch_size, "seed": c.seed,
            "shuffle_buffer": c.shuffle_buffer, "pack_buffer": c.pack_buffer,
            "world_size": self.world_size, "num_workers": c.num_workers,
            # per source [start_step, end_step, modalities]; only when some source has one, so a
            # state saved before schedules existed still matches an unscheduled config
            **({"schedule": schedule} if schedule is not None else {}),
        }

    def state_dict(self) -> dict:
        """Everything needed to continue exactly after the last consumed batch (plain data)."""
        return {"version": STATE_VERSION, "rank": self.rank, "fingerprint": self._fingerprint(),
                "consumed": self.consumed, "step": self.clock.position(self.consumed),
                "workers": copy.deepcopy(self._states)}

    def load_state_dict(self, state: dict | list[dict], *, sources: str = "exact") -> None:
        """Continue from `state`: this rank's saved state, or the list of every saved rank's state.

        Same layout (world_size x workers): exact resume from this rank's state. Another layout:
        the states of every saved rank are pooled and redistributed (data/stream/elastic.py), which needs
        the whole list (or the one state of a 1-process run). Another data config: ValueError
        (another data.batch_size is not one: the rows go on, in batches of the new size), except
        with `sources="keep_unchanged"`, where the sources may differ (added, removed, reordered,
        reweighted): those of the same label and sample count continue where they were, the others
        start at their beginning (data/stream/remix.py; needs every saved rank's state)."""
        from .state_check import check_loader_state, check_shape

        if sources not in ("exact", "keep_unchanged"):  # "restart" is a fresh loader (start_at_step), not a state
            raise ValueError(f"sources must be 'exact' or 'keep_unchanged', got {sources!r}")
        states = [state] if isinstance(state, dict) else list(state)
        if not states:
            raise ValueError("no data-loader state given")
        names = [f"data state of rank {st.get('rank')}" if isinstance(st, dict) else "data state" for st in states]
        for st, who in zip(states, names):
            check_shape(st, who)  # an edited or damaged state: one line naming the field, not a traceback later
        states = [self._upgrade(st) for st in states]
        for st, who in zip(states, names):
            check_loader_state(st, who)
        self.remixed = None
        if sources == "keep_unchanged":
            states = self._remix(states)
        from .remix import comparable

        old, new = states[0]["fingerprint"], self._fingerprint()
        old, new = dict(old), dict(new)
        old["sources"], new["sources"] = comparable(old["sources"], new["sources"])
        layout = ("world_size", "num_workers")
        # batch_size may change too: a worker's state counts documents and rows, never batches of a
        # size (cursors, buffers by reference, the RNG), so the rows go on as they would have, cut
        # into batches of the new size: none lost, none repeated (docs/resume.md)
        free = (*layout, "batch_size")
        # "schedule" either way: a schedule added or dropped since the save changes the batches
        diff = [k for k in {**new, "schedule": None} if k not in free and json_safe(old.get(k)) != json_safe(new.get(k))]
        if diff:
            details = "; ".join(f"{k}: saved {old.get(k)!r}, now {new.get(k)!r}" for k in diff)
            resharded = [n[0] for o, n in zip(old["sources"], new["sources"])
                         if len(o) > 3 and len(n) > 3 and o[:3] == n[:3] and o[3] != n[3]]
            if diff == ["sources"] and len(old["sources"]) == len(new["sources"]) and resharded:
                details = (f"source {', '.join(map(repr, resharded))} has other shards than when the state was saved "
                           "(rebuilt: shard names or sample counts changed), so its saved positions name other documents")
            if diff == ["sources"] and sources != "keep_unchanged":
                advice = ("resume with the sources it was saved with, or with checkpoint.resume_data=keep_unchanged "
                          "(the unchanged sources go on where they were, the others start) or =restart (all data anew)")
            else:
                advice = ("resume with the config it was saved with, or with checkpoint.resume_data=restart (the "
                          "model, optimizer and schedule resume; the data stream starts anew)")
            raise ValueError(f"data-loader state does not match this data config ({details}); {advice}")
        if old.get("batch_size") != self.cfg.batch_size and self.rank == 0:
            log.info("data stream resumed with data.batch_size=%s (saved with %s): the same rows follow, %s per batch",
                     self.cfg.batch_size, old.get("batch_size"), self.cfg.batch_size)
        if (old["world_size"], max(old["num_workers"], 1)) == (self.world_size, self.num_logical):
            mine = [st for st in states if st["rank"] == self.rank] if len(states) > 1 else states
            if len(mine) != 1 or mine[0]["rank"] != self.rank:
                raise ValueError(f"data-loader state of rank {states[0]['rank']} given to rank {self.rank}")
            self._states = copy.deepcopy(mine[0]["workers"])
            self.consumed = int(mine[0]["consumed"])
            self.clock = StepClock(self.batches_per_step).resumed(self.consumed, mine[0].get("step"))
            self._docs_seen = [st["docs"] if st else 0 for st in self._states]
            self.resumed_from = None
            return
        self._load_elsewhere(states)

    def _load_elsewhere(self, states: list[dict]) -> None:
        """Resume on another layout: pool every saved rank's state, take this rank's share."""
        from .elastic import redistribute

        old = states[0]["fingerprint"]
        ranks = sorted(int(st["rank"]) for st in states)
        if ranks != list(range(old["world_size"])) or any(
                json_safe(st["fingerprint"]) != json_safe(old) for st in states):
            raise ValueError(
                f"data-loader state was saved with world_size={old['world_size']} x num_workers="
                f"{old['num_workers']}, this run has world_size={self.world_size} x num_workers="
                f"{self.cfg.num_workers}: resuming on another layout needs the state of every saved rank "
                f"(got ranks {ranks}); load all data_rank*.pt files of the checkpoint (the trainer does)")
        per_rank = redistribute(states, num_samples=[s.num_samples for s in self.sets], seed=self.cfg.seed,
                                world_size=self.world_size, num_workers=self.cfg.num_workers)
        self._states = per_rank[self.rank]
        self.consumed = 0
        # every rank saved the same step (they consume in lockstep): the new batches go on from it
        self.clock = StepClock(self.batches_per_step).resumed(0, states[0].get("step"))
        self._docs_seen = [0] * self.num_logical
        self.resumed_from = (int(old["world_size"]), max(int(old["num_workers"]), 1))
        if self.rank == 0:
            log.info("data stream resumed on another layout: %d rank(s) x %d worker(s) -> %d rank(s) x %d "
                     "worker(s); the unread rest of each source's epoch and the buffered documents were "
                     "redistributed (each document still trained on once per epoch, in another order)",
                     *self.resumed_from, self.world_size, self.num_logical)

    def _remix(self, states: list[dict]) -> list[dict]:
        """The saved states rewritten for this run's mix of sources (data/stream/remix.py)."""
        from .remix import comparable, describe, plan, remap_states

        mine = self._fingerprint()
        old, new = states[0]["fingerprint"]["sources"], mine["sources"]
        old_cmp, new_cmp = comparable(old, new)
        if json_safe(old_cmp) == json_safe(new_cmp) and json_safe(states[0]["fingerprint"].get("schedule")) == json_safe(mine.get("schedule")):
            return states
        world = int(states[0]["fingerprint"]["world_size"])
        if sorted(int(st["rank"]) for st in states) != list(range(world)):
            raise ValueError(f"changing the data mix on resume needs the data state of every saved rank (0..{world - 1}); "
                             "load all data_rank*.pt files of the checkpoint (the trainer does)")
        self.remixed = describe(old, new, plan(old, new))
        if self.rank == 0:
            log.info("data mix changed on resume (checkpoint.resume_data=keep_unchanged): %s", self.remixed)
        return remap_states(states, new, [[sh.num_samples for sh in s.shards] for s in self.sets], self.cfg.seed,
                            mine.get("schedule"))

    def _upgrade(self, state: dict) -> dict:
        from .elastic import upgrade_state

        return upgrade_state(state, [s.num_samples for s in self.sets], STATE_VERSION)


def shard_layout(source: ShardSet) -> str:
    """A digest of a source's shards (names and sample counts, in manifest order): a source rebuilt
    with other shards keeps its label and sample count, but its saved positions (each epoch's order
    is a shuffle of its shards) would name other documents, so a resume compares this too."""
    import hashlib
    import json

    layout = json.dumps([[sh.name, sh.num_samples] for sh in source.shards], separators=(",", ":"))
    return hashlib.sha256(layout.encode()).hexdigest()[:16]


def json_safe(value):
    """Tuples to lists, so fingerprints compare equal after a JSON/YAML round trip."""
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


class DocumentTokenizer:
    """The default tokenize_fn: omniloom.tokenizers.unified.tokenize_document with the tokenizer of
    a folder. Picklable (DataLoader workers get the serialized tokenizer). `media_errors="skip"`
    skips a document with undecodable media (counted under the MediaError's reason); "drop" keeps
    the document without that image/video (counted under tokenizer/dropped_<reason>)."""

    def __init__(self, tokenizer_dir: str, media_errors: str = "skip"):
        from omniloom.tokenizers.text import Tokenizer

        if media_errors not in ("skip", "drop"):
            raise ValueError(f"media_errors must be 'skip' or 'drop', got {media_errors!r}")
        self.tokenizer_dir, self.media_errors = tokenizer_dir, media_errors
        self.tokenizer = Tokenizer.load(tokenizer_dir)  # fails at start, not inside a worker

    def __call__(self, doc: dict, media: dict) -> TokenizedDoc:
        from omniloom.tokenizers.unified import tokenize_document

        return tokenize_document(doc, media, self.tokenizer,
                                 media_errors="raise" if self.media_errors == "skip" else "drop")


_BUDGET_LOGGED: set[str] = set()


def _log_visual_budget(seq_len: int, settings, rank: int) -> None:
    """One plain log line per process (rank 0 only) when the tokenizer's largest image or video block
    cannot fit a row, saying what to change; not a Python warning with a source line, and not
    again for every loader the run builds (each evaluation builds one)."""
    import warnings

    from omniloom.data.config import check_visual_budget

    video = settings.max_video_patches
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        messages = check_visual_budget(seq_len, max_image_patches=settings.image_patch_budget, max_video_patches=video)
    for msg in messages:
        if msg in _BUDGET_LOGGED:
            continue
        _BUDGET_LOGGED.add(msg)
        kind = "video" if "video block" in msg else "image"
        fix = ("retrain the tokenizer with a smaller --video-frame-budget or --video-patch-budget "
               f"(now {settings.video_frame_budget} frames x {settings.video_patch_budget} patches per {settings.temporal_patch_size} frames)"
               if kind == "video" else f"retrain the tokenizer with a smaller --image-patch-budget (now {settings.image_patch_budget})")
        need = (video if kind == "video" else settings.image_patch_budget) + 2
        (log.warning if rank == 0 else log.debug)(
            "data.seq_len=%d is shorter than the tokenizer's largest %s block (%d tokens): longer %ss are skipped "
            "and counted (data/skipped/visual_block_too_long); set data.seq_len=%d or more, or %s",
            seq_len, kind, need, kind, need, fix)


def build_loader(data_cfg: DataConfig, tokenize_fn: TokenizeFn | None = None, *, rank: int = 0,
                 world_size: int = 1, split: str = "train", max_batches: int | None = None,
                 pin_memory: bool = False, pad_id: int | None = None, patch_dim: int | None = None,
                 batches_per_step: int = 1) -> StreamLoader:
    """The per-rank PackedBatch loader for `split` ("train": data_cfg.sources, "eval": eval_sources).

    tokenize_fn(doc_json, media_by_ref) -> TokenizedDoc defaults to the tokenizer in
    data_cfg.tokenizer; pad_id and patch_dim (the common [P, D] width: max of image patch_dim and
    video tubelet_dim) default to that tokenizer's. Errors at start (ValueError/FileNotFoundError):
    no sources, a missing manifest or shard, a source with zero samples or fewer samples than
    world_size x num_workers. Use max_batches for a finite pass (evaluation: the same count on every
    rank); without it the stream is endless (epochs advance per source). `batches_per_step` (the
    trainer's gradient accumulation) turns the batches the rank consumes into training steps for
    the sources' schedules (start_step, end_step, data.text_first_steps: data/stream/schedule.py).
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if not (0 <= rank < world_size):
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    sources: list[SourceConfig] = data_cfg.train_sources() if split == "train" else data_cfg.eval_sources
    if not sources:
        raise ValueError(f"data.{'sources' if split == 'train' else 'eval_sources'} is empty; name at least one "
                         "shard set (a directory with manifest.json, a brace pattern or a URL)")
    if max_batches is not None and max_batches < 1:
        raise ValueError(f"max_batches must be >= 1, got {max_batches}")
    tok = None
    if tokenize_fn is None:
        if not data_cfg.tokenizer:
            raise ValueError("data.tokenizer is empty; set it to a folder made by `omniloom tokenizer train`")
        tokenize_fn = DocumentTokenizer(data_cfg.tokenizer, data_cfg.media_errors)
        tok = tokenize_fn.tokenizer
    elif isinstance(tokenize_fn, DocumentTokenizer):
        tok = tokenize_fn.tokenizer
    if tok is not None:
        _log_visual_budget(data_cfg.seq_len, tok.settings, rank)
        pad_id = tok.pad_id if pad_id is None else pad_id
        patch_dim = max(tok.patch_dim, tok.tubelet_dim) if patch_dim is None else patch_dim
    if patch_dim is None:
        raise ValueError("patch_dim is unknown with a custom tokenize_fn; pass patch_dim (the largest patch "
                         "vector length: 3*tp*p*p for video)")
    if pad_id is None:
        from omniloom.tokenizers.layout import PAD_ID

        pad_id = PAD_ID
    sets = [resolve_source(s) for s in sources]
    num_slots = world_size * max(data_cfg.num_workers, 1)
    for s in sets:
        if s.num_samples < num_slots:
            raise ValueError(f"source '{s.label}' has {s.num_samples} samples, fewer than the {num_slots} reader "
                             "slots (world_size x num_workers); use fewer workers or add data")
    if batches_per_step < 1:
        raise ValueError(f"batches_per_step must be >= 1, got {batches_per_step}")
    return StreamLoader(sets, data_cfg, tokenize_fn, rank=rank, world_size=world_size, pad_id=pad_id,
                        patch_dim=patch_dim, max_batches=max_batches, pin_memory=pin_memory, split=split,
                        schedule=SourceSchedule(sources), batches_per_step=batches_per_step)
