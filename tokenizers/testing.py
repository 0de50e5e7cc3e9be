"""Helpers for tests (ours and other packages'): a tiny tokenizer trained in about a second on a
built-in text/code sample, and small synthetic images and videos encoded in memory.
"""

from __future__ import annotations

import functools
import io
import os
from fractions import Fraction

import numpy as np

from omniloom.tokenizers.settings import MediaSettings
from omniloom.tokenizers.text import Tokenizer

SAMPLE_PROSE = """\
The river bends twice before it reaches the old mill, where the water runs fast and cold.
In spring the meadows fill with yellow flowers, and children walk along the path to school.
A model learns from many documents: some are short notes, others are long technical reports.
Each image is cut into square patches; each video is sampled at two frames per second.
She asked whether the results were reproducible, and he answered that the seed was fixed.
Numbers like 3.14159, 2026, 1e-5 and 0x1F appear in papers, tables and source code alike.
The weather report said: cloudy in the morning, sunny in the afternoon, light wind from the west.
Trains leave the station every 15 minutes; the last one departs at 23:45 on weekdays.
Good documentation explains why a choice was made, not only what the code does.
When the network is slow, the loader keeps a buffer of samples so training never waits.
Attention lets every token look at the tokens before it; experts specialise on patterns.
The committee met on Tuesday and agreed to publish the dataset under an open license.
"""

SAMPLE_CODE = '''\
import json
import os
from dataclasses import dataclass, field


@dataclass
class Config:
    """Settings for one training run."""

    name: str = "tiny"
    num_layers: int = 4
    hidden_size: int = 256
    learning_rate: float = 3e-4
    tags: list[str] = field(default_factory=list)


def load_config(path: str) -> Config:
    with open(path, "r", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object, got {type(data).__name__}")
    return Config(**data)


class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, key, value=1):
        self.counts[key] = self.counts.get(key, 0) + value
        return self.counts[key]

    def most_common(self, n=10):
        items = sorted(self.counts.items(), key=lambda kv: -kv[1])
        return items[:n]


def main(argv=None):
    for i in range(10):
        if i % 2 == 0:
            print("even", i)
        else:
            print("odd", i)
    total = sum(x * x for x in range(100))
    return 0 if total > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
'''

SAMPLE_C = """\
#include <stdio.h>

int main(int argc, char **argv) {
\tint total = 0;
\tfor (int i = 0; i < argc; i++) {
\t\ttotal += i * 2;
\t}
\tprintf("total = %d\\n", total);
\treturn 0;
}
"""

SAMPLE_TEXTS = (SAMPLE_PROSE, SAMPLE_CODE, SAMPLE_C, "Grüße aus Köln — naïve café, 東京 と 大阪, 😀 emoji.\n")


@functools.lru_cache(maxsize=8)
def _tiny_model(vocab_size: int) -> bytes:
    import tempfile

    from omniloom.tokenizers.text import MODEL_FILE, train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        # character_coverage < 1 keeps the handful of rare non-ASCII characters in byte fallback
        train_tokenizer(list(SAMPLE_TEXTS) * 2, tmp, vocab_size, character_coverage=0.995, num_threads=1)
        with open(os.path.join(tmp, MODEL_FILE), "rb") as f:
            return f.read()


