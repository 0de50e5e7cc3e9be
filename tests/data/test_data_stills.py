"""Still images in formats beyond JPEG/PNG (issue 28 item 2): a file that is a still image is an
image document whichever decoder reads it (PIL, or PyAV's image pipes), never a one-frame video,
and the tokenizer reads what the build stored."""

from __future__ import annotations

import io
import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.data.prep.shards import build
from omniloom.tokenizers.image import decode_image
from omniloom.tokenizers.settings import MediaSettings

W, H = 48, 40


def _pixels() -> np.ndarray:
    rng = np.random.default_rng(0)
    return (rng.random((H, W, 3)) * 255).astype(np.uint8)


def _pil(fmt: str, mode: str | None = None) -> bytes:
    from PIL import Image

    img = Image.fromarray(_pixels())
    buf = io.BytesIO()
    (img.convert(mode) if mode else img).save(buf, format=fmt)
    return buf.getvalue()


def _pyav(codec: str, pix_fmt: str) -> bytes:
    """One picture through FFmpeg's image2pipe muxer (formats PIL cannot write)."""
    import av

    buf = io.BytesIO()
    with av.open(buf, "w", format="image2pipe") as out:
        stream = out.add_stream(codec, rate=1)
        stream.width, stream.height, stream.pix_fmt = W, H, pix_fmt
        frame = av.VideoFrame.from_ndarray(_pixels(), format="rgb24").reformat(format=pix_fmt)
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    return buf.getvalue()


def _stills() -> dict[str, bytes]:
    """The formats of Python's test/imghdrdata that are not JPEG/PNG/GIF/BMP/TIFF/WebP; from that
    folder where this Python ships it, else made here."""
    made = {"ppm": lambda: _pil("PPM"), "pgm": lambda: _pil("PPM", "L"), "pbm": lambda: _pil("PPM", "1"),
            "xbm": lambda: _pil("XBM", "1"), "sgi": lambda: _pil("SGI"), "ras": lambda: _pyav("sunrast", "bgr24"),
            "exr": lambda: _pyav("exr", "gbrpf32le")}
    shipped = Path(sysconfig.get_paths()["stdlib"]) / "test" / "imghdrdata"
    return {ext: (shipped / f"python.{ext}").read_bytes() if (shipped / f"python.{ext}").is_file() else make()
            for ext, make in made.items()}


def _documents(out: Path) -> dict[str, tuple[dict, dict]]:
    """source path inside the folder -> (doc.json, members)."""
    found = {}
    for shard in read_manifest(out)["shards"]:
        for smp in shard["samples"]:
            _, members = iter_sample_at(out / shard["name"], smp["offset"])
            doc = json.loads(members["doc.json"])
            found[doc["meta"]["source"].split("/", 1)[1]] = (doc, members)
    return found


def test_still_images_in_other_formats_are_image_documents_the_tokenizer_reads(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    stills = _stills()
    for ext, data in stills.items():
        (src / f"pic.{ext}").write_bytes(data)
    (src / "sgi_named.rgb").write_bytes(stills["sgi"])  # an unlisted name: found by its content
    (src / "exr_named.dat").write_bytes(stills["exr"])  # PIL cannot read it, FFmpeg can
    (src / "in_doc.pgm").write_bytes(stills["pgm"])
    (src / "doc.jsonl").write_text(json.dumps({"schema": 1, "segments": [
        {"type": "text", "text": "a still declared as a video"}, {"type": "video", "path": "in_doc.pgm"}]}) + "\n")
    out = tmp_path / "out"
    summary = build([str(src)], str(out), dedup=False, progress=False)
    assert summary["rejects"] == {}, summary["rejects"]
    docs = _documents(out)
    assert len(docs) == len(stills) + 3 and "in_doc.pgm" not in docs  # the JSONL document shows it
    settings = MediaSettings(patch_size=8, image_patch_budget=64)
    for name, (doc, members) in docs.items():
        kinds = [s["type"] for s in doc["segments"] if s["type"] != "text"]
        assert kinds == ["image"], (name, doc["segments"])
        ref = next(s["ref"] for s in doc["segments"] if s["type"] == "image")
        info = doc["meta"]["media"][ref]
        assert min(info["width"], info["height"]) >= 16 and info["frames"] == 1, (name, info)
        assert decode_image(members[ref], settings).shape[2] == 3  # what training reads
    for name in ("pic.exr", "exr_named.dat"):  # re-encoded for PIL, and saying so
        doc, members = docs[name]
        assert doc["segments"][0]["ref"].endswith(".png") and doc["meta"]["media"]["img0.png"]["converted_from"] == "exr"
        assert members["img0.png"][:8] == b"\x89PNG\r\n\x1a\n"
    for ext in ("ppm", "pgm", "pbm", "xbm", "sgi", "ras"):  # PIL reads these: kept as they are
        doc, members = docs[f"pic.{ext}"]
        assert members[doc["segments"][0]["ref"]] == stills[ext] and doc["segments"][0]["ref"] == f"img0.{ext}"


def test_a_run_of_images_in_one_pipe_stays_a_video_and_junk_is_still_rejected(tmp_path):
    from omniloom.data.prep.media import MediaLimits, still_image_format, validate_still
    from omniloom.data.prep.validate import Reject

    one = _pil("PPM")
    assert still_image_format(one) == "ppm_pipe".removesuffix("_pipe")
    assert still_image_format(one + one) is None  # two pictures in a row: a (very short) video
    with pytest.raises(Reject) as err:
        validate_still(b"\x00" * 300, MediaLimits())
    assert err.value.code == "not-an-image"
