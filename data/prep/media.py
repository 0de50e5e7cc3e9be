"""Image and video validation for data prep: every media file is decoded before it is written.

Images: header read, pixel-count (decompression bomb) limit checked *before* decoding, then a full
decode of every frame with `img.load()`, then minimum side and aspect-ratio limits. A still image
that PIL cannot read (OpenEXR, ...) but FFmpeg's image decoders can is decoded through PyAV and
re-encoded as PNG (`validate_still`), since the tokenizer reads images with PIL; a file that FFmpeg
opens as a single-image pipe is a still image whatever its name (`still_image_format`), never a
one-frame video. Videos: opened
with PyAV, a video stream must exist and yield a decoded frame, the whole file is demuxed and must
hold what its container promises (`_check_complete`: frame counts, last packets, header duration),
duration is taken from the container or estimated from packet timestamps, and duration and
resolution must be within limits.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from omniloom.data.manifest import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_VIDEO_BYTES

from .validate import Reject

IMAGE_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp", "GIF": "gif", "BMP": "bmp", "TIFF": "tiff", "MPO": "jpg",
                 # kept as they are too: PIL reads them at training time (netpbm names come from the mode)
                 "PPM": "ppm", "XBM": "xbm", "SGI": "sgi", "SUN": "ras", "TGA": "tga", "ICO": "ico", "PCX": "pcx",
                 "QOI": "qoi"}
_NETPBM_EXT = {"1": "pbm", "L": "pgm", "I": "pgm", "I;16": "pgm", "I;16B": "pgm"}
# Container names FFmpeg reports -> a file extension for the shard member.
CONTAINER_EXT = {
    "mov,mp4,m4a,3gp,3g2,mj2": "mp4",
    "matroska,webm": "mkv",
    "avi": "avi",
    "flv": "flv",
    "mpegts": "ts",
    "ogg": "ogv",
    "mpeg": "mpg",
    "gif": "gif",
}


@dataclass(frozen=True, kw_only=True)
class MediaLimits:
    """Acceptance limits for media (all have CLI flags; see `omniloom data build --help`)."""

    max_image_pixels: int = 8192 * 8192
    min_image_side: int = 16
    max_image_aspect: float = 10.0
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_frames: int = 1000
    min_video_seconds: float = 0.0
    max_video_seconds: float = 600.0
    min_video_side: int = 16
    max_video_side: int = 4096
    max_video_bytes: int = DEFAULT_MAX_VIDEO_BYTES


def validate_image(data: bytes, limits: MediaLimits) -> dict:
    """Fully decode image bytes; return {"format", "ext", "width", "height", "mode", "frames"} or
    raise Reject with the reason."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise Reject("empty", "zero-byte image file")
    if len(data) > limits.max_image_bytes:
        raise Reject("too-large", f"image is {len(data)} bytes, above --max-image-bytes {limits.max_image_bytes}")
    with warnings.catch_warnings():
        # PIL warns (and past 2x its own limit raises) on huge canvases; our limit is checked
        # explicitly below, before any pixel is decoded.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            img = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as err:
            raise Reject("image-bomb", f"image declares a huge canvas ({err}); refusing to decode it") from None
        except UnidentifiedImageError:
            raise Reject("not-an-image", "PIL cannot identify this as an image (corrupt, or not an image despite its name)") from None
        except Exception as err:  # noqa: BLE001 - any parser error means an unusable file
            raise Reject("corrupt-image", f"image header cannot be read: {err}") from None
        with img:
            if img.format not in IMAGE_FORMATS:
                raise Reject("image-format", f"image format {img.format} is not accepted (accepted: {sorted(IMAGE_FORMATS)})")
            w, h = img.size
            if w * h > limits.max_image_pixels:
                raise Reject(
                    "image-bomb",
                    f"image declares {w}x{h} = {w * h} pixels, above --max-image-pixels {limits.max_image_pixels} "
                    "(decompression-bomb guard; raise the limit if the image is genuine)",
                )
            frames = getattr(img, "n_frames", 1)
            if frames > limits.max_image_frames:
                raise Reject("image-frames", f"animated image has {frames} frames, above {limits.max_image_frames}")
            try:
                for i in range(frames):
                    if i:
                        img.seek(i)
                    img.load()
            except Exception as err:  # noqa: BLE001 - truncated or corrupt pixel data
                raise Reject("corrupt-image", f"image data does not decode (frame {i}): {err}") from None
            mode = img.mode
    if min(w, h) < limits.min_image_side:
        raise Reject("image-too-small", f"image is {w}x{h}, smaller than --min-image-side {limits.min_image_side}")
    aspect = max(w, h) / max(1, min(w, h))
    if aspect > limits.max_image_aspect:
        raise Reject("image-aspect", f"image is {w}x{h} (aspect {aspect:.1f}), above --max-image-aspect {limits.max_image_aspect}")
    ext = _NETPBM_EXT.get(mode, "ppm") if img.format == "PPM" else IMAGE_FORMATS[img.format]
    return {"format": img.format, "ext": ext, "width": w, "height": h, "mode": mode, "frames": frames}