def write_doc_shard(path, docs) -> None:
    """A WebDataset-style tar of omniloom documents: for each (key, doc, {ref: bytes}), KEY.doc.json
    first, then its KEY.<ref> media members (what `omniloom data build` writes, without a manifest)."""
    import json
    import tarfile

    with tarfile.open(path, "w") as tar:
        for key, doc, media in docs:
            for name, data in [("doc.json", json.dumps(doc).encode()), *media.items()]:
                info = tarfile.TarInfo(f"{key}.{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def make_tiny_tokenizer(tmp_dir: str | os.PathLike, vocab_size: int = 512, settings: MediaSettings | None = None, **setting_overrides) -> Tokenizer:
    """Train (once per process and vocab size) a tiny tokenizer on the built-in sample, save it
    into tmp_dir and return it loaded. Media settings default to small ones fit for tests
    (p=8, 16 image patches, 8 patches per video frame, 4 frames) unless given.
    """
    if settings is None:
        base = dict(patch_size=8, temporal_patch_size=2, image_patch_budget=16, video_patch_budget=8, video_frame_budget=4)
        base.update(setting_overrides)
        settings = MediaSettings(**base)
    elif setting_overrides:
        settings = settings.replace(**setting_overrides)
    tok = Tokenizer(_tiny_model(vocab_size), settings, {"training": {"corpus": {"source": "omniloom.tokenizers.testing sample"}}})
    tok.save(tmp_dir)
    return Tokenizer.load(tmp_dir)


def make_image_bytes(width: int, height: int, mode: str = "RGB", fmt: str = "PNG", seed: int = 0, exif_orientation: int | None = None) -> bytes:
    """A smooth synthetic image (gradients plus a little noise) encoded in memory.

    mode: any PIL mode ("RGB", "RGBA", "L", "P", "CMYK", "I;16", "LA", "1"); fmt: "PNG", "JPEG",
    "WEBP", "GIF", "TIFF", "BMP". exif_orientation writes an EXIF Orientation tag (JPEG/WEBP/PNG).
    """
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    r = 255 * xx / max(1, width - 1)
    g = 255 * yy / max(1, height - 1)
    b = 128 + 100 * np.sin((xx + yy) / 7.0)
    rgb = np.stack([r, g, b], -1) + rng.normal(0, 4, (height, width, 3))
    rgb = np.clip(rgb, 0, 255).astype(np.uint8)
    img = Image.fromarray(rgb, "RGB")
    if mode == "I;16":
        arr = (rgb[..., 0].astype(np.uint16) * 257)
        img = Image.fromarray(arr)  # uint16 -> mode I;16
    elif mode == "RGBA":
        alpha = np.clip(255 * xx / max(1, width - 1), 0, 255).astype(np.uint8)
        img = Image.fromarray(np.dstack([rgb, alpha]), "RGBA")
    elif mode == "P":
        img = img.quantize(16)
    elif mode != "RGB":
        img = img.convert(mode)
    buf = io.BytesIO()
    kwargs = {}
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        kwargs["exif"] = exif.tobytes()
    img.save(buf, format=fmt, **kwargs)
    return buf.getvalue()


def make_video_bytes(
    seconds: float = 2.0,
    fps: float = 10,
    width: int = 64,
    height: int = 48,
    codec: str = "libx264",
    container: str = "mp4",
    vfr_times: list[float] | None = None,
    rotation: int = 0,
) -> bytes:
    """A synthetic moving-gradient video encoded in memory with PyAV.

    With vfr_times, frames are written at exactly those timestamps (seconds): variable frame rate.
    rotation (degrees counterclockwise) is stored as the display matrix, as phones record portrait video.
    The frame index is drawn as a flat gray top-left quadrant (value 10*i mod 256, which survives
    chroma subsampling, lossy coding and resizing), so tests can tell which frame was sampled.
    """
    import av

    if codec == "libx265" and (width < 64 or height < 48):
        # libx265 (4.x, through PyAV 18) corrupts the heap on frames smaller than this
        raise ValueError("libx265 test videos need width >= 64 and height >= 48")
    times = vfr_times if vfr_times is not None else [i / fps for i in range(int(round(seconds * fps)))]
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        rate = Fraction(fps).limit_denominator(1000)
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height = width, height
        if rotation:
            stream.set_display_rotation(rotation)
        stream.pix_fmt = "yuv420p" if codec not in ("mjpeg",) else "yuvj420p"
        time_base = Fraction(1, 1000)
        stream.codec_context.time_base = time_base
        if codec in ("libx264", "libx265"):
            stream.options = {"preset": "ultrafast", "g": "12"} if codec == "libx264" else {"preset": "ultrafast", "x265-params": "log-level=none"}
        yy, xx = np.mgrid[0:height, 0:width]
        for i, t in enumerate(times):
            arr = np.zeros((height, width, 3), np.uint8)
            arr[..., 0] = (xx * 255 // max(1, width - 1) + i * 9) % 256
            arr[..., 1] = (yy * 255 // max(1, height - 1)) % 256
            arr[..., 2] = (i * 23) % 256
            arr[: height // 2, : width // 2, :] = (10 * i) % 256
            frame = av.VideoFrame.from_ndarray(arr, format="rgb24")
            frame.pts = int(round(t / time_base))
            frame.time_base = time_base
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()
