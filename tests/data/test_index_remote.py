"""`omniloom data index` on remote shards (issue 38): foreign WebDataset shards served over HTTP by
a local server, and read through a `pipe:` command, index to the samples and byte offsets a local
index finds and train on the same batches."""

from __future__ import annotations

import functools
import io
import json
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.config import DataConfig, SourceConfig
from omniloom.data.stream.loader import build_loader
from omniloom.pretrain.cli import main

wds = pytest.importorskip("webdataset")

_WORDS = ("red green blue yellow cat dog horse bird river mountain city street night morning portrait painting "
          "sunset forest beach window garden kitchen bicycle train station market bridge castle flower").split()


def _image(fmt: str, seed: int) -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (32, 40, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()


def write_laion(folder: Path, shards: int = 2, per: int = 6) -> list[Path]:
    """img2dataset's layout (KEY.jpg/png + KEY.txt + KEY.json) as `laion-NNNNNN.tar`, written with
    the real webdataset.TarWriter."""
    folder.mkdir(parents=True, exist_ok=True)
    paths, n = [], 0
    for s in range(shards):
        paths.append(folder / f"laion-{s:06d}.tar")
        with wds.TarWriter(str(paths[-1])) as w:
            for _ in range(per):
                ext, fmt = (("jpg", "JPEG"), ("png", "PNG"))[n % 2]
                words = " ".join(np.random.default_rng(n).choice(_WORDS, 24))
                w.write({"__key__": f"{n:09d}", ext: _image(fmt, n), "txt": f"a photo number {n}: {words}",
                         "json": {"url": f"https://example.com/{n}.{ext}", "status": "success"}})
                n += 1
    return paths


class _Handler(SimpleHTTPRequestHandler):
    """A folder served read-only. The stream reader fetches a shard whole from its start (webdataset's
    `gopen`: curl, no Range header) and skips forward by reading, so no Range support is needed;
    every request is recorded."""

    requests: list

    def do_GET(self):  # noqa: N802 - http.server's name
        self.requests.append((self.path, self.headers.get("Range")))
        super().do_GET()

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture(scope="module")
def laion(tmp_path_factory):
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("remote")
    write_laion(root / "laion")
    make_tiny_tokenizer(root / "tok")
    return root


@pytest.fixture(scope="module")
def server(laion):
    """A threaded http.server on 127.0.0.1 serving the shards folder; shut down after the module's
    tests, and by itself after 5 minutes whatever happens."""
    handler = type("H", (_Handler,), {"requests": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(laion / "laion")))
    srv.daemon_threads = True
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    guard = threading.Timer(300, srv.shutdown)
    guard.daemon = True
    guard.start()
    try:
        yield f"http://127.0.0.1:{srv.server_port}", handler.requests
    finally:
        guard.cancel()
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=10)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    """curl (under webdataset's gopen) must reach the local server directly."""
    for var in ("http_proxy", "HTTP_PROXY", "https_proxy", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")


@pytest.fixture(scope="module")
def local_index(laion, tmp_path_factory):
    out = tmp_path_factory.mktemp("local") / "idx"
    assert main(["-qq", "data", "index", str(laion / "laion" / "laion-{000000..000001}.tar"), "--out", str(out)]) == 0
    return out


def _cfg(path, tok, **kw):
    base = dict(seq_len=96, batch_size=2, num_workers=0, shuffle_buffer=3, pack_buffer=3, seed=7, tokenizer=str(tok))
    base.update(kw)
    return DataConfig(sources=[SourceConfig(path=str(path), name="s")], **base)


def _batches(loader, n):
    out = []
    for batch in loader:
        out.append({k: v.clone() for k, v in batch.__dict__.items() if hasattr(v, "clone")})
        if len(out) == n:
            break
    return out


def _same_index_and_batches(remote_idx: Path, local_idx: Path, tok: Path) -> None:
    """The remote index lists the local one's samples (keys, offsets, members) and sizes, and its
    loader gives the same batches, tensor for tensor."""
    a, b = (json.loads((d / "manifest.json").read_text()) for d in (remote_idx, local_idx))
    assert [s["samples"] for s in a["shards"]] == [s["samples"] for s in b["shards"]]
    assert [s["bytes"] for s in a["shards"]] == [s["bytes"] for s in b["shards"]]
    assert [s["name"] for s in a["shards"]] == [s["name"] for s in b["shards"]] == ["laion-000000.tar", "laion-000001.tar"]
    assert a["totals"]["documents"] == 12
    x = _batches(build_loader(_cfg(remote_idx, tok)), 6)
    y = _batches(build_loader(_cfg(local_idx, tok)), 6)
    assert len(x) == len(y) == 6
    for p, q in zip(x, y):
        assert p.keys() == q.keys()
        for k in p:
            assert p[k].dtype == q[k].dtype and p[k].shape == q[k].shape and bool((p[k] == q[k]).all()), k
    assert any(bool((p["modality"] == 2).any()) for p in x)  # images made it through


def test_index_over_http_trains_on_the_same_batches_as_a_local_index(laion, server, local_index, tmp_path):
    base, requests = server
    out = tmp_path / "idx"
    assert main(["-qq", "data", "index", f"{base}/laion-{{000000..000001}}.tar", "--out", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert [s["url"] for s in man["shards"]] == [f"{base}/laion-00000{i}.tar" for i in (0, 1)]
    assert {p for p, _ in requests} == {"/laion-000000.tar", "/laion-000001.tar"}
    before = len(requests)
    _same_index_and_batches(out, local_index, laion / "tok")
    assert len(requests) > before  # the batches were read over HTTP
    assert all(r is None for _, r in requests)  # whole streams, skipped forward by reading


def test_train_a_few_steps_on_an_http_index(laion, server, tmp_path, train_tiny):
    base, _ = server
    out = tmp_path / "idx"
    assert main(["-qq", "data", "index", f"{base}/laion-{{000000..000001}}.tar", "--out", str(out)]) == 0
    run = tmp_path / "run"
    assert train_tiny(run, out, laion / "tok", "train.num_steps=3") == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(r["step"] for r in rows if "loss" in r) == [1, 2, 3]
    assert all(r.get("data/skipped_total", 0) == 0 for r in rows)


def test_index_through_a_pipe_command_trains_on_the_same_batches(laion, local_index, tmp_path):
    out = tmp_path / "idx"
    shards = laion / "laion"
    assert main(["-qq", "data", "index", f"pipe:cat {shards}/laion-{{000000..000001}}.tar", "--out", str(out)]) == 0
    man = json.loads((out / "manifest.json").read_text())
    assert [s["url"] for s in man["shards"]] == [f"pipe:cat {shards}/laion-00000{i}.tar" for i in (0, 1)]
    _same_index_and_batches(out, local_index, laion / "tok")

