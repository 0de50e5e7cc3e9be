"""Images to patch vectors and back (docs/data-format.md section 4).

Legend: H, W pixels; h, w patch grid; p patch size; tp temporal patch size; F frames; T tubelet
groups; N patch positions; D patch dim (3*p*p for images, 3*tp*p*p for video). Patch vectors are
laid out (c, y, x) for images and (c, t, y, x) for video, the order of a Conv2d/Conv3d weight, so
a patch-embedding Linear can be loaded from a conv checkpoint.
"""

from __future__ import annotations

import io
import math
import struct
import warnings

import numpy as np

from omniloom.tokenizers.settings import MediaError, MediaSettings

_TRANSPOSE_FOR_ORIENTATION = {}  # EXIF orientation -> PIL transpose method, filled lazily


def fit_grid(height: int, width: int, patch_size: int, budget: int) -> tuple[int, int]:
    """Patch grid (h, w) for a picture of height x width pixels, with h*w <= budget.

    A picture over the budget is scaled down keeping its aspect ratio; each side is then rounded
    to a whole number of patches (so a picture within budget keeps about its own size), and never
    below one patch (tiny pictures are scaled up to p x p). Extreme aspect ratios (1 x 4000) keep
    as much of their shape as the budget allows."""
    if height < 1 or width < 1:
        raise MediaError("empty", f"picture has size {width}x{height}")
    hf, wf = height / patch_size, width / patch_size
    if hf * wf > budget:
        scale = math.sqrt(budget / (hf * wf))
        hf, wf = hf * scale, wf * scale
    h, w = max(1, round(hf)), max(1, round(wf))
    # rounding up or clamping an extreme aspect ratio (1 x 4000) can overshoot: shrink the side
    # that overshoots its ideal the least, relatively, until the budget holds.
    while h * w > budget:
        if w > 1 and (h == 1 or w / wf >= h / hf):
            w = min(w - 1, budget // h)
        else:
            h = min(h - 1, budget // w)
    return h, w


def _orientation_methods():
    if not _TRANSPOSE_FOR_ORIENTATION:
        from PIL import Image

        T = Image.Transpose
        _TRANSPOSE_FOR_ORIENTATION.update({
            2: [T.FLIP_LEFT_RIGHT], 3: [T.ROTATE_180], 4: [T.FLIP_TOP_BOTTOM], 5: [T.TRANSPOSE],
            6: [T.ROTATE_270], 7: [T.TRANSVERSE], 8: [T.ROTATE_90],
        })
    return _TRANSPOSE_FOR_ORIENTATION


def _to_rgb(img, background: tuple[int, int, int]):
    """Any PIL mode to 8-bit RGB: palette and alpha composited over `background`, 16-bit and
    float scaled (not clipped) to 0..255, CMYK and grayscale converted."""
    from PIL import Image

    mode = img.mode
    if mode == "RGB":
        return img
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        arr = np.asarray(img)
        if mode == "F":
            peak = float(np.nanmax(arr)) if arr.size else 0.0
            arr = np.nan_to_num(arr) * (255.0 if peak <= 1.0 else 1.0)
        elif mode == "I" and arr.size and arr.max() <= 255:
            pass  # an 8-bit range stored as int32
        else:
            arr = arr.astype(np.float32) / 257.0  # 16-bit range (PNG 16-bit gray decodes as I or I;16)
        gray = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
        return Image.fromarray(np.repeat(gray[..., None], 3, axis=2), "RGB")
    if mode == "P":
        img = img.convert("RGBA" if "transparency" in img.info else "RGB")
        mode = img.mode
    elif mode in ("LA", "PA", "La", "RGBa") or (mode == "L" and "transparency" in img.info) or (mode == "RGB" and "transparency" in img.info):
        img = img.convert("RGBA")
        mode = "RGBA"
    if mode == "RGBA":
        base = Image.new("RGB", img.size, background)
        base.paste(img, mask=img.getchannel("A"))
        return base
    return img.convert("RGB")  # L, 1, CMYK, YCbCr, LAB, HSV


def open_image(data):
    """A PIL image from encoded bytes, a PIL image (a copy of its decoded pixels: the caller's
    object is left alone, and a JPEG is not draft-decoded as its bytes would be) or a uint8
    [H, W, 3] (or [H, W]) array of pixels."""
    from PIL import Image

    if isinstance(data, Image.Image):
        return data.copy()
    if isinstance(data, np.ndarray):
        if data.dtype != np.uint8 or data.ndim not in (2, 3) or (data.ndim == 3 and data.shape[2] not in (3, 4)):
            raise MediaError("undecodable", f"image pixels must be uint8 [H, W, 3], got {data.dtype} {list(data.shape)}")
        return Image.fromarray(data)
    if not data:
        raise MediaError("empty", "image has zero bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # decode_image applies its own limit
        return Image.open(io.BytesIO(data))


def decode_image(data, settings: MediaSettings, budget: int | None = None) -> np.ndarray:
    """Image bytes (or a PIL image, or uint8 pixels: `open_image`) to a uint8 [H, W, 3] array:
    EXIF orientation applied, any mode made RGB, resized (bicubic, keeping the aspect ratio) to the
    patch grid `fit_grid` gives for `budget` (default settings.image_patch_budget). Raises
    MediaError for anything undecodable."""
    from PIL import Image, UnidentifiedImageError

    p = settings.patch_size
    budget = settings.image_patch_budget if budget is None else budget
    try:
        img = open_image(data)
        width, height = img.size
        if width * height > settings.max_image_pixels:
            raise MediaError("too_large", f"image is {width}x{height}, over max_image_pixels={settings.max_image_pixels}")
        try:
            orientation = int(img.getexif().get(0x0112, 1))
        except Exception:  # a broken EXIF block must not cost the picture
            orientation = 1
        swap = orientation in (5, 6, 7, 8)
        oh, ow = (width, height) if swap else (height, width)
        gh, gw = fit_grid(oh, ow, p, budget)
        # target size in the stored (unrotated) orientation: resize first, rotate the small result
        tw, th = (gh * p, gw * p) if swap else (gw * p, gh * p)
        if img.format == "JPEG" and settings.jpeg_draft:
            # DCT-domain downscaling (1/2, 1/4, 1/8) while decoding; PIL keeps the result >= the
            # requested size, so the bicubic resize below still sets the exact size.
            img.draft("RGB", (tw, th))
        img.load()
        img = _to_rgb(img, settings.alpha_background)
        if img.size != (tw, th):
            img = img.resize((tw, th), Image.Resampling.BICUBIC)
        for method in _orientation_methods().get(orientation, ()):
            img = img.transpose(method)
        arr = np.asarray(img)
    except MediaError:
        raise
    except Image.DecompressionBombError as err:
        raise MediaError("too_large", f"image over PIL's decompression-bomb limit: {err}") from err
    except UnidentifiedImageError as err:
        # PIL's message names only its in-memory buffer (<_io.BytesIO object at 0x...>); callers name the file
        raise MediaError("undecodable", "not a readable image (PIL cannot identify the format)") from err
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error) as err:
        raise MediaError("undecodable", f"image decode failed: {type(err).__name__}: {err}") from err
    assert arr.shape == (gh * p, gw * p, 3) and arr.dtype == np.uint8, arr.shape
    return arr


def frames_to_patches(frames_FHW3: np.ndarray, settings: MediaSettings, temporal_patch_size: int = 1) -> tuple[np.ndarray, tuple[int, int, int]]:
    """uint8 frames [F, H, W, 3] (H, W multiples of p) to normalized patch vectors [N, 3*tp*p*p]
    and grid (T, h, w), T = ceil(F / tp); a last incomplete group repeats the last frame."""
    p, tp = settings.patch_size, temporal_patch_size
    F, H, W, C = frames_FHW3.shape
    assert C == 3 and H % p == 0 and W % p == 0 and F >= 1, frames_FHW3.shape
    if F % tp:
        pad = np.repeat(frames_FHW3[-1:], tp - F % tp, axis=0)
        frames_FHW3 = np.concatenate([frames_FHW3, pad], axis=0)
    T, h, w = frames_FHW3.shape[0] // tp, H // p, W // p
    x = frames_FHW3.reshape(T, tp, h, p, w, p, 3).transpose(0, 2, 4, 6, 1, 3, 5)  # T h w c t y x
    # transpose while still uint8 (4x less memory traffic), then one contiguous float conversion
    out_ND = np.ascontiguousarray(x).reshape(T * h * w, 3, tp * p * p).astype(np.float32)
    std = np.asarray(settings.pixel_std, np.float32)
    mean = np.asarray(settings.pixel_mean, np.float32)
    if (std == std[0]).all() and (mean == mean[0]).all():
        out_ND *= 1.0 / (255.0 * std[0])
        out_ND -= mean[0] / std[0]
    else:
        out_ND *= (1.0 / (255.0 * std))[None, :, None]
        out_ND -= (mean / std)[None, :, None]
    out_ND = out_ND.reshape(T * h * w, 3 * tp * p * p)
    if settings.patch_dtype != "float32":
        out_ND = out_ND.astype(settings.patch_dtype)
    return out_ND, (T, h, w)


def patches_to_frames(patches_ND: np.ndarray, grid: tuple[int, int, int], settings: MediaSettings, temporal_patch_size: int = 1) -> np.ndarray:
    """Inverse of frames_to_patches: uint8 frames [T*tp, h*p, w*p, 3] (padding frames included)."""
    p, tp = settings.patch_size, temporal_patch_size
    T, h, w = grid
    x = np.asarray(patches_ND, dtype=np.float32).reshape(T, h, w, 3, tp, p, p)
    std = np.asarray(settings.pixel_std, np.float32)[:, None, None, None]
    mean = np.asarray(settings.pixel_mean, np.float32)[:, None, None, None]
    x = (x * std + mean) * 255.0
    x = x.transpose(0, 4, 1, 5, 2, 6, 3).reshape(T * tp, h * p, w * p, 3)  # T t h y w x c
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def image_to_patches(data, settings: MediaSettings) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Image bytes (or a PIL image or uint8 pixels, see `open_image`) to patch vectors [N, 3*p*p]
    (N <= image_patch_budget) and grid (1, h, w)."""
    pixels_HW3 = decode_image(data, settings)
    return frames_to_patches(pixels_HW3[None], settings, 1)


def patches_to_image(patches_ND: np.ndarray, grid: tuple[int, int, int], settings: MediaSettings) -> np.ndarray:
    """Inverse of image_to_patches for inspection and tests: uint8 [h*p, w*p, 3]."""
    if grid[0] != 1:
        raise ValueError(f"an image grid has t == 1, got {grid}; use patches_to_frames for video")
    return patches_to_frames(patches_ND, grid, settings, 1)[0]
