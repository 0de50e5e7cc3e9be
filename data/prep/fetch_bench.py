"""`omniloom bench data --fetch`: images/s that `data build --fetch-media` gets from an HTTP server on
127.0.0.1, against img2dataset run alone on the same URL list at the same concurrency, in the same
run (rounds alternate; each round starts from an empty cache and output).

The server answers every request after `latency_ms` (a stand-in for a remote host's round trip;
0 measures the clients' own cost). The URL list is a `url` + `caption` parquet of `images` distinct
JPEGs. omniloom's figures: its fetcher alone on the list (`fetch.Fetcher`, the same pool and cache
the build uses: every URL submitted, first request to last answer), and the whole build
(discovery, fetch, decode-validate every image, write the shards; `--workers` decode processes,
first value, default 1). img2dataset's: its own
`NNNNN_stats.json` duration (download and write, no re-encoding: `--disable_all_reencoding`, one
process, `--thread_count` = --fetch-workers), so neither side counts its interpreter's start-up.
img2dataset cannot live in omniloom's environment (it pins webdataset<0.3 and pandas<3): give its
executable from another venv with `--img2dataset PATH`; without it that half is skipped, and says so.
"""

from __future__ import annotations

import glob
import io
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer


def _serve(folder: str, latency: float):
    class Handler(SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=folder, **kw)

        def do_GET(self):  # noqa: N802 - http.server's name
            if latency:
                time.sleep(latency)
            super().do_GET()

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # listen()'s backlog: at the default 5, concurrent connects wait out a SYN retry (1 s)

    srv = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_port}"


def _make_images(folder: str, n: int, size: int) -> int:
    import numpy as np
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    total = 0
    for i in range(n):
        rng = np.random.default_rng(i)
        arr = (np.linspace(0, 255, size * size * 3).reshape(size, size, 3) + rng.integers(0, 40, (size, size, 3))).clip(0, 255)
        buf = io.BytesIO()
        Image.fromarray(arr.astype("uint8")).save(buf, format="JPEG", quality=85)
        with open(os.path.join(folder, f"{i}.jpg"), "wb") as f:
            f.write(buf.getvalue())
        total += len(buf.getvalue())
    return total


def _run_img2dataset(exe: str, urls: str, out: str, workers: int, n: int) -> tuple[int, float]:
    """(images stored, seconds by its own stats) of one img2dataset run."""
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", WANDB_MODE="disabled", WANDB_SILENT="true", PYTHONWARNINGS="ignore",
               no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1,localhost")
    for var in ("http_proxy", "https_proxy", "all_proxy"):
        env.pop(var, None)
        env.pop(var.upper(), None)
    cmd = [exe, "--url_list", urls, "--input_format", "parquet", "--url_col", "url", "--caption_col", "caption",
           "--output_format", "webdataset", "--output_folder", out, "--processes_count", "1", "--thread_count", str(workers),
           "--disable_all_reencoding", "True", "--enable_wandb", "False", "--distributor", "multiprocessing",
           "--number_sample_per_shard", str(n), "--timeout", "10", "--retries", "0"]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"img2dataset failed ({proc.returncode}): {proc.stdout[-1500:]}")
    stats = [json.load(open(p)) for p in glob.glob(os.path.join(out, "*_stats.json"))]
    start = min(s["start_time"] for s in stats)
    end = max(s["end_time"] for s in stats)
    return sum(s["successes"] for s in stats), end - start


def run_fetch_bench(*, images: int = 400, image_size: int = 64, workers: int = 16, latency_ms: float = 10.0, repeats: int = 3,
                    img2dataset: str = "", keep: str | None = None, build_workers: int = 1) -> str:
    """Run the comparison and return the report (one line per round, then the medians)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .fetch import Fetcher, FetchOptions
    from .media import MediaLimits
    from .shards import build

    root = keep or tempfile.mkdtemp(prefix="omniloom-fetch-bench-")
    lines = []
    srv = None
    try:
        nbytes = _make_images(os.path.join(root, "www", "img"), images, image_size)
        srv, base = _serve(os.path.join(root, "www"), latency_ms / 1000)
        urls = os.path.join(root, "urls.parquet")
        pq.write_table(pa.table({"url": [f"{base}/img/{i}.jpg" for i in range(images)],
                                 "caption": [f"picture number {i}" for i in range(images)]}), urls)
        exe = img2dataset and (shutil.which(img2dataset) or (img2dataset if os.access(img2dataset, os.X_OK) else ""))
        if img2dataset and not exe:
            raise FileNotFoundError(f"--img2dataset {img2dataset}: no such executable")
        build_rate, fetch_rate, i2d_rate = [], [], []
        for r in range(repeats):
            fetcher = Fetcher(FetchOptions(workers=workers), os.path.join(root, f"fetch-only-{r}"), MediaLimits())
            t0 = time.perf_counter()
            answers = [f.result() for f in [fetcher.submit(f"{base}/img/{i}.jpg", "image") for i in range(images)]]
            fsecs = time.perf_counter() - t0
            fetcher.close()
            fetched = sum(a[0] == "ok" for a in answers)
            fetch_rate.append(fetched / fsecs)
            out = os.path.join(root, f"omniloom-{r}")
            t0 = time.perf_counter()
            s = build([urls], out, progress=False, workers=build_workers,
                      fetch=FetchOptions(workers=workers, cache=os.path.join(root, f"cache-{r}")))
            secs = time.perf_counter() - t0
            got = s["segments"]["image"]
            build_rate.append(got / secs)
            row = (f"round {r + 1}: omniloom fetcher {fetched}/{images} in {fsecs:.2f}s = {fetch_rate[-1]:.0f} images/s; "
                   f"build --fetch-media {got}/{images} images in {secs:.2f}s = {build_rate[-1]:.0f} images/s")
            if exe:
                n, i2d_secs = _run_img2dataset(exe, urls, os.path.join(root, f"img2dataset-{r}"), workers, images)
                i2d_rate.append(n / i2d_secs)
                row += f"; img2dataset {n}/{images} in {i2d_secs:.2f}s = {i2d_rate[-1]:.0f} images/s"
            lines.append(row)
        med = statistics.median
        head = (f"{images} JPEGs of {image_size}px ({nbytes / 1e6:.1f} MB) from 127.0.0.1, {latency_ms:g} ms per answer, "
                f"{workers} requests in flight, build with {build_workers} decode worker(s), {repeats} rounds")
        summary = f"median: omniloom fetcher {med(fetch_rate):.0f} images/s, build --fetch-media {med(build_rate):.0f} images/s"
        if i2d_rate:
            summary += (f"; img2dataset {med(i2d_rate):.0f} images/s; fetcher / img2dataset = "
                        f"{med([f / i for f, i in zip(fetch_rate, i2d_rate)]):.2f}x, build / img2dataset = "
                        f"{med([b / i for b, i in zip(build_rate, i2d_rate)]):.2f}x (medians of per-round ratios)")
        else:
            summary += "; img2dataset skipped: pass --img2dataset PATH (its executable, installed in a separate venv: " \
                       "python3 -m venv /tmp/i2d && /tmp/i2d/bin/pip install img2dataset)"
        return "\n".join([head, *lines, summary])
    finally:
        if srv is not None:
            srv.shutdown()
            srv.server_close()
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
