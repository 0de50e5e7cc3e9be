"""Image patches and video tubelets: budgets, modes, orientation, inverses, frame counts per codec,
variable frame rate, seeking, corrupt and undecodable media."""

from __future__ import annotations

import io
import math
import wave

import numpy as np
import pytest

from omniloom.tokenizers.image import decode_image, fit_grid, frames_to_patches, image_to_patches, patches_to_image
from omniloom.tokenizers.settings import MediaError, MediaSettings
from omniloom.tokenizers.testing import make_image_bytes, make_video_bytes
from omniloom.tokenizers.video import decode_video, tubelets_to_frames, video_to_tubelets

S = MediaSettings(patch_size=8, image_patch_budget=32, video_patch_budget=12, video_frame_budget=16)


def marker(frame_HW3) -> float:
    """The gray level make_video_bytes drew into the top-left quadrant of source frame i (10*i mod 256)."""
    H, W, _ = frame_HW3.shape
    return float(np.median(frame_HW3[H // 8 : H // 2 - H // 8, W // 8 : W // 2 - W // 8]))


def assert_source_frames(frames, *numbers) -> None:
    """The sampled frames are these source frame numbers (markers 10 apart; lossy coding moves them a few levels)."""
    got = [marker(f) for f in frames]
    want = [10 * i % 256 for i in numbers]
    assert len(got) == len(want) and all(abs(g - w) <= 4 for g, w in zip(got, want)), (got, want)


@pytest.mark.parametrize("h,w", [(1, 4000), (4000, 1), (1, 1), (3, 5), (480, 640), (4000, 4000), (17, 4000), (10_000, 3)])
def test_fit_grid_budget_and_aspect(h, w):
    for p, budget in [(16, 256), (8, 32), (14, 1)]:
        gh, gw = fit_grid(h, w, p, budget)
        assert 1 <= gh * gw <= budget
        if max(h / w, w / h) < budget:  # representable aspect: shape kept within a patch of rounding
            scale = min(1.0, math.sqrt(budget / ((h / p) * (w / p))))
            assert abs(gh - h / p * scale) <= max(1.0, 0.5 * gh) and abs(gw - w / p * scale) <= max(1.0, 0.5 * gw)


def test_fit_grid_random_sizes():
    rng = np.random.default_rng(0)
    for h, w in rng.integers(1, 5000, size=(300, 2)):
        gh, gw = fit_grid(int(h), int(w), 16, 256)
        assert 1 <= gh * gw <= 256
        if h * w <= 256 * 16 * 16 and h >= 16 and w >= 16:
            assert abs(gh * 16 - h) < 16 and abs(gw * 16 - w) < 16  # within budget: native size within a patch


@pytest.mark.parametrize("w,h", [(1, 4000), (4000, 1), (1, 1), (2, 3), (300, 200)])
def test_images_extreme_and_tiny_within_budget(w, h):
    patches, grid = image_to_patches(make_image_bytes(w, h, "RGB", "PNG"), S)
    t, gh, gw = grid
    assert t == 1 and 1 <= gh * gw <= S.image_patch_budget
    assert patches.shape == (gh * gw, S.patch_dim) and patches.dtype == np.float32
    assert patches.min() >= -1.0 - 1e-6 and patches.max() <= 1.0 + 1e-6
    if w > h:
        assert gw >= gh
    elif h > w:
        assert gh >= gw


@pytest.mark.parametrize("mode,fmt", [("RGB", "JPEG"), ("RGBA", "PNG"), ("P", "PNG"), ("P", "GIF"), ("L", "PNG"), ("LA", "PNG"), ("1", "PNG"), ("CMYK", "JPEG"), ("I;16", "PNG"), ("RGB", "WEBP"), ("RGB", "TIFF"), ("RGB", "BMP")])
def test_image_modes_become_rgb(mode, fmt):
    pixels = decode_image(make_image_bytes(48, 32, mode, fmt), S)
    assert pixels.dtype == np.uint8 and pixels.shape[2] == 3 and pixels.shape[0] % 8 == 0 and pixels.shape[1] % 8 == 0
    if mode == "I;16":  # 16-bit is scaled to 8-bit, not clipped to white
        assert 0 < pixels.mean() < 250 and pixels.std() > 10
    if mode == "RGBA":  # alpha grows left to right; composited over white, the left edge is white
        assert pixels[:, 0].min() >= 250


def test_exif_orientation_applied():
    upright = decode_image(make_image_bytes(64, 32, "RGB", "JPEG"), S)
    rotated = decode_image(make_image_bytes(64, 32, "RGB", "JPEG", exif_orientation=6), S)
    assert upright.shape[:2] == (32, 64) and rotated.shape[:2] == (64, 32)
    # orientation 6 means "rotate 90 degrees clockwise to display": the left column becomes the top row
    np.testing.assert_allclose(rotated[0, :, :].astype(float), upright[::-1, 0, :].astype(float), atol=40)


def test_image_patch_inverse():
    pixels = decode_image(make_image_bytes(40, 24, "RGB", "PNG"), S)
    patches, grid = frames_to_patches(pixels[None], S)
    assert np.array_equal(patches_to_image(patches, grid, S), pixels)
    # (c, y, x) layout: the first p*p entries of patch 0 are the red channel of the top-left block
    red = pixels[:8, :8, 0].astype(np.float32) / 127.5 - 1
    np.testing.assert_allclose(patches[0, :64].reshape(8, 8), red, atol=1e-6)
    f16 = S.replace(patch_dtype="float16")
    assert image_to_patches(make_image_bytes(40, 24), f16)[0].dtype == np.float16


@pytest.mark.parametrize("data,reason", [(b"", "empty"), (b"definitely not an image", "undecodable")])
def test_undecodable_images(data, reason):
    with pytest.raises(MediaError) as err:
        image_to_patches(data, S)
    assert err.value.reason == reason and isinstance(err.value, ValueError)


def test_truncated_and_oversized_images():
    jpeg = make_image_bytes(64, 64, "RGB", "PNG")
    with pytest.raises(MediaError, match="undecodable"):
        image_to_patches(jpeg[: len(jpeg) // 2], S)
    with pytest.raises(MediaError) as err:
        image_to_patches(jpeg, S.replace(max_image_pixels=1000))
    assert err.value.reason == "too_large"


CODECS = [("libx264", "mp4"), ("mpeg4", "avi"), ("libvpx-vp9", "webm"), ("mjpeg", "avi"), ("libx265", "mp4"), ("libvpx", "matroska")]


@pytest.mark.parametrize("codec,container", CODECS)
@pytest.mark.parametrize("seconds,fps", [(3.0, 10), (1.2, 25)])
def test_video_frame_count_per_codec(codec, container, seconds, fps):
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"{codec} not in this FFmpeg build")
    w, h = (64, 48) if codec == "libx265" else (48, 32)  # smaller frames crash libx265
    data = make_video_bytes(seconds, fps, w, h, codec, container)
    frames, info = decode_video(data, S)
    expected = min(S.video_frame_budget, math.ceil(seconds * S.video_fps - 1e-9))
    assert len(frames) == expected, (info.timestamps, info.duration)
    # frame k is the latest source frame at or before k / video_fps
    want = [min(int(math.floor(k / S.video_fps * fps + 1e-6)), int(seconds * fps) - 1) for k in range(expected)]
    assert_source_frames(frames, *want)
    patches, grid, _ = video_to_tubelets(data, S)
    T, gh, gw = grid
    assert T == math.ceil(expected / S.temporal_patch_size) and gh * gw <= S.video_patch_budget
    assert patches.shape == (T * gh * gw, S.tubelet_dim)


def test_frame_budget_stops_decoding_early():
    data = make_video_bytes(10.0, 10, 32, 32)
    frames, info = decode_video(data, S.replace(video_frame_budget=4))
    assert_source_frames(frames, 0, 5, 10, 15)
    assert info.frames_decoded < 40  # 100 frames in the file


def test_variable_frame_rate_by_timestamp():
    times = [0.0, 0.1, 0.15, 0.9, 1.0, 1.7, 2.05, 2.3]
    frames, info = decode_video(make_video_bytes(vfr_times=times, fps=10), S)
    # targets 0, .5, 1, 1.5, 2 get the latest frame shown at or before them: indices 0, 2, 4, 4, 5
    assert_source_frames(frames, 0, 2, 4, 4, 5)
    assert info.timestamps == pytest.approx([0.0, 0.15, 1.0, 1.0, 1.7], abs=1e-3)


def test_clip_start_seeks_and_spread_covers_the_whole_video():
    data = make_video_bytes(60.0, 5, 32, 32)  # 300 frames, keyframe every 12
    frames, info = decode_video(data, S.replace(video_clip_start=30.0, video_frame_budget=4))
    assert info.seeks == 1 and info.frames_decoded < 40
    assert_source_frames(frames, 150, 152, 155, 157)
    frames, info = decode_video(data, S.replace(video_sampling="spread", video_frame_budget=6))
    assert len(frames) == 6 and info.seeks == 6 and info.frames_decoded < 150
    assert_source_frames(frames, 0, 50, 100, 150, 200, 250)
    short = make_video_bytes(2.0, 10, 32, 32)  # shorter than the budget: spread == every target
    assert len(decode_video(short, S.replace(video_sampling="spread"))[0]) == 4
    # a clip start past the end clips from the start rather than rejecting the video
    assert len(decode_video(short, S.replace(video_clip_start=30.0))[0]) == 4


def test_container_without_duration():
    data = make_video_bytes(3.0, 10, 32, 32, "libx264", "matroska")
    frames, _ = decode_video(data, S)
    assert len(frames) == 6
    frames, info = decode_video(data, S.replace(video_sampling="spread", video_frame_budget=3))
    assert len(frames) == 3 and info.duration == pytest.approx(3.0, abs=0.15)


@pytest.mark.parametrize("rotation", [90, -90])
def test_display_rotation_applied(rotation):
    plain, _ = decode_video(make_video_bytes(1.0, 10, 64, 32), S)
    rotated, _ = decode_video(make_video_bytes(1.0, 10, 64, 32, rotation=rotation), S)
    assert plain.shape[1] < plain.shape[2] and rotated.shape[1] > rotated.shape[2]  # landscape stored, portrait shown
    # the marker quadrant (top-left when stored) ends bottom-left after a counterclockwise quarter turn
    expected = np.rot90(plain[0], 1 if rotation == 90 else -1)
    assert expected.shape == rotated[0].shape
    assert np.abs(expected.astype(int) - rotated[0].astype(int)).mean() < 12


def test_tubelet_inverse_and_padding():
    frames, _ = decode_video(make_video_bytes(2.5, 10, 32, 24), S)  # 5 frames -> 3 groups of 2
    patches, grid = frames_to_patches(frames, S, S.temporal_patch_size)
    assert grid[0] == 3
    back = tubelets_to_frames(patches, grid, S)
    assert back.shape[0] == 6 and np.array_equal(back[:5], frames) and np.array_equal(back[5], frames[4])


def test_decode_threads_and_the_shared_scaler_do_not_change_frames():
    """video_threads=0 decodes small frames on one thread (larger ones on FFmpeg's threads), and
    small frames share one scaler per thread, scaling on one thread: the frames equal those of
    an explicit thread count and of a scaler with swscale's own threads, also when the frame size
    changes from one video to the next (the shared scaler is rebuilt)."""
    import av
    from av.video.reformatter import VideoReformatter

    from omniloom.tokenizers import video as video_mod

    small = make_video_bytes(2.0, 10, 64, 48)
    assert 64 * 48 <= video_mod.SINGLE_THREAD_MAX_PIXELS < 400 * 300
    large = make_video_bytes(1.0, 10, 400, 300)
    wide = make_video_bytes(1.0, 10, 96, 32)
    first = {}
    for name, data in (("small", small), ("large", large), ("wide", wide), ("small", small), ("large", large)):
        auto, _ = decode_video(data, S)
        for threads in (1, 3):
            fixed, _ = decode_video(data, S.replace(video_threads=threads))
            assert np.array_equal(auto, fixed), (name, threads)
        assert np.array_equal(first.setdefault(name, auto), auto), name  # after another size: the same frames
    assert first["small"].shape != first["large"].shape != first["wide"].shape
    # the shared one-thread scaler against a scaler of its own (swscale's threads on PyAV >= 17)
    with av.open(io.BytesIO(small)) as container:
        frame = next(container.decode(video=0))
    h, w = first["small"].shape[1:3]
    own = VideoReformatter().reformat(frame, width=w, height=h, format="rgb24", interpolation="AREA").to_ndarray()
    assert np.array_equal(own, first["small"][0])
    assert video_mod._scaler(64, 48)[0] is video_mod._scaler(64, 48)[0]
    assert video_mod._scaler(400, 300)[0] is not video_mod._scaler(400, 300)[0]


def _decode_in_child(data, queue):
    queue.put(decode_video(data, S)[0])


def test_a_forked_child_decodes_after_the_parent_did():
    """The parent's shared scaler reaches a forked child (a DataLoader worker) and must not be
    used or freed there: that hung in swscale, which waited for the parent's threads."""
    import multiprocessing

    small, other = make_video_bytes(1.0, 10, 64, 48), make_video_bytes(1.0, 10, 48, 32)
    decode_video(small, S)  # the parent's scaler now exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_decode_in_child, args=(other, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert np.array_equal(got, decode_video(other, S)[0])


@pytest.mark.parametrize("codec,container", [("libx264", "mp4"), ("mpeg4", "avi")])
def test_corrupt_middle_keeps_good_frames(codec, container):
    data = bytearray(make_video_bytes(4.0, 10, 64, 48, codec, container))
    rng = np.random.default_rng(1)
    n = len(data)
    for off in (n // 3, n // 2, 2 * n // 3):
        data[off : off + 300] = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
    frames, info = decode_video(bytes(data), S)
    assert len(frames) == 8  # every target still gets a frame
    if codec == "libx264":  # h264 rejects the damaged packets: counted, not raised
        assert info.decode_errors > 0


def _wav() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(8000)
        w.writeframes(b"\x00\x00" * 800)
    return buf.getvalue()


@pytest.mark.parametrize("data,reasons", [(b"", {"empty"}), (b"garbage" * 50, {"undecodable"}), (_wav(), {"no_video_stream"})])
def test_undecodable_videos(data, reasons):
    with pytest.raises(MediaError) as err:
        decode_video(data, S)
    assert err.value.reason in reasons


def test_video_with_no_decodable_frame():
    data = bytearray(make_video_bytes(1.0, 10, 32, 32, "mpeg4", "avi"))
    head = 600  # keep the AVI headers, destroy every frame
    data[head:] = bytes(len(data) - head)
    with pytest.raises(MediaError) as err:
        decode_video(bytes(data), S)
    assert err.value.reason in ("no_frames", "undecodable")
