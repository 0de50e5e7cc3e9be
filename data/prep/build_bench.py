"""`omniloom bench data`: data-build throughput on a generated corpus, for several worker counts.

Prints docs/s and MB/s (shard bytes written per second) per worker count and the speedup over the
first count, measured in the same run, and checks the shards are byte-identical across counts.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time


def make_bench_corpus(root: str, *, docs: int, image_size: int) -> int:
    """Write about `docs` inputs (40% prose, 20% code, 30% images, 5% videos, 5% interleaved) and
    return how many were written."""
    from .synth import make_good_corpus

    rounds = max(1, docs // 40)
    per = max(1, docs // rounds)
    n_img = max(1, per * 30 // 100)
    n_vid = max(1, per * 5 // 100)
    n_text = max(1, per - n_img - n_vid - 8 - 3)
    total = 0
    for r in range(rounds):
        written = make_good_corpus(os.path.join(root, f"r{r:03d}"), n_text=n_text, n_images=n_img, n_videos=n_vid,
                                   image_size=(image_size, image_size * 3 // 4), seed=r)
        total += sum(len(v) for v in written.values())
    return total


def _digest(out: str) -> str:
    h = hashlib.sha256()
    for f in sorted(os.listdir(out)):
        if f.endswith(".tar") or f == "manifest.json":
            with open(os.path.join(out, f), "rb") as fh:
                h.update(f.encode() + fh.read())
    return h.hexdigest()


def run_bench(*, docs: int = 240, workers: list[int] = (1, 2), image_size: int = 256, keep: str | None = None) -> str:
    """Generate a corpus, build it once per worker count, and return the report as text."""
    from .shards import build

    base = keep or tempfile.mkdtemp(prefix="omniloom-bench-data-")
    try:
        corpus = os.path.join(base, "corpus")
        shutil.rmtree(corpus, ignore_errors=True)
        t0 = time.perf_counter()
        n_inputs = make_bench_corpus(corpus, docs=docs, image_size=image_size)
        gen_s = time.perf_counter() - t0
        rows, digests = [], set()
        for w in workers:
            out = os.path.join(base, f"out-w{w}")
            shutil.rmtree(out, ignore_errors=True)
            t = time.perf_counter()
            s = build([corpus], out, workers=w, shard_max_docs=64, progress=False)
            secs = time.perf_counter() - t
            rows.append((w, s["documents"], s["bytes"], secs))
            digests.add(_digest(out))
        ref = rows[0][1] / rows[0][3]
        lines = [
            f"corpus: {n_inputs} inputs generated in {gen_s:.1f}s (images {image_size}px, 8-frame 32x32 videos), {os.cpu_count()} CPUs",
            f"{'workers':>8}{'docs':>8}{'MB':>9}{'seconds':>9}{'docs/s':>9}{'MB/s':>8}{'speedup':>9}",
        ]
        for w, d, b, secs in rows:
            lines.append(f"{w:>8}{d:>8}{b / 1e6:>9.2f}{secs:>9.2f}{d / secs:>9.1f}{b / secs / 1e6:>8.2f}{(d / secs) / ref:>8.2f}x")
        lines.append("shards byte-identical across worker counts: " + ("yes" if len(digests) == 1 else "NO (bug)"))
        return "\n".join(lines)
    finally:
        if not keep:
            shutil.rmtree(base, ignore_errors=True)


def compare_builds(base: str, cases: list[tuple[str, str, tuple[int, float], str]], *, workers: int, inputs: str) -> str:
    """Build each case's source into `base`, timed, and return the table of docs/s against its
    reference. A case is (label, reference name, (documents the reference read, its seconds),
    source): the caller times the reference in the same run, reading the same inputs with their own
    library alone. `inputs` is the line that says what was generated."""
    from .shards import build

    lines = [f"{inputs}; {os.cpu_count()} CPUs, build --workers {workers}",
             f"{'input':<34}{'reference':>24}{'ref docs/s':>12}{'build docs/s':>14}{'build/ref':>11}"]
    for i, (label, refname, (n_ref, ref_s), src) in enumerate(cases):
        out = os.path.join(base, f"out-{i}")
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        docs = build([src], out, workers=workers, progress=False)["documents"]
        secs = time.perf_counter() - t
        lines.append(f"{label:<34}{refname:>24}{n_ref / ref_s:>12.1f}{docs / secs:>14.1f}{(docs / secs) / (n_ref / ref_s):>10.2f}x")
        if docs != n_ref:
            lines.append(f"  (the build wrote {docs} documents of {n_ref} inputs: see {out}/rejects.jsonl)")
    return "\n".join(lines)
