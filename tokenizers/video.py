"""Videos to tubelet vectors with PyAV (docs/data-format.md section 4).

Legend: F sampled frames, H, W pixels, T = ceil(F / tp) tubelet groups, h, w patch grid,
N = T*h*w tubelets, D = 3*tp*p*p.

Frames are sampled by timestamp, not by index, so variable-frame-rate streams and containers
without a recorded duration work: target times are k / fps from the first frame; each target gets
the latest frame shown at or before it (a source slower than fps repeats frames, keeping time
uniform). Decoding is packet by packet so a corrupt packet costs only its frames; it stops as soon
as the frame budget is filled (`clip`), and `spread` sampling of a long video seeks to each target
instead of decoding everything in between.
"""

from __future__ import annotations

import functools
import io
import logging
import math
import os
import threading
from dataclasses import dataclass, field

import numpy as np

from omniloom.tokenizers.image import fit_grid, frames_to_patches, patches_to_frames
from omniloom.tokenizers.settings import MediaError, MediaSettings

log = logging.getLogger(__name__)

MAX_DECODE_ERRORS = 64  # a stream this broken is given up (its good frames so far are kept)
SEEK_MIN_GAP_S = 4.0  # spread sampling seeks when targets are further apart than this
# video_threads=0 decodes frames up to this size (320x240) on one thread and larger ones with
# FFmpeg's threads: on small frames starting and syncing the threads costs more than they save
# (H.264, 2 cores: 64x64 clips 2.6 ms against 4.5 ms a clip, 320x240 8.2 against 8.9 ms; 640x480
# 21.7 against 19.8 ms, with 1.2x the CPU time). The frames are the same either way.
SINGLE_THREAD_MAX_PIXELS = 320 * 240


@dataclass
class VideoInfo:
    """What decoding one video did: sampled timestamps (s from the first frame), errors, work."""

    timestamps: list[float] = field(default_factory=list)
    decode_errors: int = 0  # packets the decoder rejected (their frames are lost, the rest kept)
    corrupt_frames: int = 0  # frames the decoder returned but flagged corrupt (kept, concealed)
    frames_decoded: int = 0
    seeks: int = 0
    duration: float | None = None
    source_size: tuple[int, int] = (0, 0)  # (width, height)


def _open(data: bytes):
    import av

    if not data:
        raise MediaError("empty", "video has zero bytes")
    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except (av.FFmpegError, ValueError, OSError) as err:
        raise MediaError("undecodable", f"not a readable video container: {err}") from err
    if not container.streams.video:
        container.close()
        raise MediaError("no_video_stream", "container has no video stream")
    return container


def _duration(container, stream) -> float | None:
    """Duration in seconds from stream or container headers, None when neither records one."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def _scan_duration(data: bytes) -> float | None:
    """Duration from packet timestamps (demux only, no decoding): for containers without one."""
    import av

    container = _open(data)
    end = None
    try:
        stream = container.streams.video[0]
        tb = stream.time_base
        first = None
        for packet in container.demux(stream):
            if packet.pts is None:
                continue
            t = float(packet.pts * tb)
            first = t if first is None else min(first, t)
            t_end = t + float((packet.duration or 0) * tb)
            end = t_end if end is None else max(end, t_end)
        if end is not None and first is not None:
            end -= first
    except av.FFmpegError:
        pass  # a duration from the packets read so far is still a good estimate
    finally:
        container.close()
    return end


_THREAD = threading.local()
_INHERITED: list = []  # scalers made before a fork, found in the child: kept, never freed (see _scaler)


def _scaler(width: int, height: int):
    """(reformatter, reformat keyword arguments) for frames of this source size.

    Small frames (up to SINGLE_THREAD_MAX_PIXELS) share one VideoReformatter per thread, scaling on
    one thread: it keeps its SwsContext while sizes and formats stay the same, so a stream of
    like-sized clips pays the scaler's setup once, and PyAV >= 17 would otherwise start a pool of
    swscale slice threads for every new context (64x64 frames: 0.01 ms a frame on one shared
    scaler, 0.15 ms with a scaler and its threads per clip). A scaler found in a forked child
    (a DataLoader worker) is set aside unfreed: freeing it would join threads that only the
    parent has. Larger frames get a scaler of their own with swscale's threads, freed with it."""
    from av.video.reformatter import VideoReformatter

    if width * height > SINGLE_THREAD_MAX_PIXELS:
        return VideoReformatter(), {}
    cached = getattr(_THREAD, "scaler", None)
    if cached is None or cached[0] != os.getpid():
        if cached is not None:
            _INHERITED.append(cached[1])
        cached = _THREAD.scaler = (os.getpid(), VideoReformatter())
    return cached[1], ({"threads": 1} if _reformat_takes_threads() else {})


