"""Media by URL for `omniloom data build --fetch-media` (issue 40; docs/data-format.md, "Media by URL").

Which media are URLs: an image or video segment whose path is an http(s) URL, in JSONL (the
omniloom schema, OBELICS `images`, MMC4 `image_info[].raw_url`) and in parquet (a `url`-like
column, URL strings in `images` lists: `parquet.plan_columns`). Without --fetch-media such a
segment stays a `remote-ref` reject.

How they are fetched: the build's main process reads ahead of the workers (`FetchFiller`: up to
`ahead` inputs past the one handed out), finds each input's URLs and hands them to a bounded pool
of `FetchOptions.workers` threads (`Fetcher`). Every answer, good or bad, is stored in a cache
folder by URL (`FetchCache`: an SQLite index of what happened, the bodies appended to pack
files), and an input reaches a decode worker only once all its URLs have an answer, carrying
`{url: ("ok", cache file, offset, size) | ("fail", code, reason)}` (`Unit.fetched`). The worker then validates the
body exactly as a local file's bytes (`ingest._finish`: the full decode, never the Content-Type
alone). So the shards are a pure function of the inputs and the cache: fetched in parallel, written
in input order, byte-identical for any --workers / --fetch-workers, and a rerun or a resumed build
fetches nothing the cache holds.

Every failure is cached, transient ones too (timeouts, connection errors, 5xx and 429 after the
retries): a rerun is then deterministic and quiet; `--fetch-retry-transient` asks those again. A
cached answer is asked again only when it could now differ: `too-large` under a larger limit
than it was refused at, `opted-out` under --fetch-ignore-robots-tag.

The HTTP client is the standard library's (`urllib`), not img2dataset: img2dataset pins
webdataset<0.3 and pandas<3 (pyproject.toml, `interop`), and `omniloom bench data --fetch`
measures the two on the same URL list (BENCHMARKS.md).
"""

from __future__ import annotations

import email.utils
import json
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from .validate import Reject

URL_PREFIXES = ("http://", "https://")
CACHE_DIR = ".fetch-cache"  # under --out unless --fetch-cache names another folder
# img2dataset's default `disallowed_header_directives` and its rule (`is_disallowed`): an
# X-Robots-Tag value "[TOKEN:] d1, d2" opts out when it names no user agent or ours, and one of
# its directives is in this list.
ROBOTS_DIRECTIVES = ("noai", "noimageai", "noindex", "noimageindex")
UA_TOKEN = "omniloom"
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16


def is_media_url(path) -> bool:
    """An http(s) URL, the only kind --fetch-media fetches."""
    return isinstance(path, str) and path[:8].lower().startswith(URL_PREFIXES)


