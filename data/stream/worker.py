"""One reader slot of the stream: WorkerStream (read -> mix -> shuffle -> tokenize -> best-fit pack
for one (rank, worker) slot), StreamDataset (the per-rank IterableDataset whose DataLoader workers
each run one), and the signal guard of those workers. data/stream/loader.py builds and drives them.

Legend: B rows per batch, S seq_len, W DataLoader workers per rank, N = world_size * W slots.

How work is split. Each (rank, worker) pair is one *slot*. For every source and epoch, the shard
order is shuffled from (seed, source, epoch) and the concatenated samples are cut into N contiguous
ranges whose sizes differ by at most one; slot s reads range s. A slot that finishes its range
starts the next epoch of that source (new shard order), so the stream is endless, every rank yields
a batch at every step (unequal shards can never hang DDP), and per-source epochs advance in
lockstep across slots. Sources are mixed per document: each draw picks a source with probability
proportional to its weight.

A worker's whole state is a few integers plus *references*: its RNG state, the (epoch, position)
cursor of each source, the references (source, epoch, global index in the epoch's order) of the raw
samples in its shuffle buffer and of the document pieces in its packer, and its counters
(WorkerStream.state_dict); on restore, buffered samples are re-read by manifest offset.
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
from omniloom.data.config import DataConfig
from omniloom.data.packing import BestFitPacker, PackingError, Piece, split_document
from omniloom.tokenizers.layout import TokenizedDoc

from .cursor import SourceCursor as _SourceCursor
from .doc_cache import DocCache
from .reader import SampleError, ShardSet
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
    _quiet_handover_errors()
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


_HANDOVER_ERRORS = (BrokenPipeError, ConnectionResetError, EOFError)


def _quiet_handover_errors() -> None:
    """In a DataLoader worker: a tensor hand-over that the trainer broke off (it was stopped by a
    signal, or died) fails in multiprocessing's resource-sharer thread, which reports it through
    sys.excepthook as a traceback under the trainer's clean stop (seen in
    test_sigterm_under_omniloom_launch_saves_and_exits_0). The receiving side, the trainer, reports
    a hand-over that really failed; here it is one debug line. Other errors reach the old hook."""
    import sys
    import traceback

    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        sharer = any(frame.f_code.co_filename.endswith(os.path.join("multiprocessing", "resource_sharer.py"))
                     for frame, _ in traceback.walk_tb(tb))
        if sharer and issubclass(exc_type, _HANDOVER_ERRORS):
            log.debug("loader worker: the trainer broke off a tensor hand-over (%s)", exc)
            return
        previous(exc_type, exc, tb)

    sys.excepthook = hook


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
