"""Validation of a saved data-loader state (`StreamLoader.state_dict()`), before anything uses it.

A checkpoint's `data_rankNNNNN.pt` is plain data that anyone can edit. Out-of-range values used
to surface deep inside the stream as an IndexError traceback from a loader worker, and a negative
cursor or an empty worker list were taken as they were. `check_loader_state` refuses them up
front with one line naming the field, as the loader already refuses another data config.

Layout checked (state version 2; a version-1 state is checked for its shape, then upgraded, then
checked whole): {version, rank, fingerprint: {world_size, num_workers, sources: [[label, weight,
num_samples, shard layout?]], schedule?: [[start_step, end_step, [modality, ...]]] per source,
...}, consumed, step?: [training step of the next batch, batches of that step already consumed], workers: [one per worker: None or {rng, cursors: [[epoch, pos]]
per source, pending?: per source [[epoch, [[lo, hi], ...]], ...], shuffle: [[source, epoch, g]],
packer: [[[source, epoch, g], piece]], skipped: {reason: n}, token_stats: {name: n}, docs,
batches, barren?: [source]}]}.
"""

from __future__ import annotations

import copy
import numbers

import numpy as np

from .cursor import slot_range


class LoaderStateError(ValueError):
    """A saved data-loader state that cannot be right (edited or damaged)."""