@functools.cache
def _reformat_takes_threads() -> bool:
    """PyAV >= 17 scales on swscale's threads and takes `threads=`; older versions scale on one."""
    import av

    try:
        return int(av.__version__.split(".")[0]) >= 17
    except ValueError:
        return False


class _Geometry:
    """Output frame size, fixed at the first decoded frame: its display rotation (phone videos
    store landscape pixels plus a rotation) decides which way round the patch grid fits."""

    def __init__(self, width: int, height: int, settings: MediaSettings):
        self.width, self.height, self.settings = width, height, settings
        self.reformatter, self.reformat_kw = _scaler(width, height)
        self.rot_k: int | None = None  # quarter turns counterclockwise to display the frame
        self.size = (0, 0)  # (width, height) handed to swscale, before rotation

    def resolve(self, frame) -> None:
        if self.rot_k is not None:
            return
        try:
            rotation = frame.rotation or 0  # degrees counterclockwise, from the display matrix
        except Exception:  # no or malformed side data
            rotation = 0
        self.rot_k = int(round(rotation / 90)) % 4
        w, h = (self.height, self.width) if self.rot_k % 2 else (self.width, self.height)
        p = self.settings.patch_size
        gh, gw = fit_grid(h, w, p, self.settings.video_patch_budget)
        self.size = (gh * p, gw * p) if self.rot_k % 2 else (gw * p, gh * p)

    def pixels(self, frame) -> np.ndarray:
        self.resolve(frame)
        w, h = self.size
        # area averaging: antialiased downscaling, and the cheapest swscale filter
        arr = self.reformatter.reformat(frame, width=w, height=h, format="rgb24", interpolation="AREA",
                                        **self.reformat_kw).to_ndarray()
        return np.ascontiguousarray(np.rot90(arr, self.rot_k)) if self.rot_k else arr


class _Sampler:
    """Assigns decoded frames to target times: each target gets the latest frame at or before it."""

    def __init__(self, targets: list[float], geometry: _Geometry):
        self.targets, self.geometry = targets, geometry
        self.k = 0
        self.prev = None  # (time, av.VideoFrame)
        self.frames: list[np.ndarray] = []
        self.times: list[float] = []
        self._cache: tuple[object, np.ndarray] | None = None  # (frame, pixels): holding the frame keeps its id unique

    @property
    def done(self) -> bool:
        return self.k >= len(self.targets)

    def _take(self, t: float, frame) -> None:
        if self._cache is None or self._cache[0] is not frame:
            self._cache = (frame, self.geometry.pixels(frame))
        self.frames.append(self._cache[1])
        self.times.append(t)
        self.k += 1

    def push(self, t: float, frame) -> None:
        while not self.done and self.targets[self.k] < t - 1e-6:
            # target falls before this frame: the previous frame was on screen then (or, before
            # the first frame, this one is the nearest)
            self._take(*(self.prev or (t, frame)))
        self.prev = (t, frame)

    def finish(self, end_time: float) -> None:
        """Stream ended: targets up to the end of the last frame get the last frame."""
        while self.prev is not None and not self.done and self.targets[self.k] < end_time - 1e-6:
            self._take(*self.prev)