def user_agent() -> str:
    """`omniloom/VERSION (+PROJECT URL)`: names the fetcher, its version and where to read about it."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        md = metadata("omniloom")
        version = md["Version"]
        urls = [u.split(",", 1)[-1].strip() for u in (md.get_all("Project-URL") or [])] + [md.get("Home-page") or ""]
    except PackageNotFoundError:
        version, urls = "0+unknown", []
    home = next((u for u in urls if u and u != "UNKNOWN"), "")
    return f"{UA_TOKEN}/{version} ({f'+{home}' if home else 'omniloom data build --fetch-media'}; compatible; {UA_TOKEN})"


def robots_opt_out(values: list[str], token: str = UA_TOKEN, directives=ROBOTS_DIRECTIVES) -> list[str]:
    """The opting-out directives among X-Robots-Tag header `values` (img2dataset's rule: a value
    `[TOKEN:] d1, d2, ...` counts when it names no user agent, or ours)."""
    found = []
    for value in values:
        head, sep, rest = value.partition(":")
        agent = head.strip().lower() if sep else None
        if agent is not None and agent != token:
            continue
        found += [d for d in (x.strip().lower() for x in (rest if sep else value).split(",")) if d in directives]
    return found


@dataclass(frozen=True, kw_only=True)
class FetchOptions:
    """How --fetch-media asks. Only `honour_robots` changes what a build keeps for the same answers
    (it is in the manifest's settings); the rest shape how the answers are got."""

    workers: int = 16  # --fetch-workers: requests in flight at once
    timeout: float = 10.0  # --fetch-timeout: seconds to connect and for each wait for bytes
    deadline: float = 120.0  # --fetch-deadline: seconds one try may take in all (redirects and the whole body)
    retries: int = 3  # --fetch-retries: more tries after a 429, 5xx, timeout or connection error
    backoff: float = 0.5  # first wait before a retry, doubled each time
    max_wait: float = 30.0  # cap of one wait (a Retry-After too)
    max_redirects: int = 5
    honour_robots: bool = True  # --fetch-ignore-robots-tag sets False
    retry_transient: bool = False  # --fetch-retry-transient: ask cached transient failures again
    cache: str = ""  # --fetch-cache; "": OUT/.fetch-cache

    def __post_init__(self):
        if self.workers < 1 or self.timeout <= 0 or self.deadline <= 0 or self.retries < 0 or self.max_redirects < 0:
            raise ValueError("--fetch-workers must be >= 1, --fetch-timeout and --fetch-deadline > 0 and --fetch-retries >= 0")

    def settings(self) -> dict:
        return {"x_robots_tag": "honour" if self.honour_robots else "ignore"}


class FetchCacheError(OSError, ValueError):
    """The fetch cache's index cannot be used (locked past its timeout, disk full, corrupt): the
    build stops and says so in one line (a ValueError: a user error the CLI prints as one),
    instead of turning every URL into a reject."""


class FetchCache:
    """The answers by URL: an index (`ROOT/index.sqlite`: url -> the record as JSON, {ok: true,
    bytes, robots, content_type} or {ok: false, code, reason, transient, limit}, and where the body
    is) and the bodies as served, appended to pack files (`ROOT/packs/`, one open file per fetch
    thread and process). A body is written and flushed before its row is committed, so a killed
    build leaves rows whose bodies are whole; `load` checks the pack is long enough all the same.
    Not a file per URL: at a LAION's 100M URLs that is 100M files, and creating them cost ~300 us
    each here, a third of the fetch rate (BENCHMARKS.md). SQLite in WAL mode lets builds on one
    machine share a cache; not on NFS."""

    def __init__(self, root: str):
        self.root = root
        os.makedirs(os.path.join(root, "packs"), exist_ok=True)
        self.local = threading.local()
        self.lock = threading.Lock()
        self.opened: list = []
        self.db = None
        self._sql("CREATE TABLE IF NOT EXISTS answers (url TEXT PRIMARY KEY, rec TEXT NOT NULL, pack TEXT, "
                           "offset INTEGER, size INTEGER)")  # once, before any thread needs it

    def _sql(self, query: str, args=()) -> list:
        """Run `query` on the one connection, under the lock: the threads take turns in Python, which
        costs microseconds, where a connection each made them wait in SQLite's busy handler (sleeps
        of a millisecond and more; a fifth of the fetch rate at 64 threads)."""
        import sqlite3

        with self.lock:
            try:
                if self.db is None:
                    self.db = sqlite3.connect(os.path.join(self.root, "index.sqlite"), timeout=120, isolation_level=None,
                                              check_same_thread=False)
                    self.db.execute("PRAGMA journal_mode=WAL")
                    self.db.execute("PRAGMA synchronous=NORMAL")
                return self.db.execute(query, args).fetchall()
            except sqlite3.Error as err:
                raise FetchCacheError(f"the fetch cache {os.path.join(self.root, 'index.sqlite')} cannot be used: {err} "
                                      "(another build holding it, a full disk, or a damaged file: free space, wait for the "
                                      "other build, or give --fetch-cache another folder)") from err

    def load(self, url: str) -> dict | None:
        """The cached answer (a good one with `path`, `offset`: where its body is), None when there is none."""
        rows = self._sql("SELECT rec, pack, offset, size FROM answers WHERE url = ?", (url,))
        if not rows:
            return None
        row = rows[0]
        rec = {"url": url, **json.loads(row[0])}
        if rec.get("ok"):
            path = os.path.join(self.root, "packs", row[1])
            try:
                if os.path.getsize(path) < row[2] + row[3]:
                    return None
            except OSError:
                return None
            rec.update(path=path, offset=row[2])
        return rec

    def store(self, url: str, rec: dict, data: bytes | None = None) -> dict:
        pack = offset = None
        if data is not None:
            f = getattr(self.local, "pack", None)
            if f is None:
                name = f"pack-{os.getpid()}-{threading.get_ident()}-{time.time_ns()}.bin"
                f = self.local.pack = open(os.path.join(self.root, "packs", name), "ab")
                with self.lock:
                    self.opened.append(f)
            offset = f.tell()
            f.write(data)
            f.flush()  # in the kernel before the row says it is there: a kill -9 loses neither
            pack = os.path.basename(f.name)
        row = (url, json.dumps(rec, ensure_ascii=False, sort_keys=True), pack, offset, len(data) if data is not None else None)
        if data is not None:
            self._sql("INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)", row)
        else:  # a failure never replaces a body: a URL used as image and video, answered at once under two limits
            self._sql("INSERT INTO answers VALUES (?, ?, ?, ?, ?) ON CONFLICT(url) DO UPDATE SET rec = excluded.rec, "
                      "pack = NULL, offset = NULL, size = NULL WHERE json_extract(answers.rec, '$.ok') IS NOT 1", row)
        out = {"url": url, **rec}
        if data is not None:
            out.update(path=os.path.join(self.root, "packs", pack), offset=offset)
        return out

    def tally(self) -> list:
        """(ok, code, transient, answers, body bytes, bodies with an opting-out X-Robots-Tag) by kind of
        answer, counted by SQLite (a cache of 100M URLs is never read into Python)."""
        return self._sql("SELECT json_extract(rec, '$.ok'), json_extract(rec, '$.code'), json_extract(rec, '$.transient'), COUNT(*), "
                         "COALESCE(SUM(size), 0), SUM(json_array_length(rec, '$.robots') > 0) FROM answers GROUP BY 1, 2, 3")

    def close(self) -> None:
        with self.lock:
            for f in self.opened:
                f.close()
            self.opened.clear()
            if self.db is not None:
                self.db.close()
                self.db = None
        self.local = threading.local()


class _Failed(Exception):
    """A try's failure. `transient`: cached as such (--fetch-retry-transient asks again); `retry`:
    tried again within this build (a transient failure but one past --fetch-deadline, which would
    hold the build up as long again)."""

    def __init__(self, code: str, reason: str, *, transient: bool, wait: float | None = None, retry: bool | None = None):
        super().__init__(reason)
        self.code, self.reason, self.transient, self.wait = code, reason, transient, wait
        self.retry = transient if retry is None else retry


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):  # redirects are followed by `Fetcher._once`, counted
        return None


