"""The unified stream: read -> mix -> shuffle -> tokenize -> best-fit pack -> PackedBatch, resumable.

Legend: B rows per batch, S seq_len, W DataLoader workers per rank, N = world_size * W slots.

How work is split. Each (rank, worker) pair is one *slot*. For every source and epoch, the shard
order is shuffled from (seed, source, epoch) and the concatenated samples are cut into N contiguous
ranges whose sizes differ by at most one; slot s reads range s. A slot that finishes its range
starts the next epoch of that source (new shard order), so the stream is endless, every rank yields
a batch at every step (unequal shards can never hang DDP), and per-source epochs advance in
lockstep across slots. Sources are mixed per document: each draw picks a source with probability
proportional to its weight. A finite pass (evaluation) is `max_batches` batches per rank.

Exact resume. A worker's whole state is a few integers plus *references*: its RNG state, the
(epoch, position) cursor of each source, the references (source, epoch, global index in the epoch's
order) of the raw samples in its shuffle buffer and of the document pieces in its packer, and its
counters. Each batch carries the producing worker's state to the main process;
`StreamLoader.state_dict()` holds, for each worker, the state as of the last batch the trainer
consumed, and which worker is next. On restore, buffered samples are re-read by manifest offset (not
replayed from the start of the epoch) and the DataLoader's round-robin is rotated so the next batch
comes from the right worker: the batches after a restore are identical to an uninterrupted run.

Elastic resume. A state saved with another world size or worker count is accepted when the states of
every saved rank are given: data/stream/elastic.py pools them and splits the unread rest of each source's
begun epochs, and the buffered documents, among the new slots. Every document is then still trained
on once per epoch (the order differs); see docs/resume.md. Another data config is refused.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import NamedTuple

import numpy as np
import torch
import torch.utils.data

from omniloom.data.batch import PackedBatch, collate_rows
from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.packing import BestFitPacker, PackingError, Piece, split_document
from omniloom.tokenizers.layout import MODALITY_NAMES, TokenizedDoc

from .cursor import SourceCursor as _SourceCursor
from .doc_cache import DocCache
from .reader import SampleError, SampleReader, ShardSet, resolve_source
from .schedule import OUTSIDE_MODALITIES, SourceSchedule, StepClock

log = logging.getLogger(__name__)

TokenizeFn = Callable[[dict, dict], TokenizedDoc]
STATE_VERSION = 2  # 2: buffered refs are (source, epoch, global index); 1 was slot-relative
_MAX_LOGGED_SKIPS = 5  # per reason and worker; the counters keep counting after that


class StreamDataError(ValueError, RuntimeError):
    """The data cannot feed the run at all (every sample of a source unreadable, no document that
    tokenizes): a user error (ValueError: one line, exit 2) raised in the main process even when a
    DataLoader worker found it; still a RuntimeError for code that caught it as one before."""


_WORKER_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_guard_started = False


def _guard_worker() -> None:
    """Make this DataLoader worker outlive SIGTERM/SIGINT sent to its whole process group, yet
    never outlive its trainer.

    torchrun, Slurm and Ctrl-C signal the whole process group: a worker that died first would
    fail the trainer's next batch before the trainer could save, so a worker must not die of
    those. But a worker that ignores SIGTERM outright also ignores its own parent's `terminate()`
    (DataLoader shutdown, interpreter exit), and the parent then waits for it forever: a fatal
    error hung the run (issue 14 item 1). So the signals are blocked and a watcher thread takes
    them: one sent by the parent ends the worker at once; any other is ignored. The same thread
    ends the worker within a second of the parent's death (SIGKILL, crash), busy or not."""
    global _guard_started
    if _guard_started:
        return
    _guard_started = True
    parent = multiprocessing.parent_process()
    parent_pid = parent.pid if parent is not None else os.getppid()
    if not hasattr(signal, "sigtimedwait"):  # no sigtimedwait (macOS): ignore, and watch the parent only
        for sig in _WORKER_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
    else:
        for sig in _WORKER_SIGNALS:
            # not SIG_IGN: an ignored signal is discarded before the watcher could see who sent it
            signal.signal(sig, lambda signum, frame: None)
        signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)  # threads started below inherit it

    def watch() -> None:
        while True:
            info = signal.sigtimedwait(_WORKER_SIGNALS, 1.0) if hasattr(signal, "sigtimedwait") else time.sleep(1.0)
            if info is not None and info.si_pid == parent_pid:
                os._exit(0)  # the trainer shuts its loader down
            if os.getppid() != parent_pid and (parent is None or not parent.is_alive()):
                os._exit(1)  # the trainer is gone: nobody will read another batch

    threading.Thread(target=watch, name="omniloom-worker-guard", daemon=True).start()


