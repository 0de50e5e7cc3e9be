"""Image/video tokenizer settings (kept in omniloom_tokenizer.json) and the errors the data loader counts.

The model's patch_dim (3*p*p) and tubelet_dim (3*tp*p*p) follow from these settings, so they
travel with the tokenizer rather than with the model config.
"""

from __future__ import annotations

import difflib
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
        problems = []
        if self.patch_size < 1:
            problems.append("patch_size must be >= 1")
        if self.temporal_patch_size < 1:
            problems.append("temporal_patch_size must be >= 1")
        for name in ("image_patch_budget", "video_frame_budget", "video_patch_budget", "max_image_pixels"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if not self.video_fps > 0:
            problems.append("video_fps must be > 0")
        if self.video_clip_start < 0:
            problems.append("video_clip_start must be >= 0")
        if self.video_sampling not in VIDEO_SAMPLING:
            problems.append(f"video_sampling must be one of {VIDEO_SAMPLING}, got {self.video_sampling!r}")
        if self.patch_dtype not in PATCH_DTYPES:
            problems.append(f"patch_dtype must be one of {PATCH_DTYPES}, got {self.patch_dtype!r}")
        if len(self.pixel_mean) != 3 or len(self.pixel_std) != 3 or min(self.pixel_std) <= 0:
            problems.append("pixel_mean and pixel_std need 3 values each, std > 0")
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
        """Build from a dict (omniloom_tokenizer.json's "media"); an unknown key is an error naming the closest."""
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
