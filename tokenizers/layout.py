"""The unified token layout shared by tokenizers, the data stream and (through config) the model.

DESIGN 2.2. Legend: L tokens of one document, N patch positions of one visual block, D patch dim.
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
    """One document in the unified layout (DESIGN 2.2); positions start at 0 per document."""

    ids_L: np.ndarray  # int64 [L]
    modality_L: np.ndarray  # uint8 [L]
    positions_3L: np.ndarray  # int32 [3, L] (t, h, w)
    blocks: list[VisualBlock] = field(default_factory=list)
    key: str = ""

    def __len__(self) -> int:
        return int(self.ids_L.shape[0])
