"""`omniloom data demo-corpus`: a small, deterministic, offline corpus for the demo and tests.

Two kinds of material:
- real files that installed packages ship: source code from Python's standard library, prose from
  its bundled documentation (`pydoc_data.topics`), and the sample photographs scikit-image ships
  (when it is installed; the `demo` extra adds it);
- generated captioned images and videos whose captions can only be predicted by looking: shapes of
  several colours, sizes and positions ("a large red circle at the top left"), and short videos of
  a shape moving in a direction ("a blue square moves left"); some as interleaved documents
  (text, image, text, video, code).

Layout written (the input of `omniloom data build`):

    OUT/train/  photos/ (png + .txt caption sidecars), stdlib/ (.py), docs/ (.txt),
                shapes.jsonl + shapes/, motion.jsonl + motion/, interleaved.jsonl
    OUT/heldout/ shapes.jsonl + shapes/, motion.jsonl + motion/   (held-out synthetic captions)

Synthetic documents put the visual first and the caption after it, so that caption tokens can
attend to the pixels: the cross-modal gap of `omniloom eval` measures exactly that.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 200),
    "white": (245, 245, 245),
}
SHAPES = ("circle", "square", "triangle")
SIZES = {"small": 0.22, "large": 0.42}  # shape extent as a share of the image side
ROWS = ("top", "middle", "bottom")
COLS = ("left", "center", "right")
DIRECTIONS = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
BACKGROUND = (24, 24, 28)

# Standard-library modules whose source is copied in (stable, pure-Python, varied style).
STDLIB_MODULES = (
    "bisect.py", "heapq.py", "textwrap.py", "fnmatch.py", "shlex.py", "colorsys.py", "graphlib.py",
    "queue.py", "sched.py", "statistics.py", "string.py", "this.py", "keyword.py", "numbers.py",
    "abc.py", "base64.py", "calendar.py", "copy.py", "csv.py", "difflib.py", "dataclasses.py",
    "functools.py", "glob.py", "gzip.py", "hmac.py", "ipaddress.py", "json/__init__.py",
    "json/decoder.py", "json/encoder.py", "operator.py", "pprint.py", "random.py", "secrets.py",
    "selectors.py", "shutil.py", "struct.py", "tempfile.py", "timeit.py", "tokenize.py",
    "traceback.py", "uuid.py", "weakref.py", "zipapp.py",
)
PHOTOS = {
    "astronaut.png": "a photograph of an astronaut in a white suit in front of a flag",
    "coffee.png": "a photograph of a cup of coffee on a saucer",
    "chelsea.png": "a photograph of a tabby cat named chelsea",
    "rocket.jpg": "a photograph of a rocket on its launch pad",
    "motorcycle_left.png": "a photograph of a motorcycle seen from the left",
    "horse.png": "a silhouette of a horse",
    "camera.png": "a black and white photograph of a man with a camera",
    "coins.png": "a photograph of old coins on a dark background",
    "hubble_deep_field.jpg": "a telescope image of distant galaxies",
}


@dataclass(kw_only=True)
class DemoCorpusSettings:
    seed: int = 0
    image_size: int = 64
    # distinct training images and clips: the demo's model reads small shapes and clips it never
    # saw far better from 4x / 12x these than from 1,600 / 400 (BENCHMARKS.md, issue 29)
    num_images: int = 6400
    num_videos: int = 4800
    num_heldout_images: int = 200
    num_heldout_videos: int = 100
    num_interleaved: int = 60
    video_frames: int = 8
    video_fps: int = 4
    max_doc_topics: int = 80


def _draw_shape(draw, shape: str, cx: float, cy: float, r: float, color) -> None:
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        draw.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    else:
        draw.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=color)


def _shape_image(rng: np.random.Generator, size: int):
    """One or two shapes on a dark background; returns (PIL image, caption)."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(img)
    color = str(rng.choice(list(COLORS)))
    shape = str(rng.choice(SHAPES))
    size_name = str(rng.choice(list(SIZES)))
    row, col = int(rng.integers(3)), int(rng.integers(3))
    r = SIZES[size_name] * size / 2 * rng.uniform(0.85, 1.15)
    cell = size / 3
    cx = (col + 0.5) * cell + rng.uniform(-0.08, 0.08) * size
    cy = (row + 0.5) * cell + rng.uniform(-0.08, 0.08) * size
    cx, cy = min(max(cx, r), size - r), min(max(cy, r), size - r)  # keep the whole shape visible
    _draw_shape(draw, shape, cx, cy, r, COLORS[color])
    where = "in the center" if (ROWS[row], COLS[col]) == ("middle", "center") else f"at the {ROWS[row]} {COLS[col]}"
    return img, f"a {size_name} {color} {shape} {where}."


