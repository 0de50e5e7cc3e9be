"""Text corpora as they ship (issue 38, item 4): compressed inputs and `{"text": ...}` JSONL records.

- Compression is decided by the name (`x.jsonl.gz`, `x.json.zst`, `x.txt.bz2`, `x.tar.xz`):
  `split_compression` / `open_input` give the inner name and a decompressing binary stream, which
  the JSONL line splitter (`units.iter_lines`) reads in chunks, so memory stays bounded by a
  chunk plus the longest line exactly as for plain JSONL. `.json.gz` / `.json.zst` are JSONL: that
  is how Dolma and RedPajama ship them (one record a line); a plain `.json` stays a code file.
- `parse_record(obj, text_field)` accepts the omniloom schema and the OBELICS layout
  (`validate.parse_input_document`) and, for any other object holding a string `text_field`
  (`text` by default: Dolma, RedPajama, FineWeb, C4), a one-segment document whose other keys go to
  meta. A record that names a programming language (`lang`, `language`, `programming_language`)
  or a code file extension (`ext`, `extension`, `file_extension`, or a `path`-like key) is a code
  document in that language (The Stack with `--text-field content`); a natural language (`"lang":
  "en"`) leaves it prose.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os

from .units import CODE_EXT, CODE_NAMES, PROSE_EXT, Unit
from .validate import Reject, parse_input_document

# The name suffix -> how to open it. `.zstd` is what some tools write for `.zst`.
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd", ".zstd": "zstd"}
JSONL_INNER = {".jsonl", ".ndjson"}


def split_compression(name: str) -> tuple[str, str]:
    """('x.jsonl', 'gzip') for 'x.jsonl.gz'; (name, '') when the name carries no compression suffix.
    `.tgz` is a gzipped `.tar`."""
    low = name.lower()
    if low.endswith(".tgz"):
        return name[:-4] + ".tar", "gzip"
    for suffix, comp in COMPRESSIONS.items():
        if low.endswith(suffix):
            return name[: -len(suffix)], comp
    return name, ""


def is_jsonl_name(name: str) -> bool:
    """Whether a file of this name is read as JSONL: `.jsonl`/`.ndjson`, compressed or not, and a
    compressed `.json` (Dolma's `.json.gz`)."""
    inner, comp = split_compression(name)
    ext = os.path.splitext(inner)[1].lower()
    return ext in JSONL_INNER or (bool(comp) and ext == ".json")


def open_input(path: str, compression: str | None = None):
    """A binary, read-only, forward stream of the file's (decompressed) bytes. `compression`
    defaults to what the name says. Raises Reject("unreadable") when the file cannot be opened
    or a decompressor is missing."""
    comp = split_compression(path)[1] if compression is None else compression
    try:
        if comp == "gzip":
            return gzip.open(path, "rb")
        if comp == "bz2":
            return bz2.open(path, "rb")
        if comp == "xz":
            return lzma.open(path, "rb")
        if comp == "zstd":
            try:
                import zstandard
            except ModuleNotFoundError:
                raise Reject("unreadable", f"{path} is zstd-compressed and the zstandard package is missing; "
                                           "pip install zstandard (omniloom depends on it)") from None
            f = open(path, "rb")
            # read_across_frames: files written by `zstd` in several frames (pzstd, appends) read whole
            return zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True, closefd=True)
        return open(path, "rb")
    except OSError as err:
        raise Reject("unreadable", f"cannot open {path}: {err.strerror or err}; fix its permissions") from None


def read_bounded(path: str, limit: int, *, what: str) -> bytes:
    """The whole decompressed content of `path`, refused (Reject too-large) past `limit` bytes
    without holding more than `limit + 1` of them; a corrupt stream is Reject("corrupt-compressed")."""
    try:
        with open_input(path) as f:
            data = f.read(limit + 1)
    except (OSError, EOFError, lzma.LZMAError, ValueError) as err:
        raise Reject("corrupt-compressed", f"{what} {path} does not decompress ({type(err).__name__}: {err}); "
                                           "re-download it or check it with gzip -t / zstd -t / xz -t") from None
    if len(data) > limit:
        raise Reject("too-large", f"{what} is above --max-text-bytes {limit} once decompressed")
    return data


