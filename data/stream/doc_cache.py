"""The tokenized-document cache of one loader worker (`data.doc_cache_mb`).

A small corpus that is read for many epochs (the demo reads its 11,260 synthetic documents about
four times) spends most of its loader time reading the same samples from their shards and
decoding and patchifying the same images and videos again. With `data.doc_cache_mb > 0` each
loader worker keeps what tokenizing a sample gave it, keyed by the sample's place in its shard
(source, shard, sample: the same document in every epoch), and a later draw of that sample skips
the shard read and the tokenizer.

The batches are the ones the uncached stream yields, bit for bit:
- tokenizing is deterministic, and the pieces are stored as the batch stores them: patches in the
  numpy dtype `collate_rows` writes them in (float16 for `patch_dtype=float16`, else float32),
  which is the cast the collate would have made;
- an outcome replays its counters: a tokenized document counts as a document and adds its
  tokenizer stats again; a document the tokenizer rejected for its data (an error with a reason:
  undecodable media, a bad layout) or the packer rejected is skipped again under the same reason
  (samples that cannot be read, and unexpected tokenizer errors, are never cached: they are read
  and tried again);
- nothing is ever evicted, so a sample found in the cache when it is drawn is still there when it
  is tokenized. When the budget is full, new documents are simply not added (for a corpus read
  epoch after epoch, keeping the first ones is as good as any policy and better than LRU, which
  would evict every document just before its next use).

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
    """key -> ("ok", pieces, stats) | ("skip", reason, message), within `budget_bytes`."""

    def __init__(self, budget_bytes: int, patch_dtype: str):
        if budget_bytes <= 0:
            raise ValueError(f"a document cache needs a positive budget, got {budget_bytes} bytes")
        self.budget = int(budget_bytes)
        self.dtype = patch_store_dtype(patch_dtype)
        self._entries: dict[tuple, tuple] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.full = False  # some document did not fit in what was left of the budget

    def __contains__(self, key: tuple) -> bool:
        return key in self._entries

    def get(self, key: tuple) -> tuple | None:
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
        else:
            self.hits += 1
        return entry

    def _admit(self, key: tuple, entry: tuple, nbytes: int) -> None:
        if self.bytes + nbytes > self.budget:
            self.full = True
            return
        self._entries[key] = entry
        self.bytes += nbytes

    def store_pieces(self, key: tuple, pieces: list[Piece], stats: dict) -> list[Piece]:
        """Keep `pieces` (their patches cast to the batch's storage dtype, arrays made read-only)
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
        self._admit(key, ("ok", [dataclasses.replace(p, ref=()) for p in stored], dict(stats)), nbytes)
        return stored

    def store_skip(self, key: tuple, reason: str, message: str) -> None:
        self._admit(key, ("skip", reason, message), ENTRY_OVERHEAD + len(message))

    @staticmethod
    def pieces_for(entry: tuple, ref: tuple) -> list[Piece]:
        """The cached pieces of an "ok" entry, named by this draw's reference."""
        return [dataclasses.replace(p, ref=ref, blocks=list(p.blocks)) for p in entry[1]]

    def stats(self) -> list[int]:
        """[hits, misses, bytes, documents, full]: plain ints for the batch's meta."""
        return [self.hits, self.misses, self.bytes, len(self._entries), int(self.full)]