def parse_caption(text: str) -> dict | None:
    """The attributes of a caption in the demo's grammar (the inverse of `_shape_image` and
    `_motion_video`), or None for any other text. Images: kind, size, colour, shape, row, column
    ("in the center" is the middle row and centre column); videos: kind, colour, shape, direction."""
    m = _IMAGE_CAPTION.fullmatch(text.strip())
    if m:
        size, colour, shape, where = m.group("size", "colour", "shape", "where")
        row, col = ("middle", "center") if where == "in the center" else where.removeprefix("at the ").split(" ")
        if (row, col) == ("middle", "center") and where != "in the center":
            return None  # the generator never writes "at the middle center"
        return {"kind": "image", "colour": colour, "size": size, "shape": shape, "row": row, "column": col}
    m = _VIDEO_CAPTION.fullmatch(text.strip())
    if m:
        return {"kind": "video", "colour": m["colour"], "shape": m["shape"], "direction": m["direction"]}
    return None


_ALT = "|".join
_IMAGE_CAPTION = re.compile(
    rf"a (?P<size>{_ALT(SIZES)}) (?P<colour>{_ALT(COLORS)}) (?P<shape>{_ALT(SHAPES)}) "
    rf"(?P<where>in the center|at the (?:{_ALT(ROWS)}) (?:{_ALT(COLS)}))\."
)
_VIDEO_CAPTION = re.compile(rf"a (?P<colour>{_ALT(COLORS)}) (?P<shape>{_ALT(SHAPES)}) moves (?P<direction>{_ALT(DIRECTIONS)})\.")


def _encode_mp4(frames: list, fps: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames[0].shape[1], frames[0].shape[0]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.thread_count = 1  # deterministic bytes
        stream.options = {"qscale": "3"}
        for arr in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def _motion_video(rng: np.random.Generator, size: int, num_frames: int, fps: int):
    """A shape moving in one direction; returns (mp4 bytes, caption)."""
    from PIL import Image, ImageDraw

    color = str(rng.choice(list(COLORS)))
    shape = str(rng.choice(SHAPES))
    direction = str(rng.choice(list(DIRECTIONS)))
    dx, dy = DIRECTIONS[direction]
    # size, path length and the lane across the motion vary so clips are rarely identical
    r = rng.uniform(0.11, 0.19) * size
    travel = rng.uniform(0.35, 0.6) * size
    lane = rng.uniform(-0.2, 0.2) * size
    cx0 = size / 2 - dx * travel / 2 + lane * (dx == 0)
    cy0 = size / 2 - dy * travel / 2 + lane * (dy == 0)
    frames = []
    for i in range(num_frames):
        t = i / max(1, num_frames - 1)
        img = Image.new("RGB", (size, size), BACKGROUND)
        _draw_shape(ImageDraw.Draw(img), shape, cx0 + dx * travel * t, cy0 + dy * travel * t, r, COLORS[color])
        frames.append(np.asarray(img))
    return _encode_mp4(frames, fps), f"a {color} {shape} moves {direction}."


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def _write_jsonl(path: Path, docs: list[dict]) -> None:
    path.write_text("".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs), encoding="utf-8")


def _unique(draw, seen: set[str]) -> tuple[bytes, str]:
    """(media bytes, caption) from `draw()`, drawn again while the bytes repeat media in `seen`
    (sha256); the result's digest joins `seen`."""
    for _ in range(1000):
        data, caption = draw()
        digest = hashlib.sha256(data).hexdigest()
        if digest not in seen:
            seen.add(digest)
            return data, caption
    raise RuntimeError(f"could not draw media unlike the {len(seen)} already written; lower the count")