class Fetcher:
    """A bounded pool of threads answering URLs through the cache; `submit(url, kind)` returns a
    future of the worker's view: ("ok", cache file, body offset, size) or ("fail", code, reason). Counts what it did
    (`figures`)."""

    def __init__(self, opts: FetchOptions, cache_root: str, limits):
        self.opts, self.limits = opts, limits
        self.cache = FetchCache(cache_root)
        self.pool = ThreadPoolExecutor(opts.workers, thread_name_prefix="fetch")
        self.ua = user_agent()
        self.lock = threading.Lock()
        self.counts: Counter = Counter()
        self.failed: Counter = Counter()
        self.inflight: dict = {}
        self.span = [None, None]  # first network request started, last one ended
        self.local = threading.local()

    def submit(self, url: str, kind: str):
        # by URL and kind: a URL used as an image and as a video is answered under each one's size limit
        fut = self.inflight.get((url, kind))
        if fut is None:
            if len(self.inflight) > 4096:
                self.inflight = {k: f for k, f in self.inflight.items() if not f.done()}
            fut = self.inflight[(url, kind)] = self.pool.submit(self._answer, url, kind)
        return fut

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.cache.close()

    def limit(self, kind: str) -> int:
        return self.limits.max_video_bytes if kind == "video" else self.limits.max_image_bytes

    def _answer(self, url: str, kind: str) -> tuple:
        limit = self.limit(kind)
        rec = self.cache.load(url)
        if rec is not None and not self._stale(rec, limit):
            self._count("cached")
            return self._view(rec)
        try:
            rec = self._download(url, limit)
        except OSError:
            raise  # the cache's disk (full, unwritable) or its index (FetchCacheError): the build stops and says so
        except Exception as err:  # noqa: BLE001 - a bug or an exotic answer must not kill the build; not cached
            return ("fail", "error", f"{url[:200]}: unexpected {type(err).__name__}: {err}")
        return self._view(rec)

    def _stale(self, rec: dict, limit: int) -> bool:
        """Whether a cached answer could differ now (see the module docstring)."""
        if rec.get("ok"):
            return False
        code = rec.get("code")
        return ((rec.get("transient") and self.opts.retry_transient) or (code == "too-large" and limit > rec.get("limit", 0))
                or (code == "opted-out" and not self.opts.honour_robots))

    def _view(self, rec: dict) -> tuple:
        if rec.get("ok"):
            if rec.get("robots") and self.opts.honour_robots:  # fetched by a build that ignored the header
                return ("fail", "opted-out", f"{rec['url'][:200]}: X-Robots-Tag {', '.join(rec['robots'])} opts out of AI use "
                                             "(img2dataset's rule); --fetch-ignore-robots-tag fetches it anyway")
            return ("ok", rec["path"], rec["offset"], rec["bytes"])
        return ("fail", rec["code"], rec["reason"])

    def _count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def _download(self, url: str, limit: int) -> dict:
        o = self.opts
        t0 = time.perf_counter()
        with self.lock:
            self.span[0] = t0 if self.span[0] is None else min(self.span[0], t0)
        try:
            for attempt in range(o.retries + 1):
                try:
                    data, headers, robots = self._once(url, limit)
                    self._count("fetched")
                    self._count("bytes", len(data))
                    return self.cache.store(url, {"ok": True, "bytes": len(data), "robots": robots,
                                                  "content_type": headers.get("Content-Type", "")}, data)
                except _Failed as f:
                    if not f.retry or attempt == o.retries:
                        with self.lock:
                            self.failed[f.code] += 1
                        reason = f.reason + (f" (after {attempt + 1} tries)" if f.retry else "")
                        return self.cache.store(url, {"ok": False, "code": f.code, "reason": reason, "transient": f.transient,
                                                      "limit": limit})
                    wait = min(o.max_wait, f.wait if f.wait is not None else o.backoff * 2 ** attempt)
                    self._count("retries")
                    time.sleep(max(0.0, wait))
            raise AssertionError("unreachable")
        finally:
            t1 = time.perf_counter()
            with self.lock:
                self.span[1] = t1 if self.span[1] is None else max(self.span[1], t1)

    def _opener(self):
        op = getattr(self.local, "opener", None)
        if op is None:
            op = self.local.opener = urllib.request.build_opener(_NoRedirect)
        return op

    def _once(self, url: str, limit: int) -> tuple[bytes, dict, list]:
        """One try: the body (at most `limit` bytes), its headers and the opting-out directives it
        carried (when they are not honoured), following at most `max_redirects` redirects."""
        seen = [url]
        where = url[:200]
        deadline = time.monotonic() + self.opts.deadline
        while True:
            self._count("requests")
            req = urllib.request.Request(iri_to_uri(seen[-1]), headers={"User-Agent": self.ua, "Accept": "image/*,video/*;q=0.9,*/*;q=0.5"})
            try:
                resp = self._opener().open(req, timeout=self.opts.timeout)
            except urllib.error.HTTPError as err:
                status, headers = err.code, err.headers
                err.close()
                if status in _REDIRECTS and headers.get("Location"):
                    nxt = urllib.parse.urljoin(seen[-1], headers["Location"])
                    if not is_media_url(nxt):
                        raise _Failed("bad-redirect", f"{where}: redirected to {nxt[:200]}, which is not http(s)", transient=False) from None
                    if nxt in seen:
                        raise _Failed("redirect-loop", f"{where}: redirect loop ({' -> '.join(s[:80] for s in seen + [nxt])})",
                                      transient=False) from None
                    if len(seen) > self.opts.max_redirects:
                        raise _Failed("redirect-loop", f"{where}: more than {self.opts.max_redirects} redirects", transient=False) from None
                    seen.append(nxt)
                    continue
                transient = status in (408, 425, 429) or status >= 500
                wait = _retry_after(headers.get("Retry-After")) if status in (429, 503) else None
                raise _Failed(f"http-{status}", f"{where}: HTTP {status} {err.reason}", transient=transient, wait=wait) from None
            except (TimeoutError, socket.timeout) as err:
                raise _Failed("timeout", f"{where}: no answer within --fetch-timeout {self.opts.timeout:g}s", transient=True) from err
            except urllib.error.URLError as err:
                raise _classify(where, err.reason, self.opts.timeout) from None
            except (OSError, ValueError) as err:  # http.client errors (a bad status line) are OSErrors too
                raise _classify(where, err, self.opts.timeout) from None
            with resp:
                return self._read(resp, where, limit, deadline)

    def _read(self, resp, where: str, limit: int, deadline: float) -> tuple[bytes, dict, list]:
        headers = resp.headers
        robots = robots_opt_out(headers.get_all("X-Robots-Tag") or [])
        if robots and self.opts.honour_robots:
            raise _Failed("opted-out", f"{where}: X-Robots-Tag {', '.join(robots)} opts out of AI use (img2dataset's rule); "
                                       "--fetch-ignore-robots-tag fetches it anyway", transient=False)
        declared = headers.get("Content-Length")
        if declared and declared.strip().isdigit() and int(declared) > limit:
            raise _Failed("too-large", f"{where}: Content-Length {int(declared)} is above the limit {limit} "
                                       "(--max-image-bytes / --max-video-bytes); not read", transient=False)
        buf = bytearray()
        try:
            while len(buf) <= limit:
                if time.monotonic() > deadline:  # a server that trickles bytes never trips the timeout of one wait
                    raise _Failed("timeout", f"{where}: the answer took longer than --fetch-deadline {self.opts.deadline:g}s "
                                             f"({len(buf)} bytes read); not tried again in this build", transient=True, retry=False)
                chunk = resp.read1(min(_CHUNK, limit + 1 - len(buf)))  # one recv: read(n) waits for all n bytes
                if not chunk:
                    break
                buf += chunk
        except (TimeoutError, socket.timeout):
            raise _Failed("timeout", f"{where}: the body stalled for --fetch-timeout {self.opts.timeout:g}s after {len(buf)} bytes",
                          transient=True) from None
        except (OSError, ValueError) as err:  # IncompleteRead, a reset connection
            raise _Failed("connection-error", f"{where}: the body broke off after {len(buf)} bytes ({type(err).__name__})",
                          transient=True) from None
        if declared and declared.strip().isdigit() and len(buf) < int(declared):
            # http.client ends a body at a closed connection without a word (no IncompleteRead for read(n))
            raise _Failed("connection-error", f"{where}: the body broke off after {len(buf)} of its {int(declared)} bytes "
                                              "(Content-Length)", transient=True)
        if len(buf) > limit:
            raise _Failed("too-large", f"{where}: the body is above the limit {limit} (--max-image-bytes / --max-video-bytes); "
                                       f"stopped reading at {len(buf)} bytes", transient=False)
        return bytes(buf), dict(headers.items()), robots

    def figures(self) -> dict:
        """What this build's fetching did: network answers, cache hits, failures by code, bytes,
        seconds from the first request to the last answer, and the rates over them."""
        with self.lock:
            c, failed, span = dict(self.counts), dict(sorted(self.failed.items())), self.span
        secs = (span[1] - span[0]) if span[0] is not None and span[1] is not None else 0.0
        fetched = c.get("fetched", 0)
        return {"fetched": fetched, "failed": failed, "cached": c.get("cached", 0), "requests": c.get("requests", 0),
                "retries": c.get("retries", 0), "bytes": c.get("bytes", 0), "seconds": round(secs, 3),
                "per_second": round(fetched / secs, 1) if secs > 0 else 0.0,
                "mb_per_second": round(c.get("bytes", 0) / secs / 1e6, 2) if secs > 0 else 0.0, "cache": self.cache.root}