def _is_image_pipe(format_name: str) -> bool:
    """FFmpeg's demuxers for files of images (image2, and one `*_pipe` per image format)."""
    return format_name in ("image2", "image2pipe") or format_name.endswith("_pipe")


def still_image_format(data: bytes) -> str | None:
    """The image format ("ppm", "exr", ...) when FFmpeg opens `data` as an image pipe holding one
    image, else None (a video, several images in a row, or nothing PyAV can open)."""
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception:  # noqa: BLE001 - not for us to judge here: validate_video says why
        return None
    with container:
        name = container.format.name
        if not container.streams.video or not _is_image_pipe(name):
            return None
        packets = 0
        try:
            for packet in container.demux(container.streams.video[0]):
                if packet.size:
                    packets += 1
                if packets > 1:
                    return None
        except Exception:  # noqa: BLE001 - a broken pipe of images: validate_video rejects it
            return None
    return name.removesuffix("_pipe") if packets == 1 else None


def validate_still(data: bytes, limits: MediaLimits) -> tuple[bytes, dict]:
    """`validate_image`, with a way in for still images PIL cannot read: decoded with PyAV and
    re-encoded as PNG (the bytes returned are then the PNG's; `converted_from` names the original
    format). Returns (bytes to store, info) or raises Reject."""
    try:
        return data, validate_image(data, limits)
    except Reject as rej:
        if rej.code != "not-an-image":
            raise
        fmt = still_image_format(data)
        if fmt is None:
            raise Reject("not-an-image", "neither PIL nor FFmpeg reads this as an image (corrupt, or not an image "
                                         "despite its name)") from None
    png = _still_to_png(data, fmt, limits)
    info = validate_image(png, limits)
    info.update(converted_from=fmt, original_bytes=len(data))
    return png, info


def _still_to_png(data: bytes, fmt: str, limits: MediaLimits) -> bytes:
    """Decode the one image of an FFmpeg image pipe and encode it as 8-bit PNG (RGB, or RGBA when
    it has alpha). Floating-point formats (OpenEXR) are clipped to 0..1, without tone mapping."""
    import av
    from PIL import Image

    with av.open(io.BytesIO(data), mode="r") as container:
        stream = container.streams.video[0]
        w, h = stream.codec_context.width, stream.codec_context.height
        if w * h > limits.max_image_pixels:
            raise Reject("image-bomb", f"image declares {w}x{h} = {w * h} pixels, above --max-image-pixels "
                                       f"{limits.max_image_pixels} (decompression-bomb guard; raise the limit if the image is genuine)")
        try:
            frame = next(container.decode(stream), None)
        except Exception as err:  # noqa: BLE001 - FFmpeg raises many error types for broken data
            raise Reject("corrupt-image", f"{fmt} image data does not decode ({_short(err)})") from None
        if frame is None:
            raise Reject("corrupt-image", f"{fmt} image holds no decodable picture")
        alpha = any(c.is_alpha for c in frame.format.components) or frame.format.has_palette
        pixels = frame.to_ndarray(format="rgba" if alpha else "rgb24")
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGBA" if alpha else "RGB").save(buf, format="PNG")
    return buf.getvalue()