@contextlib.contextmanager
def _signals_held():
    """Block SIGTERM/SIGINT in this thread for the duration (the processes it forks inherit the
    mask); a signal that arrives meanwhile is delivered when the block ends."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _WORKER_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _worker_init(worker_id: int) -> None:
    # As early as torch allows (its own SIGTERM handler is in place by now, and would let a group
    # signal kill the worker): not at the first batch, which a worker may reach seconds later.
    _guard_worker()
    _one_thread_worker(worker_id)


class Drawn(NamedTuple):
    """A sample in the shuffle buffer: its reference and either its raw document (doc, media) or
    the document cache's entry found when it was drawn; `ident` is its shard file's identity then
    (data/stream/doc_cache.py; None without a cache or for a remote shard)."""

    ref: tuple
    doc: dict | None
    media: dict | None
    entry: tuple | None
    ident: tuple | None


class WorkerStream:
    """The deterministic pipeline of one slot. `next_batch()` -> (PackedBatch, counts)."""

    def __init__(self, sets: list[ShardSet], cfg: DataConfig, tokenize_fn: TokenizeFn, *, slot: int,
                 num_slots: int, pad_id: int, patch_dim: int, cache_mb: float = 0,
                 schedule: SourceSchedule | None = None):
        self.cfg, self.tokenize_fn, self.slot = cfg, tokenize_fn, slot
        # sources drawn per training step and their modality filters (data/stream/schedule.py);
        # `step` is the training step of the batch being built, set by StreamDataset
        self.schedule = schedule if schedule is not None and schedule.fingerprint() is not None else None
        self.step = 0
        # filtered sources with no document their modalities take in this slot's whole epoch (the
        # demo's synthetic set under text-first): drawn no more; saved, rediscovered on another layout
        self.barren: set[int] = set()
        # tokenized documents kept for later epochs (data/stream/doc_cache.py); not part of the state
        self.cache = DocCache(int(cache_mb * 2**20), cfg.patch_dtype) if cache_mb > 0 else None
        self.pad_id, self.patch_dim = pad_id, patch_dim
        self.cursors = [_SourceCursor(s, i, cfg.seed, slot, num_slots) for i, s in enumerate(sets)]
        w = np.array([s.weight for s in sets], dtype=np.float64)
        self.weights = w / w.sum()
        self.rng = np.random.Generator(np.random.PCG64([cfg.seed, slot, 0x5EED]))
        self.shuffle: list[Drawn] = []
        self.packer = BestFitPacker(cfg.seq_len, cfg.pack_buffer)
        self.skipped: Counter = Counter()
        self.token_stats: Counter = Counter()  # TokenizedDoc.stats summed (decode errors, drops)
        self.docs = 0  # documents tokenized and handed to the packer
        self.last_pieces: list = []
        self.batches = 0

    # -- pipeline ------------------------------------------------------------------------------
    def _skip(self, reason: str, err: Exception, ref: tuple) -> None:
        self.skipped[reason] += 1
        if self.skipped[reason] <= _MAX_LOGGED_SKIPS:
            log.warning("skipping sample %s (%s): %s", ref, reason, err)

    def _drawn(self, ref: tuple) -> Drawn:
        """Sample `ref` as drawn: its cache entry when the cache holds one for its shard as the
        shard is now (neither read nor held raw), else read (raises SampleError). The shard's
        identity is taken before the read, so a document read across a change is never cached."""
        cursor = self.cursors[ref[0]]
        ident = None
        if self.cache is not None:
            key = self._cache_key(ref)
            ident = cursor.reader.shard_identity(key[1])
            entry = self.cache.lookup(key, ident)
            if entry is not None:
                return Drawn(ref, None, None, entry, ident)
        doc, media = cursor.read(ref[1], ref[2])
        return Drawn(ref, doc, media, None, ident)

    def _pick_source(self) -> int:
        if self.schedule is None:
            return int(self.rng.choice(len(self.weights), p=self.weights)) if len(self.weights) > 1 else 0
        p, active = self.schedule.at(self.step)
        if self.barren & set(active):
            active = [i for i in active if i not in self.barren]
            if not active:
                raise StreamDataError(f"slot {self.slot}: at training step {self.step} no active source has a document its "
                                      "modalities take (a text-first start needs text or code documents without images "
                                      "or videos in some source)")
            p = p.copy()
            p[sorted(self.barren)] = 0.0
            p /= p.sum()
        return int(self.rng.choice(len(p), p=p)) if len(active) > 1 else active[0]

    def _admitted(self, drawn: Drawn) -> bool:
        """Whether the source's modality filter takes the drawn document; a document it leaves
        out is counted (not logged) and, with the cache, remembered as such, so a cached draw
        decides as a read one does."""
        src = drawn.ref[0]
        if self.schedule is None or self.schedule.modalities[src] is None:
            return True
        if drawn.entry is not None:
            admitted = not (drawn.entry[0] == "skip" and drawn.entry[1] == OUTSIDE_MODALITIES)
        else:
            why = self.schedule.outside(src, drawn.doc)
            if why is not None and self.cache is not None:
                self.cache.store_skip(self._cache_key(drawn.ref), drawn.ident, OUTSIDE_MODALITIES, why)
            admitted = why is None
        if not admitted:
            self.skipped[OUTSIDE_MODALITIES] += 1
        return admitted

    def _draw_sample(self) -> Drawn:
        while True:
            drawn = self._draw_from(self.cursors[self._pick_source()])
            if drawn is not None:
                return drawn

    def _draw_from(self, cursor) -> Drawn | None:
        """The next sample of the cursor's source; None when a filtered source proved barren."""
        for _ in range(cursor.attempts_left_bound()):
            ref = cursor.next_ref()
            try:
                drawn = self._drawn(ref)
            except SampleError as err:
                self._skip(err.reason, err, ref)
                continue
            if self._admitted(drawn):
                return drawn
        if self.schedule is not None and self.schedule.modalities[cursor.src_idx] is not None:
            self.barren.add(cursor.src_idx)
            log.warning("source '%s': no document its modalities take in a whole epoch of slot %d; it is drawn no more "
                        "by this slot (skips so far: %s)", cursor.set.label, self.slot, dict(self.skipped))
            return None
        raise StreamDataError(f"source '{cursor.set.label}': not one readable sample in a whole epoch of slot "
                           f"{self.slot}; check the shards (skips so far: {dict(self.skipped)})")

    def _next_doc(self) -> Drawn:
        while len(self.shuffle) < self.cfg.shuffle_buffer:
            self.shuffle.append(self._draw_sample())
        i = int(self.rng.integers(len(self.shuffle)))
        item = self.shuffle[i]
        self.shuffle[i] = self.shuffle[-1]
        self.shuffle.pop()
        return item

    def _cache_key(self, ref: tuple) -> tuple:
        """The sample itself, whatever the epoch: (source, shard, sample in the shard)."""
        return (ref[0], *self.cursors[ref[0]].locate_global(ref[1], ref[2]))

    def _pieces(self, drawn: Drawn, count: bool = True) -> list[Piece]:
        ref, doc, media, entry, ident = drawn
        key = self._cache_key(ref) if self.cache is not None else None
        if key is not None:
            self.cache.count(hit=entry is not None)
            if entry is not None:  # replay the outcome and its counters exactly
                if entry[0] == "skip":
                    if count:
                        self._skip(entry[1], entry[2], ref)
                    return []
                if count:
                    self.docs += 1
                    self.token_stats.update(entry[2])
                return DocCache.pieces_for(entry, ref)
        try:
            tdoc = self.tokenize_fn(doc, media)
        except Exception as err:  # any tokenizer failure is a bad sample, never a dead run
            reason = getattr(err, "reason", None) or type(err).__name__
            # a data error (DocumentError, MediaError: it has a reason) fails the same way next
            # time and is remembered; anything else (out of memory, too many open files) is retried
            if key is not None and getattr(err, "reason", None):
                self.cache.store_skip(key, ident, reason, str(err))
            if count:
                self._skip(reason, err, ref)
            return []
        try:
            pieces = split_document(tdoc, self.cfg.seq_len, ref)
        except PackingError as err:
            if key is not None:
                self.cache.store_skip(key, ident, err.reason, str(err))
            if count:
                self._skip(err.reason, err, ref)
            return []
        for b in tdoc.blocks:
            if b.patches_ND.shape[1] > self.patch_dim:
                raise ValueError(f"tokenizer gave {b.patches_ND.shape[1]}-dim patches but the stream's patch_dim "
                                 f"is {self.patch_dim}; pass patch_dim=max(patch_dim, tubelet_dim) of the tokenizer")
        stats = getattr(tdoc, "stats", None) or {}
        if key is not None:
            pieces = self.cache.store_pieces(key, ident, pieces, stats)
        if count:
            self.docs += 1
            self.token_stats.update(stats)
        return pieces

    def _fill_packer(self) -> None:
        failed = 0
        limit = max(1000, 2 * sum(c.range_len for c in self.cursors))
        while self.packer.needs_more():
            pieces = self._pieces(self._next_doc())
            for piece in pieces:
                self.packer.add(piece)
            failed = 0 if pieces else failed + 1
            if failed > limit:  # bad data is skipped, but a stream with no usable document must stop
                raise StreamDataError(f"slot {self.slot}: {failed} documents in a row could not be tokenized or "
                                   f"packed (skips: {dict(self.skipped)}); check data.tokenizer and the shards")

    def next_batch(self) -> tuple[PackedBatch, dict]:
        if self.schedule is not None:
            self._drop_ended()
        rows = []
        for _ in range(self.cfg.batch_size):
            self._fill_packer()
            rows.append(self.packer.pop_row())
        self.last_pieces = [[list(p.ref), p.index] for row in rows for p in row]
        batch, counts = collate_rows(rows, seq_len=self.cfg.seq_len, pad_id=self.pad_id,
                                     patch_dim=self.patch_dim, patch_dtype=self.cfg.patch_dtype)
        self.batches += 1
        return batch, counts

    def _drop_ended(self) -> None:
        """A source past its end_step gives up what it drew but did not train on yet (its samples in
        the shuffle buffer, its pieces in the packer), counted as skipped `source_ended`. Left there,
        a buffer of long documents from the phase that ended holds the next phase off for hundreds of
        steps (bench arch measured 0.4% image tokens 360 steps after a text-first switch); a
        text-first start's text copy gives up only documents its full source also holds. A function
        of the state and the step alone, so a resumed stream drops exactly the same."""
        ended = {i for i, end in enumerate(self.schedule.ends) if end and self.step >= end}
        if not ended:
            return
        kept = [d for d in self.shuffle if d.ref[0] not in ended]
        gone = self.packer.discard(lambda piece: piece.ref[0] in ended)
        dropped = len(self.shuffle) - len(kept) + len({tuple(p.ref) for p in gone})
        if dropped:
            self.shuffle = kept
            self.skipped["source_ended"] += dropped

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain data (ints, lists, dicts): JSON- and torch.save-friendly."""
        return {
            "rng": copy.deepcopy(self.rng.bit_generator.state),
            "cursors": [[c.epoch, c.pos] for c in self.cursors],
            **({"pending": [c.pending_state() for c in self.cursors]} if any(c.pending for c in self.cursors) else {}),
            "shuffle": [list(d.ref) for d in self.shuffle],
            "packer": [[list(ref), idx] for ref, idx in self.packer.state_refs()],
            "skipped": dict(self.skipped),
            "token_stats": dict(self.token_stats),
            "docs": self.docs,
            "batches": self.batches,
            **({"barren": sorted(self.barren)} if self.barren else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore; buffered samples are re-read by reference (random access by manifest offset)."""
        self.rng.bit_generator.state = copy.deepcopy(state["rng"])
        pending = state.get("pending") or [None] * len(self.cursors)
        for cursor, (epoch, pos), pend in zip(self.cursors, state["cursors"], pending, strict=True):
            cursor.load(epoch, pos, pend)
        self.skipped = Counter(state["skipped"])
        self.token_stats = Counter(state.get("token_stats", {}))
        self.docs, self.batches = int(state["docs"]), int(state["batches"])
        self.barren = {int(i) for i in state.get("barren", [])}
        self.shuffle = []
        for ref in map(tuple, state["shuffle"]):
            try:
                self.shuffle.append(self._drawn(ref))
            except SampleError as err:  # the data changed since the checkpoint: say so, keep going
                self._skip("restore_unreadable", err, ref)
        self.packer = BestFitPacker(self.cfg.seq_len, self.cfg.pack_buffer)
        cache: dict[tuple, list[Piece]] = {}
        for ref, idx in state["packer"]:
            ref = tuple(ref)
            if ref not in cache:
                try:
                    cache[ref] = self._pieces(self._drawn(ref), count=False)
                except SampleError as err:
                    self._skip("restore_unreadable", err, ref)
                    cache[ref] = []
            if idx < len(cache[ref]):
                self.packer.add(cache[ref][idx])
            else:
                self.skipped["restore_unreadable"] += 1

    def close(self) -> None:
        for c in self.cursors:
            c.reader.close()


