"""Tar headers parsed directly: the plain ustar / GNU / pax headers WebDataset writers write.

tarfile builds a TarInfo per header (every field decoded, pax records applied one by one) and a
file object per member read: most of the time of an index, and of reading a sample in place.
`plain_header` parses one header straight from the file and raises `NotPlain` on anything it
leaves to tarfile, so that the caller reads the same bytes again with tarfile: an odd tar gives
exactly what it gave. `data/wds.py: plain_members` walks a window of headers with it;
tests/data/test_plain_headers.py holds it to tarfile on odd and corrupted tars.
"""

from __future__ import annotations

import re
import tarfile


class NotPlain(Exception):
    """The direct parser met something it leaves to tarfile: a header that fails its checksum or
    does not parse, a global or sparse pax header, hdrcharset, a base-256 number, a type other than
    a file, link, device, folder or fifo, a member or header that reaches past the bytes given."""


class PlainHeader:
    """The fields of a member `groups_of` and `member_value` use, as tarfile would give them."""

    __slots__ = ("name", "size", "offset", "offset_data")

    def __init__(self, name: str, size: int, offset: int, offset_data: int):
        self.name, self.size, self.offset, self.offset_data = name, size, offset, offset_data

    def isreg(self) -> bool:
        return True

    def issparse(self) -> bool:
        return False