def iri_to_uri(url: str) -> str:
    """`url` as http.client can send it: a non-ASCII host in IDNA, other non-ASCII characters and
    spaces percent-encoded as UTF-8 (OBELICS and LAION hold such URLs); an ASCII URL is unchanged."""
    if url.isascii() and " " not in url:
        return url
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    try:
        host = host.encode("idna").decode("ascii") if not host.isascii() else host
    except UnicodeError:
        pass  # left as it is: the request fails as bad-url
    netloc = host + (f":{parts.port}" if parts.port else "")
    if parts.username:
        netloc = f"{parts.username}{':' + parts.password if parts.password else ''}@{netloc}"
    keep = "/:@!$&'()*+,;=%~?#[]"
    return urllib.parse.urlunsplit((parts.scheme, netloc, urllib.parse.quote(parts.path, safe=keep),
                                    urllib.parse.quote(parts.query, safe=keep), urllib.parse.quote(parts.fragment, safe=keep)))


def _retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _classify(where: str, err, timeout: float) -> _Failed:
    if isinstance(err, (TimeoutError, socket.timeout)):
        return _Failed("timeout", f"{where}: no answer within --fetch-timeout {timeout:g}s", transient=True)
    if isinstance(err, ssl.SSLCertVerificationError):
        return _Failed("tls-error", f"{where}: TLS certificate not valid ({err})", transient=False)
    if isinstance(err, ValueError):
        return _Failed("bad-url", f"{where}: not a URL that can be fetched ({err})", transient=False)
    return _Failed("connection-error", f"{where}: {type(err).__name__}: {str(err)[:200]}", transient=True)


