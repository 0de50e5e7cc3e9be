"""The unified token layout shared by tokenizers, the data stream and (through config) the model.

docs/data-format.md section 4. Legend: L tokens of one document, N patch positions of one visual block, D patch dim.
First version written with the foundation; the tokenizers issue owns and extends it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Modality codes carried per token (PackedBatch.modality) and per patch (patch_kind uses 2/3).
TEXT, CODE, IMAGE, VIDEO, SPECIAL = 0, 1, 2, 3, 4
MODALITY_NAMES = ("text", "code", "image", "video", "special")

SPECIAL_TOKENS = (
    "<|image|>", "<|/image|>", "<|video|>", "<|/video|>", "<|patch|>", "<|code|>", "<|/code|>",
)


@dataclass
class VisualBlock:
    """One image or video inside a TokenizedDoc: `length` <|patch|> tokens starting at `start`
    (index into the doc's ids, the open tag sits at start-1 and the close tag at start+length)."""

    start: int
    length: int
    kind: int  # IMAGE or VIDEO
    patches_ND: np.ndarray  # float16/float32 [N, D], N == length
    grid: tuple[int, int, int]  # (t, h, w) with t*h*w == length


@dataclass
class TokenizedDoc:
    """One document in the unified layout (docs/data-format.md section 4); positions start at 0 per document."""

    ids_L: np.ndarray  # int64 [L]
    modality_L: np.ndarray  # uint8 [L]
    positions_3L: np.ndarray  # int32 [3, L] (t, h, w)
    blocks: list[VisualBlock] = field(default_factory=list)
    key: str = ""
    # counters from tokenizing (video decode errors, media dropped with media_errors="drop"), for
    # the loader's logs; empty when nothing happened
    stats: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.ids_L.shape[0])


# ---------------------------------------------------------------------------------------------
# Vocabulary layout (extended by the tokenizers issue). Every special token sits at a fixed id
# *inside* the SentencePiece model (as a control symbol), so a plain `sentencepiece` load agrees
# with omniloom on every id and the ids do not move when the vocabulary size changes:
#   0 <unk>, 1 <s> (bos), 2 </s> (eos), 3 <pad>, 4..10 the layout tags above, 11..31 reserved,
#   32..287 the 256 byte-fallback pieces <0x00>..<0xFF>, 288.. learned pieces.
# Control symbols are never matched in raw text: a user typing "<|image|>" gets ordinary text ids.
META_TOKENS = ("<unk>", "<s>", "</s>", "<pad>")
UNK_ID, BOS_ID, EOS_ID, PAD_ID = 0, 1, 2, 3
NUM_SPECIAL_SLOTS = 28  # ids 4..31: the SPECIAL_TOKENS first, the rest reserved for later tags
RESERVED_TOKENS = tuple(f"<|reserved_{i}|>" for i in range(NUM_SPECIAL_SLOTS - len(SPECIAL_TOKENS)))
CONTROL_TOKENS = SPECIAL_TOKENS + RESERVED_TOKENS
FIRST_BYTE_ID = len(META_TOKENS) + NUM_SPECIAL_SLOTS  # 32
FIRST_LEARNED_ID = FIRST_BYTE_ID + 256  # 288

# name -> fixed id, the `special_ids` of omniloom_tokenizer.json (names are the tags without <| |>).
SPECIAL_IDS: dict[str, int] = {"unk": UNK_ID, "bos": BOS_ID, "eos": EOS_ID, "pad": PAD_ID}
SPECIAL_IDS.update({tok[2:-2]: len(META_TOKENS) + i for i, tok in enumerate(SPECIAL_TOKENS)})
IMAGE_ID, IMAGE_END_ID = SPECIAL_IDS["image"], SPECIAL_IDS["/image"]
VIDEO_ID, VIDEO_END_ID = SPECIAL_IDS["video"], SPECIAL_IDS["/video"]
PATCH_ID = SPECIAL_IDS["patch"]
CODE_ID, CODE_END_ID = SPECIAL_IDS["code"], SPECIAL_IDS["/code"]


def token_modality(token_ids):
    """The modality of tokens that are not inside a visual block, from their ids alone: SPECIAL
    for the fixed low ids (bos, eos, pad, the tags), TEXT for everything else (byte pieces and
    learned pieces). An int gives an int; an array or tensor of ids, one of modalities. What
    generation gives the tokens it appends, where no document structure is known; a tokenized
    document marks code segments CODE (unified.tokenize_document), which routes the MoE like TEXT."""
    special = token_ids < FIRST_BYTE_ID
    if isinstance(special, bool):
        return SPECIAL if special else TEXT
    return TEXT + special * (SPECIAL - TEXT)


def validate_tokenized_doc(doc: TokenizedDoc, patch_dim: int | None = None, tubelet_dim: int | None = None) -> None:
    """Check the layout invariants of one TokenizedDoc; raises AssertionError naming the broken one.

    Meant for tests and debugging: shapes and dtypes, bos/eos at the ends, every block framed by
    its tags with only <|patch|> ids inside, grid product == length, patch rows == length.
    """
    L = len(doc)
    assert doc.ids_L.dtype == np.int64 and doc.ids_L.shape == (L,), "ids_L must be int64 [L]"
    assert doc.modality_L.dtype == np.uint8 and doc.modality_L.shape == (L,), "modality_L must be uint8 [L]"
    assert doc.positions_3L.dtype == np.int32 and doc.positions_3L.shape == (3, L), "positions_3L must be int32 [3, L]"
    assert L >= 2 and doc.ids_L[0] == BOS_ID and doc.ids_L[-1] == EOS_ID, "a document starts with bos and ends with eos"
    in_block = np.zeros(L, dtype=bool)
    for b in doc.blocks:
        open_id, close_id = (IMAGE_ID, IMAGE_END_ID) if b.kind == IMAGE else (VIDEO_ID, VIDEO_END_ID)
        assert b.kind in (IMAGE, VIDEO), f"block kind {b.kind} is not IMAGE or VIDEO"
        assert doc.ids_L[b.start - 1] == open_id and doc.ids_L[b.start + b.length] == close_id, "block tags misplaced"
        assert (doc.ids_L[b.start : b.start + b.length] == PATCH_ID).all(), "a block holds only <|patch|> ids"
        assert (doc.modality_L[b.start : b.start + b.length] == b.kind).all(), "patch modality must equal block kind"
        assert int(np.prod(b.grid)) == b.length == b.patches_ND.shape[0], "grid product, length and patch rows differ"
        want = patch_dim if b.kind == IMAGE else tubelet_dim
        assert want is None or b.patches_ND.shape[1] == want, f"patch dim {b.patches_ND.shape[1]} != {want}"
        in_block[b.start : b.start + b.length] = True
    assert not (doc.ids_L[~in_block] == PATCH_ID).any(), "<|patch|> outside a block"