def _decode_packets(container, stream, sampler: _Sampler, info: VideoInfo, t0: float | None, stop_after: float | None = None) -> float | None:
    """Decode packet by packet, feeding frames (time relative to t0) to the sampler. Returns t0
    (the first frame's time when t0 was None) and stops when the sampler is done or a frame passes
    stop_after. Corrupt packets are counted in info.decode_errors and skipped."""
    import av

    rate = float(stream.average_rate or stream.guessed_rate or 25)
    last = None
    demux = container.demux(stream)
    while not sampler.done:
        try:
            packet = next(demux)
        except StopIteration:
            break
        except av.FFmpegError as err:  # a broken container past this point: keep what we have
            info.decode_errors += 1
            log.debug("demux error after %d frames: %s", info.frames_decoded, err)
            break
        try:
            frames = packet.decode()
        except av.FFmpegError as err:
            info.decode_errors += 1
            log.debug("decode error in packet at pts %s: %s", packet.pts, err)
            if info.decode_errors >= MAX_DECODE_ERRORS:
                break
            continue
        for frame in frames:
            info.frames_decoded += 1
            if frame.is_corrupt:
                info.corrupt_frames += 1
            t = frame.time
            if t is None:  # no timestamps (raw streams): count frames at the nominal rate
                t = (last + 1.0 / rate) if last is not None else 0.0
            if t0 is None:
                t0 = t
            t -= t0
            if last is not None and t < last:
                t = last  # non-monotonic timestamps: never move backwards
            last = t
            sampler.push(t, frame)
            if sampler.done or (stop_after is not None and t > stop_after):
                return t0
    if last is not None:
        frame_dur = 1.0 / rate
        if sampler.prev is not None and sampler.prev[1].duration and sampler.prev[1].time_base:
            frame_dur = float(sampler.prev[1].duration * sampler.prev[1].time_base)
        if stop_after is None:
            sampler.finish(last + frame_dur)
    return t0


def decode_video(data: bytes, settings: MediaSettings) -> tuple[np.ndarray, VideoInfo]:
    """Video bytes to uint8 frames [F, H, W, 3] (F <= video_frame_budget) sampled at video_fps,
    resized to the patch grid for video_patch_budget. Raises MediaError when no frame decodes."""
    import av

    container = _open(data)
    info = VideoInfo()
    try:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"  # frame + slice threads
        cc = stream.codec_context
        width, height = cc.width, cc.height
        if width < 1 or height < 1:
            raise MediaError("undecodable", f"video stream reports size {width}x{height}")
        if settings.video_threads:
            stream.thread_count = settings.video_threads
        elif width * height <= SINGLE_THREAD_MAX_PIXELS:
            stream.thread_count = 1  # FFmpeg's threads cost more than they save on small frames
        info.source_size = (width, height)
        geometry = _Geometry(width, height, settings)
        info.duration = _duration(container, stream)
        fps, budget = settings.video_fps, settings.video_frame_budget
        tb = stream.time_base
        start = float(stream.start_time * tb) if stream.start_time is not None and tb else 0.0
        if settings.video_sampling == "spread":
            if info.duration is None:
                info.duration = _scan_duration(data)
            natural = math.ceil((info.duration or 0) * fps - 1e-6)
            if info.duration is not None and natural > budget:
                targets = [info.duration * k / budget for k in range(budget)]
                if info.duration / budget >= SEEK_MIN_GAP_S:
                    sampler = _Sampler(targets, geometry)
                    _spread_by_seeking(container, stream, sampler, info, start)
                    return _finish(sampler, info)
            else:
                targets = [k / fps for k in range(budget)]
            sampler = _Sampler(targets, geometry)
            _decode_packets(container, stream, sampler, info, None)
            return _finish(sampler, info)
        # clip: budget frames at fps from clip_start, seeking there rather than decoding up to it
        clip_start = settings.video_clip_start
        if info.duration is not None and clip_start >= info.duration:
            log.debug("clip start %.1fs is past the end (%.1fs): clipping from the start", clip_start, info.duration)
            clip_start = 0.0
        targets = [clip_start + k / fps for k in range(budget)]
        sampler = _Sampler(targets, geometry)
        t0 = None
        if clip_start > 0:
            try:
                container.seek(int((start + clip_start) / tb), stream=stream, backward=True)
                info.seeks += 1
                t0 = start
            except av.FFmpegError:  # unseekable: decode from the start instead
                pass
        _decode_packets(container, stream, sampler, info, t0)
        return _finish(sampler, info)
    except av.FFmpegError as err:
        raise MediaError("undecodable", f"video decode failed: {err}") from err
    finally:
        container.close()


