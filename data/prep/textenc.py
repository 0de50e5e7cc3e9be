"""Which character encoding a text file or HTML page uses (data prep, `decode_text`).

The rule, in the order browsers and web-corpus extractors apply it:
1. a byte-order mark wins: UTF-8 (EF BB BF), UTF-16 LE/BE (FF FE / FE FF), UTF-32 LE/BE;
2. an HTML page's own declaration, found in its first `SNIFF_BYTES` bytes: `<meta charset=X>`,
   `<meta http-equiv=Content-Type content="text/html; charset=X">` (what Word and old editors
   write), or an XHTML `<?xml ... encoding="X"?>`; labels map as the WHATWG Encoding Standard maps
   them (`iso-8859-1`, `latin1` and `ascii` mean windows-1252; `gb2312` means gb18030; a page
   that declares UTF-16 without a BOM is UTF-8), and an unknown label is ignored;
3. otherwise UTF-8, when the bytes are valid UTF-8 (the detector never sees them);
4. otherwise, under `--undeclared-encoding detect` (the default), `detect_encoding`: the
   charset-normalizer library scores each legacy encoding a browser knows (`DETECT_CANDIDATES`)
   and its best guess is used only when it is confident (see `detect_encoding` for the exact
   thresholds). A guess that is not confident, binary-looking bytes and `--undeclared-encoding
   utf-8` follow `--bad-utf8` (rejected by default, so the failure is counted and visible).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass, replace

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


# --- detection: bytes with no BOM and no declaration that are not valid UTF-8 ---------------------------

# The legacy encodings of the WHATWG Encoding Standard (what browsers decode), as Python codec names;
# Windows code pages first, so that among encodings that decode the bytes to the same text the name a
# declared label maps to is reported (WHATWG: shift_jis is windows-31j = cp932, euc-kr is cp949).
# ISO-2022-JP is absent: it is 7-bit, so its bytes are valid UTF-8 and never reach detection.
# UTF-16/32 are absent: without a BOM they hold NUL bytes (--nul).
DETECT_CANDIDATES = (
    "cp1252", "cp1250", "cp1251", "cp1253", "cp1254", "cp1255", "cp1256", "cp1257", "cp1258", "cp874",
    "iso8859_2", "iso8859_3", "iso8859_4", "iso8859_5", "iso8859_6", "iso8859_7", "iso8859_8", "iso8859_10",
    "iso8859_13", "iso8859_14", "iso8859_15", "iso8859_16", "koi8_r", "koi8_u", "cp866", "mac_roman",
    "mac_cyrillic", "gb18030", "big5", "euc_jp", "cp932", "shift_jis", "cp949", "euc_kr",
)
# A guess is confident only when all of these hold (charset-normalizer's own measures, 0..1):
MAX_CHAOS = 0.10  # single-byte: "mess", the share of the decoded text that looks wrong (odd symbols, mixed scripts, ...)
MAX_CHAOS_MULTIBYTE = 0.20  # multi-byte (CJK): charset-normalizer's own cut-off; Japanese iteration marks (々) alone score ~19%
MIN_COHERENCE = 0.30  # single-byte encodings: how well the letter frequencies match a known language
MIN_MULTIBYTE_CHARS = 8  # multi-byte encodings (CJK): decoded non-ASCII characters (their coherence is often 0)
TIE_CHAOS, TIE_COHERENCE = 0.01, 0.02  # another decoding this close is a tie; windows-1252 wins a tie, else no guess
MAX_CONTROL_SHARE = 0.01  # C0 control bytes (not tab, newlines, form feed, ESC, DOS EOF) above this: binary
_CONTROLS = bytes(b for b in range(32) if b not in b"\t\n\v\f\r\x1a\x1b")
_HIGH = re.compile(rb"[\x80-\xff]")
_MARKUP = re.compile(rb"<!--.*?(?:-->|$)|<(script|style)\b.*?(?:</\1\s*>|$)|<[^<>]*>", re.S | re.I)


@dataclass(frozen=True)
class Detection:
    """What `detect_encoding` found. `codec` is None when it is not confident; `why` then says why."""

    codec: str | None
    chaos: float = 1.0
    coherence: float = 0.0
    language: str = ""
    why: str = ""

    def describe(self) -> str:
        lang = f"{self.language}, " if self.language and self.language != "Unknown" else ""
        return f"{lang}mess {self.chaos:.1%}, language coherence {self.coherence:.0%}"


def detect_encoding(data: bytes, *, html: bool = False) -> Detection:
    """Guess the encoding of `data` (bytes that are not UTF-8 and declare nothing) with
    charset-normalizer, restricted to `DETECT_CANDIDATES`. For an HTML page the guess is made on
    the text between the tags (markup is ASCII and says nothing about the language). The guess is
    accepted only when it is confident:
    - the bytes do not look binary: at most `MAX_CONTROL_SHARE` of them are C0 control bytes
      other than tab, line breaks, form feed, ESC and the DOS end-of-file byte;
    - a single-byte decoding has mess (chaos) of at most `MAX_CHAOS` and language coherence of at
      least `MIN_COHERENCE` (a few accented letters in a short string fit a dozen code pages
      equally well); a multi-byte one (whose valid byte sequences are evidence in themselves) has
      mess of at most `MAX_CHAOS_MULTIBYTE` and yields at least `MIN_MULTIBYTE_CHARS` non-ASCII
      characters;
    - no decoding into different text scores within `TIE_CHAOS` mess and `TIE_COHERENCE`
      coherence of it, except that a tie that includes windows-1252 goes to windows-1252 (the
      HTML standard's default for undeclared legacy pages, as in browsers);
    - the whole input decodes strictly in the chosen encoding.
    Known blind spot: close Latin code pages can score alike (Turkish windows-1254 text may score
    best as Baltic windows-1257); declare the charset, or convert to UTF-8, where that matters."""
    if not data:
        return Detection(None, why="empty input")
    controls = len(data) - len(data.translate(None, _CONTROLS))
    if controls > MAX_CONTROL_SHARE * len(data):
        return Detection(None, why=f"binary-looking: {controls} control bytes in {len(data)}")
    from charset_normalizer import from_bytes  # imported here: only non-UTF-8, undeclared input pays for it

    sample = _MARKUP.sub(b" ", data) if html else data
    if not _HIGH.search(sample):  # every non-ASCII byte sits inside markup: judge the whole page
        sample = data
    matches = list(from_bytes(sample, cp_isolation=list(DETECT_CANDIDATES)))
    if not matches:
        return Detection(None, why="no candidate encoding decodes it without heavy mess")
    matches.sort(key=lambda m: (round(m.chaos, 4), -round(m.coherence, 4)))
    best = matches[0]
    found = Detection(None, best.chaos, best.coherence, best.language or "")
    ties = [m for m in matches[1:] if m.chaos <= best.chaos + TIE_CHAOS and m.coherence >= best.coherence - TIE_COHERENCE]
    if ties:
        web_default = [m for m in (best, *ties) if "cp1252" in m.could_be_from_charset]
        if not web_default:
            names = ", ".join(m.encoding for m in (best, *ties[:3]))
            return replace(found, why=f"encodings that decode it differently score alike ({names})")
        best = web_default[0]
        found = Detection(None, best.chaos, best.coherence, best.language or "")
    multi = best.multi_byte_usage > 0
    limit = MAX_CHAOS_MULTIBYTE if multi else MAX_CHAOS
    if best.chaos > limit:
        return replace(found, why=f"best guess {best.encoding} has mess {best.chaos:.1%} > {limit:.0%}")
    if multi:
        wide = sum(1 for ch in str(best) if ord(ch) > 0x7F)
        if wide < MIN_MULTIBYTE_CHARS:
            return replace(found, why=f"only {wide} non-ASCII characters as {best.encoding}, fewer than {MIN_MULTIBYTE_CHARS}")
    elif best.coherence < MIN_COHERENCE:
        return replace(found, why=f"too little text to tell the language: coherence {best.coherence:.0%} < {MIN_COHERENCE:.0%} as {best.encoding}")
    names = [c for c in DETECT_CANDIDATES if c in best.could_be_from_charset] or [best.encoding]
    for codec in dict.fromkeys([*names, best.encoding]):
        try:
            data.decode(codec)
        except (UnicodeDecodeError, LookupError):
            continue
        return replace(found, codec=codec)
    return replace(found, why=f"the whole input does not decode as {best.encoding} (only a sample was scored)")
