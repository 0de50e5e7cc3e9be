"""Random PackedBatch-shaped inputs for tests and benchmarks (no data/ or tokenizers/ import).

Rows hold several documents in the unified layout (docs/data-format.md section 4): bos, text or code, visual blocks
`<|image|> <|patch|>*N <|/image|>` (and video), eos; M-RoPE positions per document; labels
shifted with -100 at patches, across documents and at padding; padding gets its own doc id.
"""

from __future__ import annotations

import torch

from .config import ModelConfig

TEXT, CODE, IMAGE, VIDEO, SPECIAL = 0, 1, 2, 3, 4


def random_packed_batch(
    cfg: ModelConfig,
    *,
    batch_size: int = 2,
    seq_len: int = 128,
    docs_per_row: int = 3,
    image_grid: tuple[int, int, int] = (1, 3, 4),
    video_grid: tuple[int, int, int] = (2, 2, 3),
    visual: bool = True,
    pad: int = 5,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """A dict with the PackedBatch fields (input_ids, labels, positions, doc_ids, block_ids,
    modality, patches, patch_kind). Row r, doc d gets an image when (r + d) is even and a video
    when d == 1 (if `visual` and they fit); the last `pad` tokens of each row are padding."""
    g = torch.Generator().manual_seed(seed)
    V, patch_id = cfg.vocab_size, cfg.patch_token_id
    n_special = 6
    if V <= n_special + 2 or (visual and patch_id < 0):
        raise ValueError("random_packed_batch needs vocab_size > 8 and a patch_token_id for visual blocks")
    # special ids at the top of the vocab, away from patch_token_id
    specials = [i for i in range(V - 1, -1, -1) if i != patch_id][:n_special]
    bos, eos, img_open, img_close, vid_open, vid_close = specials
    text_hi = min(specials + ([patch_id] if patch_id >= 0 else []))
    patch_width = max(cfg.patch_dim, cfg.tubelet_dim)
    skip_pad = int(0 <= cfg.pad_token_id < text_hi)

    ids = torch.zeros(batch_size, seq_len, dtype=torch.int64)
    mod = torch.full((batch_size, seq_len), SPECIAL, dtype=torch.uint8)
    pos = torch.zeros(batch_size, 3, seq_len, dtype=torch.int32)
    doc = torch.zeros(batch_size, seq_len, dtype=torch.int32)
    blk = torch.full((batch_size, seq_len), -1, dtype=torch.int32)
    patches, kinds = [], []
    usable = seq_len - pad
    for r in range(batch_size):
        bounds = [usable * d // docs_per_row for d in range(docs_per_row + 1)]
        n_blocks = 0
        for d in range(docs_per_row):
            start, end = bounds[d], bounds[d + 1]
            L = end - start
            want = []
            if visual and (r + d) % 2 == 0:
                want.append((IMAGE, image_grid))
            if visual and d == 1:
                want.append((VIDEO, video_grid))
            # segments: text, [block, text]*; drop blocks that do not fit
            blocks = []
            room = L - 2 - 2
            for kind, grid in want:
                n = grid[0] * grid[1] * grid[2]
                if n + 2 + 1 <= room:
                    blocks.append((kind, grid))
                    room -= n + 2 + 1
            n_text = L - 2 - sum(g_[0] * g_[1] * g_[2] + 2 for _, g_ in blocks)
            text_chunks = [n_text // (len(blocks) + 1)] * (len(blocks) + 1)
            text_chunks[-1] += n_text - sum(text_chunks)
            i, p = start, 0

            def put(tok, m, t, h, w):
                nonlocal i
                ids[r, i], mod[r, i], doc[r, i] = tok, m, d
                pos[r, :, i] = torch.tensor([t, h, w], dtype=torch.int32)
                i += 1

            put(bos, SPECIAL, p, p, p)
            p += 1
            for c, n in enumerate(text_chunks):
                m = CODE if (r + d + c) % 3 == 2 else TEXT
                for tok in torch.randint(0, text_hi - skip_pad, (n,), generator=g).tolist():
                    tok += int(skip_pad and tok >= cfg.pad_token_id)  # text never uses the pad id
                    put(tok, m, p, p, p)
                    p += 1
                if c < len(blocks):
                    kind, (T, Hh, W) = blocks[c]
                    put(img_open if kind == IMAGE else vid_open, SPECIAL, p, p, p)
                    p += 1
                    blk[r, i : i + T * Hh * W] = n_blocks
                    for ti in range(T):
                        for hi in range(Hh):
                            for wi in range(W):
                                put(patch_id, kind, p + ti, p + hi, p + wi)
                    n_blocks += 1
                    dim = cfg.patch_dim if kind == IMAGE else cfg.tubelet_dim
                    rows = torch.zeros(T * Hh * W, patch_width)
                    rows[:, :dim] = torch.randn(T * Hh * W, dim, generator=g)
                    patches.append(rows)
                    kinds += [kind] * (T * Hh * W)
                    p += max(T, Hh, W)
                    put(img_close if kind == IMAGE else vid_close, SPECIAL, p, p, p)
                    p += 1
            put(eos, SPECIAL, p, p, p)
            assert i == end
        # padding: its own document, no labels
        doc[r, usable:] = docs_per_row
        ids[r, usable:] = cfg.pad_token_id if cfg.pad_token_id >= 0 else eos
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:]
    same_doc = torch.zeros_like(ids, dtype=torch.bool)
    same_doc[:, :-1] = doc[:, 1:] == doc[:, :-1]
    is_patch = ids == patch_id if patch_id >= 0 else torch.zeros_like(same_doc)
    nxt_patch = torch.zeros_like(is_patch)
    nxt_patch[:, :-1] = is_patch[:, 1:]
    labels[~same_doc | is_patch | nxt_patch] = -100
    labels[:, usable:] = -100
    return {
        "input_ids": ids,
        "labels": labels,
        "positions": pos,
        "doc_ids": doc,
        "block_ids": blk,
        "modality": mod,
        "patches": torch.cat(patches) if patches else torch.zeros(0, patch_width),
        "patch_kind": torch.tensor(kinds, dtype=torch.uint8),
    }