def _spread_by_seeking(container, stream, sampler: _Sampler, info: VideoInfo, start: float) -> None:
    """Spread sampling of a long video: for each target, seek to the keyframe before it and decode
    forward to it, instead of decoding the whole file."""
    import av

    tb = stream.time_base
    targets = sampler.targets
    for k, target in enumerate(targets):
        if sampler.k > k:
            continue
        try:
            container.seek(int((start + target) / tb), stream=stream, backward=True)
            info.seeks += 1
        except av.FFmpegError as err:
            info.decode_errors += 1
            log.debug("seek to %.2fs failed: %s", target, err)
            continue
        one = _Sampler([target], sampler.geometry)
        _decode_packets(container, stream, one, info, start, stop_after=target)
        if not one.done and one.prev is not None:  # the target is past the last frame: take the last one
            one._take(*one.prev)
        if one.frames:
            sampler.frames.append(one.frames[0])
            sampler.times.append(one.times[0])
            sampler.k = k + 1


def _finish(sampler: _Sampler, info: VideoInfo) -> tuple[np.ndarray, VideoInfo]:
    if not sampler.frames:
        if info.decode_errors:
            raise MediaError("no_frames", f"no frame decoded ({info.decode_errors} decode errors)")
        raise MediaError("no_frames", "video holds no decodable frame")
    info.timestamps = list(sampler.times)
    return np.stack(sampler.frames), info


def sampled_frames(frames, settings: MediaSettings) -> tuple[np.ndarray, VideoInfo]:
    """Frames already sampled at the video rate (uint8 [F, H, W, 3], or a list of uint8 arrays or
    PIL images of one size) as decode_video returns them: the first video_frame_budget frames,
    each resized by FFmpeg's area scaler (as decoded frames are) to the patch grid for
    video_patch_budget."""
    import av

    arrays = [np.asarray(f.convert("RGB")) if hasattr(f, "convert") else np.asarray(f)
              for f in list(frames)[: settings.video_frame_budget]]
    if not arrays:
        raise MediaError("no_frames", "the video has no frames")
    H, W = arrays[0].shape[:2]
    for a in arrays:
        if a.dtype != np.uint8 or a.shape != (H, W, 3):
            raise MediaError("undecodable", f"video frames must all be uint8 [{H}, {W}, 3], got {a.dtype} {list(a.shape)}")
    p = settings.patch_size
    gh, gw = fit_grid(H, W, p, settings.video_patch_budget)
    reformatter, kw = _scaler(W, H)
    out = [reformatter.reformat(av.VideoFrame.from_ndarray(np.ascontiguousarray(a), format="rgb24"), width=gw * p,
                                height=gh * p, format="rgb24", interpolation="AREA", **kw).to_ndarray() for a in arrays]
    info = VideoInfo(timestamps=[k / settings.video_fps for k in range(len(out))], frames_decoded=len(out),
                     source_size=(W, H))
    return np.stack(out), info


def video_to_tubelets(data, settings: MediaSettings) -> tuple[np.ndarray, tuple[int, int, int], VideoInfo]:
    """Video bytes (or frames already sampled at the video rate: `sampled_frames`) to tubelet
    vectors [N, 3*tp*p*p], grid (T, h, w) and the decode VideoInfo."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        frames_FHW3, info = decode_video(bytes(data), settings)
    else:
        frames_FHW3, info = sampled_frames(data, settings)
    patches_ND, grid = frames_to_patches(frames_FHW3, settings, settings.temporal_patch_size)
    return patches_ND, grid, info


def tubelets_to_frames(patches_ND: np.ndarray, grid: tuple[int, int, int], settings: MediaSettings) -> np.ndarray:
    """Inverse of video_to_tubelets for inspection and tests: uint8 [T*tp, H, W, 3] (a padded last
    group repeats the last frame)."""
    return patches_to_frames(patches_ND, grid, settings, settings.temporal_patch_size)