# --- the build's side: which URLs an input holds, and the read-ahead ----------------------------------------


def media_urls(unit, st) -> list[tuple[str, str]]:
    """(url, "image"|"video") of each media segment of a JSONL line or parquet row that is an
    http(s) URL; [] for anything else or for an input that does not parse (its worker says why)."""
    from .parquet import map_row
    from .textcorpus import parse_record
    from .validate import loads_finite

    try:
        if unit.kind == "jsonl" and (unit.payload is None or isinstance(unit.payload, bytes)):
            raw = unit.payload if unit.payload is not None else _read_line(unit)
            segments, _ = parse_record(loads_finite(raw.decode("utf-8"))[0], st.text_field)
        elif unit.kind == "parquet" and isinstance(unit.payload, tuple):
            segments = map_row(*unit.payload, caption_first=st.caption_first)[0]
        else:
            return []
    except Exception:  # noqa: BLE001 - reported when the worker processes the input
        return []
    return [(s["path"], s["type"]) for s in segments if s["type"] in ("image", "video") and is_media_url(s.get("path"))]


def _read_line(unit) -> bytes:
    with open(os.path.join(unit.root, unit.rel), "rb") as f:
        f.seek(unit.offset)
        return f.read(unit.length)


class FetchFiller:
    """Wraps the build's payload fillers (`shards.iter_results`): hands out the inputs in order,
    each with its URLs answered (`Unit.fetched`), while the URLs of the next `ahead` inputs are
    being fetched by the pool. Inputs must be asked for in order, as the other fillers' are."""

    def __init__(self, inner, units: list, fetcher: Fetcher, settings, ahead: int = 0):
        self.inner, self.units, self.fetcher, self.st = inner, units, fetcher, settings
        self.ahead = ahead or max(16, 4 * fetcher.opts.workers)
        self.scanned = self.handed = 0
        self.queue: deque = deque()  # (filled unit, {url: future})

    def fill(self, part: list) -> list:
        out = []
        for _ in part:
            self._scan(min(len(self.units), self.handed + 1 + self.ahead))
            unit, futures = self.queue.popleft()
            self.handed += 1
            out.append(replace(unit, fetched={url: f.result() for url, f in futures.items()}) if futures else unit)
        return out

    def _scan(self, end: int) -> None:
        while self.scanned < end:
            unit = self.inner.fill([self.units[self.scanned]])[0]
            self.scanned += 1
            if unit.kind == "jsonl" and unit.payload is None:
                try:
                    unit = replace(unit, payload=_read_line(unit))  # read once here; the worker checks it as usual
                except OSError:
                    pass
            self.queue.append((unit, {url: self.fetcher.submit(url, kind) for url, kind in media_urls(unit, self.st)}))

    def close(self) -> None:
        self.queue.clear()
        self.inner.close()