def compressed_file_unit(source: str, root: str, rel: str):
    """Discovery's unit for a compressed file that is neither JSONL nor a tar: a text or code
    document (`x.txt.gz`, `x.py.zst`), read decompressed within --max-text-bytes, or a reject
    that says to decompress it."""

    inner = split_compression(rel)[0]
    ext = os.path.splitext(inner)[1].lower()
    lang = CODE_NAMES.get(os.path.basename(inner)) or CODE_EXT.get(ext)
    if ext in PROSE_EXT or lang:
        return Unit(source=source, root=root, rel=rel, kind="text" if ext in PROSE_EXT else "code", lang="" if ext in PROSE_EXT else lang)
    return Unit(source=source, root=root, rel=rel, kind="reject", code="unsupported",
                reason=f"compressed {ext or 'file'}: compressed inputs are read when they are JSONL (.jsonl, .json, .ndjson), "
                       "text, code or tar shards; decompress it to build its content")


# Programming languages a corpus record may name, lower case -> the `lang` of the code segment.
_LANG_ALIASES = {"c++": "cpp", "c#": "csharp", "js": "javascript", "py": "python", "golang": "go", "shell script": "shell",
                 "bash": "shell", "jupyter": "python", "html": "html", "tex": "tex", "latex": "tex", "fortran": "fortran",
                 "perl": "perl", "dart": "dart", "elixir": "elixir", "erlang": "erlang", "clojure": "clojure",
                 "objective-c": "objective-c", "matlab": "matlab", "assembly": "assembly", "vhdl": "vhdl", "verilog": "verilog",
                 "visual basic": "visual-basic", "powershell": "powershell", "dockerfile": "dockerfile", "makefile": "makefile"}
_LANG_KEYS = ("lang", "language", "programming_language")
_EXT_KEYS = ("ext", "extension", "file_extension")
_PATH_KEYS = ("path", "file_path", "filepath", "filename", "max_stars_repo_path")


def code_language(record: dict) -> str:
    """The programming language a corpus record names, or "" when it names none (natural languages
    such as "en" are not programming languages: the record stays prose)."""

    known = set(CODE_EXT.values()) | set(CODE_NAMES.values()) | set(_LANG_ALIASES.values())
    for k in _LANG_KEYS:
        v = record.get(k)
        if isinstance(v, str) and v.strip():
            low = v.strip().lower()
            low = _LANG_ALIASES.get(low, low)
            if low in known:
                return low
    for k in _EXT_KEYS:
        v = record.get(k)
        if isinstance(v, str) and v.strip():
            lang = CODE_EXT.get("." + v.strip().lower().lstrip("."))
            if lang:
                return lang
    for k in _PATH_KEYS:
        v = record.get(k)
        if isinstance(v, str) and v:
            base = v.replace("\\", "/").rsplit("/", 1)[-1]
            lang = CODE_NAMES.get(base) or CODE_EXT.get(os.path.splitext(base)[1].lower())
            if lang:
                return lang
    return ""


def parse_record(obj, text_field: str = "text") -> tuple[list[dict], dict]:
    """One JSONL record -> (segments, meta): the omniloom schema and OBELICS layout as
    `parse_input_document` reads them, else the text-corpus layout (a string `text_field`; every
    other key into meta; code when `code_language` finds a programming language). Raises Reject
    ("schema") naming the layouts and the --text-field flag when none fits."""
    if isinstance(obj, dict) and "segments" not in obj and not ("texts" in obj and "images" in obj) and text_field in obj:
        text = obj[text_field]
        if not isinstance(text, str):
            raise Reject("schema", f"the record's {text_field!r} field must be a string, got {type(text).__name__}")
        meta = {k: v for k, v in obj.items() if k != text_field}
        lang = code_language(obj)
        seg = {"type": "code", "lang": lang, "text": text} if lang else {"type": "text", "text": text}
        return [seg], meta
    try:
        return parse_input_document(obj)
    except Reject as rej:
        if rej.reason.startswith("unknown record layout"):
            raise Reject("schema", f"{rej.reason}; or a string {text_field!r} field (a text corpus record: Dolma, RedPajama, "
                                   "FineWeb; pass --text-field NAME when the text is under another key, e.g. content)") from None
        raise
