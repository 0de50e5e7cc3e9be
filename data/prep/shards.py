"""`omniloom data build`: deterministic, parallel, resumable shard writing (docs/data-format.md section 1).

How the guarantees are met:
- Deterministic: units are discovered in sorted order and processed by a pure function; workers
  only compute, the main process consumes results strictly in unit order (sorted, or with
  `--shuffle SEED` ordered by a hash of the seed and each unit's key) and alone decides
  duplicates and shard boundaries; tar headers are fixed (mtime 0, uid/gid 0, mode 0644, USTAR).
  So the bytes do not depend on `--workers`.
- Resumable: each shard is written to `NAME-000000.tar.tmp`, fsynced, renamed, and only then a
  line is appended to the build journal (`.build-journal.jsonl`) recording the shard entry, the
  unit span it consumed, its rejects and the duplicate fingerprints it added. A rerun replays the
  journal and continues at the first unconsumed unit; a half-written `.tmp` is discarded. The
  manifest is written last (atomically), so no half-written shard is ever listed.
- Scale-out: `--part I/N` keeps the units whose key hash is I mod N (stable, balanced), names its
  shards `NAME-pIIII-000000.tar`, and `omniloom data merge` joins the parts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import tarfile
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace

from omniloom.data.manifest import FORMAT, MANIFEST, REJECTS, VERSION, fsync_dir, read_manifest, write_json_atomic
from omniloom.data.outlock import OutputLock
from omniloom.data.progress import bar_wanted, hms

from .fetch import CACHE_DIR, FetchFiller, Fetcher
from .foreign import is_remote
from .ingest import discover, process_unit
from .units import IngestSettings, Unit
from .validate import json_safe, printable

log = logging.getLogger(__name__)

JOURNAL = ".build-journal.jsonl"
TAR_MTIME = 0
_RECORD = tarfile.RECORDSIZE  # 10240: tar files are padded to whole records
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
# Test hook: seconds to sleep after each written sample, so the kill -9 test can interrupt a build
# mid-shard deterministically. Never set in normal use.
_PAUSE_ENV = "OMNILOOM_TEST_BUILD_PAUSE"


def _blocks(n: int) -> int:
    return (n + 511) // 512 * 512


class DeterministicTarWriter:
    """Writes samples to a tar with fixed headers, tracking offsets and a running sha256."""

    def __init__(self, path: str):
        self.path = path
        self.f = open(path, "wb")
        self.sha = hashlib.sha256()
        self.size = 0
        self.samples: list[dict] = []

    def _write(self, data: bytes) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data)

    @staticmethod
    def sample_bytes(members: list[tuple[str, bytes]]) -> int:
        return sum(512 + _blocks(len(d)) for _, d in members)

    def add_sample(self, key: str, members: list[tuple[str, bytes]]) -> None:
        """Append one sample; `members` are (suffix, bytes) with doc.json first."""
        self.samples.append({"key": key, "offset": self.size})
        for suffix, data in members:
            info = tarfile.TarInfo(f"{key}.{suffix}")
            info.size, info.mtime, info.mode = len(data), TAR_MTIME, 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            self._write(info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict"))
            self._write(data)
            self._write(b"\0" * (_blocks(len(data)) - len(data)))

    def finish(self) -> tuple[int, str]:
        """End-of-archive blocks, pad to a whole record, fsync, close; return (bytes, sha256)."""
        end = self.size + 1024
        self._write(b"\0" * (end + (-end) % _RECORD - self.size))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        return self.size, self.sha.hexdigest()


def final_size(content: int) -> int:
    """Size of a tar whose samples take `content` bytes, after end blocks and record padding."""
    end = content + 1024
    return end + (-end) % _RECORD


# --- workers ---------------------------------------------------------------------------------

_WORKER_SETTINGS: IngestSettings | None = None


def _init_worker(settings: IngestSettings) -> None:
    global _WORKER_SETTINGS
    _WORKER_SETTINGS = settings
    logging.getLogger().setLevel(logging.WARNING)


def _process_chunk(units: list[Unit]) -> list[dict]:
    return [process_unit(u, _WORKER_SETTINGS) for u in units]


def iter_results(units: list[Unit], settings: IngestSettings, workers: int, *, chunk: int = 8, fetcher=None):
    """Yield process_unit results in unit order, computed by `workers` processes with a bounded
    number of chunks in flight (back-pressure: memory stays flat on big media).

    A worker that dies (a decoder segfault, the OOM killer) breaks the pool: the chunk at the head
    is then re-run one unit per single-use process, so the input that crashes becomes a counted
    reject instead of ending the build, and the pool is restarted for the rest. `fetcher`
    (--fetch-media, fetch.Fetcher): each input's media URLs are answered before it is handed out,
    the next inputs' fetched meanwhile (fetch.FetchFiller)."""
    from .foreign import PayloadFiller
    from .parquet import ParquetFiller

    filler = ParquetFiller(settings, PayloadFiller(settings))  # compressed inputs and parquet row groups are read here, once
    if fetcher is not None:
        filler = FetchFiller(filler, units, fetcher, settings)
    if workers <= 1:
        try:
            for u in units:
                yield process_unit(filler.fill([u])[0], settings)
        finally:
            filler.close()
        return

    def new_pool():
        return ProcessPoolExecutor(workers, initializer=_init_worker, initargs=(settings,))

    ex = new_pool()
    if fetcher is not None:
        ex.submit(int).result()  # the workers are forked now, before the fetch threads start
    pending: deque = deque()  # (units with their payloads, future)
    pos = 0
    try:
        while pos < len(units) or pending:
            while pos < len(units) and len(pending) < workers * 4:
                end = min(len(units), pos + chunk)
                part = filler.fill(units[pos:end])
                pending.append((part, ex.submit(_process_chunk, part)))
                pos = end
            part, fut = pending.popleft()
            try:
                results = fut.result()
            except BrokenProcessPool:
                ex.shutdown(wait=True, cancel_futures=True)
                log.warning("a worker process died; re-running inputs %s..%s one by one to find the culprit", part[0].display, part[-1].display)
                results = [_isolated(u, settings) for u in part]
                ex = new_pool()
                pending = deque((p, ex.submit(_process_chunk, p)) for p, _ in pending)
            yield from results
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
        filler.close()