_ZERO_BLOCK = bytes(tarfile.BLOCKSIZE)
_REG = frozenset(b"0\x007")  # REGTYPE, AREGTYPE, CONTTYPE (tarfile's regular files, GNU sparse aside)
_NONREG = frozenset(b"123456")  # links, devices, folders, fifos: no data follows their header
_XHD, _LONGNAME = tarfile.XHDTYPE[0], tarfile.GNUTYPE_LONGNAME[0]
_PAX_RECORD = re.compile(rb"(\d+) ([^=]+)=")  # tarfile's own record pattern
_WRAPPER_MAX = 1 << 16  # a longer pax block or GNU long name is left to tarfile
_OCTAL_FIELD = re.compile(rb" *[0-7]*[ \0]*")  # an octal field tarfile reads (its number ends at a space or NUL)
# The numbers as tarfile and GNU tar write them (mode uid gid size mtime chksum; devmajor devminor):
# when both match, every number parses and the size and checksum are read straight off.
_USUAL_NUMBERS = re.compile(rb"[0-7]{7}\0[0-7]{7}\0[0-7]{7}\0[0-7]{11}\0[0-7]{11}\0[0-7]{6}\0 ")
_USUAL_DEVICE = re.compile(rb"(?:[0-7]{7}\0|\0{8}){2}")
_OTHER_NUMBERS = ((100, 108), (108, 116), (116, 124), (136, 148), (329, 337), (337, 345))  # mode uid gid mtime devmajor devminor
_EVEN_BYTES = int.from_bytes(b"\xff\x00" * (tarfile.BLOCKSIZE // 2), "little")


def _byte_sum(block: bytes) -> int:
    """sum(block) of a 512-byte block, three times faster: the bytes as one integer, folded into
    16-bit lanes (each at most 510), whose sum mod 2**32-1 is lo + 65536 * hi of the lane sums."""
    x = int.from_bytes(block, "little")
    r = ((x & _EVEN_BYTES) + ((x >> 8) & _EVEN_BYTES)) % 0xFFFFFFFF
    return (r & 0xFFFF) + (r >> 16)


def _nti(field: bytes) -> int:
    """tarfile's `nti` of an octal field where both read it (NotPlain where tarfile refuses it,
    reads it as base-256, or would strip a character bytes.strip keeps)."""
    if field[0] in (0o200, 0o377):
        raise NotPlain("base-256 number")
    p = field.find(b"\0")
    digits = (field if p < 0 else field[:p]).strip()
    try:
        return int(digits, 8) if digits else 0
    except ValueError:
        raise NotPlain("bad number") from None


def _nts(field: bytes) -> str:
    p = field.find(b"\0")
    return (field if p < 0 else field[:p]).decode(tarfile.ENCODING, "surrogateescape")


def _block(n: int) -> int:
    return n + (-n) % tarfile.BLOCKSIZE


def _pax_fields(buf: bytes) -> tuple[str | None, int | None]:
    """(path, size) of a pax extended header's records, read as tarfile reads them."""
    if b"hdrcharset" in buf or b"GNU.sparse" in buf:
        raise NotPlain("pax charset or sparse record")
    path = size = None
    pos = 0
    while True:
        m = _PAX_RECORD.match(buf, pos)
        if not m:
            return path, size
        length = int(m.group(1))
        if length == 0:
            raise NotPlain("pax record of length 0")
        key, value = m.group(2), buf[m.end(2) + 1:m.start(1) + length - 1]
        if key == b"path":
            try:
                path = value.decode("utf-8")
            except UnicodeDecodeError:
                raise NotPlain("pax path not UTF-8") from None
        elif key == b"size":
            if not value.isdigit():
                raise NotPlain("pax size not a number")
            size = int(value)
        pos += length


def plain_header(f, pos: int, start: int, stop: int):
    """(header, is a regular file, position of the next header) of the member whose first header
    (pax or long-name headers included) is at `pos`, or None where tarfile sees the end (a zero
    block, or the end of the bytes, after `start`)."""
    offset, wrappers = pos, None
    while True:
        if pos + tarfile.BLOCKSIZE > stop:
            if pos == stop and pos > start and wrappers is None:
                return None
            raise NotPlain("header past the end")
        f.seek(pos)
        buf = f.read(tarfile.BLOCKSIZE)
        if len(buf) != tarfile.BLOCKSIZE:
            raise NotPlain("short read")
        usual = _USUAL_NUMBERS.fullmatch(buf, 100, 156) and _USUAL_DEVICE.fullmatch(buf, 329, 345)
        chk = buf[148:156]
        if (int(buf[148:154], 8) if usual else _nti(chk)) != _byte_sum(buf) - sum(chk) + 256:  # a signed sum: left to tarfile
            if buf == _ZERO_BLOCK and pos > start and wrappers is None:
                return None
            raise NotPlain("checksum")
        typ = buf[156]
        if usual:
            size = int(buf[124:135], 8)
        else:
            size = _nti(buf[124:136])
            for a, b in _OTHER_NUMBERS:  # tarfile refuses a header any of whose numbers does not parse
                if not _OCTAL_FIELD.fullmatch(buf, a, b) and buf[a] not in (0o200, 0o377):
                    _nti(buf[a:b])
        data_at = pos + tarfile.BLOCKSIZE
        if typ == _XHD or typ == _LONGNAME:
            n = _block(size)
            if size > _WRAPPER_MAX or data_at + n > stop:
                raise NotPlain("long extended header")
            data = f.read(n)
            if len(data) != n:
                raise NotPlain("short read")
            wrappers = [(typ, data)] if wrappers is None else [*wrappers, (typ, data)]
            pos = data_at + n
            continue
        p = buf.find(b"\0", 0, 100)
        name = buf[:p if p >= 0 else 100].decode(tarfile.ENCODING, "surrogateescape")
        if typ in _REG:
            reg = not (typ == 0 and name.endswith("/"))  # tarfile: an old-style folder
        elif typ in _NONREG:
            reg = False
        else:
            raise NotPlain(f"member type {typ!r}")
        if buf[345]:
            name = _nts(buf[345:500]) + "/" + name  # a ustar prefix (tarfile joins it whatever the magic)
        if wrappers is not None:
            for kind, data in reversed(wrappers):  # the outermost header has the last word, as in tarfile
                if kind == _LONGNAME:
                    name = _nts(data)
                else:
                    path, psize = _pax_fields(data)
                    if path is not None:
                        name = path.rstrip("/")
                    if psize is not None:
                        size = psize
        nxt = data_at + _block(size) if reg else data_at
        if nxt > stop:
            raise NotPlain("member data past the end")
        return PlainHeader(name, size, offset, data_at), reg, nxt
