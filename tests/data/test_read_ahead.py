"""The stream's read-ahead on local indexed shards (data/stream/reader.py: `SampleReader`): every
sample gives what reading it alone gives (its document, or its skip), a shard changed after a
read-ahead is read again (and skipped as changed), and a sample past the byte budget is never
read early."""

from __future__ import annotations

import pytest

from omniloom.data.config import SourceConfig
from omniloom.data.prep.index import index_shards
from omniloom.data.stream import reader as R
from omniloom.data.stream.reader import SampleError, SampleReader, resolve_source


def _shards(folder, n_shards: int = 2, per: int = 9) -> list[str]:
    import webdataset

    paths = []
    for s in range(n_shards):
        path = str(folder / f"{s:05d}.tar")
        with webdataset.TarWriter(path) as w:
            for i in range(per):
                caption = b"\xff\xfe not utf-8" if i == 4 else f"caption {s} {i}".encode()  # a bad_sample skip
                w.write({"__key__": f"{s:03d}{i:06d}", "jpg": bytes([i]) * (200 + 50 * i), "txt": caption,
                         "json": {"i": i}})
        paths.append(path)
    return paths


@pytest.fixture()
def indexed(tmp_path):
    shards = _shards(tmp_path)
    out = str(tmp_path / "index")
    index_shards(shards, out, echo=None)
    return out, shards


def _outcome(reader: SampleReader, si: int, i: int):
    try:
        return reader.read_document(si, i)
    except SampleError as err:
        return ("skip", err.reason, str(err))


def test_read_ahead_gives_each_sample_what_reading_it_alone_gives(indexed):
    out, _ = indexed
    shards = resolve_source(SourceConfig(path=out)).shards
    ahead = SampleReader(shards)
    order = [(si, i) for si, sh in enumerate(shards) for i in range(sh.num_samples)]
    order = order[3:] + order[:3] + [(0, 1), (1, 2), (0, 2)]  # a start mid-shard, a wrap, jumps
    for si, i in order:
        alone = SampleReader(shards)
        alone._read_ahead = lambda *a: None
        assert _outcome(ahead, si, i) == _outcome(alone, si, i), (si, i)
    assert any(_outcome(SampleReader(shards), si, i)[0] == "skip" for si, i in order)


def test_a_shard_changed_after_a_read_ahead_is_read_again_and_skipped(indexed):
    out, shards = indexed
    infos = resolve_source(SourceConfig(path=out)).shards
    reader = SampleReader(infos)
    reader.read_document(0, 0)
    assert (0, 1) in reader._ahead  # read ahead
    with open(shards[0], "ab") as f:
        f.write(b"\0" * 1024)  # the shard changes size: every sample of it is `changed_shard`
    with pytest.raises(SampleError) as err:
        reader.read_document(0, 1)
    assert err.value.reason == "changed_shard"


def test_a_sample_past_the_byte_budget_is_not_read_ahead(indexed, monkeypatch):
    out, _ = indexed
    infos = resolve_source(SourceConfig(path=out)).shards
    monkeypatch.setattr(R, "READ_AHEAD_BYTES", sum(infos[0].byte_range(j)[1] - infos[0].byte_range(j)[0] for j in (1, 2)))
    reader = SampleReader(infos)
    read = []
    real = reader._read_document
    reader._read_document = lambda si, i: (read.append((si, i)), real(si, i))[1]
    reader.read_document(0, 0)
    assert read == [(0, 0), (0, 1), (0, 2)]
