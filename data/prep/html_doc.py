"""HTML page -> one interleaved document: text blocks and local images/videos in document order, the
way OBELICS-style corpora are extracted from web pages (scripts, styles and navigation chrome
dropped, whitespace collapsed except inside <pre>)."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from urllib.parse import unquote, urlsplit

_BLOCK = {
    "p", "div", "section", "article", "main", "header", "footer", "aside", "nav", "h1", "h2", "h3", "h4", "h5", "h6",
    "li", "ul", "ol", "dl", "dt", "dd", "table", "tr", "td", "th", "blockquote", "figure", "figcaption", "br", "hr",
    "pre", "form", "address", "details", "summary",
}
_SKIP = {"script", "style", "noscript", "template", "svg", "head", "iframe", "object", "canvas", "button", "select"}
_WS = re.compile(r"[ \t\r\n\f\v]+")


def _local(src: str) -> str:
    """A page's src as a file path: query and fragment dropped, %-escapes decoded. URLs and data:
    URIs are kept as they are (the ingest step reports or decodes them)."""
    src = src.strip()
    parts = urlsplit(src)
    if parts.scheme:
        return src
    return unquote(parts.path)


class _Extractor(HTMLParser):
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.segments: list[dict] = []
        self.blocks: list[str] = []
        self.current: list[str] = []
        self.skip_depth = 0
        self.pre_depth = 0
        self.title: list[str] = []
        self.in_title = False
        self.in_video = False

    def _flush_block(self):
        text = "".join(self.current)
        self.current = []
        text = text.strip("\n") if self.pre_depth else _WS.sub(" ", text).strip()
        if text:
            self.blocks.append(text)

    def _flush_text(self):
        self._flush_block()
        if self.blocks:
            self.segments.append({"type": "text", "text": "\n\n".join(self.blocks)})
            self.blocks = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "title":
            self.in_title = True
        if tag in _SKIP:
            self.skip_depth += 1
            return
        if self.skip_depth:
            return
        if tag in _BLOCK:
            self._flush_block()
        if tag == "pre":
            self.pre_depth += 1
        if tag == "img" and a.get("src"):
            self._flush_text()
            seg = {"type": "image", "path": _local(a["src"])}
            if a.get("alt"):
                seg["alt"] = a["alt"]
            self.segments.append(seg)
        elif tag == "video":
            self.in_video = True
            if a.get("src"):
                self._flush_text()
                self.segments.append({"type": "video", "path": _local(a["src"])})
                self.in_video = False  # nested <source> tags are alternatives of the same video
        elif tag == "source" and self.in_video and a.get("src"):
            self._flush_text()
            self.segments.append({"type": "video", "path": _local(a["src"])})
            self.in_video = False

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag in _SKIP:
            self.skip_depth -= 1

    def handle_endtag(self, tag):
        if tag == "title":
            self.in_title = False
        if tag in _SKIP:
            self.skip_depth = max(0, self.skip_depth - 1)
            return
        if self.skip_depth:
            return
        if tag == "video":
            self.in_video = False
        if tag in _BLOCK:
            self._flush_block()
        if tag == "pre":
            self.pre_depth = max(0, self.pre_depth - 1)

    def handle_data(self, data):
        if self.in_title:
            self.title.append(data)
        if not self.skip_depth:
            self.current.append(data)


def extract_html(text: str) -> tuple[list[dict], dict]:
    """Return (segments, meta) for an HTML page: text segments, and media segments
    `{"type": "image"|"video", "path": src[, "alt": ...]}` whose paths are still unresolved."""
    parser = _Extractor()
    parser.feed(text)
    parser.close()
    parser._flush_text()
    meta = {}
    title = _WS.sub(" ", "".join(parser.title)).strip()
    if title:
        meta["title"] = title
    return parser.segments, meta


def local_refs(segments: list[dict]) -> list[str]:
    """The media paths of `segments` (for excluding them from standalone media documents)."""
    return [s["path"] for s in segments if s["type"] in ("image", "video") and "path" in s]