def _draw_image(rng, settings: DemoCorpusSettings) -> tuple[bytes, str]:
    img, caption = _shape_image(rng, settings.image_size)
    return _png_bytes(img), caption


def _draw_video(rng, settings: DemoCorpusSettings) -> tuple[bytes, str]:
    return _motion_video(rng, settings.image_size, settings.video_frames, settings.video_fps)


def _captioned_set(root: Path, name: str, rng, count: int, settings: DemoCorpusSettings, video: bool,
                   seen: set[str] | None = None) -> list[str]:
    """`count` captioned images or clips under root/name and root/name.jsonl; their captions.
    `seen`: sha256 of media already written (the held-out set's, for the training set): a draw
    that repeats one pixel for pixel is drawn again, so no held-out document is ever trained on
    and no training document is a copy of another. What is written joins `seen`."""
    media_dir = root / name
    media_dir.mkdir(parents=True, exist_ok=True)
    seen = set() if seen is None else seen
    docs, captions = [], []
    for i in range(count):
        if video:
            data, caption = _unique(lambda: _draw_video(rng, settings), seen)
            ref, kind = f"{name}/{i:06d}.mp4", "video"
        else:
            data, caption = _unique(lambda: _draw_image(rng, settings), seen)
            ref, kind = f"{name}/{i:06d}.png", "image"
        (root / ref).write_bytes(data)
        docs.append({
            "schema": 1,
            "segments": [{"type": kind, "ref": ref}, {"type": "text", "text": caption}],
            "meta": {"source": "omniloom-demo-synthetic", "caption": caption, "license": "CC0-1.0"},
        })
        captions.append(caption)
    _write_jsonl(root / f"{name}.jsonl", docs)
    return captions


def _copy_stdlib(dest: Path) -> int:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for rel in STDLIB_MODULES:
        src = stdlib / rel
        if src.is_file():
            shutil.copyfile(src, dest / rel.replace("/", "_"))
            n += 1
    return n


def _write_docs(dest: Path, max_topics: int) -> int:
    from pydoc_data.topics import topics

    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(topics)[:max_topics]
    for name in names:
        (dest / f"{name}.txt").write_text(topics[name], encoding="utf-8")
    return len(names)


def _copy_photos(dest: Path) -> int:
    try:
        import skimage
    except ModuleNotFoundError:
        log.warning("scikit-image is not installed: the demo corpus has no sample photographs (pip install 'omniloom[demo]')")
        return 0
    src_dir = Path(skimage.__file__).parent / "data"
    dest.mkdir(parents=True, exist_ok=True)
    n = 0
    for name, caption in PHOTOS.items():
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, dest / name)
            (dest / name).with_suffix(".txt").write_text(caption + "\n", encoding="utf-8")
            n += 1
    return n


def _interleaved(root: Path, rng, settings: DemoCorpusSettings, stdlib_dir: Path, seen: set[str]) -> int:
    media = root / "interleaved"
    media.mkdir(parents=True, exist_ok=True)
    code_files = sorted(stdlib_dir.glob("*.py"))
    docs = []
    for i in range(settings.num_interleaved):
        img, img_caption = _unique(lambda: _draw_image(rng, settings), seen)
        vid, vid_caption = _unique(lambda: _draw_video(rng, settings), seen)
        (media / f"{i:06d}.png").write_bytes(img)
        (media / f"{i:06d}.mp4").write_bytes(vid)
        code = ""
        if code_files:
            lines = code_files[i % len(code_files)].read_text(encoding="utf-8").splitlines()
            start = int(rng.integers(0, max(1, len(lines) - 12)))
            code = "\n".join(lines[start:start + 12]) + "\n"
        segments = [
            {"type": "text", "text": f"Scene {i}. First a still picture:"},
            {"type": "image", "ref": f"interleaved/{i:06d}.png"},
            {"type": "text", "text": f"It shows {img_caption} Then a short clip:"},
            {"type": "video", "ref": f"interleaved/{i:06d}.mp4"},
            {"type": "text", "text": f"In it {vid_caption} The code that drew them is not this one:"},
        ]
        if code:
            segments.append({"type": "code", "lang": "python", "text": code})
        docs.append({"schema": 1, "segments": segments, "meta": {"source": "omniloom-demo-synthetic", "license": "CC0-1.0"}})
    _write_jsonl(root / "interleaved.jsonl", docs)
    return len(docs)


