"""The direct tar header parser (data/wds.py: `plain_members`) against tarfile, on odd tars: every
window it reads either gives what tarfile gives (same samples, members, bytes, offsets, refusals
and errors) or is handed back to tarfile (`NotPlain`). The plain tars real writers make (pax per
member from webdataset.TarWriter, GNU long names, ustar prefixes, pax long paths) must take the
direct path; sparse members, global headers, base-256 sizes, bad checksums and truncated shards
may fall back, and must then read exactly as before."""

from __future__ import annotations

import io
import os
import random
import tarfile

import pytest

from omniloom.data import wds
from omniloom.data.prep import index as prep_index
from omniloom.data.stream import reader
from omniloom.data.stream.reader import ShardInfo, _foreign_members, _Window

LIMITS = wds.ReadLimits(image=4096, video=8192, text=2048)
BIG = 5000  # a jpg past LIMITS.image: refused from its header, never read


def _add(tf: tarfile.TarFile, name: str, data: bytes = b"", *, type=tarfile.REGTYPE, pax: dict | None = None,
         linkname: str = "") -> None:
    ti = tarfile.TarInfo(name)
    ti.type, ti.size, ti.mtime, ti.linkname = type, len(data) if type == tarfile.REGTYPE else 0, 1_700_000_000, linkname
    if pax:
        ti.pax_headers = pax
    tf.addfile(ti, io.BytesIO(data) if ti.size else None)


def _samples(tf: tarfile.TarFile, prefix: str = "", n: int = 3) -> None:
    for i in range(n):
        key = f"{prefix}{i:06d}"
        _add(tf, f"{key}.jpg", bytes([i]) * (100 + 37 * i))
        _add(tf, f"{key}.txt", f"caption {i}".encode())
        _add(tf, f"{key}.json", b'{"caption": "x"}')


def _odd_members(tf: tarfile.TarFile) -> None:
    """A folder, links, a fifo, a member without a dot, webdataset meta members, an empty member
    and an oversize one, between samples."""
    _add(tf, "dir/", type=tarfile.DIRTYPE)
    _add(tf, "dir/a.jpg", b"\xff" * 20)
    _add(tf, "dir/a.lnk.txt", type=tarfile.SYMTYPE, linkname="dir/a.jpg")
    _add(tf, "dir/a.hard", type=tarfile.LNKTYPE, linkname="dir/a.jpg")
    _add(tf, "dir/a.fifo", type=tarfile.FIFOTYPE)
    _add(tf, "README", b"no dot")
    _add(tf, "__index__", b"meta")
    _add(tf, "x/__meta__/b.txt", b"meta too")
    _add(tf, "b.txt", b"")
    _add(tf, "b.jpg", b"\x01" * BIG)
    _add(tf, "b.other", b"\x02" * 5000)  # an unknown member past SMALL_MEMBER
    _add(tf, "b.cls", b"7")


def _write(path, fmt, body) -> str:
    with tarfile.open(path, "w", format=fmt) as tf:
        body(tf)
    return str(path)


def _long(tf: tarfile.TarFile) -> None:
    deep = "/".join(["folder%02d" % i for i in range(12)])  # > 100 characters: long-name headers
    _samples(tf, prefix=deep + "/", n=2)
    _add(tf, deep + "/élan.jpg", b"\x03" * 40)  # a non-ASCII name
    _add(tf, deep + "/élan.txt", "légende".encode())
    _samples(tf, n=2)


def _webdataset_shard(path) -> str:
    import webdataset

    with webdataset.TarWriter(str(path)) as w:
        for i in range(4):
            w.write({"__key__": f"pre/fix/{i:09d}", "jpg": bytes([i]) * 300, "txt": f"photo {i}", "json": {"i": i}})
    return str(path)


def _plain_tars(tmp_path) -> dict[str, str]:
    return {
        "webdataset": _webdataset_shard(tmp_path / "wds.tar"),
        "pax": _write(tmp_path / "pax.tar", tarfile.PAX_FORMAT, lambda tf: (_samples(tf), _odd_members(tf), _samples(tf, "z"))),
        "gnu": _write(tmp_path / "gnu.tar", tarfile.GNU_FORMAT, lambda tf: (_samples(tf), _odd_members(tf))),
        "ustar": _write(tmp_path / "ustar.tar", tarfile.USTAR_FORMAT, lambda tf: (_samples(tf), _odd_members(tf))),
        "gnu-longname": _write(tmp_path / "gnulong.tar", tarfile.GNU_FORMAT, _long),
        "pax-longpath": _write(tmp_path / "paxlong.tar", tarfile.PAX_FORMAT, _long),
        "ustar-prefix": _write(tmp_path / "ustarlong.tar", tarfile.USTAR_FORMAT,
                               lambda tf: _samples(tf, prefix="/".join(["f%02d" % i for i in range(30)]) + "/")),
    }


