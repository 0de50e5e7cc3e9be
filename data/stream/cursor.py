"""Where one reader slot is in one source: the per-epoch sample order and the slot's share of it.

Legend: n samples in the source, N reader slots (world_size x workers), g a global index into an
epoch's sample order (0 <= g < n), pos a position in one slot's sequence of that epoch.

Each epoch of a source has a global sample order: the shards shuffled from (seed, source, epoch),
their samples concatenated. A slot's *sequence* of an epoch is, by default, its standard range
`slot_range(n, slot, N)` of that order. After a resume on another layout (data/stream/elastic.py), the
epochs the old layout had begun are given explicitly instead, as lists of global intervals
(`pending`): the unread rest of those epochs, split among the new slots. A reference to a sample,
(source, epoch, g), names it independently of any slot, so it can move between slots.
"""

from __future__ import annotations

import numpy as np

from .reader import SampleReader, ShardSet

Intervals = list[tuple[int, int]]


def slot_range(n: int, slot: int, num_slots: int) -> tuple[int, int]:
    """[lo, hi) of slot `slot` of `num_slots` in an epoch of n samples (sizes differ by at most 1)."""
    return (n * slot) // num_slots, (n * (slot + 1)) // num_slots


class SourceCursor:
    """(epoch, pos) of one slot in one source, over the slot's sequence of each epoch."""

    def __init__(self, shard_set: ShardSet, src_idx: int, seed: int, slot: int, num_slots: int):
        self.set, self.src_idx, self.seed = shard_set, src_idx, seed
        n = shard_set.num_samples
        if n < num_slots:
            raise ValueError(f"source '{shard_set.label}' has {n} samples, fewer than the {num_slots} reader slots "
                             "(world_size x num_workers); use fewer workers or add data")
        self.lo_frac, self.hi_frac = slot_range(n, slot, num_slots)
        self.range_len = self.hi_frac - self.lo_frac
        self.counts = np.array([s.num_samples for s in shard_set.shards], dtype=np.int64)
        self.epoch, self.pos = 0, 0
        self.pending: dict[int, Intervals] = {}  # epoch -> this slot's explicit sequence (elastic resume)
        self.reader = SampleReader(shard_set.shards)
        self._plans: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if epoch not in self._plans:
            if len(self._plans) > 2:  # a cache: buffered refs are mostly of this or the previous epoch
                self._plans.pop(min(self._plans))
            rng = np.random.default_rng([self.seed, self.src_idx, epoch, 0x0A11])
            order = rng.permutation(len(self.counts))
            self._plans[epoch] = (order, np.cumsum(self.counts[order]))
        return self._plans[epoch]

    def seq_len(self, epoch: int) -> int:
        ivs = self.pending.get(epoch)
        return self.range_len if ivs is None else sum(hi - lo for lo, hi in ivs)

    def global_index(self, epoch: int, pos: int) -> int:
        """g of position `pos` of this slot's sequence of `epoch`."""
        ivs = self.pending.get(epoch)
        if ivs is None:
            return self.lo_frac + pos
        for lo, hi in ivs:
            if pos < hi - lo:
                return lo + pos
            pos -= hi - lo
        raise IndexError(f"position past the end of the sequence of epoch {epoch}")

    def locate_global(self, epoch: int, g: int) -> tuple[int, int]:
        """(shard index, sample index) of global position g of `epoch`."""
        order, cum = self._plan(epoch)
        k = int(np.searchsorted(cum, g, side="right"))
        return int(order[k]), int(g - (cum[k - 1] if k else 0))

    def locate(self, epoch: int, pos: int) -> tuple[int, int]:
        """(shard index, sample index) of position `pos` of this slot's standard range in `epoch`."""
        return self.locate_global(epoch, self.lo_frac + pos)

    def settle(self) -> None:
        """Move past finished (or empty) sequences to the next epoch that has something to read."""
        while self.pos >= self.seq_len(self.epoch):
            self.pending.pop(self.epoch, None)
            self.epoch, self.pos = self.epoch + 1, 0

    def next_ref(self) -> tuple[int, int, int]:
        ref = (self.src_idx, self.epoch, self.global_index(self.epoch, self.pos))
        self.pos += 1
        self.settle()
        return ref

    def attempts_left_bound(self) -> int:
        """More draws than this without one readable sample means a whole epoch is unreadable."""
        return self.range_len + sum(self.seq_len(e) for e in self.pending) + 1

    def read(self, epoch: int, g: int) -> tuple[dict, dict]:
        return self.reader.read_document(*self.locate_global(epoch, g))

    # -- state ---------------------------------------------------------------------------------
    def pending_state(self) -> list:
        return [[e, [[lo, hi] for lo, hi in ivs]] for e, ivs in sorted(self.pending.items())]

    def load(self, epoch: int, pos: int, pending: list | None) -> None:
        self.epoch, self.pos = int(epoch), int(pos)
        self.pending = {int(e): [(int(lo), int(hi)) for lo, hi in ivs] for e, ivs in (pending or [])}
        self.settle()