def write_demo_corpus(out: str | Path, settings: DemoCorpusSettings | None = None) -> dict:
    """Write the demo corpus under `out` (train/ and heldout/); returns counts per part."""
    settings = settings or DemoCorpusSettings()
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty; pass an empty or new folder")
    train, heldout = out / "train", out / "heldout"
    train.mkdir(parents=True)
    heldout.mkdir(parents=True)
    rng = np.random.default_rng(settings.seed)
    counts = {
        "stdlib_files": _copy_stdlib(train / "stdlib"),
        "doc_topics": _write_docs(train / "docs", settings.max_doc_topics),
        "photos": _copy_photos(train / "photos"),
    }
    from tqdm import tqdm

    with tqdm(total=4, desc="demo corpus", unit="part", disable=None) as bar:
        # the held-out set first, so that no training image or clip repeats one of them pixel for
        # pixel (shapes are drawn on a pixel grid: identical draws happen, ~7% of 7,500)
        held_rng, seen = np.random.default_rng(settings.seed + 1_000_003), set()
        counts["heldout_images"] = len(_captioned_set(heldout, "shapes", held_rng, settings.num_heldout_images, settings,
                                                      video=False, seen=seen))
        counts["heldout_videos"] = len(_captioned_set(heldout, "motion", held_rng, settings.num_heldout_videos, settings,
                                                      video=True, seen=seen)); bar.update()
        counts["images"] = len(_captioned_set(train, "shapes", rng, settings.num_images, settings, video=False, seen=seen)); bar.update()
        counts["videos"] = len(_captioned_set(train, "motion", rng, settings.num_videos, settings, video=True, seen=seen)); bar.update()
        counts["interleaved"] = _interleaved(train, rng, settings, train / "stdlib", seen); bar.update()
    (out / "README.txt").write_text(
        "omniloom demo corpus (generated by `omniloom data demo-corpus`).\n"
        "train/: stdlib source, pydoc topics, sample photos, synthetic captioned shapes/motion, interleaved docs.\n"
        "heldout/: synthetic captioned shapes and motion clips for evaluation.\n"
        f"counts: {json.dumps(counts, sort_keys=True)}\n",
        encoding="utf-8",
    )
    return counts


def register_demo_corpus(data_sub) -> None:
    """Adds `omniloom data demo-corpus` to the `data` command group."""
    p = data_sub.add_parser(
        "demo-corpus",
        help="write a small deterministic offline demo corpus (real stdlib/docs/photos + synthetic captioned shapes and motion)",
        description=__doc__.split("\n\n")[0] + " The output feeds `omniloom data build OUT/train` and `OUT/heldout`.",
    )
    p.add_argument("--out", required=True, help="output folder (new or empty)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-images", type=int, default=DemoCorpusSettings.num_images, help="synthetic captioned images for training")
    p.add_argument("--num-videos", type=int, default=DemoCorpusSettings.num_videos, help="synthetic motion clips for training")
    p.add_argument("--num-heldout-images", type=int, default=DemoCorpusSettings.num_heldout_images)
    p.add_argument("--num-heldout-videos", type=int, default=DemoCorpusSettings.num_heldout_videos)
    p.add_argument("--num-interleaved", type=int, default=DemoCorpusSettings.num_interleaved)
    p.add_argument("--image-size", type=int, default=DemoCorpusSettings.image_size, help="side of generated images and clips, pixels")
    p.set_defaults(func=_cmd)


def _cmd(args) -> int:
    settings = DemoCorpusSettings(
        seed=args.seed, image_size=args.image_size, num_images=args.num_images, num_videos=args.num_videos,
        num_heldout_images=args.num_heldout_images, num_heldout_videos=args.num_heldout_videos,
        num_interleaved=args.num_interleaved,
    )
    counts = write_demo_corpus(args.out, settings)
    print(f"demo corpus written to {args.out}: " + ", ".join(f"{k}={v}" for k, v in counts.items()))
    return 0