def _isolated(unit: Unit, settings: IngestSettings) -> dict:
    """process_unit in a single-use process; a crash becomes a reject."""
    with ProcessPoolExecutor(1, initializer=_init_worker, initargs=(settings,)) as one:
        try:
            return one.submit(_process_chunk, [unit]).result()[0]
        except BrokenProcessPool:
            return {
                "key": unit.key, "doc": None, "members": [], "fingerprint": "", "stats": {},
                "rejects": [{"path": unit.display, "code": "worker-crash", "action": "dropped-doc",
                             "reason": "decoding this input killed the worker process (decoder crash or out of memory); inspect or remove the file"}],
            }


# --- the build -------------------------------------------------------------------------------


def shuffled_units(units, seed: int) -> list[int]:
    """The order `--shuffle SEED` writes `units` in: by a hash of (seed, the unit's key), so it
    depends on nothing but the seed and each input's identity (no library's random stream; an
    input added later does not move the others relative to each other).

    Why: a training rank reads a contiguous range of each epoch's shard sequence (data/stream/loader.py),
    so inputs that arrive grouped (a folder of images, then one of videos) give one rank long runs
    of one kind and the ranks unequal work; shuffled before sharding, every range is a sample of
    the whole."""
    digest = [hashlib.sha256(f"{seed}:{u.key}".encode()).digest() for u in units]
    return sorted(range(len(units)), key=digest.__getitem__)


