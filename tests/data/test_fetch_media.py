"""`omniloom data build --fetch-media` (issue 40): media by http(s) URL in OBELICS and MMC4 JSONL,
the omniloom schema and `url` + `caption` parquet, fetched from a server on 127.0.0.1 that the
test starts (tests/data/conftest.py `route_server`; proxies cleared by `no_proxy`).

Each URL kind ends as documented (docs/data-format.md, "Media by URL"): 200, 404, 500 then 200,
429 with Retry-After, a response slower than --fetch-timeout, a body above the limit (declared,
and undeclared: enforced while reading), a redirect loop, bytes that are not an image, and an
`X-Robots-Tag: noai` header. The server counts requests: a rebuild fetches nothing, a SIGKILLed
build resumes without fetching twice, and the shards are byte-identical whoever fetched them.
"""

from __future__ import annotations

import io
import json
import time

import pytest

from omniloom.data.manifest import iter_documents, read_manifest
from omniloom.data.prep.fetch import FetchOptions, cache_stats, robots_opt_out, user_agent
from omniloom.data.prep.media import MediaLimits
from omniloom.data.prep.shards import build
from omniloom.data.prep.units import IngestSettings

CAP = 8192  # --max-image-bytes of these builds
FAST = dict(timeout=0.3, retries=1, backoff=0.05, max_wait=2.0)


def _png(seed: int) -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _video() -> bytes:
    from omniloom.tokenizers.testing import make_video_bytes

    return make_video_bytes(seconds=0.4, fps=10, width=32, height=32)


@pytest.fixture
def routes(http_reply):
    """The URL kinds of the issue, by path."""
    r = http_reply

    def ok(seed, headers=()):
        return lambda h, n: r(h, 200, _png(seed), [("Content-Type", "image/png"), *headers])

    def flaky(h, n):
        return r(h, 500, b"oops") if n == 1 else r(h, 200, _png(3), [("Content-Type", "image/png")])

    def busy(h, n):
        return r(h, 429, b"slow down", [("Retry-After", "1")]) if n == 1 else r(h, 200, _png(4), [("Content-Type", "image/png")])

    def slow(h, n):
        time.sleep(1.0)
        r(h, 200, _png(5))

    return {
        "/ok1.png": ok(1), "/ok2.png": ok(2), "/flaky.png": flaky, "/busy.png": busy, "/slow.png": slow,
        "/big.png": lambda h, n: r(h, 200, b"\x89PNG" + bytes(3 * CAP), [("Content-Type", "image/png")]),
        "/big-nolen.png": lambda h, n: r(h, 200, b"\x89PNG" + bytes(3 * CAP), [("Content-Type", "image/png")], length=False),
        "/loop1": lambda h, n: r(h, 302, headers=[("Location", "/loop2")]),
        "/loop2": lambda h, n: r(h, 302, headers=[("Location", "/loop1")]),
        "/moved.png": lambda h, n: r(h, 301, headers=[("Location", "/ok2.png")]),
        "/page.png": lambda h, n: r(h, 200, b"<html><body>not an image</body></html>", [("Content-Type", "image/png")]),
        "/noai.png": ok(6, [("X-Robots-Tag", "noai")]),
        "/caf%C3%A9.png": ok(7),  # asked for as /café.png: percent-encoded as UTF-8
        "/clip.mp4": lambda h, n: r(h, 200, _video(), [("Content-Type", "video/mp4")]),
    }


def _settings(**kw) -> IngestSettings:
    return IngestSettings(limits=MediaLimits(max_image_bytes=CAP), **kw)


