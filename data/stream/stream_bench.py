"""`omniloom bench stream`: tokens/s per worker, best-fit vs sequential padding, restore vs replay.

Also home of the synthetic corpus and tokenizer the stream's tests and benchmark share: shards in
the contract format (docs/data-format.md section 1, tar + manifest with per-sample offsets) and a deterministic
byte-level `SyntheticTokenizer` that follows the token layout contract (docs/data-format.md section 4) without
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
    """Yield (doc_json, media) pairs: text, code, images and videos in the docs/data-format.md section 1 format.

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

        # Per segment: (ids, modality, positions_3L relative to the running position, advance).
        parts, blocks, p, at = [], [], 0, 0

        def emit(ids, mod, rel_3L, advance):
            nonlocal p, at
            parts.append((ids, np.full(len(ids), mod, np.uint8), rel_3L + p))
            p, at = p + advance, at + len(ids)

        def text_like(ids, mod):
            emit(ids, mod, np.broadcast_to(np.arange(len(ids), dtype=np.int32), (3, len(ids))), len(ids))

        text_like(np.array([L.BOS_ID], np.int64), L.SPECIAL)
        for seg in doc["segments"]:
            kind = seg.get("type")
            if kind in ("text", "code"):
                data = np.frombuffer(seg["text"].encode(), dtype=np.uint8)
                text_like(data.astype(np.int64) + L.FIRST_BYTE_ID, L.TEXT if kind == "text" else L.CODE)
            elif kind in ("image", "video"):
                raw = media[seg["ref"]]
                if raw[:6] not in (b"SYNIMG", b"SYNVID"):
                    raise SyntheticMediaError(f"media {seg['ref']} is not synthetic media")
                t, h, w = raw[6], raw[7], raw[8]
                code, open_id, close_id = ((L.IMAGE, L.IMAGE_ID, L.IMAGE_END_ID) if kind == "image"
                                           else (L.VIDEO, L.VIDEO_ID, L.VIDEO_END_ID))
                n, dim = t * h * w, (self.patch_dim if kind == "image" else self.tubelet_dim)
                rng = np.random.default_rng(int.from_bytes(hashlib.sha1(raw).digest()[:8], "little"))
                text_like(np.array([open_id], np.int64), L.SPECIAL)
                blocks.append(L.VisualBlock(start=at, length=n, kind=code, grid=(t, h, w),
                                            patches_ND=rng.standard_normal((n, dim), dtype=np.float32)))
                grid_3N = np.stack([g.ravel() for g in np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                                                      indexing="ij")]).astype(np.int32)
                emit(np.full(n, L.PATCH_ID, np.int64), code, grid_3N, max(t, h, w))
                text_like(np.array([close_id], np.int64), L.SPECIAL)
            else:
                raise SyntheticMediaError(f"unknown segment type {kind!r}")
        text_like(np.array([L.EOS_ID], np.int64), L.SPECIAL)
        return L.TokenizedDoc(ids_L=np.concatenate([x[0] for x in parts]),
                              modality_L=np.concatenate([x[1] for x in parts]),
                              positions_3L=np.concatenate([x[2] for x in parts], axis=1).astype(np.int32),
                              blocks=blocks, key=doc.get("meta", {}).get("source", ""))


# -- the benchmark ------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `omniloom bench stream`."""
    parser.add_argument("--shards", default="", help="shard set to read (directory with manifest.json, brace "
                        "pattern or URL); default: a synthetic mixed corpus written to a temp dir")
    parser.add_argument("--tokenizer", default="", help="tokenizer folder for --shards (default: the synthetic "
                        "byte-level tokenizer, which needs synthetic media)")
    parser.add_argument("--docs", type=int, default=1500, help="documents in the synthetic corpus (default 1500)")
    parser.add_argument("--seq-len", type=int, default=4096, help="row length (default 4096)")
    parser.add_argument("--batch-size", type=int, default=4, help="rows per batch (default 4)")
    parser.add_argument("--batches", type=int, default=12, help="batches per measurement (default 12)")
    parser.add_argument("--pack-buffer", type=int, default=64, help="pieces the packer chooses from (default 64)")
    parser.add_argument("--shuffle-buffer", type=int, default=128, help="raw samples per worker (default 128)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers for the loader run (0: skip it)")
    parser.add_argument("--seed", type=int, default=0)


