"""Fixtures of the data tests."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest


@pytest.fixture
def start_build():
    """Start `data build SOURCES --out OUT --shard-docs 2 EXTRA...` in a subprocess of its own session
    (so a test can kill -9 it mid-build), through the data commands' own entry point: the same
    handlers as `omniloom data build`, without the start-up cost of importing every package's CLI."""

    def start(src, out, *extra, env=None) -> subprocess.Popen:
        sources = [src] if isinstance(src, (str, bytes)) or hasattr(src, "__fspath__") else list(src)
        return subprocess.Popen([sys.executable, "-m", "omniloom.data.cli", "build", *map(str, sources), "--out", str(out),
                                 "--shard-docs", "2", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                start_new_session=True)

    return start


@pytest.fixture
def kill_build(start_build):
    """Start a build slowed down between shards (OMNILOOM_TEST_BUILD_PAUSE) and kill -9 its whole
    process group once its journal holds `shards` more shards' lines than before and a shard is being
    written; the folder is left as the kill left it (no manifest, a `.tar.tmp`)."""

    def kill(src, out, *extra, shards: int = 2) -> None:
        journal = out / ".build-journal.jsonl"
        before = len(journal.read_text().splitlines()) if journal.exists() else 0
        p = start_build(src, out, *extra, env={**os.environ, "OMNILOOM_TEST_BUILD_PAUSE": "0.15"})
        deadline = time.time() + 60
        while time.time() < deadline:
            if (journal.exists() and len(journal.read_text().splitlines()) >= before + shards
                    and any(f.suffix == ".tmp" for f in out.iterdir())):
                break
            time.sleep(0.02)
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        assert not (out / "manifest.json").exists()

    return kill



@pytest.fixture
def check_kill_and_resume(tmp_path, start_build, kill_build):
    """Build `src` once whole, once killed (kill_build) and resumed: the resumed build says so and
    its folder is byte-identical to the whole one. `first` adds flags to the whole and the killed run
    (the resumed one runs without them: e.g. another --workers must give the same bytes); `always`
    adds flags to all three (e.g. --fetch-media)."""

    def check(src, *, first=(), always=(), shards: int = 3) -> None:
        clean, out = tmp_path / "clean", tmp_path / "killed"
        p = start_build(src, clean, *first, *always)
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()
        kill_build(src, out, *first, *always, shards=shards)
        p = start_build(src, out, *always)
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()
        assert "(resumed)" in p.stdout.read().decode()
        assert_same_files(clean, out)

    return check


def assert_same_files(a, b) -> None:
    """Two folders hold the same file names with the same bytes (a --fetch-media cache folder inside
    them, .fetch-cache, is left out: what it holds depends on what each build fetched itself)."""
    names = sorted(n for n in os.listdir(a) if n != ".fetch-cache")
    assert names == sorted(n for n in os.listdir(b) if n != ".fetch-cache")
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture
def check_workers_and_parts(tmp_path):
    """Build `src` at 1 and 2 workers (byte-identical) and as --part 0/2 + 1/2 merged (the same
    documents, by sample key); returns the 1-worker folder."""

    def check(src, **build_kw):
        from omniloom.data.cli import main
        from omniloom.data.manifest import iter_documents
        from omniloom.data.prep.shards import build

        a, b = tmp_path / "w1", tmp_path / "w2"
        build([str(x) for x in src], str(a), progress=False, workers=1, **build_kw)
        build([str(x) for x in src], str(b), progress=False, workers=2, **build_kw)
        assert_same_files(a, b)
        parts = [tmp_path / f"part{i}" for i in range(2)]
        for i, part in enumerate(parts):
            build([str(x) for x in src], str(part), part=(i, 2), progress=False, **build_kw)
        assert main(["merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 0
        assert {k for k, _, _ in iter_documents(tmp_path / "merged")} == {k for k, _, _ in iter_documents(a)}
        return a

    return check


class _Handler(SimpleHTTPRequestHandler):
    """A folder served read-only, every GET recorded as (path, Range header)."""

    requests: list

    def do_GET(self):  # noqa: N802 - http.server's name
        self.requests.append((self.path, self.headers.get("Range")))
        super().do_GET()

    def log_message(self, *args):  # quiet
        pass


@contextlib.contextmanager
def _serving(srv):
    """Run `srv` in a thread for the block; shut down on exit, and by itself after 5 minutes."""
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    guard = threading.Timer(300, srv.shutdown)
    guard.daemon = True
    guard.start()
    try:
        yield
    finally:
        guard.cancel()
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


@contextlib.contextmanager
def serve_folder(folder):
    """A threaded http.server on 127.0.0.1 serving `folder`; yields (base URL, requests). Shut down
    on exit, and by itself after 5 minutes whatever happens."""
    handler = type("H", (_Handler,), {"requests": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    srv.daemon_threads = True
    with _serving(srv):
        yield f"http://127.0.0.1:{srv.server_port}", handler.requests


@pytest.fixture(scope="session")
def http_folder():
    """`serve_folder` for module-scoped server fixtures: `with http_folder(path) as (url, requests)`."""
    return serve_folder


class _RouteHandler(BaseHTTPRequestHandler):
    routes: dict
    requests: list

    def do_GET(self):  # noqa: N802 - http.server's name
        path = self.path.split("?", 1)[0]
        with self.lock:
            self.requests.append((path, dict(self.headers.items()), time.monotonic()))
            n = sum(1 for p, _, _ in self.requests if p == path)
        route = self.routes.get(path)
        if route is None:
            reply(self, 404, b"not here")
        else:
            route(self, n)

    def log_message(self, *args):  # quiet
        pass


def reply(handler, status: int, body: bytes = b"", headers=(), *, length: bool = True) -> None:
    """Answer a request of `serve_routes`: `status`, `headers` (pairs), `body`; with `length` False
    no Content-Length is sent and the body ends when the connection closes (HTTP/1.0)."""
    handler.send_response(status)
    for k, v in headers:
        handler.send_header(k, v)
    if length:
        handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    try:
        handler.wfile.write(body)
    except OSError:  # the client gave up (a timeout test)
        pass


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen()'s backlog: at the default 5, concurrent connects wait out a SYN retry (1 s)

    def handle_error(self, request, client_address):  # a client that timed out and closed: expected in these tests
        pass


@contextlib.contextmanager
def serve_routes(routes: dict):
    """A threaded HTTP server on 127.0.0.1 answering GET `path` by `routes[path](handler, n)` (n:
    the how-many-th request to that path, from 1; `reply` writes an answer), 404 for the rest; yields
    (base URL, requests: [(path, headers, monotonic time)]). Shut down on exit, and by itself after
    5 minutes whatever happens."""
    handler = type("R", (_RouteHandler,), {"routes": routes, "requests": [], "lock": threading.Lock()})
    srv = _QuietServer(("127.0.0.1", 0), handler)
    with _serving(srv):
        yield f"http://127.0.0.1:{srv.server_port}", handler.requests


@pytest.fixture(scope="session")
def route_server():
    """`serve_routes`: `with route_server(routes) as (base URL, requests)`; a route writes its answer
    with the `http_reply` fixture's function."""
    return serve_routes


@pytest.fixture(scope="session")
def http_reply():
    """`reply(handler, status, body, headers, length=True)`, for `route_server` routes."""
    return reply


@pytest.fixture
def no_proxy(monkeypatch):
    """curl (under webdataset's gopen) must reach the local server directly."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture(scope="session")
def loader_cfg():
    """`cfg(path, tokenizer, **overrides)`: a small DataConfig over one source named "s"."""
    from omniloom.data.config import DataConfig, SourceConfig

    def cfg(path, tok, **kw):
        base = dict(seq_len=96, batch_size=2, num_workers=0, shuffle_buffer=3, pack_buffer=3, seed=7, tokenizer=str(tok))
        base.update(kw)
        return DataConfig(sources=[SourceConfig(path=str(path), name="s")], **base)

    return cfg


@pytest.fixture(scope="session")
def take_batches():
    """`take(loader, n)`: the first n batches' tensors, cloned."""

    def take(loader, n):
        out = []
        for batch in loader:
            out.append({k: v.clone() for k, v in batch.__dict__.items() if hasattr(v, "clone")})
            if len(out) == n:
                break
        return out

    return take


@pytest.fixture(scope="session")
def laion_served(tmp_path_factory, http_folder):
    """(root, base URL, requests): `root/laion/laion-00000{0,1}.tar`, 6 samples each in
    img2dataset's layout (KEY.jpg|png + KEY.txt "a photo number N" + KEY.json) written by the real
    webdataset.TarWriter, a `root/laion/docs.jsonl` that is not a tar, and a tiny tokenizer in
    `root/tok`; `root` served over http on 127.0.0.1 for the session."""
    import io

    import numpy as np
    import webdataset as wds
    from PIL import Image

    from omniloom.tokenizers.testing import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("remote")
    (root / "laion").mkdir()
    n = 0
    for s in range(2):
        with wds.TarWriter(str(root / "laion" / f"laion-{s:06d}.tar")) as w:
            for _ in range(6):
                ext, fmt = (("jpg", "JPEG"), ("png", "PNG"))[n % 2]
                buf = io.BytesIO()
                Image.fromarray(np.random.default_rng(n).integers(0, 255, (32, 40, 3), dtype=np.uint8)).save(buf, format=fmt)
                w.write({"__key__": f"{n:09d}", ext: buf.getvalue(), "txt": f"a photo number {n}",
                         "json": {"url": f"https://example.com/{n}.{ext}", "status": "success"}})
                n += 1
    (root / "laion" / "docs.jsonl").write_text('{"text": "not a tar"}\n')
    make_tiny_tokenizer(root / "tok")
    with http_folder(root) as (base, requests):
        yield root, base, requests


@pytest.fixture(scope="session")
def laion(laion_served):
    """The root of `laion_served` (`laion/`, `tok/`)."""
    return laion_served[0]


@pytest.fixture(scope="session")
def server(laion_served):
    """(base URL, the requests it got) of `laion_served`."""
    return laion_served[1:]