def parse_part(text: str) -> tuple[int, int]:
    """'I/N' -> (I, N) with 0 <= I < N (0-based, like SLURM_ARRAY_TASK_ID)."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text or "")
    if not m or not (0 <= int(m.group(1)) < int(m.group(2))):
        raise ValueError(f"--part must be I/N with 0 <= I < N (0-based, e.g. 0/4 ... 3/4), got {text!r}")
    return int(m.group(1)), int(m.group(2))


def shard_name(name: str, part: tuple[int, int], index: int) -> str:
    return f"{name}-{index:06d}.tar" if part[1] == 1 else f"{name}-p{part[0]:04d}-{index:06d}.tar"


def build(
    sources: list[str],
    out: str,
    *,
    name: str = "data",
    workers: int = 1,
    part: tuple[int, int] = (0, 1),
    shard_max_docs: int = 10_000,
    shard_max_bytes: int = 1 << 30,
    dedup: bool = True,
    ingest: IngestSettings | None = None,
    standalone_referenced: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    progress_seconds: float = 30.0,
    include_hidden: bool = False,
    shuffle: int | None = None,
    fetch=None,
) -> dict:
    """Build (or resume) a shard directory `out` from `sources`; return a summary dict with
    documents, shards, rejects by code, duplicates, bytes, seconds, whether it resumed and the
    hidden and cache files/folders discovery skipped. `progress`: a bar on a terminal, else a log
    line every `progress_seconds` (0: none). `shuffle`: write the documents in an order drawn from
    this seed (`shuffled_units`) instead of the sorted input order. `fetch` (fetch.FetchOptions,
    --fetch-media): media given by http(s) URL are downloaded (into `fetch.cache`, default
    OUT/.fetch-cache) and built like local media; the summary's `fetch` holds the figures."""
    ingest = ingest or IngestSettings()
    if fetch is not None:
        ingest = replace(ingest, fetch_media=True)  # parquet url columns are media (parquet.plan_columns)
    if not _NAME_RE.match(name):
        raise ValueError(f"--name must use letters, digits, '-' and '_' only, got {name!r}")
    if shard_max_docs < 1 or shard_max_bytes < 64 * 1024:
        raise ValueError("--shard-docs must be >= 1 and --shard-size >= 64 KiB")
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    t0 = time.perf_counter()
    os.makedirs(out, exist_ok=True)
    # Held for the whole build, before anything in `out` is read or removed (--overwrite too).
    with OutputLock(out, f"data build into {out}"):
        return _build_locked(sources, out, name=name, workers=workers, part=part, shard_max_docs=shard_max_docs,
                             shard_max_bytes=shard_max_bytes, dedup=dedup, ingest=ingest,
                             standalone_referenced=standalone_referenced, overwrite=overwrite, progress=progress,
                             progress_seconds=progress_seconds, include_hidden=include_hidden, shuffle=shuffle, fetch=fetch, t0=t0)