def _first_batch_index(consumed: int, logical: int, num_logical: int) -> int:
    """Smallest global batch index >= consumed that logical worker `logical` produces."""
    return consumed + (logical - consumed) % num_logical


class StreamDataset(torch.utils.data.IterableDataset):
    """The per-rank IterableDataset: each DataLoader worker runs one WorkerStream.

    Workers are *logical*: physical worker i serves logical worker (i + consumed) % W, because
    torch's DataLoader always asks worker 0 first while the next batch after a restore may be due
    from another worker. Logical worker w produces global batches w, w + W, w + 2W, ...; each item
    is (PackedBatch, meta) with meta = {worker, index, state, counts}.
    """

    def __init__(self, sets: list[ShardSet], cfg: DataConfig, tokenize_fn: TokenizeFn, *, rank: int,
                 world_size: int, pad_id: int, patch_dim: int, states: list[dict | None], consumed: int,
                 max_batches: int | None, cache_mb: float = 0, schedule: SourceSchedule | None = None,
                 clock: StepClock = StepClock()):
        self.sets, self.cfg, self.tokenize_fn, self.cache_mb = sets, cfg, tokenize_fn, cache_mb
        self.schedule, self.clock = schedule, clock
        self.rank, self.world_size, self.pad_id, self.patch_dim = rank, world_size, pad_id, patch_dim
        self.states, self.consumed, self.max_batches = states, consumed, max_batches
        self.num_logical = max(cfg.num_workers, 1)

    def __iter__(self) -> Iterator[tuple[PackedBatch, dict]]:
        info = torch.utils.data.get_worker_info()
        if info is not None:
            # The trainer handles SIGTERM/SIGINT and saves; its workers outlive the signal but
            # never the trainer (see _guard_worker).
            _guard_worker()
        physical = info.id if info is not None else 0
        logical = (physical + self.consumed) % self.num_logical
        stream = WorkerStream(self.sets, self.cfg, self.tokenize_fn, slot=self.rank * self.num_logical + logical,
                              num_slots=self.world_size * self.num_logical, pad_id=self.pad_id,
                              patch_dim=self.patch_dim, cache_mb=self.cache_mb, schedule=self.schedule)
        if self.states[logical] is not None:
            stream.load_state_dict(self.states[logical])
        index = _first_batch_index(self.consumed, logical, self.num_logical)
        assert stream.batches * self.num_logical + logical == index, "worker state and batch index disagree"
        try:
            while self.max_batches is None or index < self.max_batches:
                stream.step = self.clock.step_of(index)
                batch, counts = stream.next_batch()
                meta = {"worker": logical, "index": index, "state": stream.state_dict(), "counts": counts,
                        "pieces": stream.last_pieces,
                        "cache": stream.cache.stats() if stream.cache is not None else None}
                yield batch, meta
                index += self.num_logical
        finally:
            stream.close()


