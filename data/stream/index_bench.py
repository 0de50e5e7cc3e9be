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


def loader_vs_webdataset(index_dir: str, shards: list[str], *, rounds: int = 5) -> dict:
    """{"loader_sps", "webdataset_sps", "ratio", "samples", "rounds"} over one epoch of the indexed
    set: one untimed pass of each first (the file cache warm for both, imports and decoders
    loaded), then `rounds` rounds of both, their order alternating so both see the same machine
    load; the figures are medians, the ratio the median of the rounds' ratios."""
    import statistics

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

    sets = [resolve_source(SourceConfig(path=index_dir))]
    n = sets[0].num_samples
    cfg = DataConfig(seq_len=4096, batch_size=1, num_workers=0, shuffle_buffer=16, pack_buffer=4)

    def reference() -> float:
        t = time.perf_counter()
        n_ref = sum(1 for _ in wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode("rgb8"))
        return n_ref / (time.perf_counter() - t)

    def loader() -> float:
        ws = WorkerStream(sets, cfg, tokenize, slot=0, num_slots=1, pad_id=3, patch_dim=text_only.tubelet_dim)
        t = time.perf_counter()
        while ws.docs < n:
            ws.next_batch()
        return ws.docs / (time.perf_counter() - t)

    reference(), loader()  # warm-up, untimed
    refs, loads = [], []
    for r in range(rounds):
        if r % 2 == 0:
            refs.append(reference())
            loads.append(loader())
        else:
            loads.append(loader())
            refs.append(reference())
    return {"samples": n, "rounds": rounds, "loader_sps": statistics.median(loads), "webdataset_sps": statistics.median(refs),
            "ratio": statistics.median(a / b for a, b in zip(loads, refs))}
