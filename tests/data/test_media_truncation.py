"""Issue 14, item 7, the rule README and docs/data-format.md state: where a stream's index declares a
frame count, at most 1% of it (rounded down) may be missing; none under 100 frames."""

from __future__ import annotations

import io

import pytest

from omniloom.data.prep.media import MediaLimits, validate_video
from omniloom.data.prep.synth import make_video
from omniloom.data.prep.validate import Reject


def _cut_after(full: bytes, frames_kept: int) -> bytes:
    """`full` (an MP4 with its index first, video only) cut at a packet boundary so that exactly
    `frames_kept` frames remain and no packet is cut short."""
    import av

    with av.open(io.BytesIO(full)) as c:
        pos = [p.pos for p in c.demux(c.streams.video[0]) if p.size]
    assert pos == sorted(pos)
    return full[: pos[frames_kept]]


@pytest.mark.parametrize("declared, kept, ok", [
    (300, 298, True),  # 2 missing: within 1% of 300 (3 frames)
    (300, 297, True),  # 3 missing: the slack exactly
    (300, 296, False),  # 4 missing
    (300, 290, False),
    (99, 98, False),  # under 100 frames nothing may be missing
])
def test_one_percent_of_declared_frames_may_be_missing(tmp_path, declared, kept, ok):
    full = make_video(tmp_path / "clip.mp4", frames=declared, size=(16, 16), fps=30, faststart=True).read_bytes()
    assert validate_video(full, MediaLimits())["frames"] == declared
    cut = _cut_after(full, kept)
    if ok:
        info = validate_video(cut, MediaLimits())
        assert info["frames"] == declared  # the declared count is what meta.media records
    else:
        with pytest.raises(Reject) as err:
            validate_video(cut, MediaLimits())
        assert err.value.code == "truncated-video"
        assert f"declares {declared} video frames but only {kept} are in the file" in err.value.reason
