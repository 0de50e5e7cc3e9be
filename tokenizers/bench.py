"""`omniloom bench tokenizers`: throughput of each tokenizer beside its bare reference, same run.

Rows: text MB/s (Tokenizer.encode and tokenize_document vs bare SentencePiece encode), images/s
(image_to_patches vs bare PIL decode + convert RGB + bicubic resize to the same size), video
source frames/s (decode_video + tubelets vs bare PyAV threaded decode of every frame). Inputs are
generated in memory; each figure is the best of `repeats` timed runs.
"""

from __future__ import annotations

import io
import math
import random
import tempfile
import time

import numpy as np

from omniloom.tokenizers.testing import SAMPLE_TEXTS, make_image_bytes, make_video_bytes


def _pair(ours, ref, repeats: int) -> tuple[float, float]:
    """Best times of ours and the reference, run alternately so both see the same machine load."""
    best_o = best_r = math.inf
    for i in range(repeats):
        for fn, which in ((ours, 0), (ref, 1)) if i % 2 else ((ref, 1), (ours, 0)):
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            if which:
                best_r = min(best_r, dt)
            else:
                best_o = min(best_o, dt)
    return best_o, best_r


def _text_corpus(total_chars: int, seed: int = 0) -> list[str]:
    """Real code and docstrings: the Python standard library's own sources (sorted, so the same
    files every run), topped up with shuffled sample lines if the install lacks them."""
    import sysconfig
    from pathlib import Path

    docs, size = [], 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        if size >= total_chars:
            return docs
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        docs.append(text)
        size += len(text)
    rng = random.Random(seed)
    lines = [ln for t in SAMPLE_TEXTS for ln in t.splitlines(keepends=True)]
    while size < total_chars:
        doc = "".join(
            (" " * rng.choice((0, 0, 4, 8)) + rng.choice(lines)).replace("15", str(rng.randrange(10**6)))
            for _ in range(rng.randrange(20, 80))
        )
        docs.append(doc)
        size += len(doc)
    return docs


def _row(rows: list, name: str, unit: str, ours: float, ref: float, ref_name: str) -> None:
    ratio = ours / ref if ref else float("nan")
    rows.append({"name": name, "unit": unit, "ours": ours, "reference": ref, "reference_name": ref_name, "ratio": ratio})
    print(f"{name:<34} {ours:>10.2f} {unit:<9} {ref_name:<28} {ref:>10.2f} {unit:<9} ratio {ratio:5.2f}  ({(1 / ratio - 1) * 100:+.0f}% time)", flush=True)


def run_bench(quick: bool = False, repeats: int = 5) -> dict:
    """Run every row, print it, and return {"rows": [...]} with ours/reference/ratio per row."""
    import av
    import sentencepiece as spm
    from PIL import Image

    from omniloom.tokenizers.image import fit_grid, image_to_patches
    from omniloom.tokenizers.settings import MediaSettings
    from omniloom.tokenizers.text import MODEL_FILE, train_tokenizer
    from omniloom.tokenizers.unified import tokenize_document
    from omniloom.tokenizers.video import decode_video, video_to_tubelets

    repeats = max(1, 2 if quick else repeats)
    rows: list[dict] = []
    print(f"{'row':<34} {'omniloom':>20} {'reference':<28} {'':>20} ratio = ours/reference throughput")

    # -- text ---------------------------------------------------------------------------------
    docs = _text_corpus(200_000 if quick else 2_000_000)
    nbytes = sum(len(d.encode("utf-8")) for d in docs)
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_tokenizer(docs, tmp, 1024 if quick else 4096, num_threads=2)
        sp = spm.SentencePieceProcessor(model_file=f"{tmp}/{MODEL_FILE}")
    def bare_text():
        return [sp.encode(d) for d in docs]

    ours_s, bare_s = _pair(lambda: [tok.encode(d) for d in docs], bare_text, repeats)
    _row(rows, "text Tokenizer.encode", "MB/s", nbytes / ours_s / 1e6, nbytes / bare_s / 1e6, "sentencepiece encode")
    tdocs = [{"segments": [{"type": "text", "text": d}]} for d in docs]
    doc_s, bare_s = _pair(lambda: [tokenize_document(d, None, tok) for d in tdocs], bare_text, repeats)
    _row(rows, "text tokenize_document", "MB/s", nbytes / doc_s / 1e6, nbytes / bare_s / 1e6, "sentencepiece encode")

    # -- images -------------------------------------------------------------------------------
    settings = MediaSettings()
    p = settings.patch_size
    sizes = [(640, 480), (1024, 768), (480, 800)] if quick else [(1024, 768), (1920, 1080), (800, 1200), (640, 480)]
    for fmt in ("JPEG", "PNG"):
        imgs = [make_image_bytes(w, h, "RGB", fmt, seed=i) for i, (w, h) in enumerate(sizes * (1 if quick else 2))]
        targets = []
        for b in imgs:
            w, h = Image.open(io.BytesIO(b)).size
            gh, gw = fit_grid(h, w, p, settings.image_patch_budget)
            targets.append((gw * p, gh * p))

        def bare():
            for b, size in zip(imgs, targets):
                np.asarray(Image.open(io.BytesIO(b)).convert("RGB").resize(size, Image.Resampling.BICUBIC))

        ours_s, bare_s = _pair(lambda: [image_to_patches(b, settings) for b in imgs], bare, repeats)
        _row(rows, f"image_to_patches {fmt}", "images/s", len(imgs) / ours_s, len(imgs) / bare_s, "PIL decode+resize")
        if fmt == "JPEG":
            # without DCT-domain downscaling: the cost of the pipeline itself (orientation, mode
            # handling, patchify, normalize) over the same full decode the reference does
            nodraft = settings.replace(jpeg_draft=False)
            nd_s, bare_s = _pair(lambda: [image_to_patches(b, nodraft) for b in imgs], bare, repeats)
            _row(rows, "image_to_patches JPEG, no draft", "images/s", len(imgs) / nd_s, len(imgs) / bare_s, "PIL decode+resize")

    # -- video --------------------------------------------------------------------------------
    w, h, secs = (320, 240, 3.0) if quick else (640, 360, 8.0)
    vids = [make_video_bytes(secs, 25, w, h, codec, cont) for codec, cont in (("libx264", "mp4"), ("libvpx-vp9", "webm"))]
    counted = []

    def bare_video():
        counted.clear()
        for b in vids:
            with av.open(io.BytesIO(b)) as c:
                s = c.streams.video[0]
                s.thread_type = "AUTO"
                counted.append(sum(1 for _ in c.decode(s)))

    bare_video()
    frames = sum(counted)
    vset = settings.replace(video_frame_budget=math.ceil(secs * settings.video_fps))  # covers the whole video: same decode work
    ours_s, bare_s = _pair(lambda: [video_to_tubelets(b, vset) for b in vids], bare_video, repeats)
    _row(rows, "video_to_tubelets (whole video)", "frames/s", frames / ours_s, frames / bare_s, "PyAV threaded decode")
    short = settings.replace(video_frame_budget=4)
    decoded = sum(decode_video(b, short)[1].frames_decoded for b in vids)
    clip_s, bare_s = _pair(lambda: [video_to_tubelets(b, short) for b in vids], bare_video, repeats)
    _row(rows, "video_to_tubelets (4-frame clip)", "frames/s", frames / clip_s, frames / bare_s, "PyAV threaded decode")
    print(f"(4-frame clip decodes {decoded} of {frames} source frames and stops; frames/s counts the whole videos)")
    return {"rows": rows, "quick": quick, "repeats": repeats}
