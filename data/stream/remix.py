"""Resuming the data stream on another mix of sources (`checkpoint.resume_data=keep_unchanged`).

Legend: i a source's index in the saved mix, j its index in the new one, e an epoch, g a global
index into an epoch's sample order, n a source's sample count.

A saved loader state describes each source by its index i: the slots' cursors, their explicit
sequences (`pending`), and the buffered references (i, e, g). A source is *kept* when the new mix
holds one of the same label (its name, else its path), sample count and shard layout (the names
and sample counts of its shards, as a digest; a state saved before the digest matches on label
and count); sources that are new, or whose samples or shards changed, start at their beginning;
sources no longer in the mix are dropped, with their buffered documents (counted as skipped
`source_removed`). Weights may change freely: they only steer the draws from now on.

A kept source whose index moved (i != j) needs more than a renumbering: each epoch's sample order
is a shuffle of the source's shards seeded by (seed, index, epoch) (data/stream/cursor.py), so
the same g names another sample under j. Every position a slot has not read yet, and every
buffered reference, is therefore translated through the sample it names: g under i -> (shard,
sample in shard) -> g' under j. Within a shard samples stay in order, so a slot's unread rest of
an epoch becomes at most one interval per shard, given explicitly as the slot's `pending`
sequence for that epoch; epochs no slot had begun use the new order as they are. So a kept source
loses and repeats nothing, exactly as a plain resume; only the order of its unread rest changes.
"""

from __future__ import annotations

import copy

import numpy as np

from .cursor import Intervals, slot_range
from .elastic import drop_first


def source_key(entry) -> tuple[str, int]:
    """(label, sample count) of a fingerprint's sources entry [label, weight, n, layout?]."""
    return str(entry[0]), int(entry[2])


def shard_layout(entry) -> str | None:
    """The digest of a source's shard names and sample counts (loader.shard_layout), None in a
    state saved before it."""
    return str(entry[3]) if len(entry) > 3 else None


def same_source(old_entry, new_entry) -> bool:
    """Same label and sample count, and the same shards where both say which."""
    a, b = shard_layout(old_entry), shard_layout(new_entry)
    return source_key(old_entry) == source_key(new_entry) and (a is None or b is None or a == b)


def plan(old_sources: list, new_sources: list) -> dict[int, int]:
    """{old index: new index} of the sources kept (same_source; the first match)."""
    free = list(range(len(new_sources)))
    out = {}
    for i, entry in enumerate(old_sources):
        j = next((j for j in free if same_source(entry, new_sources[j])), None)
        if j is not None:
            out[i] = j
            free.remove(j)
    return out


def comparable(old_sources: list, new_sources: list) -> tuple[list, list]:
    """Both lists as a saved state can be compared with this run's: without the shard layouts when
    the saved one has none (a state saved before them)."""
    if any(len(e) < 4 for e in old_sources):
        return [list(e)[:3] for e in old_sources], [list(e)[:3] for e in new_sources]
    return [list(e) for e in old_sources], [list(e) for e in new_sources]


def describe(old_sources: list, new_sources: list, kept: dict[int, int]) -> str:
    """One log line: what continues, what starts, what was dropped."""
    same = [str(new_sources[j][0]) for j in sorted(kept.values())]
    fresh = [str(e[0]) for j, e in enumerate(new_sources) if j not in kept.values()]
    gone = [str(e[0]) for i, e in enumerate(old_sources) if i not in kept]
    parts = [f"continuing where they were: {', '.join(same) or 'none'}",
             f"starting at their beginning (new or changed): {', '.join(fresh) or 'none'}"]
    if gone:
        parts.append(f"dropped with their buffered documents: {', '.join(gone)}")
    weights = ", ".join(f"{e[0]} {float(e[1]):g}" for e in new_sources)
    return "; ".join(parts) + f"; weights now {weights}"