def _patch_header(data: bytearray, at: int, field: slice, value: bytes) -> None:
    """Set a header field and its checksum, as a writer that means it would."""
    data[at + field.start:at + field.stop] = value
    data[at + 148:at + 156] = b"        "
    data[at + 148:at + 156] = b"%06o\0 " % sum(data[at:at + 512])


def _headers(path: str) -> list[int]:
    with tarfile.open(path) as tf:
        return [m.offset for m in tf.getmembers()]


def _odd_tars(tmp_path) -> dict[str, str]:
    base = _write(tmp_path / "base.tar", tarfile.PAX_FORMAT, lambda tf: (_samples(tf), _samples(tf, "y")))
    raw = open(base, "rb").read()
    offs = _headers(base)
    out = {}

    def variant(name: str, data: bytes) -> None:
        p = tmp_path / f"{name}.tar"
        p.write_bytes(bytes(data))
        out[name] = str(p)

    sparse_pax = {"GNU.sparse.map": "0,16", "GNU.sparse.size": "16", "GNU.sparse.name": "s0.jpg"}
    out["pax-sparse"] = _write(tmp_path / "paxsparse.tar", tarfile.PAX_FORMAT, lambda tf: (
        _samples(tf), _add(tf, "s0.jpg", b"\0" * 16, pax=sparse_pax), _add(tf, "s0.txt", b"sparse"), _samples(tf, "t")))
    gnu = bytearray(open(_write(tmp_path / "g.tar", tarfile.GNU_FORMAT, lambda tf: (_samples(tf), _samples(tf, "u"))), "rb").read())
    at = _headers(str(tmp_path / "g.tar"))[3]
    _patch_header(gnu, at, slice(156, 157), tarfile.GNUTYPE_SPARSE)  # a GNU sparse member
    variant("gnu-sparse", gnu)
    b256 = bytearray(open(tmp_path / "g.tar", "rb").read())
    size = int(b256[at + 124:at + 135], 8)
    _patch_header(b256, at, slice(124, 136), b"\x80" + size.to_bytes(11, "big"))  # the same size in base-256
    variant("base256-size", b256)
    with tarfile.open(tmp_path / "glob.tar", "w", format=tarfile.PAX_FORMAT, pax_headers={"comment": "global"}) as tf:
        _samples(tf)
    out["global-pax"] = str(tmp_path / "glob.tar")
    bad = bytearray(raw)
    bad[offs[4] + 7] ^= 0x20  # a header that fails its checksum mid-shard
    variant("bad-checksum", bad)
    variant("truncated-in-data", raw[:offs[5] + 512 + 700])
    variant("truncated-in-header", raw[:offs[6] + 100])
    variant("truncated-after-header", raw[:offs[6] + 512])
    variant("no-end-blocks", raw[:offs[-1] + 1024 + 512])
    variant("empty", b"")
    variant("zeros", bytes(2048))
    signed = bytearray(raw)  # a checksum written as the signed sum (old writers): tarfile takes it
    signed[offs[2] + 200] = 0xF0
    signed[offs[2] + 148:offs[2] + 156] = b"        "
    signed[offs[2] + 148:offs[2] + 156] = b"%06o\0 " % sum(b - 256 if b > 127 else b for b in signed[offs[2]:offs[2] + 512])
    variant("signed-checksum", signed)
    v7 = bytearray(raw)
    _patch_header(v7, offs[1], slice(156, 157), b"\0")  # the old-style regular type
    variant("v7-type", v7)
    return out


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as err:  # noqa: BLE001 - the outcome compared is the exception itself
        return (type(err).__name__, getattr(err, "reason", None), str(err))


class _AnyKey(str):
    """A key equal to whatever the tar holds: the window's sample is compared, not the index's key."""

    def __eq__(self, other):
        return True

    def __ne__(self, other):
        return False

    __hash__ = str.__hash__


def _window_read(path: str, start: int, stop: int, fast: bool, monkeypatch) -> tuple:
    """What `_foreign_members` gives for the window [start, stop) of `path`, with the direct parser
    or with tarfile alone; and whether the direct parser answered."""
    used = []
    real = reader._plain_first_group

    def spy(window, limits):
        got = real(window, limits) if fast else wds.NotPlain
        used.append(got is not wds.NotPlain)
        return got

    monkeypatch.setattr(reader, "_plain_first_group", spy)
    shard = ShardInfo(url=path, name="t", offsets=[start], keys=[_AnyKey("?")], limits=reader.ReadLimits())
    stop = min(stop, os.path.getsize(path))  # as SampleReader.read_raw bounds a window by the file's real size
    with open(path, "rb") as f:
        f.seek(start)
        out = _outcome(lambda: _foreign_members(_Window(f, start, stop, seekable=True), shard, 0, "w", False))
    monkeypatch.setattr(reader, "_plain_first_group", real)
    return out, any(used)


