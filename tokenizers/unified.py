"""One document (doc.json + media bytes) to the unified token layout and back (docs/data-format.md section 4).

Legend: L tokens of the document, N patch positions of one block, D patch dim.

Layout of a document:
    <s> text... <|code|> "lang\\n" + code... <|/code|> <|image|> <|patch|>*N <|/image|> ... </s>
Positions are 3-D (t, h, w), M-RoPE style: text, code and tags advance all three together by one;
the patches of a block with grid (T, H, W) opened at running position p get (p+ti, p+hi, p+wi);
the close tag and the text after it resume at p + max(T, H, W).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from omniloom.tokenizers import layout
from omniloom.tokenizers.image import image_to_patches, patches_to_image
from omniloom.tokenizers.layout import CODE, IMAGE, SPECIAL, TEXT, VIDEO, TokenizedDoc, VisualBlock
from omniloom.tokenizers.settings import DocumentError, MediaError
from omniloom.tokenizers.text import Tokenizer
from omniloom.tokenizers.video import tubelets_to_frames, video_to_tubelets

MEDIA_ERROR_POLICIES = ("raise", "drop")


class _Builder:
    """Accumulates a document part by part; arrays are built once at the end.

    Positions need no per-token work while building: outside visual blocks a token's position is
    its index minus the shift accumulated by earlier blocks (a block of N patches advances the
    position by max(T, H, W), shifting what follows by N - max(T, H, W)).
    """

    def __init__(self):
        self.ids: list[np.ndarray] = []
        self.spans: list[tuple[int, int, int]] = []  # (start, end, modality)
        self.shifts: list[tuple[int, int]] = []  # (first token after a block, that block's shift)
        self.grids: list[tuple[int, int, int, int, int]] = []  # (start, T, H, W, position p)
        self.n = 0  # tokens so far
        self.shift = 0

    def run(self, ids, modality: int) -> None:
        k = len(ids)
        if not k:
            return
        self.ids.append(ids if isinstance(ids, np.ndarray) else np.asarray(ids, dtype=np.int64))
        self.spans.append((self.n, self.n + k, modality))
        self.n += k

    def block(self, kind: int, patches_ND: np.ndarray, grid: tuple[int, int, int]) -> VisualBlock:
        T, H, W = grid
        N = T * H * W
        open_id, close_id = (layout.IMAGE_ID, layout.IMAGE_END_ID) if kind == IMAGE else (layout.VIDEO_ID, layout.VIDEO_END_ID)
        self.run(_ONE[open_id], SPECIAL)
        start = self.n
        self.grids.append((start, T, H, W, start - self.shift))
        self.run(np.full(N, layout.PATCH_ID, dtype=np.int64), kind)
        self.shift += N - max(T, H, W)
        self.shifts.append((self.n, N - max(T, H, W)))
        self.run(_ONE[close_id], SPECIAL)
        return VisualBlock(start=start, length=N, kind=kind, patches_ND=patches_ND, grid=(T, H, W))

    def finish(self, blocks: list[VisualBlock], key: str, stats: Counter) -> TokenizedDoc:
        L = self.n
        ids_L = np.concatenate(self.ids).astype(np.int64, copy=False)
        modality_L = np.empty(L, dtype=np.uint8)
        for a, b, m in self.spans:
            modality_L[a:b] = m
        pos_L = np.arange(L, dtype=np.int32)
        for a, shift in self.shifts:
            pos_L[a:] -= shift
        positions_3L = np.empty((3, L), dtype=np.int32)
        positions_3L[:] = pos_L
        for start, T, H, W, p in self.grids:
            n = T * H * W
            idx = np.arange(n, dtype=np.int32)
            positions_3L[0, start : start + n] = p + idx // (H * W)
            positions_3L[1, start : start + n] = p + (idx // W) % H
            positions_3L[2, start : start + n] = p + idx % W
        return TokenizedDoc(ids_L=ids_L, modality_L=modality_L, positions_3L=positions_3L, blocks=blocks, key=key, stats={k: int(v) for k, v in stats.items() if v})


_ONE = {i: np.array([i], dtype=np.int64) for i in range(layout.FIRST_BYTE_ID)}


def tokenize_document(doc: dict, media: dict | None, tokenizer: Tokenizer | None = None, *, key: str | None = None, media_errors: str = "raise") -> TokenizedDoc:
    """A parsed doc.json (`{"segments": [...], ...}`) and its media (ref -> bytes) as a TokenizedDoc.
    A media value may also be decoded already: an image as a PIL image or uint8 pixels
    (image.open_image), a video as frames sampled at the video rate (video.sampled_frames).

    Text segments become TEXT ids, code segments `<|code|> lang\\n code <|/code|>` with CODE ids,
    images and videos visual blocks with their patches. `tokenize_document(doc, tokenizer)` works
    for documents without media. Errors: DocumentError (reason `bad_segment`, `missing_media`) for
    a malformed document; MediaError for undecodable media, unless media_errors="drop", which
    leaves that segment out and counts it in `stats` (`dropped_<reason>`).
    """
    if tokenizer is None and isinstance(media, Tokenizer):
        tokenizer, media = media, None
    if not isinstance(tokenizer, Tokenizer):
        raise TypeError("tokenize_document(doc, media, tokenizer) needs an omniloom Tokenizer")
    if media_errors not in MEDIA_ERROR_POLICIES:
        raise ValueError(f"media_errors must be one of {MEDIA_ERROR_POLICIES}, got {media_errors!r}")
    segments = doc.get("segments") if isinstance(doc, dict) else None
    if not isinstance(segments, list):
        raise DocumentError("bad_segment", "document has no 'segments' list")
    media = media or {}
    settings = tokenizer.settings
    b = _Builder()
    blocks: list[VisualBlock] = []
    stats: Counter = Counter()
    b.run(_ONE[layout.BOS_ID], SPECIAL)
    for i, seg in enumerate(segments):
        kind = seg.get("type") if isinstance(seg, dict) else None
        if kind == "text":
            text = seg.get("text")
            if not isinstance(text, str):
                raise DocumentError("bad_segment", f"segment {i}: text segment without a string 'text'")
            b.run(tokenizer.encode_array(text), TEXT)
        elif kind == "code":
            text, lang = seg.get("text"), seg.get("lang") or ""
            if not isinstance(text, str) or not isinstance(lang, str) or "\n" in lang:
                raise DocumentError("bad_segment", f"segment {i}: code segment needs a string 'text' and a one-line 'lang'")
            b.run(_ONE[layout.CODE_ID], SPECIAL)
            b.run(tokenizer.encode_array(f"{lang}\n{text}"), CODE)
            b.run(_ONE[layout.CODE_END_ID], SPECIAL)
        elif kind in ("image", "video"):
            ref = seg.get("ref")
            if not isinstance(ref, str) or ref not in media:
                raise DocumentError("missing_media", f"segment {i}: {kind} ref {ref!r} is not among the document's media ({', '.join(sorted(media)) or 'none'})")
            try:
                if kind == "image":
                    patches_ND, grid = image_to_patches(media[ref], settings)
                    blocks.append(b.block(IMAGE, patches_ND, grid))
                else:
                    patches_ND, grid, info = video_to_tubelets(media[ref], settings)
                    stats["video_decode_errors"] += info.decode_errors
                    stats["video_corrupt_frames"] += info.corrupt_frames
                    blocks.append(b.block(VIDEO, patches_ND, grid))
            except MediaError as err:
                if media_errors == "raise":
                    raise
                stats[f"dropped_{err.reason}"] += 1
        else:
            raise DocumentError("bad_segment", f"segment {i}: unknown type {kind!r} (want text, code, image or video)")
    b.run(_ONE[layout.EOS_ID], SPECIAL)
    return b.finish(blocks, key if key is not None else str(doc.get("key", "")), stats)


def detokenize(tdoc: TokenizedDoc, tokenizer: Tokenizer) -> list[dict]:
    """Segments back from a TokenizedDoc: text and code exactly (adjacent text segments come back
    joined), images as `{"type": "image", "pixels": uint8 [H, W, 3], "grid": ...}` and videos as
    `{"type": "video", "frames": uint8 [F, H, W, 3], "grid": ...}` (F a multiple of tp)."""
    ids, mod = tdoc.ids_L, tdoc.modality_L
    by_open = {blk.start - 1: blk for blk in tdoc.blocks}
    out: list[dict] = []
    i, L = 0, len(tdoc)
    while i < L:
        if i in by_open:
            blk = by_open[i]
            if blk.kind == IMAGE:
                out.append({"type": "image", "pixels": patches_to_image(blk.patches_ND, blk.grid, tokenizer.settings), "grid": blk.grid})
            else:
                out.append({"type": "video", "frames": tubelets_to_frames(blk.patches_ND, blk.grid, tokenizer.settings), "grid": blk.grid})
            i = blk.start + blk.length + 1
            continue
        if mod[i] == TEXT:
            j = i
            while j < L and mod[j] == TEXT:
                j += 1
            text = tokenizer.decode(ids[i:j].tolist())
            if out and out[-1]["type"] == "text":
                out[-1]["text"] += text
            else:
                out.append({"type": "text", "text": text})
            i = j
            continue
        if ids[i] == layout.CODE_ID:
            j = i + 1
            while j < L and mod[j] == CODE:
                j += 1
            lang, _, text = tokenizer.decode(ids[i + 1 : j].tolist()).partition("\n")
            out.append({"type": "code", "lang": lang, "text": text})
            i = j + 1 if j < L and ids[j] == layout.CODE_END_ID else j
            continue
        i += 1  # bos, eos, stray specials
    return out