def _int(value, where: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LoaderStateError(f"{where} is {value!r}, not an integer")
    if value < low:
        raise LoaderStateError(f"{where} is {value}, below {low}")
    if high is not None and value >= high:
        raise LoaderStateError(f"{where} is {value}, past its range (< {high})")
    return int(value)


def _list(value, where: str, length: int | None = None) -> list:
    if not isinstance(value, (list, tuple)):
        raise LoaderStateError(f"{where} is {type(value).__name__}, not a list")
    if length is not None and len(value) != length:
        raise LoaderStateError(f"{where} has {len(value)} entries, not {length}")
    return list(value)


def _counts(value, where: str) -> None:
    if not isinstance(value, dict):
        raise LoaderStateError(f"{where} is {type(value).__name__}, not a mapping")
    for k, n in value.items():
        if isinstance(n, bool) or not isinstance(n, numbers.Real) or not n >= 0:
            raise LoaderStateError(f"{where}[{k!r}] is {n!r}, not a count")


def check_shape(state, who: str = "data-loader state") -> tuple[int, int, int]:
    """The top level of a state of any version: returns (rank, world_size, workers)."""
    if not isinstance(state, dict):
        raise LoaderStateError(f"{who} is {type(state).__name__}, not a mapping")
    for key in ("version", "rank", "fingerprint", "consumed", "workers"):
        if key not in state:
            raise LoaderStateError(f"{who} has no '{key}'")
    fp = state["fingerprint"]
    if not isinstance(fp, dict) or not all(k in fp for k in ("world_size", "num_workers", "sources")):
        raise LoaderStateError(f"{who}: its fingerprint lacks world_size, num_workers or sources")
    world = _int(fp["world_size"], f"{who}: fingerprint.world_size", 1)
    num_workers = _int(fp["num_workers"], f"{who}: fingerprint.num_workers", 0)
    rank = _int(state["rank"], f"{who}: rank", 0, world)
    _int(state["consumed"], f"{who}: consumed", 0)
    workers = _list(state["workers"], f"{who}: workers")
    if not workers:
        raise LoaderStateError(f"{who}: workers is empty (a rank has at least one reader)")
    _list(workers, f"{who}: workers", max(num_workers, 1))
    sources = _list(fp["sources"], f"{who}: fingerprint.sources")
    for s, src in enumerate(sources):
        src = _list(src, f"{who}: fingerprint.sources[{s}]")
        if len(src) not in (3, 4):  # the 4th, the shard layout's digest, is absent in states saved before it
            raise LoaderStateError(f"{who}: fingerprint.sources[{s}] has {len(src)} entries, not 3 or 4")
        _int(src[2], f"{who}: fingerprint.sources[{s}] sample count", 1)
        if len(src) == 4 and not isinstance(src[3], str):
            raise LoaderStateError(f"{who}: fingerprint.sources[{s}] shard layout is {src[3]!r}, not a digest")
    if fp.get("schedule") is not None:  # data/stream/schedule.py: per source [start_step, end_step, modalities]
        for s, entry in enumerate(_list(fp["schedule"], f"{who}: fingerprint.schedule", len(sources))):
            start, end, mods = _list(entry, f"{who}: fingerprint.schedule[{s}]", 3)
            _int(start, f"{who}: fingerprint.schedule[{s}] start_step")
            _int(end, f"{who}: fingerprint.schedule[{s}] end_step")
            for m in _list(mods, f"{who}: fingerprint.schedule[{s}] modalities"):
                if not isinstance(m, str):
                    raise LoaderStateError(f"{who}: fingerprint.schedule[{s}] modalities hold {m!r}, not a name")
    if state.get("step") is not None:  # absent in states saved before source schedules
        step, within = _list(state["step"], f"{who}: step", 2)
        _int(step, f"{who}: step (training step of the next batch)")
        _int(within, f"{who}: step (batches of that step already consumed)")
    for w, ws in enumerate(workers):
        if ws is not None and not isinstance(ws, dict):
            raise LoaderStateError(f"{who}: workers[{w}] is {type(ws).__name__}, not a mapping")
    return rank, world, max(num_workers, 1)


def check_loader_state(state, who: str = "data-loader state") -> None:
    """Refuse (LoaderStateError, one line naming the field) a version-2 loader state whose values
    cannot be right: negative or out-of-range cursors, positions and references, a worker list
    of the wrong length, counters that are not counts, an RNG state numpy does not take."""
    rank, world, workers = check_shape(state, who)
    sizes = [int(src[2]) for src in state["fingerprint"]["sources"]]
    num_slots = world * workers
    for w, ws in enumerate(state["workers"]):
        if ws is None:
            continue
        at = f"{who}: workers[{w}]"
        for key in ("rng", "cursors", "shuffle", "packer", "skipped", "docs", "batches"):
            if key not in ws:
                raise LoaderStateError(f"{at} has no '{key}'")
        slot = rank * workers + w
        cursors = _list(ws["cursors"], f"{at}.cursors", len(sizes))
        pending = ws.get("pending") or [[] for _ in sizes]
        pending = _list(pending, f"{at}.pending", len(sizes))
        for i, n in enumerate(sizes):
            lo, hi = slot_range(n, slot, num_slots)
            explicit = {}
            for j, entry in enumerate(_list(pending[i], f"{at}.pending[{i}]")):
                entry = _list(entry, f"{at}.pending[{i}][{j}]", 2)
                epoch = _int(entry[0], f"{at}.pending[{i}][{j}] epoch")
                total = 0
                for k, iv in enumerate(_list(entry[1], f"{at}.pending[{i}][{j}] intervals")):
                    a, b = _list(iv, f"{at}.pending[{i}][{j}] interval {k}", 2)
                    a = _int(a, f"{at}.pending[{i}][{j}] interval {k} start", 0, n)
                    b = _int(b, f"{at}.pending[{i}][{j}] interval {k} end", a, n + 1)
                    total += b - a
                explicit[epoch] = total
            epoch, pos = _list(cursors[i], f"{at}.cursors[{i}]", 2)
            epoch = _int(epoch, f"{at}.cursors[{i}] epoch")
            length = explicit.get(epoch, hi - lo)
            _int(pos, f"{at}.cursors[{i}] position (epoch {epoch} has {length} samples for this reader)", 0, length + 1)
        for k, ref in enumerate(_list(ws["shuffle"], f"{at}.shuffle")):
            _ref(ref, f"{at}.shuffle[{k}]", sizes)
        for k, item in enumerate(_list(ws["packer"], f"{at}.packer")):
            ref, idx = _list(item, f"{at}.packer[{k}]", 2)
            _ref(ref, f"{at}.packer[{k}]", sizes)
            _int(idx, f"{at}.packer[{k}] piece", 0)
        _counts(ws["skipped"], f"{at}.skipped")
        _counts(ws.get("token_stats", {}), f"{at}.token_stats")
        for k, src in enumerate(_list(ws.get("barren", []), f"{at}.barren")):
            _int(src, f"{at}.barren[{k}] source", 0, len(sizes))
        _int(ws["docs"], f"{at}.docs")
        _int(ws["batches"], f"{at}.batches")
        try:
            np.random.Generator(np.random.PCG64()).bit_generator.state = copy.deepcopy(ws["rng"])
        except (ValueError, TypeError, KeyError, OverflowError) as err:
            raise LoaderStateError(f"{at}.rng is not a random generator state ({err})") from None


def _ref(ref, where: str, sizes: list[int]) -> None:
    src, epoch, g = _list(ref, where, 3)
    src = _int(src, f"{where} source", 0, len(sizes))
    _int(epoch, f"{where} epoch")
    _int(g, f"{where} sample index", 0, sizes[src])