def _rejects(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


def _count(requests, path: str) -> int:
    return sum(1 for p, _, _ in requests if p == path)


def test_obelics_each_url_kind_ends_as_documented_and_a_rebuild_fetches_nothing(tmp_path, route_server, routes, no_proxy):
    with route_server(routes) as (base, requests):
        u = lambda p: base + p  # noqa: E731
        docs = [
            {"texts": ["intro", None, "mid", None, "after", None, "end", None],
             "images": [None, u("/ok1.png"), None, u("/missing.png"), None, u("/flaky.png"), None, u("/busy.png")], "url": "https://page/1"},
            {"texts": ["a", None, "b", None, "c", None, "d", None, "e", None, "f", None, "g", None],
             "images": [None, u("/slow.png"), None, u("/big.png"), None, u("/big-nolen.png"), None, u("/loop1"), None, u("/page.png"),
                        None, u("/noai.png"), None, u("/moved.png")]},
            {"schema": 1, "segments": [{"type": "text", "text": "a clip:"}, {"type": "video", "path": u("/clip.mp4")}]},
        ]
        src = tmp_path / "src"
        src.mkdir()
        (src / "obelics.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        cache = tmp_path / "cache"
        opts = FetchOptions(workers=4, cache=str(cache), **FAST)
        summary = build([str(src)], str(tmp_path / "a"), progress=False, ingest=_settings(), fetch=opts)

        # each URL ends as the issue asks; the documents keep their other segments
        got = {r["ref"].removeprefix(base): r["code"] for r in _rejects(tmp_path / "a")}
        assert got == {"/missing.png": "http-404", "/slow.png": "timeout", "/big.png": "too-large", "/big-nolen.png": "too-large",
                       "/loop1": "redirect-loop", "/page.png": "not-an-image", "/noai.png": "opted-out"}
        assert all(r["action"] == "dropped-segment" for r in _rejects(tmp_path / "a"))
        by_text = {d["segments"][0]["text"]: d for _, d, _ in iter_documents(tmp_path / "a")}
        assert [s["type"] for s in by_text["intro"]["segments"]] == ["text", "image", "text", "text", "image", "text", "image"]
        assert [s.get("text") for s in by_text["a"]["segments"]] == ["a", "b", "c", "d", "e", "f", "g", None]
        assert [s["type"] for s in by_text["a clip:"]["segments"]] == ["text", "video"]
        media = by_text["a"]["meta"]["media"]
        assert [m["url"] for m in media.values()] == [u("/moved.png")]  # the URL given, whatever it redirected to
        assert summary["segments"]["image"] == 4 and summary["segments"]["video"] == 1
        assert summary["rejects"] == {"http-404": 1, "not-an-image": 1, "opted-out": 1, "redirect-loop": 1, "timeout": 1, "too-large": 2}
        fig = summary["fetch"]
        assert fig["fetched"] == 6 and fig["cached"] == 0 and sum(fig["failed"].values()) == 6 and fig["bytes"] > 0
        held = cache_stats(str(cache))  # `omniloom data fetch-stats`: every answer is cached, failures too
        assert held["ok"] == 6 and held["transient"] == 1 and held["bytes"] == fig["bytes"]
        assert held["failed"] == {"http-404": 1, "opted-out": 1, "redirect-loop": 1, "timeout": 1, "too-large": 2}

        # retries: 500 then 200, 429 waited its Retry-After, the timeout tried 1 + --fetch-retries times; the rest once
        counts = {p: _count(requests, p) for p in routes if p != "/caf%C3%A9.png"} | {"/missing.png": _count(requests, "/missing.png")}
        assert counts == {"/ok1.png": 1, "/ok2.png": 1, "/flaky.png": 2, "/busy.png": 2, "/slow.png": 2, "/big.png": 1,
                          "/big-nolen.png": 1, "/loop1": 1, "/loop2": 1, "/moved.png": 1, "/page.png": 1, "/noai.png": 1,
                          "/clip.mp4": 1, "/missing.png": 1}
        busy = [t for p, _, t in requests if p == "/busy.png"]
        assert busy[1] - busy[0] >= 0.95
        assert {h["User-Agent"] for _, h, _ in requests} == {user_agent()} and user_agent().startswith("omniloom/")

        # a rebuild from the same cache (2 workers, other fetch workers) fetches nothing and writes the same bytes
        before = len(requests)
        again = build([str(src)], str(tmp_path / "b"), progress=False, workers=2, ingest=_settings(), fetch=FetchOptions(workers=1, cache=str(cache)))
        assert len(requests) == before and again["fetch"]["fetched"] == 0 and again["fetch"]["cached"] == 12
        for name in ("data-000000.tar", "manifest.json", "rejects.jsonl"):
            assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name

        # --fetch-ignore-robots-tag asks the opted-out URL again and keeps it; --fetch-retry-transient the timeout
        ignore = build([str(src)], str(tmp_path / "c"), progress=False, ingest=_settings(),
                       fetch=FetchOptions(cache=str(cache), honour_robots=False, retry_transient=True, **FAST))
        assert len(requests) == before + 1 + 2 and _count(requests, "/noai.png") == 2
        assert "opted-out" not in ignore["rejects"] and ignore["rejects"]["timeout"] == 1
        assert read_manifest(tmp_path / "c")["settings"]["fetch_media"] == {"x_robots_tag": "ignore"}
        assert read_manifest(tmp_path / "a")["settings"]["fetch_media"] == {"x_robots_tag": "honour"}


KINDS = ["/ok1.png", "/missing.png", "/flaky.png", "/busy.png", "/slow.png", "/big.png", "/big-nolen.png", "/loop1", "/page.png",
         "/noai.png", "/moved.png"]
ENDS = {"/missing.png": "http-404", "/slow.png": "timeout", "/big.png": "too-large", "/big-nolen.png": "too-large",
        "/loop1": "redirect-loop", "/page.png": "not-an-image", "/noai.png": "opted-out"}


@pytest.mark.parametrize("layout", ["mmc4", "parquet"])
def test_every_url_kind_in_the_other_layouts(layout, tmp_path, route_server, routes, no_proxy):
    """The OBELICS test's URL kinds in an MMC4 record (one image per sentence) and a url + caption
    parquet (one row per URL): the same ends, the same requests."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    with route_server(routes) as (base, requests):
        if layout == "mmc4":
            src = tmp_path / "mmc4.jsonl"
            src.write_text(json.dumps({"text_list": [f"sentence {i}." for i in range(len(KINDS))],
                                       "image_info": [{"raw_url": base + p, "matched_text_index": i} for i, p in enumerate(KINDS)]}) + "\n")
        else:
            src = tmp_path / "urls.parquet"
            pq.write_table(pa.table({"url": [base + p for p in KINDS], "caption": [f"caption {p}" for p in KINDS]}), src)
        summary = build([str(src)], str(tmp_path / "out"), progress=False, ingest=_settings(), fetch=FetchOptions(workers=4, **FAST))
        counts = {p: _count(requests, p) for p in KINDS}
    if layout == "mmc4":
        got = {r["ref"].removeprefix(base): r["code"] for r in _rejects(tmp_path / "out")}
        [(_, doc, _)] = list(iter_documents(tmp_path / "out"))
        assert sum(s["type"] == "image" for s in doc["segments"]) == 4 and len(doc["segments"]) == 4 + len(KINDS)  # every sentence kept
    else:
        got = {KINDS[int(r["path"].rsplit(":", 1)[1]) - 1]: r["code"] for r in _rejects(tmp_path / "out")}
        assert sorted(d["segments"][-1]["text"] for _, d, _ in iter_documents(tmp_path / "out")) == sorted(
            f"caption {p}" for p in KINDS if p not in ENDS)
    assert got == ENDS and summary["segments"]["image"] == 4
    assert counts == {p: 2 if p in ("/flaky.png", "/busy.png", "/slow.png") else 1 for p in KINDS}


def test_mmc4_images_go_before_their_sentence(tmp_path, route_server, routes, no_proxy, capsys):
    from omniloom.data.cli import main

    with route_server(routes) as (base, requests):
        rec = {"url": "https://page", "text_list": ["First.", "Second.", "Third."],
               "image_info": [{"raw_url": base + "/ok1.png", "matched_text_index": 1, "matched_sim": 0.3},
                              {"raw_url": base + "/missing.png", "matched_text_index": 0, "matched_sim": 0.2}]}
        (tmp_path / "mmc4.jsonl").write_text(json.dumps(rec) + "\n")
        out = tmp_path / "out"
        assert main(["build", str(tmp_path / "mmc4.jsonl"), "--out", str(out), "--fetch-media", "--fetch-timeout", "2"]) == 0
    [(_, doc, members)] = list(iter_documents(out))
    assert [(s["type"], s.get("text")) for s in doc["segments"]] == [("text", "First."), ("image", None), ("text", "Second. Third.")]
    assert doc["meta"]["image_info"][0]["matched_sim"] == 0.3 and doc["meta"]["url"] == "https://page"
    printed = capsys.readouterr().out
    assert "rejected: 1 (http-404 1)" in printed
    assert "fetch: 1 URLs fetched" in printed and "0 from the cache, 1 failed (http-404 1)" in printed
    assert (out / ".fetch-cache").is_dir()  # the default cache lives in --out
    assert main(["fetch-stats", str(out)]) == 0
    assert "2 URLs: 1 fetched" in capsys.readouterr().out
    # without --fetch-media a URL stays a remote-ref reject whose reason names the flag
    assert main(["build", str(tmp_path / "mmc4.jsonl"), "--out", str(tmp_path / "plain"), "--allow-dropped-media"]) == 0
    assert {r["code"] for r in _rejects(tmp_path / "plain")} == {"remote-ref"} and "--fetch-media" in _rejects(tmp_path / "plain")[0]["reason"]


def test_parquet_url_caption_rows(tmp_path, route_server, routes, no_proxy):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with route_server(routes) as (base, requests):
        paths = ["/ok1.png", "/missing.png", "/clip.mp4", "/noai.png", "/page.png", "/ok2.png", "/caf\u00e9.png"]
        pq.write_table(pa.table({"URL": [base + p for p in paths], "caption": [f"caption {i}" for i in range(len(paths))],
                                 "similarity": [0.1 * i for i in range(len(paths))]}), tmp_path / "laion.parquet")
        summary = build([str(tmp_path / "laion.parquet")], str(tmp_path / "out"), progress=False, ingest=_settings(),
                        fetch=FetchOptions(**FAST))
        without = build([str(tmp_path / "laion.parquet")], str(tmp_path / "plain"), progress=False, ingest=_settings())
    docs = {d["segments"][-1]["text"]: d for _, d, _ in iter_documents(tmp_path / "out")}
    assert sorted(docs) == ["caption 0", "caption 2", "caption 5", "caption 6"]
    assert [s["type"] for s in docs["caption 2"]["segments"]] == ["video", "text"]
    assert [s["type"] for s in docs["caption 0"]["segments"]] == ["image", "text"] and docs["caption 0"]["meta"]["similarity"] == 0.0
    assert summary["rejects"] == {"http-404": 1, "not-an-image": 1, "opted-out": 1}
    assert {r["action"] for r in _rejects(tmp_path / "out")} == {"dropped-doc"}  # a pair's medium is its point
    # without --fetch-media the file reads as before: captions with their URL in meta, nothing fetched
    assert without["segments"]["image"] == 0 and without["documents"] == len(paths) and "fetch" not in without


def test_parquet_url_lists_and_obelics_rows(tmp_path, route_server, routes, no_proxy):
    import pyarrow as pa
    import pyarrow.parquet as pq

    with route_server(routes) as (base, requests):
        (tmp_path / "src").mkdir()
        pq.write_table(pa.table({"images": [[base + "/ok1.png", base + "/missing.png", base + "/ok2.png"]], "text": ["three pictures"]}),
                       tmp_path / "src" / "lists.parquet")
        pq.write_table(pa.table({"texts": [["before", None, "after"]], "images": [[None, base + "/ok1.png", None]]}),
                       tmp_path / "src" / "obelics.parquet")
        summary = build([str(tmp_path / "src")], str(tmp_path / "out"), progress=False, ingest=_settings(), fetch=FetchOptions(**FAST))
    docs = {d["segments"][-1]["text"]: d for _, d, _ in iter_documents(tmp_path / "out")}
    assert [s["type"] for s in docs["three pictures"]["segments"]] == ["image", "image", "text"]  # the 404 dropped, the rest kept
    assert [s["type"] for s in docs["after"]["segments"]] == ["text", "image", "text"]
    assert summary["rejects"] == {"http-404": 1} and summary["fetch"]["fetched"] == 2  # ok1.png asked once for both files


def test_killed_build_resumes_without_fetching_twice(tmp_path, route_server, http_reply, check_kill_and_resume, no_proxy):
    routes = {f"/{i}.png": (lambda i: lambda h, n: http_reply(h, 200, _png(10 + i)))(i) for i in range(10)}
    with route_server(routes) as (base, requests):
        src = tmp_path / "src"
        src.mkdir()
        (src / "docs.jsonl").write_text("".join(json.dumps({"texts": [f"doc {i}", None], "images": [None, f"{base}/{i}.png"]}) + "\n"
                                                for i in range(10)))
        check_kill_and_resume(src, always=("--fetch-media", "--fetch-workers", "2"))
        # the whole build and the killed + resumed one (each with its cache in its --out) fetched each URL once
        assert sorted(p for p, _, _ in requests) == sorted([f"/{i}.png" for i in range(10)] * 2)


def _short_body(h, n):
    """Content-Length says more than is sent before the connection closes."""
    h.send_response(200)
    h.send_header("Content-Length", "5000")
    h.end_headers()
    h.wfile.write(_png(8)[:12])  # the handler returns: an HTTP/1.0 connection closes


def _trickle(h, n):
    """A byte every 0.1 s: no single wait reaches --fetch-timeout."""
    h.send_response(200)
    h.send_header("Content-Length", "200")
    h.end_headers()
    try:
        for _ in range(60):
            h.wfile.write(b"x")
            h.wfile.flush()
            time.sleep(0.1)
    except OSError:  # the client gave up
        pass


def test_a_short_body_a_trickle_and_a_url_used_as_image_and_video(tmp_path, route_server, http_reply, no_proxy):
    from omniloom.data.prep.fetch import Fetcher

    both = b"\x00" * (3 * CAP)
    routes = {"/short.png": _short_body, "/trickle.png": _trickle, "/both": lambda h, n: http_reply(h, 200, both)}
    opts = FetchOptions(workers=2, timeout=1.0, deadline=0.8, retries=1, backoff=0.05, cache=str(tmp_path / "cache"))
    with route_server(routes) as (base, requests):
        f = Fetcher(opts, opts.cache, MediaLimits(max_image_bytes=CAP))
        try:
            short = f.submit(base + "/short.png", "image").result()
            t0 = time.monotonic()
            trickle = f.submit(base + "/trickle.png", "image").result()
            took = time.monotonic() - t0
            as_image, as_video = f.submit(base + "/both", "image"), f.submit(base + "/both", "video")
            assert as_image is not as_video  # each kind is answered under its own size limit
            as_image, as_video = as_image.result(), as_video.result()
        finally:
            f.close()
    # a body cut short is a retried connection-error, cached as a transient failure, never as an answer
    assert short[:2] == ("fail", "connection-error") and "after 12 of its 5000 bytes" in short[2], short
    assert _count(requests, "/short.png") == 2
    # a trickle ends at --fetch-deadline, once (trying again would hold the build up as long again)
    assert trickle[:2] == ("fail", "timeout") and "--fetch-deadline 0.8s" in trickle[2], trickle
    assert _count(requests, "/trickle.png") == 1 and took < 3.0
    assert as_image[:2] == ("fail", "too-large") and as_video[0] == "ok" and as_video[3] == len(both)
    held = cache_stats(opts.cache)  # the body the video use fetched stays, whichever answer came last
    assert held["failed"] == {"connection-error": 1, "timeout": 1} and held["transient"] == 2 and held["ok"] == 1


def test_a_fetch_cache_that_cannot_be_written_stops_the_build_in_one_line(tmp_path, route_server, routes, no_proxy, monkeypatch,
                                                                         capsys):
    import sqlite3

    from omniloom.pretrain.cli import main

    real_connect = sqlite3.connect

    class Full:  # an index on a disk that filled up: every write fails
        def __init__(self, *a, **kw):
            self.db = real_connect(*a, **kw)

        def execute(self, query, args=()):
            if query.startswith("INSERT"):
                raise sqlite3.OperationalError("database or disk is full")
            return self.db.execute(query, args)

        def close(self):
            self.db.close()

    with route_server(routes) as (base, requests):
        src = tmp_path / "src"
        src.mkdir()
        (src / "docs.jsonl").write_text(json.dumps({"texts": ["a", None], "images": [None, base + "/ok1.png"]}) + "\n")
        argv = ["-q", "data", "build", str(src), "--out", str(tmp_path / "out"), "--fetch-media", "--max-image-bytes", str(CAP)]
        with monkeypatch.context() as m:
            m.setattr(sqlite3, "connect", Full)
            assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "the fetch cache" in err[0] and "database or disk is full" in err[0], err
        assert not (tmp_path / "out" / "manifest.json").exists()
        # the same build with a working cache; then --fetch-retry-transient on the finished build says to add --overwrite
        assert main(argv) == 0 and (tmp_path / "out" / "manifest.json").exists()
        capsys.readouterr()
        assert main([*argv, "--fetch-retry-transient"]) == 0
        assert "already complete, so --fetch-retry-transient asks nothing: pass --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("values, opted", [
    (["noai"], ["noai"]), (["noimageai, nofollow"], ["noimageai"]), (["noindex"], ["noindex"]), (["omniloom: noimageindex"], ["noimageindex"]),
    (["otherbot: noai"], []), (["none"], []), (["nofollow", "googlebot: noindex"], []), ([], []),
])
def test_x_robots_tag_rule_is_img2dataset_s(values, opted):
    assert robots_opt_out(values) == opted


def test_build_help_explains_the_flags(capsys):
    from omniloom.data.cli import main

    with pytest.raises(SystemExit):
        main(["build", "--help"])
    out = capsys.readouterr().out
    for flag in ("--fetch-media", "--fetch-workers", "--fetch-timeout", "--fetch-deadline", "--fetch-retries", "--fetch-cache",
                 "--fetch-ignore-robots-tag", "--fetch-retry-transient", "media by URL", "X-Robots-Tag", "redirect-loop"):
        assert flag in out, flag


def test_fetch_bench_prints_figures_and_says_when_img2dataset_is_skipped(no_proxy):
    from omniloom.data.prep.fetch_bench import run_fetch_bench

    report = run_fetch_bench(images=6, image_size=32, workers=2, latency_ms=0, repeats=1)
    assert "omniloom fetcher 6/6" in report and "build --fetch-media 6/6 images" in report
    assert "img2dataset skipped: pass --img2dataset PATH" in report
