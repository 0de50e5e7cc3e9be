"""img2dataset itself (issue 38 acceptance): run against a local HTTP server on 127.0.0.1, its
WebDataset shards are indexed in place (`omniloom data index`), built (`omniloom data build`) and
trained on (`omniloom train tiny`). The samples img2dataset reports as successful in its own
`NNNNN.parquet` are the documents omniloom finds, caption for caption and image byte for byte; its
`NNNNN_stats.json` / `NNNNN.parquet` beside the shards are skipped and counted, never documents.

img2dataset is optional (the `interop` extra: `pip install -e '.[dev,interop]'`; it pins
webdataset < 0.3 and pandas < 3, which would downgrade the suite's own webdataset 1.x): without it
every test here is skipped with that reason.

Two runs of img2dataset, as people run it: `resized` (its defaults: every image re-encoded as a
32 px JPEG; the 404 and the HTML page are failures) and `as-downloaded` (`disable_all_reencoding`:
the bytes as served, so a PNG is stored as `KEY.jpg` and the HTML page is a "success" that omniloom
rejects as not an image, with the reason). Each has a row whose caption is null, which img2dataset
writes as a zero-byte `KEY.txt`: the image alone is the document.

Nothing leaves the machine: the server listens on 127.0.0.1 only, handles a bounded number of
requests and stops by itself; img2dataset runs in a child process (its `download` installs a
SIGINT handler and spawns workers that re-import `__main__`) with a time limit, wandb off,
albumentations' update check off, and every proxy variable pointing at the test server, so a
fetch of anything but the listed URLs would reach it and fail the test.
"""

from __future__ import annotations

import http.server
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from omniloom.data.manifest import iter_sample_at, read_manifest
from omniloom.pretrain.cli import main

REASON = ("img2dataset is not installed: it is in the `interop` extra (pip install -e '.[dev,interop]'), not in `dev`, "
          "because it pins webdataset<0.3 and pandas<3; see docs/data-format.md, 'img2dataset's output'")

_WORDS = ("red green blue yellow cat dog horse bird river mountain city street night morning portrait painting "
          "sunset forest beach window garden kitchen bicycle train station market bridge castle flower").split()


def _caption(n: int) -> str:
    """A photo caption with enough varied words to train a small tokenizer on."""
    return f"a photo number {n}: " + " ".join(np.random.default_rng(n).choice(_WORDS, 24))


def _image(fmt: str, seed: int, size: tuple[int, int], mode: str = "RGB") -> bytes:
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], channels), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels.squeeze(-1) if channels == 1 else pixels, mode=mode).save(buf, format=fmt)
    return buf.getvalue()


def _rows() -> list[tuple[str, bytes | None, str, str | None]]:
    """(path, body or None for a 404, content type, caption or None) of each URL in the list."""
    rows = []
    for n in range(12):
        fmt, ctype = (("JPEG", "image/jpeg"), ("PNG", "image/png"))[n % 2]
        mode = "RGBA" if n == 7 else "L" if n == 6 else "RGB"
        body = _image(fmt, n, (24 + 4 * n, 48 - 2 * n), mode)
        rows.append((f"/img/{n}.{fmt.lower()}", body, ctype, _caption(n) if n != 1 else None))
    rows[3] = ("/img/missing.jpg", None, "image/jpeg", "a photo that is gone")  # 404
    rows[5] = ("/page.html", b"<html><body>not an image</body></html>", "text/html", "a web page")
    rows[8] = (rows[8][0], rows[8][1], rows[8][2], "un caf\u00e9 \u2615 au lait, " + _caption(8))
    return rows


