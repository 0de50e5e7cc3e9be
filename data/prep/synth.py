"""Synthetic inputs for data-prep tests and `omniloom bench data`: small but real images and videos
(encoded by PIL and PyAV), prose, code, HTML and JSONL documents, and a corpus of bad inputs that
every validator must reject with a reason. Nothing here touches the network.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from fractions import Fraction
from pathlib import Path


def make_image(path: str | Path, *, size=(48, 32), mode: str = "RGB", fmt: str | None = None, seed: int = 0) -> Path:
    """Write a gradient-plus-noise image (distinct per `seed`) in the format given by the suffix."""
    import numpy as np
    from PIL import Image

    path = Path(path)
    w, h = size
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([(xx * 255 // max(1, w - 1)), (yy * 255 // max(1, h - 1)), np.full_like(xx, (seed * 37) % 256)], -1)
    arr = (arr + rng.integers(0, 32, arr.shape)).clip(0, 255).astype("uint8")
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, format=fmt)
    return path


def make_video(
    path: str | Path, *, codec: str = "mpeg4", frames: int = 8, size=(32, 32), fps: int = 8, seed: int = 0, audio: bool = False, faststart: bool = False
) -> Path:
    """Encode a short moving-gradient video with PyAV; the container follows the suffix."""
    import av
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w, h = size
    opts = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", options=opts) as out:
        stream = out.add_stream(codec, rate=fps)
        stream.width, stream.height = w, h
        stream.pix_fmt = "yuvj420p" if codec == "mjpeg" else "yuv420p"
        if audio:
            astream = out.add_stream("aac", rate=8000)
        yy, xx = np.mgrid[0:h, 0:w]
        for i in range(frames):
            arr = np.stack([(xx * 8 + i * 16 + seed * 5) % 256, (yy * 8 + seed * 11) % 256, np.full_like(xx, (i * 30) % 256)], -1)
            frame = av.VideoFrame.from_ndarray(arr.astype("uint8"), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if audio:
            _encode_tone(out, astream, seconds=frames / fps)
    return path


def _encode_tone(out, astream, *, seconds: float) -> None:
    import av
    import numpy as np

    rate = astream.codec_context.sample_rate
    n = int(rate * seconds)
    samples = (np.sin(np.arange(n) * 2 * np.pi * 440 / rate) * 0.3).astype("float32")
    chunk = astream.codec_context.frame_size or 1024
    for start in range(0, n, chunk):
        part = samples[start : start + chunk]
        frame = av.AudioFrame.from_ndarray(part[None, :], format="fltp", layout="mono")
        frame.sample_rate = rate
        frame.pts = start
        frame.time_base = Fraction(1, rate)
        for packet in astream.encode(frame):
            out.mux(packet)
    for packet in astream.encode():
        out.mux(packet)


def make_audio_only(path: str | Path, seconds: float = 0.5) -> Path:
    """An .mp4 (or any suffix) holding only an AAC audio stream."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as out:
        astream = out.add_stream("aac", rate=8000)
        _encode_tone(out, astream, seconds=seconds)
    return path


