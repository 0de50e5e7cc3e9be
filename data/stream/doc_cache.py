"""The tokenized-document cache of one loader worker (`data.doc_cache_mb`).

A small corpus that is read for many epochs (the demo reads its 11,260 synthetic documents about
four times) spends most of its loader time reading the same samples from their shards and
decoding and patchifying the same images and videos again. With `data.doc_cache_mb > 0` each
loader worker keeps what tokenizing a sample gave it, keyed by the sample's place in its shard
(source, shard, sample: the same document in every epoch) and by the shard file's identity (its
size and mtime_ns, as the reader sees it), and a later draw of that sample skips the shard read
and the tokenizer.

The batches are the ones the uncached stream yields, bit for bit:
- tokenizing is deterministic, and the pieces are stored as the batch stores them: patches in the
  numpy dtype `collate_rows` writes them in (float16 for `patch_dtype=float16`, else float32),
  which is the cast the collate would have made;
- an outcome replays its counters: a tokenized document counts as a document and adds its
  tokenizer stats again; a document the tokenizer rejected for its data (an error with a reason:
  undecodable media, a bad layout) or the packer rejected is skipped again under the same reason
  (samples that cannot be read, and unexpected tokenizer errors, are never cached: they are read
  and tried again);
- a shard rewritten during a run (another size or mtime when one of its samples is drawn) loses
  every entry it had, and what was read from it before the change is never stored after it: the
  sample is read again, as the uncached stream reads it (its new document, or the skip a
  half-written shard gives). A remote shard (a URL, `pipe:`) has no size or mtime to compare
  without reading it, so its samples are not cached;
- the entry a draw finds is held with the drawn sample (the shuffle buffer), so what a later
  change drops does not change a document already drawn. Otherwise nothing is evicted: when the
  budget is full, new documents are simply not added (for a corpus read epoch after epoch, keeping
  the first ones is as good as any policy and better than LRU, which would evict every document
  just before its next use).

The cache is not part of the loader's state: a resumed run starts with an empty one and yields the
same batches. Its memory is per worker process (`data.num_workers` per rank, or the main process
with 0 workers); the budget counts the arrays' bytes plus a fixed allowance per document.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omniloom.data.batch import patch_store_dtype
from omniloom.data.packing import Piece, PieceBlock

# Python objects around a cached document's arrays (dict entry, tuple, Piece dataclasses): an
# allowance, so that a budget of many tiny documents is not overrun by what the arrays leave out.
ENTRY_OVERHEAD = 512
PIECE_OVERHEAD = 400


class DocCache:
    """(source, shard, sample) -> ("ok", pieces, stats) | ("skip", reason, message), within
    `budget_bytes`, each shard's entries valid for one identity of its file (`lookup`)."""

    def __init__(self, budget_bytes: int, patch_dtype: str):
        if budget_bytes <= 0:
            raise ValueError(f"a document cache needs a positive budget, got {budget_bytes} bytes")
        self.budget = int(budget_bytes)
        self.dtype = patch_store_dtype(patch_dtype)
        # (source, shard) -> {sample: (entry, bytes)}, and the shard file's identity they were read under
        self._shards: dict[tuple, dict[int, tuple[tuple, int]]] = {}
        self._idents: dict[tuple, tuple] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.dropped = 0  # entries dropped because their shard changed
        self.full = False  # some document did not fit in what was left of the budget

    def lookup(self, key: tuple, ident: tuple | None) -> tuple | None:
        """The entry of sample `key` = (source, shard, sample) if it was stored while its shard had
        the identity `ident` it has now (None: a shard with none, never cached). A shard seen with
        another identity than before loses every entry first."""
        if ident is None:
            return None
        shard = key[:2]
        if self._idents.get(shard) != ident:
            gone = self._shards.pop(shard, {})
            self.bytes -= sum(nbytes for _, nbytes in gone.values())
            self.dropped += len(gone)
            self._idents[shard] = ident
            return None
        got = self._shards.get(shard, {}).get(key[2])
        return None if got is None else got[0]

    def count(self, hit: bool) -> None:
        if hit:
            self.hits += 1
        else:
            self.misses += 1

    def _admit(self, key: tuple, ident: tuple | None, entry: tuple, nbytes: int) -> None:
        if ident is None or self._idents.get(key[:2]) != ident:
            return  # read before its shard changed (or never comparable): not kept for a later draw
        if self.bytes + nbytes > self.budget:
            self.full = True
            return
        self._shards.setdefault(key[:2], {})[key[2]] = (entry, nbytes)
        self.bytes += nbytes

    def store_pieces(self, key: tuple, ident: tuple | None, pieces: list[Piece], stats: dict) -> list[Piece]:
        """Keep `pieces` of a sample read while its shard had the identity `ident` (their patches cast to the batch's storage dtype, arrays made read-only)
        and return them as stored, so a cached and an uncached draw hand the packer equal arrays."""
        stored, nbytes = [], ENTRY_OVERHEAD
        for p in pieces:
            blocks = []
            for b in p.blocks:
                patches = np.ascontiguousarray(b.patches_ND, dtype=self.dtype)
                if patches is b.patches_ND:  # no cast was needed: do not freeze the tokenizer's own array
                    patches = patches.copy()
                patches.setflags(write=False)
                blocks.append(PieceBlock(b.start, b.length, b.kind, patches))
                nbytes += patches.nbytes
            for a in (p.ids_L, p.modality_L, p.positions_3L):
                a.setflags(write=False)
                nbytes += a.nbytes
            stored.append(dataclasses.replace(p, blocks=blocks))
            nbytes += PIECE_OVERHEAD
        self._admit(key, ident, ("ok", [dataclasses.replace(p, ref=()) for p in stored], dict(stats)), nbytes)
        return stored

    def store_skip(self, key: tuple, ident: tuple | None, reason: str, message: str) -> None:
        self._admit(key, ident, ("skip", reason, message), ENTRY_OVERHEAD + len(message))

    @staticmethod
    def pieces_for(entry: tuple, ref: tuple) -> list[Piece]:
        """The cached pieces of an "ok" entry, named by this draw's reference."""
        return [dataclasses.replace(p, ref=ref, blocks=list(p.blocks)) for p in entry[1]]

    def stats(self) -> list[int]:
        """[hits, misses, bytes, documents, full]: plain ints for the batch's meta."""
        return [self.hits, self.misses, self.bytes, sum(map(len, self._shards.values())), int(self.full)]
