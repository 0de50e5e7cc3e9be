"""`omniloom bench stream`: tokens/s per worker, best-fit vs sequential padding, restore vs replay.

Also home of the synthetic corpus and tokenizer the stream's tests and benchmark share: shards in
the contract format (DESIGN 2.1, tar + manifest with per-sample offsets) and a deterministic
byte-level `SyntheticTokenizer` that follows the token layout contract (DESIGN 2.2) without
decoding pixels, so packing and resume can be exercised quickly and without a trained tokenizer.
Legend: L tokens of a document, N patches of a block, D patch dim.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import tarfile
import time

import numpy as np

_MTIME = 1_700_000_000  # fixed, so the same corpus always gives byte-identical tars


class SyntheticMediaError(ValueError):
    """Raised by SyntheticTokenizer for media bytes it cannot 'decode' (they start with b'BAD')."""

    reason = "undecodable"


def _media_bytes(kind: str, grid: tuple[int, int, int], rng: np.random.Generator) -> bytes:
    header = (b"SYNIMG" if kind == "image" else b"SYNVID") + bytes(grid)
    return header + rng.bytes(int(rng.integers(16, 64)))


def synthetic_documents(num_docs: int, *, seed: int = 0, mean_text: int = 400, max_text: int = 12000,
                        image_frac: float = 0.3, video_frac: float = 0.1, max_grid: int = 16):
    """Yield (doc_json, media) pairs: text, code, images and videos in the DESIGN 2.1 format.

    Text lengths are lognormal around `mean_text` bytes (one byte = one synthetic token), capped at
    `max_text`; image grids are up to max_grid x max_grid, videos up to 4 x max_grid/2 x max_grid/2.
    """
    rng = np.random.default_rng(seed)
    words = [w.encode() for w in "the of and loom token image video patch model data stream pack".split()]
    for d in range(num_docs):
        segments, media = [], {}
        for _ in range(int(rng.integers(1, 4))):
            n = int(min(max_text, max(8, rng.lognormal(np.log(mean_text), 0.9))))
            text = b" ".join(words[i] for i in rng.integers(len(words), size=n // 5 + 1))[:n].decode()
            if rng.random() < 0.2:
                segments.append({"type": "code", "lang": "python", "text": text})
            else:
                segments.append({"type": "text", "text": text})
            u = rng.random()
            if u < image_frac:
                ref = f"img{len(media)}.jpg"
                h, w = (int(x) for x in rng.integers(1, max_grid + 1, size=2))
                media[ref] = _media_bytes("image", (1, h, w), rng)
                segments.append({"type": "image", "ref": ref})
            elif u < image_frac + video_frac:
                ref = f"vid{len(media)}.mp4"
                t = int(rng.integers(1, 5))
                h, w = (int(x) for x in rng.integers(1, max_grid // 2 + 1, size=2))
                media[ref] = _media_bytes("video", (t, h, w), rng)
                segments.append({"type": "video", "ref": ref})
        yield {"schema": 1, "segments": segments, "meta": {"source": f"synthetic/{seed}/{d}"}}, media


def write_shards(out_dir: str, docs, *, name: str = "synth", docs_per_shard: list[int] | int = 16) -> str:
    """Write (doc_json, media) pairs as contract shards + manifest.json into out_dir; returns out_dir.

    `docs_per_shard` may list a count per shard (uneven shards); leftover documents are dropped.
    """
    os.makedirs(out_dir, exist_ok=True)
    docs = iter(docs)
    counts = docs_per_shard if isinstance(docs_per_shard, list) else None
    entries, total, index = [], 0, 0
    while counts is None or index < len(counts):
        want = counts[index] if counts is not None else docs_per_shard
        shard_name = f"{name}-{index:06d}.tar"
        path = os.path.join(out_dir, shard_name)
        samples = []
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
            for _ in range(want):
                item = next(docs, None)
                if item is None:
                    break
                doc, media = item
                key = f"{name}{total:08d}"
                samples.append({"key": key, "offset": tf.offset})
                members = [("doc.json", json.dumps(doc).encode())] + sorted(media.items())
                for suffix, data in members:
                    info = tarfile.TarInfo(f"{key}.{suffix}")
                    info.size, info.mtime, info.mode = len(data), _MTIME, 0o644
                    tf.addfile(info, io.BytesIO(data))
                total += 1
        if not samples:
            os.remove(path)
            break
        raw = open(path, "rb").read()
        entries.append({"name": shard_name, "num_samples": len(samples), "bytes": len(raw),
                        "sha256": hashlib.sha256(raw).hexdigest(), "samples": samples})
        index += 1
    manifest = {"format": "omniloom-shards", "version": 1, "name": name, "shards": entries,
                "totals": {"documents": total}, "settings": {"synthetic": True}}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    return out_dir


class SyntheticTokenizer:
    """A deterministic tokenize_fn(doc_json, media) -> TokenizedDoc following the layout contract.

    Text/code: one token per UTF-8 byte. Media: the grid is read from the synthetic header, the
    patch vectors are seeded from a hash of the bytes (so a re-read gives identical patches).
    """

    def __init__(self, patch_size: int = 2, temporal_patch_size: int = 2):
        self.patch_dim = 3 * patch_size * patch_size
        self.tubelet_dim = 3 * temporal_patch_size * patch_size * patch_size

    def __call__(self, doc: dict, media: dict):
        from omniloom.tokenizers import layout as L

        ids, mods, pos, blocks = [L.BOS_ID], [L.SPECIAL], [0], []
        grids: list[tuple[int, int, int] | None] = [None]
        for seg in doc["segments"]:
            kind = seg.get("type")
            if kind in ("text", "code"):
                data = seg["text"].encode()
                ids.extend(L.FIRST_BYTE_ID + b for b in data)
                mods.extend([L.TEXT if kind == "text" else L.CODE] * len(data))
                grids.extend([None] * len(data))
            elif kind in ("image", "video"):
                raw = media[seg["ref"]]
                if raw[:6] not in (b"SYNIMG", b"SYNVID"):
                    raise SyntheticMediaError(f"media {seg['ref']} is not synthetic media")
                t, h, w = raw[6], raw[7], raw[8]
                code, open_id, close_id = ((L.IMAGE, L.IMAGE_ID, L.IMAGE_END_ID) if kind == "image"
                                           else (L.VIDEO, L.VIDEO_ID, L.VIDEO_END_ID))
                n = t * h * w
                dim = self.patch_dim if kind == "image" else self.tubelet_dim
                rng = np.random.default_rng(int.from_bytes(hashlib.sha1(raw).digest()[:8], "little"))
                ids.append(open_id), mods.append(L.SPECIAL), grids.append(None)
                blocks.append(L.VisualBlock(start=len(ids), length=n, kind=code, grid=(t, h, w),
                                            patches_ND=rng.standard_normal((n, dim), dtype=np.float32)))
                ids.extend([L.PATCH_ID] * n)
                mods.extend([code] * n)
                grids.extend([(t, h, w)] * n)
                ids.append(close_id), mods.append(L.SPECIAL), grids.append(None)
            else:
                raise SyntheticMediaError(f"unknown segment type {kind!r}")
        ids.append(L.EOS_ID), mods.append(L.SPECIAL), grids.append(None)
        positions_3L = np.zeros((3, len(ids)), dtype=np.int32)
        p, i = 0, 0
        while i < len(ids):
            if grids[i] is None:
                positions_3L[:, i] = p
                p, i = p + 1, i + 1
                continue
            t, h, w = grids[i]
            ti, hi, wi = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
            n = t * h * w
            positions_3L[:, i:i + n] = p + np.stack([ti.ravel(), hi.ravel(), wi.ravel()])
            p, i = p + max(t, h, w), i + n
        return L.TokenizedDoc(ids_L=np.asarray(ids, dtype=np.int64), modality_L=np.asarray(mods, dtype=np.uint8),
                              positions_3L=positions_3L, blocks=blocks, key=doc.get("meta", {}).get("source", ""))
