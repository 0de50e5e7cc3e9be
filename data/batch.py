"""PackedBatch (docs/data-format.md section 5): the one contract between the data stream and the model.

Legend: B rows, S seq_len, P patch positions in the batch, D patch dim (common, see below).

Representation choices the model relies on:
- `patches` is one [P, D] tensor for images and videos together. D = max(3*p*p, 3*tp*p*p): image
  patch vectors (true dim 3*p*p) are zero-padded on the right to D; `patch_kind` (2 image, 3 video)
  says which embedding to use and implies the true dim, so the model slices `patches[:, :dim]`.
  Storage dtype is DataConfig.patch_dtype (float16 by default); the model casts.
- Rows of `patches` follow the `<|patch|>` positions of the batch in row-major order:
  `patches[i]` belongs to the i-th True of `modality in (IMAGE, VIDEO)` over input_ids.flatten().
- `doc_ids` counts documents from 0 within each row; padding at the end of a row is one more
  pseudo-document (id = number of real documents), so doc_ids are non-decreasing along a row, no
  query row of an attention mask is empty, and padding never attends to real tokens.
- `block_ids` numbers visual blocks from 0 within each row and marks only the <|patch|> tokens of a
  block; the open/close tags are ordinary causal tokens (-1), as is all text.
- `labels[i]` is `input_ids[i+1]` of the same document, -100 where token i or i+1 is a <|patch|>,
  at the last token of each document piece, and at padding.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from omniloom.data.packing import Piece
from omniloom.tokenizers.layout import IMAGE, SPECIAL, VIDEO

IGNORE_INDEX = -100
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class PackedBatch:
    """Fixed-length packed rows; see the module docstring for the meaning of every field."""

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64, -100 where no loss
    positions: torch.Tensor  # [B, 3, S] int32 (t, h, w)
    doc_ids: torch.Tensor  # [B, S] int32
    block_ids: torch.Tensor  # [B, S] int32, -1 outside visual blocks
    modality: torch.Tensor  # [B, S] uint8
    patches: torch.Tensor  # [P, D] float16/bfloat16/float32
    patch_kind: torch.Tensor  # [P] uint8 (2 image, 3 video)

    def _map(self, fn) -> "PackedBatch":
        return PackedBatch(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    def to(self, device, non_blocking: bool = False) -> "PackedBatch":
        """A copy on `device` (non_blocking pays off when the batch is pinned)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> "PackedBatch":
        """Page-locked copy; torch DataLoader(pin_memory=True) calls this on each batch."""
        return self._map(lambda t: t.pin_memory())

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def digest(self) -> str:
        """sha256 over every field (dtype, shape, bytes): equal digests mean identical batches."""
        import hashlib

        h = hashlib.sha256()
        for f in fields(self):
            t = getattr(self, f.name).detach().cpu().contiguous()
            h.update(f"{f.name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def validate(self) -> None:
        """Raise AssertionError if any attention-relevant field is inconsistent (for tests, debug)."""
        B, S = self.input_ids.shape
        for name in ("labels", "doc_ids", "block_ids", "modality"):
            assert getattr(self, name).shape == (B, S), f"{name} shape {tuple(getattr(self, name).shape)}"
        assert self.positions.shape == (B, 3, S)
        visual_BS = (self.modality == IMAGE) | (self.modality == VIDEO)
        P = int(visual_BS.sum())
        assert self.patches.shape[0] == P == self.patch_kind.shape[0], "every <|patch|> needs one patch row"
        assert torch.equal(self.patch_kind, self.modality[visual_BS]), "patch_kind disagrees with modality"
        assert bool((self.doc_ids[:, 1:] >= self.doc_ids[:, :-1]).all()), "doc_ids not monotone in a row"
        assert bool(((self.block_ids >= 0) == visual_BS).all()), "block_ids must mark exactly the patches"
        assert not bool((self.labels[visual_BS] != IGNORE_INDEX).any()), "a patch position has a label"
        for b in range(B):
            ids = self.block_ids[b][visual_BS[b]]
            if ids.numel():
                # Blocks are numbered in order, contiguous, each inside one document.
                assert bool((ids[1:] - ids[:-1] >= 0).all()) and int(ids[0]) == 0
                assert bool(((ids[1:] - ids[:-1]) <= 1).all())
                pos = torch.nonzero(visual_BS[b]).flatten()
                for k in ids.unique():
                    at = pos[ids == k]
                    assert int(at[-1] - at[0]) + 1 == at.numel(), f"row {b}: block {int(k)} is split"
                    assert self.doc_ids[b, at].unique().numel() == 1, f"row {b}: block {int(k)} spans documents"


def collate_rows(rows: list[list[Piece]], *, seq_len: int, pad_id: int, patch_dim: int,
                 patch_dtype: str = "float16") -> tuple[PackedBatch, dict]:
    """Assemble packed rows into a PackedBatch, and count tokens for metrics.

    Returns (batch, counts) where counts has `tokens_by_modality` (5 ints, padding excluded),
    `padding` (tokens) and `pieces`.
    """
    B, S = len(rows), seq_len
    input_ids_BS = np.full((B, S), pad_id, dtype=np.int64)
    labels_BS = np.full((B, S), IGNORE_INDEX, dtype=np.int64)
    positions_B3S = np.zeros((B, 3, S), dtype=np.int32)
    doc_ids_BS = np.zeros((B, S), dtype=np.int32)
    block_ids_BS = np.full((B, S), -1, dtype=np.int32)
    modality_BS = np.full((B, S), SPECIAL, dtype=np.uint8)
    blocks_in_order: list = []  # the batch's visual blocks in row-major order
    tokens_by_modality = np.zeros(5, dtype=np.int64)
    padding = pieces = 0
    for b, row in enumerate(rows):
        at = num_blocks = 0
        for d, piece in enumerate(row):
            n = len(piece)
            assert at + n <= S, "row longer than seq_len"
            sl = slice(at, at + n)
            input_ids_BS[b, sl] = piece.ids_L
            positions_B3S[b, :, sl] = piece.positions_3L
            doc_ids_BS[b, sl] = d
            modality_BS[b, sl] = piece.modality_L
            visual_L = (piece.modality_L == IMAGE) | (piece.modality_L == VIDEO)
            labels_L = np.empty(n, dtype=np.int64)
            labels_L[:-1] = piece.ids_L[1:]
            labels_L[-1] = IGNORE_INDEX
            labels_L[visual_L] = IGNORE_INDEX
            labels_L[:-1][visual_L[1:]] = IGNORE_INDEX
            labels_BS[b, sl] = labels_L
            for blk in piece.blocks:
                block_ids_BS[b, at + blk.start:at + blk.start + blk.length] = num_blocks
                num_blocks += 1
                blocks_in_order.append(blk)
            tokens_by_modality += np.bincount(piece.modality_L, minlength=5)[:5]
            at += n
            pieces += 1
        if at < S:
            # Padding: one trailing pseudo-document with its own positions (see module docstring).
            doc_ids_BS[b, at:] = len(row)
            positions_B3S[b, :, at:] = np.arange(S - at, dtype=np.int32)
            padding += S - at
    patches_PD, patch_kind_P = _gather_patches(blocks_in_order, patch_dim, patch_dtype)
    batch = PackedBatch(
        input_ids=torch.from_numpy(input_ids_BS), labels=torch.from_numpy(labels_BS),
        positions=torch.from_numpy(positions_B3S), doc_ids=torch.from_numpy(doc_ids_BS),
        block_ids=torch.from_numpy(block_ids_BS), modality=torch.from_numpy(modality_BS),
        patches=patches_PD, patch_kind=patch_kind_P,
    )
    counts = {"tokens_by_modality": tokens_by_modality.tolist(), "padding": padding, "pieces": pieces}
    return batch, counts


def patch_store_dtype(patch_dtype: str) -> np.dtype:
    """The numpy dtype patches are written in for `patch_dtype`. numpy has no bfloat16: float32,
    which torch then converts; float16 and float32 are written directly."""
    return np.dtype(np.float32 if patch_dtype in ("float32", "bfloat16") else np.float16)


def _gather_patches(blocks: list, patch_dim: int, patch_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, D] patches (zero-padded to patch_dim) and [P] kinds, written once into one buffer (the
    cast to `patch_store_dtype` happens in the slice assignment, no second pass)."""
    P = sum(b.length for b in blocks)
    patches_PD = np.zeros((P, patch_dim), dtype=patch_store_dtype(patch_dtype))
    kind_P = np.empty(P, dtype=np.uint8)
    at = 0
    for b in blocks:
        N, D = b.patches_ND.shape
        if D > patch_dim:
            raise ValueError(f"a visual block has patch dim {D} > the stream's patch_dim {patch_dim}; pass the "
                             "tokenizer's largest patch dim (video: 3*tp*p*p) as patch_dim")
        patches_PD[at:at + N, :D] = b.patches_ND
        kind_P[at:at + N] = b.kind
        at += N
    out = torch.from_numpy(patches_PD)
    return (out.to(_DTYPES[patch_dtype]) if patch_dtype == "bfloat16" else out), torch.from_numpy(kind_P)