def _build_locked(sources, out, *, name, workers, part, shard_max_docs, shard_max_bytes, dedup, ingest,
                  standalone_referenced, overwrite, progress, progress_seconds, include_hidden, shuffle, fetch, t0) -> dict:
    settings = {
        "sources": [printable(s if is_remote(s) else os.path.normpath(s)) for s in sources],  # a URL keeps its '//'
        "name": name,
        "part": list(part),
        "shard_max_docs": shard_max_docs,
        "shard_max_bytes": shard_max_bytes,
        "dedup": dedup,
        "standalone_referenced": standalone_referenced,
        **({"include_hidden": True} if include_hidden else {}),  # absent by default: older builds still resume
        **({"shuffle": shuffle} if shuffle is not None else {}),
        **ingest.to_dict(),
        **({"fetch_media": fetch.settings()} if fetch is not None else {}),  # absent without --fetch-media: older builds resume
    }
    cache = (fetch.cache or os.path.join(out, CACHE_DIR)) if fetch is not None else ""  # discovery leaves it out
    skipped = Counter()
    units = discover(sources, exclude=[out, *([cache] if cache else [])], standalone_referenced=standalone_referenced,
                     max_text_bytes=ingest.text.max_bytes, undeclared_encoding=ingest.text.undeclared_encoding,
                     include_hidden=include_hidden, skipped=skipped,
                     parquet_columns=(ingest.text_column, ingest.image_columns, ingest.fetch_media))
    order = None  # part builds: each unit's index in the whole input set, for dedup across parts in `merge`
    whole = None
    if part[1] > 1:
        whole = {"units": len(units), "sha256": _set_digest(units)}
        order = [j for j, u in enumerate(units) if int(u.key, 16) % part[1] == part[0]]
        units = [units[j] for j in order]
    if shuffle is not None:
        from .foreign import _streamed

        packed = sorted({u.url or u.rel for u in units if _streamed(u)})
        if packed:
            raise ValueError(f"--shuffle needs to read inputs in any order, and compressed or remote inputs ({packed[0]}"
                             f"{f' and {len(packed) - 1} more' if len(packed) > 1 else ''}) can only be read front to back: "
                             "decompress them first (gunzip / zstd -d / xz -d keep the format) and download remote shards, "
                             "or build without --shuffle")
        rowgroups = sorted({u.rel for u in units if u.kind == "parquet"})
        if rowgroups:  # a row group is read whole: in shuffled order each row would read its group again
            raise ValueError(f"--shuffle reads inputs in any order, and parquet files ({rowgroups[0]}"
                             f"{f' and {len(rowgroups) - 1} more' if len(rowgroups) > 1 else ''}) are read a row group at a time: "
                             "build them without --shuffle, or write them shuffled (Dataset.shuffle(seed).to_parquet(...))")
        perm = shuffled_units(units, shuffle)
        units = [units[j] for j in perm]
        if order is not None:
            order = [order[j] for j in perm]
    log.info("found %d inputs%s in %.1fs", len(units), f" for part {part[0]}/{part[1]}" if part[1] > 1 else "", time.perf_counter() - t0)
    header = {"journal": 1, "settings": settings, "units": len(units), "units_sha256": _units_digest(units)}
    if whole is not None:
        header["set"] = whole
    if overwrite:
        _remove_outputs(out, name)
    elif os.path.exists(os.path.join(out, MANIFEST)) and not os.path.exists(os.path.join(out, JOURNAL)):
        man = read_manifest(out)
        if man.get("settings") != settings:
            raise ValueError(f"{out} already holds a finished build with different settings; choose another --out or pass --overwrite")
        if man.get("inputs") != _inputs(header):
            raise ValueError(f"{out} already holds a finished build, but the inputs changed since (files added, removed or resized); pass --overwrite to rebuild")
        if fetch is not None and fetch.retry_transient:  # the finished shards are not rebuilt: say how to ask again
            log.warning("%s is already complete, so --fetch-retry-transient asks nothing: pass --overwrite too to rebuild it "
                        "(the fetch cache keeps every fetched body: only the transient failures are asked again)", out)
        log.info("%s is already complete (same settings and inputs); nothing to do", out)
        return {"complete": True, "already": True, "documents": man["totals"]["documents"], "shards": len(man["shards"]), "seconds": 0.0}
    records = _open_journal(out, header)
    start = records[-1]["span"][1] if records else 0
    seen: dict[str, str] = {}
    for rec in records:
        seen.update(rec["fingerprints"])
    for leftover in os.listdir(out):
        if leftover.endswith(".tar.tmp"):
            os.unlink(os.path.join(out, leftover))
    shard_index = sum(1 for r in records if r["shard"])
    if start:
        log.info("resuming: %d shards done, continuing at input %d of %d", shard_index, start, len(units))

    journal = open(os.path.join(out, JOURNAL), "a", encoding="utf-8")
    state = _Span(start)
    writer: DeterministicTarWriter | None = None
    bar = _Progress(len(units) - start, enabled=progress, every=progress_seconds)
    pause = float(os.environ.get(_PAUSE_ENV, "0") or 0)
    fetcher = Fetcher(fetch, cache, ingest.limits) if fetch is not None else None
    try:
        for i, res in enumerate(iter_results(units[start:], ingest, workers, fetcher=fetcher), start=start):
            bar.update(res)
            rejects = res["rejects"]
            if res["doc"] is not None and dedup and res["fingerprint"] in seen:
                rejects = rejects + [{"path": printable(units[i].display), "code": "duplicate", "reason": f"exact duplicate of document {seen[res['fingerprint']]} (same prose up to whitespace, same code and media bytes)", "action": "dropped-doc"}]
                res["doc"] = None
            if res["doc"] is not None:
                doc_json = json.dumps(res["doc"], ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
                members = [("doc.json", doc_json), *res["members"]]
                size = DeterministicTarWriter.sample_bytes(members)
                if writer is not None and (len(writer.samples) >= shard_max_docs or final_size(writer.size + size) > shard_max_bytes):
                    _close_shard(writer, out, journal, state, end=i)
                    shard_index += 1
                    writer, state = None, _Span(i)
                if writer is None:
                    fname = shard_name(name, part, shard_index)
                    writer = DeterministicTarWriter(os.path.join(out, fname + ".tmp"))
                    state.shard_name = fname
                    if final_size(size) > shard_max_bytes:
                        log.warning("%s: one document (%d bytes) is larger than --shard-size; it gets a shard of its own", units[i].display, size)
                writer.add_sample(res["key"], members)
                if order is not None and dedup:
                    # What `merge` needs to drop duplicates across parts the way one build would:
                    # the content hash, and the input's place in the whole set (the first wins).
                    writer.samples[-1].update(fp=res["fingerprint"], unit=order[i])
                if pause:
                    writer.f.flush()
                    time.sleep(pause)
                if dedup:
                    seen[res["fingerprint"]] = res["key"]
                    state.fingerprints[res["fingerprint"]] = res["key"]
                state.add_stats(res)
            state.rejects.extend(rejects)
            state.notes.update(res.get("notes") or {})
        if writer is not None:
            _close_shard(writer, out, journal, state, end=len(units))
        elif len(units) > state.start:  # trailing inputs that were all rejected
            _append(journal, state.record(None, end=len(units)))
    except BaseException:
        if writer is not None:
            writer.f.close()  # leave the .tmp: a rerun deletes it and redoes this shard
        raise
    finally:
        journal.close()
        bar.close()
        if fetcher is not None:
            fetcher.close()
    fetched = {"fetch": fetcher.figures()} if fetcher is not None else {}
    return {**_finalize(out, header, settings, time.perf_counter() - t0, resumed=bool(start)), "skipped": dict(skipped), **fetched}


class _Span:
    """What one journal record covers: units [start, end), at most one shard."""

    def __init__(self, start: int):
        self.start = start
        self.shard_name = ""
        self.rejects: list[dict] = []
        self.fingerprints: dict[str, str] = {}
        self.segments = Counter()
        self.media_bytes = Counter()
        self.notes = Counter()  # decisions counted by ingest (unmapped members, animated images, media references)

    def add_stats(self, res: dict) -> None:
        self.segments.update(res["stats"]["segments"])
        self.media_bytes.update(res["stats"]["media_bytes"])

    def record(self, shard: dict | None, *, end: int) -> dict:
        return {
            "span": [self.start, end],
            "shard": shard,
            "segments": dict(self.segments),
            "media_bytes": dict(self.media_bytes),
            "rejects": self.rejects,
            "fingerprints": self.fingerprints,
            "notes": dict(self.notes),
        }


def _close_shard(writer: DeterministicTarWriter, out: str, journal, state: _Span, *, end: int) -> None:
    size, sha = writer.finish()
    final = os.path.join(out, state.shard_name)
    os.replace(writer.path, final)
    fsync_dir(out)
    shard = {"name": state.shard_name, "num_samples": len(writer.samples), "bytes": size, "sha256": sha, "samples": writer.samples}
    _append(journal, state.record(shard, end=end))


def _append(journal, record: dict) -> None:
    journal.write(json.dumps(json_safe(record), ensure_ascii=False, allow_nan=False, separators=(",", ":")) + "\n")
    journal.flush()
    os.fsync(journal.fileno())


def _units_digest(units: list[Unit]) -> str:
    """Identity of the input set: names, kinds, sidecars and sizes (not mtimes, so copies of a
    corpus on other machines match; not contents, which would mean reading everything twice)."""
    h = hashlib.sha256()
    for u in units:
        try:
            size = os.path.getsize(os.path.join(u.root, u.rel)) if u.kind not in ("jsonl", "wds") else u.length
        except OSError:
            size = -1
        h.update(f"{u.uid}\t{u.kind}\t{u.sidecar}\t{size}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _set_digest(units: list[Unit]) -> str:
    """Identity of the whole input set of a part build (names and kinds; no stat calls): parts that
    agree on it number their inputs alike, which `merge` relies on."""
    h = hashlib.sha256()
    for u in units:
        h.update(f"{u.uid}\t{u.kind}\n".encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def _inputs(header: dict) -> dict:
    """The manifest's `inputs`: this build's input count and digest (and for a part, the whole set's)."""
    inputs = {"units": header["units"], "sha256": header["units_sha256"]}
    if "set" in header:
        inputs["set"] = header["set"]
    return inputs


def _open_journal(out: str, header: dict) -> list[dict]:
    """Return the completed records of a matching journal (starting one if there is none).
    A torn last line (kill -9 mid-write) is dropped."""
    path = os.path.join(out, JOURNAL)
    if not os.path.exists(path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(json.dumps(header, allow_nan=False, separators=(",", ":")) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return []
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    good, records = 0, []
    try:
        old = json.loads(lines[0])
    except (json.JSONDecodeError, IndexError):
        old = None
    if old != header:
        what = "settings" if not old or old.get("settings") != header["settings"] else "inputs (files added, removed or changed)"
        raise ValueError(f"{out} holds an unfinished build with different {what}; rerun it with the original ones, pass --overwrite to start over, or use another --out")
    good = len(lines[0]) + 1
    for raw in lines[1:]:
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError:
            break
        records.append(rec)
        good += len(raw) + 1
    with open(path, "r+b") as f:  # cut a torn tail so later appends start on a clean line
        f.truncate(good)
    return records


def _remove_outputs(out: str, name: str) -> None:
    pat = re.compile(rf"^{re.escape(name)}-(p\d+-)?\d+\.tar(\.tmp)?$")
    for f in os.listdir(out):
        if pat.match(f) or f in (MANIFEST, REJECTS, JOURNAL, MANIFEST + ".tmp", REJECTS + ".tmp"):
            os.unlink(os.path.join(out, f))


def _finalize(out: str, header: dict, settings: dict, seconds: float, *, resumed: bool) -> dict:
    """Turn the journal into rejects.jsonl and manifest.json (atomically), then drop the journal."""
    path = os.path.join(out, JOURNAL)
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f.read().splitlines()[1:] if line]
    shards = [r["shard"] for r in records if r["shard"]]
    segments, media, codes, notes = Counter(), Counter(), Counter(), Counter()
    tmp = os.path.join(out, REJECTS + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            segments.update(r["segments"])
            media.update(r["media_bytes"])
            notes.update(r.get("notes", {}))
            for rej in r["rejects"]:
                codes[rej["code"]] += 1
                f.write(json.dumps(rej, ensure_ascii=False, allow_nan=False) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, REJECTS))
    totals = {
        "documents": sum(s["num_samples"] for s in shards),
        "bytes": sum(s["bytes"] for s in shards),
        "segments": {k: segments.get(k, 0) for k in ("text", "code", "image", "video")},
        "media_bytes": {k: media.get(k, 0) for k in ("image", "video")},
    }
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "name": settings["name"],
        "shards": shards,
        "totals": totals,
        "rejects": {"total": sum(codes.values()), "by_code": dict(sorted(codes.items()))},
        **({"notes": dict(sorted(notes.items()))} if notes else {}),
        "settings": settings,
        "inputs": _inputs(header),
    }
    write_json_atomic(os.path.join(out, MANIFEST), manifest)
    os.unlink(path)
    fsync_dir(out)
    return {
        "complete": True,
        "already": False,
        "resumed": resumed,
        "units": header["units"],
        "documents": totals["documents"],
        "shards": len(shards),
        "bytes": totals["bytes"],
        "segments": totals["segments"],
        "rejects": dict(sorted(codes.items())),
        "notes": dict(sorted(notes.items())),
        "seconds": seconds,
    }


class _Progress:
    """Progress over inputs: a tqdm bar with docs/s and MB/s when stderr is a terminal that reports
    a width, otherwise (a log file, a pipe, a Slurm job) one log line every `every` seconds with the
    inputs done, documents, docs/s, MB/s and the time left, as training does (0: none)."""

    def __init__(self, total: int, *, enabled: bool, every: float = 30.0):
        self.bar = None
        self.total, self.every, self.enabled = total, every, enabled
        if enabled and bar_wanted(sys.stderr):
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="input", desc="build", file=sys.stderr, dynamic_ncols=True)
        self.done = 0
        self.docs = 0
        self.bytes = 0
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.last_line = self.t0

    def update(self, res: dict) -> None:
        self.done += 1
        if res["doc"] is not None:
            self.docs += 1
            self.bytes += sum(len(d) for _, d in res["members"])
        now = time.perf_counter()
        if self.bar is None:
            if self.enabled and self.every > 0 and now - self.last_line >= self.every:
                self.last_line = now
                log.info("%s", self.line(now))
            return
        self.bar.update(1)
        if now - self.last > 0.5:
            self.last = now
            self._postfix(now)

    def line(self, now: float) -> str:
        el = max(1e-9, now - self.t0)
        left = (self.total - self.done) * el / self.done if self.done else 0.0
        return (f"build: {self.done:,}/{self.total:,} inputs ({100 * self.done / max(self.total, 1):.0f}%), "
                f"{self.docs:,} documents, {self.docs / el:.1f} docs/s, {self.bytes / el / 1e6:.2f} MB/s, "
                f"elapsed {hms(el)}, left ~{hms(left)}")

    def _postfix(self, now: float) -> None:
        el = max(1e-9, now - self.t0)
        self.bar.set_postfix_str(f"{self.docs / el:.1f} docs/s, {self.bytes / el / 1e6:.2f} MB/s", refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self._postfix(time.perf_counter())
            self.bar.close()
