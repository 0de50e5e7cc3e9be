"""Resuming the data stream on another layout (world_size x num_workers): pool and redistribute.

Legend: N old reader slots, M new ones (a slot is one (rank, worker) pair, slot = rank * W + worker).

The saved state of every old slot says, per source, how far it read (cursor: epoch, pos) and which
samples it drew but did not yet train on (shuffle buffer, packer pieces), all by reference. Nothing
else is needed to know, for every epoch a slot had begun, which samples are still unread: those
past its cursor in its sequence of that epoch. Redistribution, per source:

- for each epoch from the lowest cursor epoch to the highest epoch any old slot had begun (or had
  an explicit sequence for), the unread samples of every old slot are pooled (as sorted global
  intervals) and cut into M contiguous chunks whose sizes differ by at most one; new slot t reads
  chunk t as its sequence of that epoch (`pending`);
- later epochs were untouched by everyone: they use the new layout's standard ranges;
- buffered documents keep their references (source, epoch, global index): shuffle-buffer samples are
  dealt round-robin to the new slots, packer pieces likewise, one document's pieces together.

So every sample of every epoch is read by exactly one slot, and every document drawn but not yet
trained on sits in exactly one buffer: none lost, none repeated. Only the order changes. Counters
(skips, tokenizer stats) move with their slot (old slot s to new slot s mod M) so run totals
survive; each new slot gets a fresh RNG seeded from (seed, slot, batches consumed so far).
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np

from .cursor import Intervals, slot_range


def merge(intervals: Intervals) -> Intervals:
    """Sorted, disjoint, adjacent ones joined; empty ones dropped."""
    out: Intervals = []
    for lo, hi in sorted(iv for iv in intervals if iv[1] > iv[0]):
        if out and lo <= out[-1][1]:
            assert lo == out[-1][1], f"overlapping reads {out[-1]} and {(lo, hi)}: the saved states disagree"
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def drop_first(intervals: Intervals, k: int) -> Intervals:
    """The intervals without their first k positions (in sequence order)."""
    out: Intervals = []
    for lo, hi in intervals:
        take = min(k, hi - lo)
        k -= take
        if lo + take < hi:
            out.append((lo + take, hi))
    return out


def split(intervals: Intervals, parts: int) -> list[Intervals]:
    """Cut the concatenation of `intervals` into `parts` contiguous chunks, sizes within one."""
    total = sum(hi - lo for lo, hi in intervals)
    out: list[Intervals] = []
    for t in range(parts):
        a, b = slot_range(total, t, parts)
        chunk, offset = [], 0
        for lo, hi in intervals:
            x, y = max(a, offset), min(b, offset + hi - lo)
            if x < y:
                chunk.append((lo + x - offset, lo + y - offset))
            offset += hi - lo
        out.append(chunk)
    return out


def _blank(num_sources: int) -> dict:
    """The state of a slot that has not produced a consumed batch yet."""
    return {"cursors": [[0, 0]] * num_sources, "shuffle": [], "packer": [], "skipped": {}, "token_stats": {},
            "docs": 0, "batches": 0}


def old_slots(rank_states: list[dict]) -> list[dict]:
    """The worker states of every old slot, in slot order (a worker with no state yet: blank)."""
    fp = rank_states[0]["fingerprint"]
    workers = max(int(fp["num_workers"]), 1)
    num_sources = len(fp["sources"])
    slots: list[dict] = [_blank(num_sources)] * (int(fp["world_size"]) * workers)
    for st in rank_states:
        for w, ws in enumerate(st["workers"]):
            if ws is not None:
                slots[int(st["rank"]) * workers + w] = ws
    return slots


def redistribute(rank_states: list[dict], *, num_samples: list[int], seed: int, world_size: int,
                 num_workers: int) -> list[list[dict]]:
    """Worker states for every (new rank, new worker), from the states of every old rank.

    The result is a pure function of its inputs: every new rank computes the same whole and keeps
    its own row."""
    slots = old_slots(rank_states)
    N, M = len(slots), world_size * max(num_workers, 1)
    consumed = sum(int(st["consumed"]) for st in rank_states)
    new = []
    for t in range(M):
        rng = np.random.Generator(np.random.PCG64([seed, t, 0x5EED, 0xE1A5, consumed]))
        new.append({"rng": rng.bit_generator.state, "cursors": [], "pending": [], "shuffle": [], "packer": [],
                    "skipped": Counter(), "token_stats": Counter(), "docs": 0, "batches": 0})
    for i, n in enumerate(num_samples):
        cursors = []
        for ws in slots:
            epoch, pos = ws["cursors"][i]
            pend = (ws.get("pending") or [[]] * len(num_samples))[i]
            cursors.append((int(epoch), int(pos), {int(e): [(int(a), int(b)) for a, b in ivs] for e, ivs in pend}))
        first = min(c[0] for c in cursors)
        last = max(max(c[0] for c in cursors), max((e for c in cursors for e in c[2]), default=first))
        chunks: dict[int, list[Intervals]] = {}
        for e in range(first, last + 1):
            unread: Intervals = []
            for s, (epoch, pos, pend) in enumerate(cursors):
                if e < epoch:
                    continue  # this slot finished its share of epoch e
                seq = pend[e] if e in pend else [slot_range(n, s, N)]
                unread += drop_first(seq, pos) if e == epoch else seq
            chunks[e] = split(merge(unread), M)
        for t in range(M):
            epoch = first
            while epoch <= last and not chunks[epoch][t]:
                epoch += 1
            new[t]["cursors"].append([epoch, 0])
            new[t]["pending"].append([[e, [list(iv) for iv in chunks[e][t]]] for e in range(epoch, last + 1)])
    shuffle = [ref for ws in slots for ref in ws["shuffle"]]
    for k, ref in enumerate(shuffle):
        new[k % M]["shuffle"].append(list(ref))
    docs: dict[tuple, list] = {}
    for ws in slots:
        for ref, idx in ws["packer"]:
            docs.setdefault(tuple(ref), []).append([list(ref), int(idx)])
    for j, pieces in enumerate(docs.values()):
        new[j % M]["packer"] += pieces
    for s, ws in enumerate(slots):
        new[s % M]["skipped"].update(ws.get("skipped", {}))
        new[s % M]["token_stats"].update(ws.get("token_stats", {}))
    workers = max(num_workers, 1)
    for st in new:
        st["skipped"], st["token_stats"] = dict(st["skipped"]), dict(st["token_stats"])
    return [new[r * workers:(r + 1) * workers] for r in range(world_size)]


def upgrade_state(state: dict, num_samples: list[int], version: int) -> dict:
    """Check a loader state's version; rewrite a version-1 state, whose buffered references were
    relative to the slot's range, with global references (source, epoch, global index)."""
    found = state.get("version")
    if found == version:
        return state
    if found != 1:
        raise ValueError(f"data-loader state version {found} is not {version}")
    state = copy.deepcopy(state)
    fp = state["fingerprint"]
    workers = max(int(fp["num_workers"]), 1)
    num_slots = int(fp["world_size"]) * workers
    for w, ws in enumerate(state["workers"]):
        if ws is None:
            continue
        slot = int(state["rank"]) * workers + w

        def glob(ref, slot=slot):
            return [ref[0], ref[1], slot_range(num_samples[ref[0]], slot, num_slots)[0] + ref[2]]

        ws["shuffle"] = [glob(ref) for ref in ws["shuffle"]]
        ws["packer"] = [[glob(ref), idx] for ref, idx in ws["packer"]]
    state["version"] = version
    return state