def _windows(path: str, extra: tuple = ()) -> list[tuple[int, int]]:
    size = os.path.getsize(path)
    try:
        with open(path, "rb") as f:
            starts = sorted({s for _, s, _, _ in wds.groups(tarfile.open(fileobj=f, mode="r:"), None)})
    except (tarfile.TarError, EOFError) as err:
        cur = getattr(err, "pending", None)
        starts = [cur[1]] if cur else []
    starts = sorted((set(starts) | {0} | set(extra)) - {size})
    bounds = starts[1:] + [size]
    wins = [(s, e) for s, e in zip(starts, bounds)]
    wins += [(s, size) for s in starts]  # a window to the end of the file (the last sample's, or a lying index)
    wins += [(s, max(s, e - 700)) for s, e in zip(starts, bounds)]  # cut short
    return wins


@pytest.fixture(autouse=True)
def _limits(monkeypatch):
    monkeypatch.setattr(reader, "_wds_limits", lambda limits: LIMITS)


def test_plain_tars_take_the_direct_path_and_read_as_tarfile_does(tmp_path, monkeypatch):
    for kind, path in _plain_tars(tmp_path).items():
        direct = 0
        for start, stop in _windows(path):
            fast, used = _window_read(path, start, stop, True, monkeypatch)
            slow, _ = _window_read(path, start, stop, False, monkeypatch)
            assert fast == slow, (kind, start, stop)
            direct += used and fast[0] == "ok"
        assert direct >= 2, kind
        with open(path, "rb") as f:  # the whole shard, as `data index` scans it: never handed back
            plain = list(wds.groups_of(wds.plain_members(f, 0, os.path.getsize(path)), None))
            f.seek(0)
            assert plain == list(wds.groups(tarfile.open(fileobj=f, mode="r:"), None)), kind


def test_odd_tars_read_exactly_as_with_tarfile(tmp_path, monkeypatch):
    fell_back = set()
    for kind, path in _odd_tars(tmp_path).items():
        for start, stop in _windows(path):
            fast, used = _window_read(path, start, stop, True, monkeypatch)
            slow, _ = _window_read(path, start, stop, False, monkeypatch)
            assert fast == slow, (kind, start, stop, fast, slow)
            if not used:
                fell_back.add(kind)
    # these hold what only tarfile reads: the parser hands them back rather than guess
    assert {"pax-sparse", "gnu-sparse", "base256-size", "global-pax", "bad-checksum", "signed-checksum"} <= fell_back


def test_a_sparse_or_oversize_member_is_never_read_on_the_direct_path(tmp_path):
    path = _plain_tars(tmp_path)["pax"]
    reads = []
    with open(path, "rb") as raw:
        class Spy:
            def seek(self, *a):
                return raw.seek(*a)

            def tell(self):
                return raw.tell()

            def read(self, n=-1):
                reads.append(n)
                return raw.read(n)

        got = list(wds.groups_of(wds.plain_members(Spy(), 0, os.path.getsize(path)), wds.plain_reader(Spy(), LIMITS)))
    b = next(g for g in got if g[0] == "b")
    assert dict((e, v) for e, v, _ in b[3])["jpg"] == wds.Unread(BIG, "too-large")
    assert max(reads) < BIG  # neither the 5000-byte jpg nor the 5000-byte unknown member was read


def test_index_scan_is_the_same_with_and_without_the_direct_parser(tmp_path, monkeypatch):
    tars = {**_plain_tars(tmp_path), **_odd_tars(tmp_path)}
    fast = {k: prep_index._scan(p, None) for k, p in tars.items()}

    def refuse(*a, **k):
        raise wds.NotPlain("test")

    monkeypatch.setattr(wds, "plain_members", refuse)
    slow = {k: prep_index._scan(p, None) for k, p in tars.items()}
    assert fast == slow


def test_random_header_corruption_reads_as_with_tarfile(tmp_path, monkeypatch):
    """Flip bytes in the headers of a plain shard (names, sizes, types, checksums, pax records):
    whatever each flip does, the direct parser and tarfile read every window alike."""
    base = _plain_tars(tmp_path)["webdataset"]
    raw = open(base, "rb").read()
    offs = _headers(base)
    rng = random.Random(38)
    for n in range(60):
        data = bytearray(raw)
        at = rng.choice(offs) + rng.choice([0, 1024])  # a pax header, or the member's header after it
        for _ in range(rng.choice([1, 1, 2])):
            pos = at + rng.choice([rng.randrange(512), rng.randrange(100), 124 + rng.randrange(12), 156, 512 + rng.randrange(40)])
            data[pos] = rng.randrange(256)
        if rng.random() < 0.5:  # a writer that fixes the checksum: the header then parses
            data[at + 148:at + 156] = b"        "
            data[at + 148:at + 156] = b"%06o\0 " % sum(data[at:at + 512])
        path = tmp_path / f"c{n}.tar"
        path.write_bytes(bytes(data))
        for start, stop in _windows(str(path), extra=tuple(offs)):
            fast, _ = _window_read(str(path), start, stop, True, monkeypatch)
            slow, _ = _window_read(str(path), start, stop, False, monkeypatch)
            assert fast == slow, (n, start, stop, fast, slow)
