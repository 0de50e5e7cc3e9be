"""The stream half of `omniloom bench data --index`: loader samples/s on foreign shards read in place
through an index (`omniloom data index`), against `webdataset.WebDataset(...).decode("rgb8")` over
the same shards doing the same decode, in the same run, one process each (a loader with 1 worker
runs this pipeline in its one worker process).

The loader side is the training pipeline of one slot (`WorkerStream`: read by offset, map the
members to a document with data/wds.py, shuffle, pack) with a tokenize_fn that decodes every image
to 8-bit RGB, as webdataset's "rgb8" does, and tokenizes the text one byte per token (the real
tokenizer's patching would be work the reference does not do). The figure is its samples/s over
the reference's.
"""

from __future__ import annotations

import time


def _rgb8(data: bytes):
    import io

    import numpy as np
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def loader_vs_webdataset(index_dir: str, shards: list[str], *, rounds: int = 1) -> dict:
    """{"loader_sps", "webdataset_sps", "ratio", "samples"} over one epoch of the indexed set."""
    import webdataset as wds

    from omniloom.data.config import DataConfig, SourceConfig

    from .loader import WorkerStream
    from .reader import resolve_source
    from .stream_bench import SyntheticTokenizer

    text_only = SyntheticTokenizer()

    def tokenize(doc: dict, media: dict):
        for ref in media:
            if ref.startswith("img"):
                _rgb8(media[ref])
        return text_only({"segments": [s for s in doc["segments"] if s["type"] in ("text", "code")]}, {})

    best_ref, best_loader, n = 0.0, 0.0, 0
    for _ in range(rounds):
        t = time.perf_counter()
        n_ref = 0
        for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode("rgb8"):
            n_ref += 1
        best_ref = max(best_ref, n_ref / (time.perf_counter() - t))
        sets = [resolve_source(SourceConfig(path=index_dir))]
        n = sets[0].num_samples
        cfg = DataConfig(seq_len=4096, batch_size=1, num_workers=0, shuffle_buffer=16, pack_buffer=4)
        ws = WorkerStream(sets, cfg, tokenize, slot=0, num_slots=1, pad_id=3, patch_dim=text_only.tubelet_dim)
        t = time.perf_counter()
        while ws.docs < n:
            ws.next_batch()
        best_loader = max(best_loader, ws.docs / (time.perf_counter() - t))
    return {"samples": n, "loader_sps": best_loader, "webdataset_sps": best_ref, "ratio": best_loader / max(best_ref, 1e-9)}