class _Orders:
    """Each epoch's shard order of one source under one index, as in cursor.SourceCursor._plan."""

    def __init__(self, counts: np.ndarray, seed: int, src_idx: int):
        self.counts, self.seed, self.src_idx = counts, seed, src_idx
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def starts(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(order, start): order[k] the k-th shard; start[shard] its first g in this epoch."""
        if epoch not in self._cache:
            rng = np.random.default_rng([self.seed, self.src_idx, epoch, 0x0A11])
            order = rng.permutation(len(self.counts))
            start = np.empty(len(self.counts), np.int64)
            start[order] = np.concatenate([[0], np.cumsum(self.counts[order])[:-1]])
            self._cache[epoch] = (order, start)
        return self._cache[epoch]


def _translate(ivs: Intervals, epoch: int, old: _Orders, new: _Orders) -> Intervals:
    """Old-order intervals of `epoch` as new-order ones (one piece per shard they cross)."""
    order, start = old.starts(epoch)
    _, new_start = new.starts(epoch)
    ends = np.cumsum(old.counts[order])
    out: Intervals = []
    for lo, hi in ivs:
        k = int(np.searchsorted(ends, lo, side="right"))
        while lo < hi:
            shard = int(order[k])
            first = int(start[shard])
            take = min(hi, first + int(old.counts[shard]))
            out.append((int(new_start[shard]) + lo - first, int(new_start[shard]) + take - first))
            lo, k = take, k + 1
    return out


def _filter(schedule: list | None, i: int) -> list[str]:
    """Source i's modality filter in a fingerprint's schedule ([] for none)."""
    return sorted(schedule[i][2]) if schedule else []


def _translate_ref(ref, old: _Orders, new: _Orders, j: int) -> list:
    _, epoch, g = (int(x) for x in ref)
    ((lo, _),) = _translate([(g, g + 1)], epoch, old, new)
    return [j, epoch, lo]


def remap_states(states: list[dict], new_sources: list, shard_counts: list[list[int]], seed: int,
                 schedule: list | None = None) -> list[dict]:
    """Every saved rank's state rewritten for the new mix (fingerprint sources and `schedule`, the
    new per-source schedule or None, replaced): kept sources continue, others start fresh.
    `shard_counts[j]`: the samples of each shard of new source j (the kept sources' shards are the
    saved ones: same label, sample count and, where the state says, shard layout)."""
    old_sources = states[0]["fingerprint"]["sources"]
    kept = plan(old_sources, new_sources)
    fp = states[0]["fingerprint"]
    old_schedule = fp.get("schedule")
    workers = max(int(fp["num_workers"]), 1)
    num_slots = int(fp["world_size"]) * workers
    orders = {i: (_Orders(np.asarray(shard_counts[j], np.int64), seed, i), _Orders(np.asarray(shard_counts[j], np.int64), seed, j))
              for i, j in kept.items()}
    # the highest epoch any slot had begun (or had an explicit sequence for), per kept source: up
    # to there every slot's sequence is given explicitly, so that the slots still partition each
    # epoch (a slot's standard range under the new order would overlap the others' translated ones)
    last = {i: 0 for i in kept}
    for state in states:
        for ws in state["workers"]:
            if ws is None:
                continue
            for i in kept:
                pend = (ws.get("pending") or [[] for _ in old_sources])[i]
                last[i] = max(last[i], int(ws["cursors"][i][0]), *(int(e) for e, _ in pend))
    out = []
    for state in states:
        state = copy.deepcopy(state)
        state["fingerprint"]["sources"] = [list(e) for e in new_sources]
        state["fingerprint"].pop("schedule", None)
        if schedule is not None:
            state["fingerprint"]["schedule"] = copy.deepcopy(schedule)
        for w, ws in enumerate(state["workers"]):
            slot = int(state["rank"]) * workers + w
            if ws is None:
                if all(i == j for i, j in kept.items()):
                    continue  # starts as a fresh slot, in the same orders as before
                # a slot that had not produced a batch yet: written out as the fresh state it would
                # start from (WorkerStream.__init__), so that its sequences are translated too
                rng = np.random.Generator(np.random.PCG64([seed, slot, 0x5EED]))
                ws = state["workers"][w] = {"rng": rng.bit_generator.state, "cursors": [[0, 0]] * len(old_sources),
                                            "shuffle": [], "packer": [], "skipped": {}, "token_stats": {},
                                            "docs": 0, "batches": 0}
            pending_old = ws.get("pending") or [[] for _ in old_sources]
            cursors = [[0, 0] for _ in new_sources]
            pending: list = [[] for _ in new_sources]
            for i, j in kept.items():
                epoch, pos = (int(x) for x in ws["cursors"][i])
                explicit = {int(e): [(int(a), int(b)) for a, b in ivs] for e, ivs in pending_old[i]}
                if i == j:
                    cursors[j], pending[j] = [epoch, pos], pending_old[i]
                    continue
                n = int(old_sources[i][2])
                old, new = orders[i]
                seqs = {}
                for e in range(epoch, max(last[i], *explicit, epoch) + 1):
                    seq = explicit.get(e, [slot_range(n, slot, num_slots)])
                    seqs[e] = _translate(drop_first(seq, pos) if e == epoch else seq, e, old, new)
                cursors[j] = [epoch, 0]
                pending[j] = [[e, [list(iv) for iv in ivs]] for e, ivs in sorted(seqs.items())]
            ws["cursors"], ws["pending"] = cursors, pending
            if ws.get("barren"):  # filtered sources found empty (data/stream/schedule.py), by index: still
                # empty only under the same modality filter; under another one they are looked at again
                ws["barren"] = sorted(kept[int(i)] for i in ws["barren"]
                                      if int(i) in kept and _filter(old_schedule, int(i)) == _filter(schedule, kept[int(i)]))
            # the buffered documents of a source no longer in the mix are dropped, and counted
            removed = sum(int(ref[0]) not in kept for ref in ws["shuffle"])
            removed += len({tuple(ref) for ref, _ in ws["packer"] if int(ref[0]) not in kept})
            if removed:
                skipped = dict(ws.get("skipped", {}))
                skipped["source_removed"] = skipped.get("source_removed", 0) + removed
                ws["skipped"] = skipped
            ws["shuffle"] = [_translate_ref(ref, *orders[int(ref[0])], kept[int(ref[0])]) for ref in ws["shuffle"]
                             if int(ref[0]) in kept]
            ws["packer"] = [[_translate_ref(ref, *orders[int(ref[0])], kept[int(ref[0])]), int(idx)]
                            for ref, idx in ws["packer"] if int(ref[0]) in kept]
        out.append(state)
    return out