def _one_thread_worker(_worker_id: int) -> None:
    # Decoding and tokenizing need no intra-op parallelism; the trainer's process holds the cores.
    torch.set_num_threads(1)


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
            "sources": [[s.label, s.weight, s.num_samples] for s in self.sets],
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
        old, new = states[0]["fingerprint"], self._fingerprint()
        layout = ("world_size", "num_workers")
        # batch_size may change too: a worker's state counts documents and rows, never batches of a
        # size (cursors, buffers by reference, the RNG), so the rows go on as they would have, cut
        # into batches of the new size: none lost, none repeated (docs/resume.md)
        free = (*layout, "batch_size")
        # "schedule" either way: a schedule added or dropped since the save changes the batches
        diff = [k for k in {**new, "schedule": None} if k not in free and json_safe(old.get(k)) != json_safe(new.get(k))]
        if diff:
            details = "; ".join(f"{k}: saved {old.get(k)!r}, now {new.get(k)!r}" for k in diff)
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
        from .remix import describe, plan, remap_states

        mine = self._fingerprint()
        old, new = states[0]["fingerprint"]["sources"], mine["sources"]
        if json_safe(old) == json_safe(new) and json_safe(states[0]["fingerprint"].get("schedule")) == json_safe(mine.get("schedule")):
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