def validate_video(data: bytes, limits: MediaLimits) -> dict:
    """Open video bytes with PyAV, decode a frame, demux the whole stream; return
    {"container", "ext", "codec", "width", "height", "fps", "frames", "duration", "duration_source"}
    or raise Reject with the reason."""
    import av

    if not data:
        raise Reject("empty", "zero-byte video file")
    if len(data) > limits.max_video_bytes:
        raise Reject("too-large", f"video is {len(data)} bytes, above --max-video-bytes {limits.max_video_bytes}")
    try:
        container = av.open(io.BytesIO(data), mode="r")
    except Exception as err:  # noqa: BLE001 - FFmpeg raises many error types for junk input
        raise Reject("not-a-video", f"PyAV/FFmpeg cannot open it as a media container ({_short(err)}); not a video, or truncated") from None
    with container:
        if not container.streams.video:
            n_audio = len(container.streams.audio)
            if n_audio:
                raise Reject("audio-only", f"audio-only file ({n_audio} audio stream(s), no video stream); put it in an audio corpus instead")
            if not container.streams.audio and not container.streams.video:
                raise Reject(
                    "no-video-stream",
                    f"container ({container.format.name}) has no audio or video stream: a truncated MP4/MOV loses its index ('moov' atom) "
                    "at the end of the file; re-download or re-encode it",
                )
            raise Reject("no-video-stream", "container has no video stream")
        stream = container.streams.video[0]
        cc = stream.codec_context
        if cc is None:  # a cut index can leave the stream without codec parameters
            raise Reject("corrupt-video", "the video stream has no usable codec parameters: the index is truncated or corrupt")
        width, height = cc.width, cc.height
        codec = cc.name
        declared_frames = int(stream.frames or 0)
        first = None
        packets = 0
        decode_errors = 0
        max_end = None
        min_pts = None
        last_corrupt: dict[int, bool] = {}  # per stream: is its last packet cut short?
        ends = _StreamEnds()  # where each stream's data ends, against the duration the header promises
        per_stream: dict[int, int] = {}  # packets per stream index, against each stream's declared count
        try:
            # Every stream is demuxed (audio packets are cheap) so the end of the data can be set
            # against the duration the container header promises (`_check_complete`).
            for packet in container.demux():
                ends.add(packet)
                if packet.size or packet.pts is not None:  # AVI's empty "dropped frame" chunks count; flush packets do not
                    per_stream[packet.stream.index] = per_stream.get(packet.stream.index, 0) + 1
                    last_corrupt[packet.stream.index] = packet.is_corrupt
                if packet.stream.index != stream.index:
                    continue
                if packet.size == 0 and packet.pts is None:
                    if first is None:  # flush packet: drain the decoder for the first frame
                        first = _decode_first(stream, packet, first)
                    continue
                packets += 1
                if packet.pts is not None:
                    end = packet.pts + (packet.duration or 0)
                    max_end = end if max_end is None else max(max_end, end)
                    min_pts = packet.pts if min_pts is None else min(min_pts, packet.pts)
                if first is None:
                    try:
                        first = _decode_first(stream, packet, first)
                    except av.FFmpegError:
                        decode_errors += 1
        except Exception as err:  # noqa: BLE001
            raise Reject("corrupt-video", f"demuxing failed after {packets} packets ({_short(err)}): the index or data is truncated or corrupt") from None
        if first is None:
            raise Reject("no-frames", f"video stream ({codec}) yields no decodable frame ({packets} packets, {decode_errors} decode errors)")
        width, height = width or first.width, height or first.height
        fps = float(stream.average_rate or stream.guessed_rate or 0) or None
        _check_complete(container, per_stream, last_corrupt=last_corrupt, ends=ends, fps=fps)
        duration, source = None, None
        tb = stream.time_base
        if stream.duration and tb:
            duration, source = float(stream.duration * tb), "stream"
        elif container.duration:
            duration, source = container.duration / 1_000_000, "container"
        elif max_end is not None and tb:
            duration, source = float((max_end - (min_pts or 0)) * tb), "packets"
        elif fps:
            duration, source = packets / fps, "frame-count"
        if duration is None:
            raise Reject("no-duration", "video duration is neither recorded nor estimable from timestamps")
        fmt = container.format.name
    if not (limits.min_video_seconds <= duration <= limits.max_video_seconds):
        raise Reject(
            "video-duration",
            f"video lasts {duration:.2f}s, outside [--min-video-seconds {limits.min_video_seconds}, "
            f"--max-video-seconds {limits.max_video_seconds}]",
        )
    if min(width, height) < limits.min_video_side or max(width, height) > limits.max_video_side:
        raise Reject(
            "video-resolution",
            f"video is {width}x{height}, outside --min-video-side {limits.min_video_side} / --max-video-side {limits.max_video_side}",
        )
    return {
        "container": fmt,
        "ext": CONTAINER_EXT.get(fmt, fmt.split(",")[0]),
        "codec": codec,
        "width": width,
        "height": height,
        "fps": round(fps, 3) if fps else None,
        "frames": declared_frames or packets,
        "duration": round(duration, 3),
        "duration_source": source,
    }


# Containers whose header states the duration (rather than FFmpeg estimating it from the data);
# MP4/MOV and AVI state a frame count instead, which is checked first.
_HEADER_DURATION = ("matroska,webm", "flv", "asf")