def huge_png_header(path: str | Path, width: int = 100_000, height: int = 100_000) -> Path:
    """A tiny PNG that declares a `width` x `height` canvas (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\x00" * 64)
    data = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
    Path(path).write_bytes(data)
    return Path(path)


PROSE = [
    "The loom weaves threads of text, pixels and motion into one cloth.",
    "A river remembers every stone it has passed, and sings about them at night.",
    "Small tests, honest numbers, and clear errors make a pipeline people trust.",
    "Sparse attention looks only where it matters, like a reader skimming a map.",
]

CODE = {
    "py": "def add(a, b):\n    return a + b\n",
    "rs": "fn main() {\n    println!(\"hi\");\n}\n",
    "go": "package main\n\nfunc main() {}\n",
    "c": "int main(void) { return 0; }\n",
    "js": "export const f = (x) => x * 2;\n",
    "sh": "#!/bin/sh\necho hello\n",
    "sql": "SELECT 1;\n",
    "yaml": "a: 1\nb: [2, 3]\n",
}


def make_good_corpus(root: str | Path, *, n_text: int = 4, n_images: int = 4, n_videos: int = 2, image_size=(48, 32), seed: int = 0) -> dict:
    """Write a corpus of valid inputs of every kind under `root`; return what it wrote, by kind, as
    paths relative to `root` (the tests check each is present in the shards)."""
    root = Path(root)
    written: dict[str, list[str]] = {"text": [], "code": [], "image": [], "video": [], "html": [], "jsonl": []}
    for i in range(n_text):
        p = root / "prose" / f"note{i:03d}.{['txt', 'md', 'rst'][i % 3]}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"{PROSE[i % len(PROSE)]} (note {i}, seed {seed})\n")
        written["text"].append(str(p.relative_to(root)))
    for ext, src in CODE.items():
        p = root / "code" / f"sample_{seed}.{ext}"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src + f"// {seed}\n" if ext in ("rs", "go", "c", "js") else src)
        written["code"].append(str(p.relative_to(root)))
    formats = [("jpg", "RGB"), ("png", "RGBA"), ("webp", "RGB"), ("gif", "P"), ("bmp", "RGB"), ("tiff", "L"), ("png", "L"), ("jpg", "L")]
    for i in range(n_images):
        ext, mode = formats[i % len(formats)]
        p = make_image(root / "images" / f"pic{i:03d}.{ext}", size=image_size, mode=mode, seed=seed * 1000 + i)
        if i % 2 == 0:
            p.with_suffix(".txt").write_text(f"caption for picture {i}")
        elif i % 4 == 1:
            p.with_suffix(".json").write_text(json.dumps({"caption": f"json caption {i}", "license": "CC0"}))
        written["image"].append(str(p.relative_to(root)))
    videos = [("mp4", "mpeg4"), ("mkv", "libvpx-vp9"), ("avi", "mjpeg"), ("webm", "libvpx")]
    for i in range(n_videos):
        ext, codec = videos[i % len(videos)]
        p = make_video(root / "videos" / f"clip{i:03d}.{ext}", codec=codec, seed=seed * 1000 + i)
        p.with_suffix(".txt").write_text(f"a clip numbered {i}")
        written["video"].append(str(p.relative_to(root)))
    # An HTML page with two local images and a video, OBELICS-style.
    web = root / "web"
    make_image(web / "media" / "a.png", size=image_size, seed=seed * 1000 + 501)
    make_image(web / "media" / "b.jpg", size=image_size, seed=seed * 1000 + 502)
    (web / "page.html").write_text(
        "<html><head><title>T</title><style>p{}</style><script>var x=1;</script></head><body>"
        f"<h1>Weaving {seed}</h1><p>First paragraph   with\n spaces.</p><img src='media/a.png' alt='A'>"
        "<p>Between the pictures.</p><div><img src=\"media/b.jpg\"></div><p>The end.</p></body></html>"
    )
    written["html"].append("web/page.html")
    # JSONL: one omniloom-schema record and one OBELICS record, media relative to the JSONL file.
    jdir = root / "jsonl"
    make_image(jdir / "img" / "j1.png", size=image_size, seed=seed * 1000 + 601)
    make_image(jdir / "img" / "j2.jpg", size=image_size, seed=seed * 1000 + 602)
    make_video(jdir / "img" / "v1.mp4", seed=seed * 1000 + 603)
    recs = [
        {"schema": 1, "segments": [{"type": "text", "text": f"Look {seed}:"}, {"type": "image", "path": "img/j1.png"},
                                   {"type": "code", "lang": "python", "text": "print(1)\n"}, {"type": "video", "ref": "img/v1.mp4"}],
         "meta": {"license": "CC-BY"}},
        {"texts": [f"Obelics intro {seed}", None, "outro"], "images": [None, "img/j2.jpg", None], "metadata": "[]"},
    ]
    (jdir / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    written["jsonl"] += ["jsonl/docs.jsonl:1", "jsonl/docs.jsonl:2"]
    return written


def make_bad_corpus(root: str | Path) -> dict[str, str]:
    """Write one bad input per failure class under `root`; return {relative path: expected reject
    code}. JSONL entries name the line as `path:N`."""
    root = Path(root)
    bad = root / "bad"
    bad.mkdir(parents=True, exist_ok=True)
    expected = {}
    good_jpg = make_image(bad / "_full.jpg", size=(64, 64), seed=99).read_bytes()
    (bad / "_full.jpg").unlink()
    (bad / "truncated.jpg").write_bytes(good_jpg[: len(good_jpg) // 2])
    expected["bad/truncated.jpg"] = "corrupt-image"
    (bad / "zero.png").write_bytes(b"")
    expected["bad/zero.png"] = "empty"
    (bad / "empty.txt").write_bytes(b"")
    expected["bad/empty.txt"] = "empty"
    huge_png_header(bad / "bomb.png")
    expected["bad/bomb.png"] = "image-bomb"
    (bad / "fake.mp4").write_text("this is text, not a video\n" * 10)
    expected["bad/fake.mp4"] = "not-a-video"
    full = make_video(bad / "_full.mp4", frames=24, size=(32, 32)).read_bytes()
    (bad / "_full.mp4").unlink()
    (bad / "cut.mp4").write_bytes(full[: int(len(full) * 0.6)])  # moov at the end: index lost
    expected["bad/cut.mp4"] = "no-video-stream"
    fast = make_video(bad / "_fast.mp4", frames=48, size=(32, 32), faststart=True).read_bytes()
    (bad / "_fast.mp4").unlink()
    (bad / "cutindex.mp4").write_bytes(fast[: int(len(fast) * 0.5)])  # index kept, data gone
    expected["bad/cutindex.mp4"] = "truncated-video"
    make_audio_only(bad / "voice.mp4")
    expected["bad/voice.mp4"] = "audio-only"
    # An undeclared legacy encoding is detected and kept (a counted notice); bytes that only look
    # like text to no encoding (controls and high bytes, no NULs) are still bad UTF-8.
    (bad / "latin1.txt").write_bytes(
        "Le matin, la boulang\xe8re ouvre sa boutique \xe0 six heures. Les croissants sont encore ti\xe8des "
        "quand arrive un \xe9tudiant press\xe9 qui commande un caf\xe9 cr\xe8me, comme toujours.\n".encode("latin-1"))
    expected["bad/latin1.txt"] = "encoding-detected"
    (bad / "undecodable.txt").write_bytes(bytes((i * 151 + 7) % 255 + 1 for i in range(512)))
    expected["bad/undecodable.txt"] = "bad-utf8"
    (bad / "nul.py").write_bytes(b"print(1)\x00\x00\n")
    expected["bad/nul.py"] = "nul-bytes"
    make_image(bad / "thin.png", size=(400, 16), seed=5)
    expected["bad/thin.png"] = "image-aspect"
    lines = [
        '{"schema": 1, "segments": [{"type": "text", "text": "fine line"}]}',
        '{"schema": 1, "segments": [{"type": "text", "text": "unterminated',
        '{"schema": 1, "segments": [{"type": "sound", "ref": "x.wav"}]}',
        '{"schema": 1, "segments": [{"type": "image", "path": "../../etc/passwd"}]}',
        '[1, 2, 3]',
        '{"schema": 1, "segments": [{"type": "image", "path": "missing.png"}]}',
    ]
    (bad / "docs.jsonl").write_text("\n".join(lines) + "\n")
    expected["bad/docs.jsonl:2"] = "bad-json"
    expected["bad/docs.jsonl:3"] = "schema"
    expected["bad/docs.jsonl:4"] = "escapes-root"
    expected["bad/docs.jsonl:5"] = "schema"
    expected["bad/docs.jsonl:6"] = "missing"
    os.symlink("loop_b", bad / "loop_a.png")
    os.symlink("loop_a.png", bad / "loop_b")
    expected["bad/loop_a.png"] = "symlink-loop"
    expected["bad/loop_b"] = "symlink-loop"
    outside = root.parent / f"{root.name}_outside.txt"
    outside.write_text("secret outside the root\n")
    os.symlink(outside, bad / "escape.txt")
    expected["bad/escape.txt"] = "escapes-root"
    return expected