def read_fetched(unit, url: str, kind: str, limit: int, flag: str) -> bytes:
    """The worker's side: the body fetched for `url` (within `limit`), or the Reject its fetch ended in."""
    answer = (unit.fetched or {}).get(url)
    if answer is None:
        raise Reject("remote-ref", f"media reference {url[:200]!r} was not fetched (an internal miss); rerun the build")
    if answer[0] == "fail":
        raise Reject(answer[1], answer[2])
    _, path, offset, size = answer
    if size > limit:
        raise Reject("too-large", f"{kind} {url[:200]} is {size} bytes, above {flag} {limit}")
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read(size)
        if len(data) != size:
            raise OSError(f"{len(data)} bytes where {size} were cached")
        return data
    except OSError as err:
        raise Reject("unreadable", f"{url[:200]}: its cached body {answer[1]} cannot be read ({err.strerror or err}); "
                                   "rerun the build to fetch it again") from None


# --- `omniloom data fetch-stats` ------------------------------------------------------------------------


def cache_stats(folder: str) -> dict:
    """What a fetch cache holds (`folder` is the cache, or a build's --out holding .fetch-cache):
    good answers and their bytes, failures by code, how many of those are transient, opted-out bodies kept."""
    root = os.path.join(folder, CACHE_DIR) if os.path.isdir(os.path.join(folder, CACHE_DIR)) else folder
    if not os.path.isfile(os.path.join(root, "index.sqlite")):
        raise FileNotFoundError(f"{folder} holds no fetch cache ({CACHE_DIR}/index.sqlite); pass a build's --out or its --fetch-cache folder")
    ok = size = transient = robots = 0
    failed: Counter = Counter()
    cache = FetchCache(root)
    try:
        for good, code, passing, n, nbytes, opted in cache.tally():
            if good:
                ok, size, robots = ok + n, size + nbytes, robots + (opted or 0)
            else:
                failed[code or "?"] += n
                transient += n if passing else 0
    finally:
        cache.close()
    return {"cache": root, "urls": ok + sum(failed.values()), "ok": ok, "bytes": size, "failed": dict(sorted(failed.items())),
            "transient": transient, "ok_with_opt_out": robots}


def format_figures(f: dict) -> str:
    """The build summary's `fetch:` line."""
    failed = sum(f["failed"].values())
    parts = ", ".join(f"{k} {v}" for k, v in f["failed"].items())
    return (f"fetch: {f['fetched']} URLs fetched ({f['bytes'] / 1e6:.2f} MB in {f['seconds']:.1f}s: {f['per_second']:.1f} URLs/s, "
            f"{f['mb_per_second']:.2f} MB/s; {f['requests']} requests, {f['retries']} retries), {f['cached']} from the cache, "
            f"{failed} failed" + (f" ({parts})" if parts else "") + f"; cache {f['cache']}")