class _StreamEnds:
    """The time (seconds) at which the data of the longest stream ends: its last timestamp plus
    one packet's duration. Containers often leave the last packet's duration unset (Matroska's
    last audio block), so a missing duration is taken from the stream's other packets."""

    def __init__(self):
        self.state: dict[int, list] = {}  # index -> [max pts, last duration, min positive pts step, previous pts]

    def add(self, packet) -> None:
        tb = packet.stream.time_base
        if packet.pts is None or not tb:
            return
        t = float(packet.pts * tb)
        st = self.state.setdefault(packet.stream.index, [t, 0.0, 0.0, None])
        st[0] = max(st[0], t)
        if packet.duration:
            st[1] = float(packet.duration * tb)
        if st[3] is not None and t > st[3] and (not st[2] or t - st[3] < st[2]):
            st[2] = t - st[3]
        st[3] = t

    def end(self, index: int | None = None) -> float:
        """Where the data of stream `index` (default: the longest stream) ends."""
        if index is not None:
            m, d, step, _ = self.state.get(index, [0.0, 0.0, 0.0, None])
            return m + (d or step)
        return max((m + (d or step) for m, d, step, _ in self.state.values()), default=0.0)

    def step(self, index: int) -> float:
        _, d, step, _ = self.state.get(index, [0.0, 0.0, 0.0, None])
        return d or step

    def longest_packet(self) -> float:
        """The longest packet duration of any stream (an AAC frame at 8 kHz is 0.128 s)."""
        return max((d or step for _, d, step, _ in self.state.values()), default=0.0)


def _check_complete(container, per_stream: dict[int, int], *, last_corrupt: dict[int, bool], ends: _StreamEnds, fps) -> None:
    """Reject a video whose container promises more than its bytes hold (a truncated download).

    The rule: (1) when the index declares a frame count for a stream (MP4, MOV, AVI; video and
    audio alike), every frame must be there, with 1% slack for long streams (none under 100
    frames), unless the stream's timestamps still reach its declared duration (AVI counts skipped
    frame slots); (2) the last packet of every stream must not be cut short (FFmpeg flags it
    corrupt); (3) when the header states a duration (Matroska/WebM, FLV, ASF), the data of some
    stream must reach it within 1.5 packet durations (the longer of a video frame and an audio
    packet: encoders pad audio by a frame) or 1%, whichever is larger. Streams that promise
    nothing (MPEG-TS, raw streams) can only be checked by (2)."""
    av_streams = [st for st in container.streams if st.type in ("video", "audio")]  # not timecode/data tracks
    for st in av_streams:
        declared, got = int(st.frames or 0), per_stream.get(st.index, 0)
        if declared and declared - got > declared // 100:
            if st.duration and st.time_base:
                # AVI counts frame slots, some of them skipped: a stream whose timestamps reach its
                # declared end holds everything, whatever the count.
                promised = float(((st.start_time or 0) + st.duration) * st.time_base)
                if ends.end(st.index) >= promised - 0.5 * ends.step(st.index) - 1e-6:
                    continue
            raise Reject(
                "truncated-video",
                f"the index declares {declared} {st.type} frames but only {got} are in the file: it is truncated; re-download or re-encode it",
            )
    for st in av_streams:
        if last_corrupt.get(st.index):
            raise Reject("truncated-video", f"the last {st.type} packet is cut short or corrupt: the file is truncated; re-download or re-encode it")
    if container.format.name in _HEADER_DURATION and container.duration:
        promised = container.duration / 1_000_000
        data_end = ends.end()
        slack = max(1.5 * max(1.0 / fps if fps else 0.1, ends.longest_packet()), 0.01 * promised)
        if data_end < promised - slack:
            raise Reject(
                "truncated-video",
                f"the header promises {promised:.3f}s but the data ends at {data_end:.3f}s: the file is truncated; re-download or re-encode it",
            )


def _decode_first(stream, packet, first):
    for frame in stream.codec_context.decode(packet):
        return frame
    return first


def _short(err: Exception) -> str:
    msg = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return msg[:200]


def video_frame_strip(data: bytes, *, num_frames: int = 6, height: int = 96) -> list:
    """Decode up to `num_frames` frames spread over the video, each scaled to `height` pixels high,
    as PIL images (for `omniloom data inspect`)."""
    import av

    frames = []
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        total = int(stream.frames or 0)
        all_frames = []
        for i, frame in enumerate(container.decode(stream)):
            # Without a frame count keep every frame (inspect targets short clips), else sample.
            if total <= 0 or i % max(1, total // num_frames) == 0:
                all_frames.append(frame)
        step = max(1, len(all_frames) // num_frames)
        for frame in all_frames[::step][:num_frames]:
            w = max(1, round(frame.width * height / max(1, frame.height)))
            frames.append(frame.reformat(width=w, height=height, format="rgb24").to_image())
    return frames
