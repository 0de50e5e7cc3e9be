"""Splitting tokenized documents into row-sized pieces, and best-fit packing of pieces into rows.

Legend: L tokens of one document or piece, N patch positions of one visual block, D patch dim,
S seq_len.

Rules (docs/data-format.md section 5): a document is split only when it alone exceeds a row, and then only
at a cut between two tokens that are not inside a visual block (a block with its open and close
tags stays whole); a block that cannot fit a row makes its document unusable (skipped, counted).
Each piece restarts its positions at 0, so a continuation never carries positions past what the
model sees for a row.

Packing is best-fit over a buffer of pieces (at least `capacity` pieces and two rows' worth of
tokens): a row starts with the oldest piece (so no piece waits long), then repeatedly takes the
largest buffered piece that still fits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from omniloom.tokenizers.layout import IMAGE, VIDEO, TokenizedDoc


class PackingError(Exception):
    """A document that cannot be packed; `reason` is the counter it is skipped under."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass
class PieceBlock:
    """A visual block inside a piece: `start` indexes the piece's first <|patch|> of the block."""

    start: int
    length: int
    kind: int
    patches_ND: np.ndarray


@dataclass
class Piece:
    """A row-sized slice of one tokenized document. `ref` names the document's sample so the
    piece can be re-read on restore; `index` is the piece's number within its document."""

    ref: tuple
    index: int
    ids_L: np.ndarray
    modality_L: np.ndarray
    positions_3L: np.ndarray
    blocks: list[PieceBlock] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.ids_L.shape[0])


def _check_doc(doc: TokenizedDoc) -> None:
    L = len(doc)
    if L == 0:
        raise PackingError("empty_document", f"{doc.key}: tokenized to zero tokens")
    if doc.modality_L.shape != (L,) or doc.positions_3L.shape != (3, L):
        raise PackingError("invalid_tokens", f"{doc.key}: ids/modality/positions lengths disagree")
    visual_L = (doc.modality_L == IMAGE) | (doc.modality_L == VIDEO)
    covered = 0
    for b in doc.blocks:
        if b.start < 1 or b.start + b.length > L or b.patches_ND.shape[0] != b.length:
            raise PackingError("invalid_tokens", f"{doc.key}: visual block at {b.start} is out of range "
                               "or its patch count differs from its length")
        if not visual_L[b.start:b.start + b.length].all():
            raise PackingError("invalid_tokens", f"{doc.key}: block at {b.start} covers non-visual tokens")
        covered += b.length
    if covered != int(visual_L.sum()):
        raise PackingError("invalid_tokens", f"{doc.key}: {int(visual_L.sum())} visual tokens but blocks "
                           f"cover {covered}")


def split_document(doc: TokenizedDoc, seq_len: int, ref: tuple = ()) -> list[Piece]:
    """Cut a tokenized document into pieces of at most `seq_len` tokens (one piece if it fits).

    Raises PackingError("visual_block_too_long") when a block with its tags exceeds a row, and
    PackingError("invalid_tokens") when the document breaks the layout contract.
    """
    _check_doc(doc)
    L = len(doc)
    blocks = sorted(doc.blocks, key=lambda b: b.start)
    # forbidden_L[i]: a cut just before token i would separate tokens of one block (tags included).
    forbidden_L = np.zeros(L + 1, dtype=bool)
    for b in blocks:
        if b.length + 2 > seq_len:
            raise PackingError("visual_block_too_long",
                               f"{doc.key}: a block of {b.length} patches (+2 tags) exceeds seq_len={seq_len}")
        forbidden_L[b.start:b.start + b.length + 1] = True
    cuts = [0]
    while L - cuts[-1] > seq_len:
        cut = cuts[-1] + seq_len
        while cut > cuts[-1] and forbidden_L[cut]:
            cut -= 1
        # A block is at most seq_len - 2 long, so some cut after the previous one always exists.
        assert cut > cuts[-1], "no legal cut found although every block fits a row"
        cuts.append(cut)
    cuts.append(L)
    pieces = []
    for index, (lo, hi) in enumerate(zip(cuts[:-1], cuts[1:])):
        positions_3L = doc.positions_3L[:, lo:hi].astype(np.int32, copy=True)
        if lo:
            positions_3L -= positions_3L[0, 0]  # cut at a non-visual token: its t == h == w
        pieces.append(Piece(
            ref=ref, index=index,
            ids_L=np.ascontiguousarray(doc.ids_L[lo:hi], dtype=np.int64),
            modality_L=np.ascontiguousarray(doc.modality_L[lo:hi], dtype=np.uint8),
            positions_3L=positions_3L,
            blocks=[PieceBlock(b.start - lo, b.length, int(b.kind), b.patches_ND)
                    for b in blocks if lo <= b.start < hi],
        ))
    return pieces