def _stream_parts(args, tmp: str):
    from omniloom.data.config import DataConfig, SourceConfig

    from .reader import resolve_source

    if args.shards:
        if args.tokenizer:
            from .loader import DocumentTokenizer

            tok = DocumentTokenizer(args.tokenizer)
            patch_dim = max(tok.tokenizer.patch_dim, tok.tokenizer.tubelet_dim)
        else:
            tok = SyntheticTokenizer(patch_size=16)
            patch_dim = tok.tubelet_dim
        path = args.shards
    else:
        tok = SyntheticTokenizer(patch_size=16)
        patch_dim = tok.tubelet_dim
        path = write_shards(os.path.join(tmp, "corpus"), synthetic_documents(
            args.docs, seed=args.seed, mean_text=700, max_text=20000, image_frac=0.35, video_frac=0.15, max_grid=32),
            name="bench", docs_per_shard=max(1, args.docs // 8))
    cfg = DataConfig(sources=[SourceConfig(path=path)], seq_len=args.seq_len, batch_size=args.batch_size,
                     num_workers=args.workers, shuffle_buffer=args.shuffle_buffer, pack_buffer=args.pack_buffer,
                     seed=args.seed)
    return cfg, [resolve_source(s) for s in cfg.sources], tok, patch_dim


class _TimedTokenize:
    """Wraps a tokenize_fn and adds up the seconds spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, doc, media):
        t0 = time.perf_counter()
        try:
            return self.fn(doc, media)
        finally:
            self.seconds += time.perf_counter() - t0


def run(args) -> int:
    """Run the stream benchmark and print its figures (see add_arguments)."""
    import tempfile

    from omniloom.data.packing import PackingError, padding_best_fit, padding_sequential, split_document
    from omniloom.tokenizers.layout import PAD_ID

    from .loader import WorkerStream, build_loader
    from .reader import SampleReader

    if args.batches < 2 or args.seq_len < 8:
        raise ValueError("--batches must be >= 2 and --seq-len >= 8")
    with tempfile.TemporaryDirectory(prefix="omniloom-bench-stream-") as tmp:
        cfg, sets, tok, patch_dim = _stream_parts(args, tmp)
        n_docs = sets[0].num_samples
        print(f"corpus: {n_docs} documents in {len(sets[0].shards)} shards; seq_len {cfg.seq_len}, "
              f"batch {cfg.batch_size}, pack_buffer {cfg.pack_buffer}, patch_dim {patch_dim}")

        # Reference: read + tokenize alone, the work a worker cannot avoid.
        reader = SampleReader(sets[0].shards)
        lengths, ref_tokens, t0 = [], 0, time.perf_counter()
        for shard_idx, shard in enumerate(sets[0].shards):
            for i in range(shard.num_samples):
                try:
                    tdoc = tok(*reader.read_document(shard_idx, i))
                    ref_tokens += len(tdoc)
                    lengths += [len(p) for p in split_document(tdoc, cfg.seq_len)]
                except (PackingError, ValueError):
                    continue
        ref_dt = time.perf_counter() - t0
        ref_tps = ref_tokens / ref_dt

        rows_bf, pad_bf = padding_best_fit(lengths, cfg.seq_len, cfg.pack_buffer)
        rows_seq, pad_seq = padding_sequential(lengths, cfg.seq_len)
        print(f"padding on the same {len(lengths)} pieces: best-fit {pad_bf / (rows_bf * cfg.seq_len):.2%} "
              f"({rows_bf} rows) vs sequential {pad_seq / (rows_seq * cfg.seq_len):.2%} ({rows_seq} rows); "
              f"rows saved {1 - rows_bf / rows_seq:.1%}")

        # One worker, in process, in steady state (the first batch also fills the buffers): tokens/s
        # against the read+tokenize reference above.
        timed = _TimedTokenize(tok)
        stream = WorkerStream(sets, cfg, timed, slot=0, num_slots=1, pad_id=PAD_ID, patch_dim=patch_dim)
        t0 = time.perf_counter()
        stream.next_batch()
        t_first = time.perf_counter() - t0
        timed.seconds = 0.0
        docs0, t0 = stream.docs, time.perf_counter()
        real = padded = 0
        for _ in range(args.batches):
            _, counts = stream.next_batch()
            real += sum(counts["tokens_by_modality"])
            padded += counts["padding"]
        dt = time.perf_counter() - t0
        print(f"one worker: {real / dt:,.0f} tokens/s ({(stream.docs - docs0) / dt:,.1f} docs/s) after a "
              f"{t_first * 1e3:,.0f} ms first batch, padding in the stream {padded / (real + padded):.2%}; "
              f"{timed.seconds / dt:.0%} of the worker's time is in tokenize_fn, the rest is reading, "
              f"shuffling, splitting, packing and collation (read+tokenize over the whole corpus in shard "
              f"order: {ref_tps:,.0f} tokens/s)")

        # Restore vs replay: continue after the batches above both ways, check they agree.
        done = stream.batches
        state = stream.state_dict()
        expect = stream.next_batch()[0].digest()
        t0 = time.perf_counter()
        restored = WorkerStream(sets, cfg, tok, slot=0, num_slots=1, pad_id=PAD_ID, patch_dim=patch_dim)
        restored.load_state_dict(state)
        t_restore = time.perf_counter() - t0
        got = restored.next_batch()[0].digest()
        t0 = time.perf_counter()
        replay = WorkerStream(sets, cfg, tok, slot=0, num_slots=1, pad_id=PAD_ID, patch_dim=patch_dim)
        for _ in range(done):
            replay.next_batch()
        t_replay = time.perf_counter() - t0
        per_batch = dt / args.batches
        print(f"restore after {done} batches: {t_restore * 1e3:,.0f} ms (re-reads {len(state['shuffle'])} "
              f"buffered samples, re-tokenizes the documents of {len(state['packer'])} pieces) vs replay "
              f"{t_replay * 1e3:,.0f} ms -> {t_replay / max(t_restore, 1e-9):.1f}x; restore costs as much as "
              f"replaying {t_restore / per_batch:.1f} batches and stays flat while replay grows with the "
              f"position in the epoch; next batch identical: {got == expect}")
        if args.workers > 0:
            loader = build_loader(cfg, tok, patch_dim=patch_dim, max_batches=args.batches * args.workers)
            it = iter(loader)
            next(it)  # worker start-up and first buffer fill are not throughput
            loader.metrics()
            for _ in it:
                pass
            m = loader.metrics()
            print(f"loader, {args.workers} workers: {m['tokens_per_s']:,.0f} tokens/s "
                  f"({m['tokens_per_s'] / args.workers:,.0f} per worker), {m['samples_per_s']:,.1f} docs/s, "
                  f"padding {m['padding_fraction']:.2%}, shares " + ", ".join(
                      f"{k.split('/')[1]} {v:.1%}" for k, v in m.items() if k.startswith("token_share/")))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="omniloom bench stream", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
