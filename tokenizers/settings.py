"""Image/video tokenizer settings (kept in omniloom_tokenizer.json) and the errors the data loader counts.

The model's patch_dim (3*p*p) and tubelet_dim (3*tp*p*p) follow from these settings, so they
travel with the tokenizer rather than with the model config.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, fields

VIDEO_SAMPLING = ("clip", "spread")
PATCH_DTYPES = ("float32", "float16")  # numpy has no bfloat16; cast on the device


class DocumentError(ValueError):
    """A document that cannot be tokenized (bad segment, missing media ref, undecodable media).

    `reason` is a short stable code (`missing_media`, `bad_segment`, `undecodable`, ...) the loader
    uses as a counter name when it skips the document.
    """

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


class MediaError(DocumentError):
    """Image or video bytes that yield no usable pixels. Reasons: `undecodable` (not an image/video
    or broken headers), `no_video_stream`, `no_frames` (no frame decodes), `too_large` (over the
    pixel limit), `empty` (zero bytes or a zero-sized picture)."""


# The range of every numeric media setting, (low, high) inclusive: a tokenizer file is read from
# exports others wrote, and these numbers size allocations (video_fps=1e4 with a frame budget of
# 1e6 sampled 20,000 frames of a 2 s clip: 8.7 GB). Wide enough for any real model.
MEDIA_RANGES: dict[str, tuple[type, float, float]] = {
    "patch_size": (int, 1, 128),
    "temporal_patch_size": (int, 1, 64),
    "image_patch_budget": (int, 1, 65_536),
    "video_fps": (float, 0.001, 240.0),
    "video_frame_budget": (int, 1, 4096),
    "video_patch_budget": (int, 1, 65_536),
    "video_clip_start": (float, 0.0, 1e7),
    "video_threads": (int, 0, 256),
    "max_image_pixels": (int, 1, 1 << 28),
}
TRIPLES = {"pixel_mean": (float, 0.0, 1.0), "pixel_std": (float, 0.001, 1000.0), "alpha_background": (int, 0, 255)}
# The most values one visual block's patches may hold: 2**25 float32 values, 128 MiB (the
# defaults' largest video block holds 688,128). Checked from the settings before any decoding, so
# the memory of one block is bounded whatever the file says.
MAX_BLOCK_VALUES = 1 << 25


def _is_number(value, tp: type) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if tp is int else isinstance(value, (int, float)) and math.isfinite(value)


def _range_problems(s) -> list[str]:
    """What is wrong with each setting on its own: its type, then its range."""
    problems = []
    for name, (tp, low, high) in MEDIA_RANGES.items():
        value = getattr(s, name)
        if not _is_number(value, tp):
            problems.append(f"{name}={value!r} must be {'a whole number' if tp is int else 'a finite number'}")
        elif not low <= value <= high:
            problems.append(f"{name}={value!r} is out of range ({low:g} to {high:g})")
    for name, (tp, low, high) in TRIPLES.items():
        value = getattr(s, name)
        if not isinstance(value, (list, tuple)) or len(value) != 3 or not all(_is_number(v, tp) for v in value):
            problems.append(f"{name}={value!r} must be 3 {'whole' if tp is int else 'finite'} numbers")
        elif not all(low <= v <= high for v in value):
            problems.append(f"{name}={list(value)} is out of range (each {low:g} to {high:g})")
    for name, choices in (("video_sampling", VIDEO_SAMPLING), ("patch_dtype", PATCH_DTYPES)):
        if getattr(s, name) not in choices:
            problems.append(f"{name} must be one of {choices}, got {getattr(s, name)!r}")
    if not isinstance(s.jpeg_draft, bool):
        problems.append(f"jpeg_draft={s.jpeg_draft!r} must be true or false")
    return problems


def _block_problems(s) -> list[str]:
    """Settings each in range that together would make one visual block too large."""
    problems = []
    cap_mib = MAX_BLOCK_VALUES * 4 >> 20
    image = s.image_patch_budget * s.patch_dim
    if image > MAX_BLOCK_VALUES:
        problems.append(f"one image block would hold {s.image_patch_budget} patches x {s.patch_dim} values "
                        f"({image * 4 >> 20} MiB as float32), over the {cap_mib} MiB a block may take: lower "
                        "image_patch_budget or patch_size")
    video = s.max_video_patches * s.tubelet_dim
    if video > MAX_BLOCK_VALUES:
        problems.append(f"one video block would hold {s.max_video_patches} tubelets x {s.tubelet_dim} values "
                        f"({video * 4 >> 20} MiB as float32), over the {cap_mib} MiB a block may take: lower "
                        "video_frame_budget, video_patch_budget, temporal_patch_size or patch_size")
    return problems


@dataclass(frozen=True, kw_only=True)
class MediaSettings:
    """How images and videos become patch vectors (docs/data-format.md section 4).

    Images: resized keeping the aspect ratio so (H/p)*(W/p) <= image_patch_budget, sides multiples
    of p (never below one patch). Videos: frames sampled by timestamp at video_fps, at most
    video_frame_budget frames (`clip`: the first ones, from video_clip_start seconds; `spread`:
    spread evenly over the whole video), each frame resized so (H/p)*(W/p) <= video_patch_budget,
    grouped by temporal_patch_size frames into tubelets. Pixels are normalized per channel as
    (x/255 - mean) / std.
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    image_patch_budget: int = 256
    video_fps: float = 2.0
    # 14 frames = 7 tubelet groups of 64 patches: a video block of 450 tokens, which fits the shipped
    # presets' shortest rows (seq_len 512; tests/pretrain/test_config.py checks every preset against these defaults)
    video_frame_budget: int = 14
    video_patch_budget: int = 64
    video_sampling: str = "clip"
    video_clip_start: float = 0.0
    video_threads: int = 0  # 0: one thread for frames up to 320x240, else FFmpeg's pick (frame threads); N: N threads
    pixel_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    pixel_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    patch_dtype: str = "float32"
    max_image_pixels: int = 100_000_000  # decompression-bomb guard, checked before decoding
    alpha_background: tuple[int, int, int] = (255, 255, 255)  # transparent pixels become this
    jpeg_draft: bool = True  # let libjpeg downscale by 1/2..1/8 while decoding (much faster, near-identical pixels)

    def __post_init__(self):
        problems = _range_problems(self)
        if not problems:
            problems = _block_problems(self)
        if problems:
            raise ValueError("invalid media settings: " + "; ".join(problems))
        # JSON gives lists; keep tuples so settings stay hashable and compare equal.
        object.__setattr__(self, "pixel_mean", tuple(float(v) for v in self.pixel_mean))
        object.__setattr__(self, "pixel_std", tuple(float(v) for v in self.pixel_std))
        object.__setattr__(self, "alpha_background", tuple(int(v) for v in self.alpha_background))

    @property
    def patch_dim(self) -> int:
        """Length of one image patch vector: 3 * p * p (layout c, y, x)."""
        return 3 * self.patch_size * self.patch_size

    @property
    def max_video_patches(self) -> int:
        """Patch positions of the largest video block: video_patch_budget per group of
        temporal_patch_size frames, for video_frame_budget frames (a last partial group counts)."""
        return self.video_patch_budget * -(-self.video_frame_budget // self.temporal_patch_size)

    @property
    def tubelet_dim(self) -> int:
        """Length of one video tubelet vector: 3 * tp * p * p (layout c, t, y, x)."""
        return 3 * self.temporal_patch_size * self.patch_size * self.patch_size

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> MediaSettings:
        """Build from a dict (omniloom_tokenizer.json's "media"); an unknown key is an error naming the
        closest, a value of the wrong type or out of its range (MEDIA_RANGES) one naming the key."""
        if not isinstance(d, dict):
            raise ValueError(f"invalid media settings: expected an object of settings, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else f"; valid keys: {', '.join(names)}"
                raise ValueError(f"unknown media setting {key!r}{hint}")
        return cls(**d)

    def replace(self, **changes) -> MediaSettings:
        """A copy with some fields changed (validated like the constructor)."""
        d = asdict(self)
        d.update(changes)
        return MediaSettings.from_dict(d)


class MediaSizes:
    """The patch sizes of a tokenizer's media settings, as tokenize_document reads them: shared by
    the SentencePiece tokenizer (text.py) and the one an export carries (hf_text.py)."""

    settings: MediaSettings

    @property
    def patch_dim(self) -> int:
        return self.settings.patch_dim

    @property
    def tubelet_dim(self) -> int:
        return self.settings.tubelet_dim