class BestFitPacker:
    """Buffer of pieces and the rule that turns it into rows (see module docstring).

    The buffer holds at least `capacity` pieces and at least `MIN_ROWS_BUFFERED` rows' worth of
    tokens: sized in pieces alone, short documents and long rows shipped rows half empty (45% padding
    at seq 4096 on the demo shards). Best-fit lookups go through a length-sorted index (bisect), so
    a large buffer of short pieces stays cheap; ties go to the oldest piece.

    The packer holds Pieces in arrival order; `state_refs()` lists (ref, piece index) for each, in
    that order, which is all exact resume needs to rebuild it (the index is rebuilt from it).
    """

    MIN_ROWS_BUFFERED = 2

    def __init__(self, seq_len: int, capacity: int):
        self.seq_len, self.capacity = seq_len, capacity
        self.pieces: list[Piece] = []
        self._tokens = 0
        self._seq = 0  # arrival counter: the tie-breaker of the sorted index
        self._by_len: list[tuple[int, int]] = []  # (length, arrival) sorted
        self._by_seq: dict[int, Piece] = {}
        self._seq_of: dict[int, int] = {}  # id(piece) -> arrival

    def __len__(self) -> int:
        return len(self.pieces)

    def needs_more(self) -> bool:
        return len(self.pieces) < self.capacity or self._tokens < self.MIN_ROWS_BUFFERED * self.seq_len

    def add(self, piece: Piece) -> None:
        assert len(piece) <= self.seq_len
        self.pieces.append(piece)
        self._tokens += len(piece)
        key = (len(piece), self._seq)
        bisect.insort(self._by_len, key)
        self._by_seq[self._seq] = piece
        self._seq_of[id(piece)] = self._seq
        self._seq += 1

    def _remove(self, seq: int) -> Piece:
        piece = self._by_seq.pop(seq)
        del self._seq_of[id(piece)]
        self._by_len.pop(bisect.bisect_left(self._by_len, (len(piece), seq)))
        for i, p in enumerate(self.pieces):  # identity, not equality: pieces hold arrays
            if p is piece:
                del self.pieces[i]
                break
        self._tokens -= len(piece)
        return piece

    def pop_row(self) -> list[Piece]:
        """Remove and return the pieces of the next row (at least one; total length <= seq_len):
        the oldest piece, then repeatedly the longest piece that still fits (the oldest of equals)."""
        assert self.pieces, "pop_row on an empty packer"
        row = [self._remove(self._seq_of[id(self.pieces[0])])]
        remaining = self.seq_len - len(row[0])
        while remaining > 0 and self._by_len:
            j = bisect.bisect_right(self._by_len, (remaining, float("inf"))) - 1
            if j < 0:
                break
            best_len = self._by_len[j][0]
            first = bisect.bisect_left(self._by_len, (best_len, -1))  # the oldest piece of that length
            row.append(self._remove(self._by_len[first][1]))
            remaining -= best_len
        return row

    def state_refs(self) -> list[tuple]:
        return [(p.ref, p.index) for p in self.pieces]

    def discard(self, drop) -> list[Piece]:
        """Remove (and return) every piece for which `drop(piece)` is true."""
        gone = [p for p in self.pieces if drop(p)]
        for piece in gone:
            self._remove(self._seq_of[id(piece)])
        return gone


def padding_best_fit(lengths: list[int], seq_len: int, capacity: int) -> tuple[int, int]:
    """(rows, padding tokens) of best-fit packing `lengths` (each <= seq_len) in arrival order."""
    packer = BestFitPacker(seq_len, capacity)
    rows = pad = 0
    it = iter(lengths)
    exhausted = False
    while True:
        while not exhausted and packer.needs_more():
            n = next(it, None)
            if n is None:
                exhausted = True
            else:
                packer.add(Piece((), 0, np.zeros(n, np.int64), np.zeros(n, np.uint8), np.zeros((3, n), np.int32)))
        if not packer.pieces:
            return rows, pad
        rows += 1
        pad += seq_len - sum(len(p) for p in packer.pop_row())


def padding_sequential(lengths: list[int], seq_len: int) -> tuple[int, int]:
    """(rows, padding tokens) of naive packing: append pieces in order, start a new row when the
    next one does not fit."""
    rows = pad = used = 0
    for n in lengths:
        if used and used + n > seq_len:
            rows, pad, used = rows + 1, pad + seq_len - used, 0
        used += n
    if used:
        rows, pad = rows + 1, pad + seq_len - used
    return rows, pad