class _Server:
    """A threaded HTTP server on 127.0.0.1 (port 0) serving `files` {path: (body, type)}, 404 for
    the rest. It handles at most `max_requests` requests and stops by itself after `lifetime`
    seconds (or at `close()`). `seen` lists (method, path) of every request, proxied ones included."""

    def __init__(self, files: dict, max_requests: int = 64, lifetime: float = 240.0):
        seen = self.seen = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                hit = files.get(self.path)
                if hit is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", hit[1])
                self.send_header("Content-Length", str(len(hit[0])))
                self.end_headers()
                self.wfile.write(hit[0])

            def log_request(self, code="-", size="-"):
                seen.append((self.command, self.path))

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.httpd.timeout = 0.2
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._stop = threading.Event()
        self._limits = (max_requests, time.monotonic() + lifetime)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        max_requests, deadline = self._limits
        try:
            while not self._stop.is_set() and time.monotonic() < deadline and len(self.seen) < max_requests:
                self.httpd.handle_request()
        finally:
            self.httpd.server_close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def _run_img2dataset(kwargs: dict, cwd: Path, proxy: str, limit: float = 300) -> str:
    """`img2dataset.download(**kwargs)` in a child process (its own session, killed whole past `limit`)."""
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", WANDB_SILENT="true", WANDB_DISABLED="true",
               PYTHONWARNINGS="ignore")
    for var in ("http_proxy", "https_proxy", "ftp_proxy", "all_proxy"):
        env[var] = env[var.upper()] = proxy
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    code = "import json, sys, img2dataset; img2dataset.download(**json.loads(sys.argv[1]))"
    proc = subprocess.Popen([sys.executable, "-c", code, json.dumps(kwargs)], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"img2dataset did not finish in {limit}s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def _tar_samples(path: Path) -> dict[str, dict[str, bytes]]:
    """{key: {ext: bytes}} of a tar, keys and extensions as WebDataset splits them."""
    samples: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tf:
        for ti in tf:
            if ti.isreg():
                folder, _, base = ti.name.rpartition("/")
                stem, _, ext = base.partition(".")
                samples.setdefault(f"{folder}/{stem}" if folder else stem, {})[ext.lower()] = tf.extractfile(ti).read()
    return samples


MODES = {
    # img2dataset's defaults: resized to 32 px (border), re-encoded as JPEG
    "resized": dict(image_size=32),
    # the bytes as served: a PNG stays PNG under KEY.jpg; the HTML page passes as a "success"
    "as-downloaded": dict(disable_all_reencoding=True),
}


@pytest.fixture(scope="module")
def img2dataset_runs(tmp_path_factory):
    """{mode: run} for each of MODES, made on first use: run = {out, rows by url, parquet rows by key, tar samples by key}."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NO_ALBUMENTATIONS_UPDATE", "1")  # its import would ask PyPI for a newer albumentations
        pytest.importorskip("img2dataset", reason=REASON)
    import pyarrow as pa
    import pyarrow.parquet as pq

    cache: dict[str, dict] = {}

    def get(mode: str) -> dict:
        if mode in cache:
            return cache[mode]
        work = tmp_path_factory.mktemp(f"img2dataset-{mode}")
        rows = _rows()
        server = _Server({p: (b, t) for p, b, t, _ in rows if b is not None})
        try:
            urls = [server.url + p for p, _, _, _ in rows]
            pq.write_table(pa.table({"url": urls, "caption": [c for _, _, _, c in rows],
                                     "license": [f"cc-by-{n}" for n in range(len(rows))]}), work / "urls.parquet")
            kwargs = dict(url_list=str(work / "urls.parquet"), input_format="parquet", url_col="url", caption_col="caption",
                          save_additional_columns=["license"], output_folder=str(work / "out"), output_format="webdataset",
                          processes_count=1, thread_count=2, number_sample_per_shard=4, timeout=10, retries=0,
                          enable_wandb=False, distributor="multiprocessing", **MODES[mode])
            log = _run_img2dataset(kwargs, work, proxy=server.url)
        finally:
            server.close()
        # it fetched each listed URL once and nothing else (a proxied request would show its full URL or CONNECT)
        assert sorted(server.seen) == sorted(("GET", p) for p, _, _, _ in rows), (server.seen, log[-2000:])
        out = work / "out"
        shards = sorted(p.name for p in out.glob("*.tar"))
        assert shards == ["00000.tar", "00001.tar", "00002.tar"], sorted(os.listdir(out))
        report = {r["key"]: r for s in shards for r in pq.read_table(out / s.replace(".tar", ".parquet")).to_pylist()}
        tars = {s: _tar_samples(out / s) for s in shards}
        cache[mode] = run = {"out": out, "work": work, "urls": dict(zip(urls, rows)), "report": report, "tars": tars, "log": log}
        return run

    return get


def _successes(run: dict) -> dict[str, dict]:
    return {k: r for k, r in run["report"].items() if r["status"] == "success"}


@pytest.mark.parametrize("mode", list(MODES))
def test_img2dataset_writes_its_layout_against_the_local_server(img2dataset_runs, mode):
    run = img2dataset_runs(mode)
    report, by_url = run["report"], run["urls"]
    status = {by_url[r["url"]][0]: r["status"] for r in report.values()}
    assert status["/img/missing.jpg"] == "failed_to_download"
    assert status["/page.html"] == ("failed_to_resize" if mode == "resized" else "success")
    assert sum(s == "success" for s in status.values()) == (10 if mode == "resized" else 11)
    # its stats agree with its parquet, and the tars hold exactly the successes: KEY.jpg + KEY.txt + KEY.json
    stats = [json.loads(p.read_text()) for p in sorted(run["out"].glob("*_stats.json"))]
    assert sum(s["successes"] for s in stats) == len(_successes(run)) and sum(s["count"] for s in stats) == 12
    members = {k: v for t in run["tars"].values() for k, v in t.items()}
    assert set(members) == set(_successes(run))
    assert all(sorted(m) == ["jpg", "json", "txt"] for m in members.values())
    nulls = [k for k, r in _successes(run).items() if r["caption"] is None]
    assert len(nulls) == 1 and members[nulls[0]]["txt"] == b""  # a null caption is a zero-byte KEY.txt
    if mode == "as-downloaded":  # the bytes as served: a PNG under .jpg
        png = next(k for k, r in _successes(run).items() if by_url[r["url"]][0] == "/img/1.png")
        assert members[png]["jpg"] == by_url[report[png]["url"]][1] and members[png]["jpg"].startswith(b"\x89PNG")


def _expected(run: dict, mode: str) -> tuple[dict[str, str | None], list[str]]:
    """({key: caption or None} of the samples omniloom must keep, [keys it must reject]) for a run."""
    keep, bad = {}, []
    for key, r in _successes(run).items():
        if run["urls"][r["url"]][0] == "/page.html":
            bad.append(key)  # "success" only because img2dataset did not decode it
        else:
            keep[key] = r["caption"]
    assert len(bad) == (1 if mode == "as-downloaded" else 0)
    return keep, bad


def _check_document(key: str, doc: dict, media: dict, caption: str | None, run: dict) -> None:
    """An omniloom document of img2dataset's sample `key`: its image member's bytes, then its
    caption (none for a null one), its json (url, license) as meta."""
    members = next(t[key] for t in run["tars"].values() if key in t)
    kinds = [(s["type"], s.get("text")) for s in doc["segments"]]
    assert kinds == [("image", None)] + ([("text", caption)] if caption is not None else []), (key, kinds)
    ref = doc["segments"][0]["ref"]
    # the member's bytes as img2dataset wrote them; a build names a PNG stored as KEY.jpg img0.png
    assert ref in ("img0.jpg", "img0.png") and media[ref] == members["jpg"], key
    row = run["report"][key]
    assert doc["meta"]["wds_key"] == key and doc["meta"]["json"]["url"] == row["url"]
    assert doc["meta"]["json"]["license"] == row["license"] and doc["meta"]["json"]["status"] == "success"


@pytest.mark.parametrize("mode", list(MODES))
def test_data_index_finds_img2datasets_successes_member_for_member(img2dataset_runs, mode, tmp_path, capsys):
    from omniloom.data.config import SourceConfig
    from omniloom.data.stream.reader import SampleReader, _foreign_members, resolve_source

    run = img2dataset_runs(mode)
    keep, bad = _expected(run, mode)
    # headers only: every sample img2dataset wrote, in its shards' order, members as in the tars
    assert main(["-qq", "data", "index", str(run["out"]), "--out", str(tmp_path / "idx")]) == 0
    printed = capsys.readouterr().out
    assert "skipped: 6 shard-metadata" in printed, printed  # 3 x NNNNN_stats.json + NNNNN.parquet
    man = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert man["skipped"] == {"shard-metadata": 6} and man["rejects"]["total"] == 0
    shards = resolve_source(SourceConfig(path=str(tmp_path / "idx"))).shards
    assert [Path(s.url).name for s in shards] == sorted(run["tars"])
    reader = SampleReader(shards)
    for i, shard in enumerate(shards):
        tar = run["tars"][Path(shard.url).name]
        assert sorted(shard.keys) == sorted(tar)
        for j, key in enumerate(shard.keys):
            got_key, members = reader.read_raw(i, j, _foreign_members)
            assert got_key == key and dict(members) == tar[key]
            if key in keep:
                doc, media = reader.read_document(i, j)
                _check_document(key, doc, media, keep[key], run)
    # --validate: what the build would reject is left out with its reason; the rest are kept
    assert main(["-qq", "data", "index", str(run["out"]), "--out", str(tmp_path / "valid"), "--validate"]) == 0
    shards = resolve_source(SourceConfig(path=str(tmp_path / "valid"))).shards
    assert sorted(k for s in shards for k in s.keys) == sorted(keep)
    rejects = [json.loads(x) for x in (tmp_path / "valid" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["path"].rsplit("#", 1)[1], r["code"]) for r in rejects] == [(k, "not-an-image") for k in bad]


@pytest.mark.parametrize("mode", list(MODES))
def test_data_build_makes_one_document_per_success_and_skips_the_metadata(img2dataset_runs, mode, tmp_path, capsys):
    run = img2dataset_runs(mode)
    keep, bad = _expected(run, mode)
    out = tmp_path / "built"
    assert main(["-qq", "data", "build", str(run["out"]), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "skipped: 6 shard-metadata" in printed and "empty-caption-member 1" in printed, printed
    docs = {}
    for shard in read_manifest(out)["shards"]:
        for smp in shard["samples"]:
            _, members = iter_sample_at(out / shard["name"], smp["offset"])
            doc = json.loads(members.pop("doc.json"))
            docs[doc["meta"]["wds_key"]] = (doc, members)
    assert sorted(docs) == sorted(keep)  # no document from NNNNN.parquet or NNNNN_stats.json
    for key, (doc, members) in docs.items():
        _check_document(key, doc, members, keep[key], run)
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert [(r["path"].rsplit("#", 1)[1], r["code"]) for r in rejects] == [(k, "not-an-image") for k in bad]


def test_train_tiny_on_an_index_of_img2datasets_shards(img2dataset_runs, tmp_path):
    run = img2dataset_runs("resized")
    idx, built, tok = tmp_path / "idx", tmp_path / "built", tmp_path / "tok"
    assert main(["-qq", "data", "index", str(run["out"]), "--out", str(idx), "--validate"]) == 0
    assert main(["-qq", "data", "build", str(run["out"]), "--out", str(built)]) == 0
    assert main(["-qq", "tokenizer", "train", "--data", str(built), "--vocab-size", "360", "--out", str(tok), "--threads", "1",
                 "--image-patch-budget", "16", "--video-frame-budget", "4", "--video-patch-budget", "8"]) == 0
    rundir = tmp_path / "run"
    assert main(["-qq", "train", "--no-progress", "--run-dir", str(rundir), "tiny", f"data.sources=[{{path: {idx}}}]",
                 f"data.tokenizer={tok}", "data.seq_len=96", "data.batch_size=2", "data.num_workers=1",
                 "model.dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.rope_sections=[4,6,6]",
                 "model.attention.window=32", "model.moe.expert_dim=32", "model.moe.dense_dim=64", "model.attention.block_size=16",
                 "optim.warmup_steps=1", "train.eval_every=0", "checkpoint.every=0", "logging.every=1", "train.num_steps=2"]) == 0
    rows = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    losses = [r for r in rows if "loss" in r]
    assert [r["step"] for r in losses] == [1, 2] and all(np.isfinite(r["loss"]) for r in losses)
    assert all(r.get("data/skipped_total", 0) == 0 for r in rows)
