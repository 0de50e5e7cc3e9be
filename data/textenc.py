"""Which character encoding a text file or HTML page uses (data prep, `decode_text`).

The rule, in the order browsers and web-corpus extractors apply it:
1. a byte-order mark wins: UTF-8 (EF BB BF), UTF-16 LE/BE (FF FE / FE FF), UTF-32 LE/BE;
2. an HTML page's own declaration, found in its first `SNIFF_BYTES` bytes: `<meta charset=X>`,
   `<meta http-equiv=Content-Type content="text/html; charset=X">` (what Word and old editors
   write), or an XHTML `<?xml ... encoding="X"?>`; labels map as the WHATWG Encoding Standard maps
   them (`iso-8859-1`, `latin1` and `ascii` mean windows-1252; `gb2312` means gb18030; a page
   that declares UTF-16 without a BOM is UTF-8), and an unknown label is ignored;
3. otherwise UTF-8. Nothing is guessed: no detector library is a dependency, and guessing a
   legacy encoding from a few bytes produces silent mojibake; an undeclared page that is not
   UTF-8 follows `--bad-utf8` (rejected by default, so the failure is counted and visible).
"""

from __future__ import annotations

import codecs
import re

SNIFF_BYTES = 4096  # WHATWG's prescan reads 1024; Word pages carry long <html xmlns...> headers

_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_WHATWG = {
    **dict.fromkeys(("iso-8859-1", "iso8859-1", "iso_8859-1", "latin1", "l1", "us-ascii", "ascii", "ansi_x3.4-1968",
                     "cp819", "ibm819", "iso-ir-100", "csisolatin1", "x-cp1252", "cp1252", "windows-1252"), "cp1252"),
    **dict.fromkeys(("iso-8859-9", "iso8859-9", "latin5", "l5", "windows-1254", "cp1254"), "cp1254"),
    **dict.fromkeys(("tis-620", "iso-8859-11", "windows-874", "cp874"), "cp874"),
    **dict.fromkeys(("gb2312", "gbk", "x-gbk", "chinese", "csgb2312", "gb18030"), "gb18030"),
    **dict.fromkeys(("utf-16", "utf-16le", "utf-16be", "unicode", "ucs-2"), "utf-8"),
    **dict.fromkeys(("shift_jis", "shift-jis", "sjis", "x-sjis", "ms_kanji", "windows-31j"), "cp932"),
    **dict.fromkeys(("euc-kr", "ks_c_5601-1987", "windows-949"), "cp949"),
    "big5": "big5hkscs",
}
_COMMENT = re.compile(rb"<!--.*?(-->|$)", re.S)
_META = re.compile(rb"<meta\b[^>]*?\bcharset\s*=\s*[\"']?\s*([A-Za-z0-9._:-]+)", re.I)
_XML = re.compile(rb"^\s*<\?xml\b[^>]*?\bencoding\s*=\s*[\"']([A-Za-z0-9._:-]+)", re.I)


def bom_encoding(data: bytes) -> tuple[str, int] | None:
    """(codec, BOM length) when `data` starts with a byte-order mark, else None."""
    for bom, codec in _BOMS:
        if data.startswith(bom):
            return codec, len(bom)
    return None


def normalize_label(label: str) -> str | None:
    """A declared charset label as a Python codec name (WHATWG mapping), or None if unknown."""
    label = label.strip().lower()
    if label in _WHATWG:
        return _WHATWG[label]
    try:
        info = codecs.lookup(label)
    except LookupError:
        return None
    if not getattr(info, "_is_text_encoding", True):  # "base64", "rot13", ...: not a charset
        return None
    return "utf-8" if info.name.startswith(("utf-16", "utf-32")) else info.name


def html_declared_encoding(data: bytes) -> tuple[str, str] | None:
    """(codec, label as written) that an HTML page declares in its head, or None."""
    head = _COMMENT.sub(b"", data[:SNIFF_BYTES])
    for pattern in (_XML, _META):
        m = pattern.search(head)
        if m:
            label = m.group(1).decode("ascii", "replace")
            codec = normalize_label(label)
            if codec:
                return codec, label
    return None
