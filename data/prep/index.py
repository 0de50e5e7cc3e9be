"""`omniloom data index`: foreign WebDataset shards trained on in place, without a copy (issue 38
item 2; docs/data-format.md, "In place: `omniloom data index`").

The index is a manifest the stream reader reads (`kind: "index"`): for each shard its path or URL,
size and mtime, and for each sample its key, the byte offset of its first header and its members
(extension and size) as the headers give them. Nothing is copied and, by default, no member data is
read: local shards are scanned header by header (tarfile seeks over the data), remote ones
(http(s), `pipe:`) streamed once. The stream then reads each sample by offset and maps its members
to a document with the build's own rules (data/wds.py), checking the headers it meets against the
index (a changed shard is skipped and counted, never misread).

`--validate` reads every sample and runs the build's processing on it (data/prep/ingest.py:
`process_unit`: the same decoding, media validation and exact dedup as `omniloom data build`):
what the build would reject is left out with its reject line, and so is a sample whose build copy
would differ from what the stream makes of it in place (a converted still, an animated image made a
video, a caption in a detected legacy encoding), so an indexed set trains on the documents a build
of it holds. Compressed tars have no byte offsets: they are refused, naming `data build`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tarfile
import time
from collections import Counter

from omniloom.data import wds
from omniloom.data.manifest import FORMAT, MANIFEST, REJECTS, VERSION, write_json_atomic

from .foreign import expand_sources, is_remote, is_tar_name
from .textcorpus import split_compression
from .units import IngestSettings, Unit

log = logging.getLogger(__name__)

_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"))


def find_shards(sources: list[str], skipped: Counter | None = None) -> list[str]:
    """The shards named by `sources` (tar files, brace patterns, folders walked for `.tar` files in
    sorted order, URLs), in order. A compressed tar anywhere refuses the whole index, in one line
    naming `data build`; so does an omniloom build folder (it has its own manifest). The other
    files of a walked folder are counted in `skipped`: `shard-metadata` (img2dataset's and
    video2dataset's `NNNNN_stats.json` / `NNNNN.parquet` beside `NNNNN.tar`), `not-a-shard` (the rest)."""
    from .sniff import shard_metadata_file

    skipped = Counter() if skipped is None else skipped
    shards = []
    for src in expand_sources(sources):
        if is_remote(src):
            shards.append(src)
        elif os.path.isdir(src):
            if os.path.exists(os.path.join(src, MANIFEST)):
                raise ValueError(f"'{src}' holds a manifest.json: it is an omniloom shard folder (or an index) already; "
                                 "set data.sources to it directly")
            found = []
            for root, dirs, files in os.walk(src):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                names = sorted(f for f in files if not f.startswith("."))
                found += [os.path.join(root, f) for f in names if is_tar_name(f)]
                nameset = set(names)
                for f in names:
                    if not is_tar_name(f):
                        skipped["shard-metadata" if shard_metadata_file(f, nameset) else "not-a-shard"] += 1
            if not found:
                raise ValueError(f"'{src}' holds no .tar shards; `omniloom data index` reads WebDataset shards "
                                 "(img2dataset, video2dataset, webdataset.TarWriter)")
            shards += found
        elif os.path.isfile(src):
            shards.append(src)
        else:
            raise FileNotFoundError(f"'{src}': no such file or folder (quote a brace pattern so the shell leaves it)")
    for shard in shards:
        _refuse_compressed(shard)
    if not shards:
        raise ValueError("no shards to index")
    return shards


def _refuse_compressed(shard: str) -> None:
    kind = split_compression(shard.split("?")[0])[1]
    if not kind and not is_remote(shard):
        with open(shard, "rb") as f:
            head = f.read(tarfile.BLOCKSIZE)
        try:  # a first block that is a tar header is a tar, whatever its first bytes spell
            tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape")
        except tarfile.HeaderError:
            kind = next((k for magic, k in _MAGIC if head.startswith(magic)), "")
    if kind:
        raise ValueError(f"'{shard}' is {kind}-compressed: its samples have no byte offsets to read in place; copy it with "
                         f"`omniloom data build {shard} --out DIR` (which reads compressed shards front to back), or decompress it "
                         "and index that")


class _Counting:
    """A read-only stream that counts the bytes read through it (a remote shard's size)."""

    def __init__(self, f):
        self.f, self.n = f, 0

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.n += len(data)
        return data


def _scan(shard: str, read) -> tuple[list, dict, str]:
    """([(key, offset, length, [(ext, value, size)])], {bytes, mtime_ns}, "" or what stopped the
    scan). `read` is None (headers only) or `groups`' member reader."""
    found, problem, stat = [], "", {"bytes": -1, "mtime_ns": -1}
    local = not is_remote(shard)
    if local:
        st = os.stat(shard)
        stat = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
        if read is None:  # headers only: parsed directly, unless the tar holds what only tarfile reads
            with open(shard, "rb") as f:
                try:
                    return [(key, start, end - start, members) for key, start, end, members
                            in wds.groups_of(wds.plain_members(f, 0, st.st_size), None)], stat, ""
                except wds.NotPlain:
                    pass
        f = open(shard, "rb")
    else:
        from webdataset import gopen

        f = _Counting(gopen(shard, "rb"))
    try:
        tf = tarfile.open(fileobj=f, mode="r:" if local and read is None else "r|")
        reader = (lambda ti, ext: read(ti, ext, tf)) if read is not None else None
        for key, start, end, members in wds.groups(tf, reader):
            found.append((key, start, end - start, members))
        if not local:
            while f.read(1 << 20):  # the end-of-archive blocks: the stream's size bounds its last sample
                pass
    except Exception as err:  # noqa: BLE001 - tarfile and transport errors alike: the samples before it are kept
        cur = getattr(err, "pending", None)
        if cur is not None and (not local or cur[2] <= stat["bytes"]) and (read is None or all(v is not None for _, v, _ in cur[3])):
            found.append((cur[0], cur[1], cur[2] - cur[1], cur[3]))
        problem = f"{type(err).__name__}: {str(err)[:200]}"
    finally:
        f.close() if local else getattr(f.f, "close", lambda: None)()
    if not local:
        stat["bytes"] = f.n
    return found, stat, problem


def _header_refusal(key: str, members: list) -> tuple[str, str] | None:
    """(code, reason) for a sample the mapping refuses from its member names alone."""
    exts = [e for e, _, _ in members]
    dup = sorted({e for e in exts if exts.count(e) > 1})
    if dup:
        return "duplicate-member", f"sample {key} has several members with extension {dup[0]!r} (WebDataset refuses it too)"
    if "doc.json" in exts:
        return "omniloom-sample", f"sample {key} is an omniloom build's sample: set data.sources to that build's folder"
    if not any(wds.member_role(e) in ("image", "video", "caption", "json") for e in exts):
        return "empty", f"sample {key} has no image, video, caption or json member ({', '.join(exts)[:200]}); nothing to train on"
    return None


def _same_document(built: dict, members: list, inplace: tuple[dict, dict]) -> bool:
    """Whether the build's document of a sample (process_unit's doc and members) is what the stream
    makes of it in place: the same segments in order, text for text, media bytes for media."""
    doc, media = inplace
    built_media = dict(members)
    a, b = built["segments"], doc["segments"]
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x["type"] != y["type"]:
            return False
        if x["type"] in ("text", "code"):
            if x.get("text") != y.get("text") or x.get("lang") != y.get("lang"):
                return False
        elif built_media.get(x["ref"]) != media.get(y["ref"]):
            return False
    return True


def index_shards(sources: list[str], out: str, *, settings: IngestSettings | None = None, validate: bool = False,
                 overwrite: bool = False, dedup: bool = True, echo=print) -> dict:
    """Write `out/manifest.json` (kind "index") and `out/rejects.jsonl` for the foreign shards of
    `sources`; returns the summary. Raises ValueError / FileNotFoundError for what the user must fix."""
    st = settings or IngestSettings()
    limits = wds.ReadLimits.of(st)
    skipped: Counter = Counter()
    shards = find_shards(sources, skipped)
    if os.path.exists(os.path.join(out, MANIFEST)) and not overwrite:
        raise ValueError(f"{out} already holds a manifest.json; pass --overwrite to replace it, or another --out")
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    entries, rejects, names = [], [], Counter()
    roles, notes, seen = Counter(), Counter(), set()
    if validate:
        from .ingest import process_unit
    for n, shard in enumerate(shards, 1):
        url = shard if is_remote(shard) else os.path.abspath(shard)
        name = os.path.basename(shard.split("?")[0]) or f"shard{n}"
        names[name] += 1
        name = name if names[name] == 1 else f"{name}~{names[name]}"  # names are unique in a manifest
        found, stat, problem = _scan(shard, wds.member_reader(limits) if validate else None)
        samples, repeats = [], Counter()
        for ordinal, (key, offset, length, members) in enumerate(found, 1):
            where = f"{shard}#{key}"
            refusal = _header_refusal(key, members)
            if refusal is None and validate:
                repeats[key] += 1
                root, rel = (os.path.dirname(url), os.path.basename(url)) if not is_remote(shard) else ("", shard)
                unit = Unit(source=shard, root=root, rel=rel, kind="wds", label=os.path.basename(out.rstrip("/")) or "index",
                            sample=key if repeats[key] == 1 else f"{key}~{repeats[key]}", line=ordinal, offset=offset,
                            length=length, payload=(key, [(e, v) for e, v, _ in members]))
                built = process_unit(unit, st)
                notes.update(built["notes"])
                if built["doc"] is None:
                    refusal = next(((r["code"], r["reason"]) for r in built["rejects"] if r["action"] == "dropped-doc"),
                                   ("rejected", "the build rejects it"))
                elif dedup and built["fingerprint"] in seen:
                    refusal = ("duplicate", "an exact duplicate of an earlier sample (as `data build` dedups; --no-dedup keeps it)")
                else:
                    try:
                        inplace = wds.document_from_sample(key, [(e, v) for e, v, _ in members], limits=limits,
                                                           caption_first=st.caption_first)
                    except wds.Reject as rej:
                        inplace = rej
                    if isinstance(inplace, wds.Reject) or not _same_document(built["doc"], built["members"], inplace):
                        why = inplace.reason if isinstance(inplace, wds.Reject) else "its media are converted or re-typed by the build"
                        refusal = ("differs-in-place", f"{why}: read in place it would not be the document `data build` "
                                                       f"makes of it; copy such samples with `omniloom data build {shard}`")
                    seen.add(built["fingerprint"])
            if refusal is not None:
                rejects.append({"path": where, "code": refusal[0], "reason": refusal[1], "action": "left-out"})
                continue
            roles.update(wds.member_role(e) for e, _, _ in members)
            samples.append({"key": key, "offset": offset, "members": [[e, size] for e, _, size in members]})
        if problem:
            rejects.append({"path": shard, "code": "corrupt-tar", "action": "left-out",
                            "reason": f"the tar stops parsing after {len(found)} samples ({problem}); those were indexed: "
                                      "re-download or rewrite the shard"})
        entries.append({"name": name, "url": url, "bytes": stat["bytes"], "mtime_ns": stat["mtime_ns"],
                        "num_samples": len(samples), "samples": samples})
        if echo is not None and sys.stderr.isatty():
            print(f"\rindexed {n}/{len(shards)} shards", end="", file=sys.stderr, flush=True)
    by_code = Counter(r["code"] for r in rejects)
    manifest = {
        "format": FORMAT, "version": VERSION, "kind": "index", "name": os.path.basename(os.path.abspath(out)),
        "shards": entries,
        "totals": {"documents": sum(e["num_samples"] for e in entries), "bytes": sum(max(e["bytes"], 0) for e in entries),
                   "members": dict(sorted(roles.items()))},
        "rejects": {"total": len(rejects), "by_code": dict(sorted(by_code.items()))},
        "settings": {"text": {"max_bytes": st.text.max_bytes},
                     "limits": {"max_image_bytes": st.limits.max_image_bytes, "max_video_bytes": st.limits.max_video_bytes},
                     "caption_first": st.caption_first, "validate": validate, "dedup": bool(validate and dedup)},
        **({"notes": dict(sorted(notes.items()))} if notes else {}),
        **({"skipped": dict(sorted(skipped.items()))} if skipped else {}),
    }
    with open(os.path.join(out, REJECTS + ".tmp"), "w", encoding="utf-8") as f:
        for r in rejects:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(os.path.join(out, REJECTS + ".tmp"), os.path.join(out, REJECTS))
    write_json_atomic(os.path.join(out, MANIFEST), manifest, indent=None)  # last: a folder without it is unfinished
    if echo is not None and sys.stderr.isatty():
        print(file=sys.stderr)
    return {"shards": len(entries), "documents": manifest["totals"]["documents"], "rejects": dict(by_code),
            "seconds": time.perf_counter() - t0, "members": dict(roles), "out": out, "skipped": dict(skipped)}


_SKIP_WHY = {"shard-metadata": "img2dataset/video2dataset NNNNN_stats.json / NNNNN.parquet beside NNNNN.tar",
             "not-a-shard": "files that are not .tar shards; `omniloom data build` reads them"}


def format_index_summary(s: dict) -> str:
    left = ", ".join(f"{n} {c}" for c, n in sorted(s["rejects"].items())) or "none"
    skipped = ", ".join(f"{s['skipped'][k]} {k} ({why})" for k, why in _SKIP_WHY.items() if s.get("skipped", {}).get(k))
    return (f"indexed {s['documents']} samples of {s['shards']} shard(s) in place in {s['seconds']:.1f}s (left out: {left}; "
            f"see {s['out']}/rejects.jsonl); train on them with data.sources=[{{path: {s['out']}}}]"
            + (f"\nskipped: {skipped}" if skipped else ""))


def register_index(dsub, size_type) -> None:
    """Add `omniloom data index` to the `data` command group."""
    p = dsub.add_parser("index", help="index foreign WebDataset shards to train on them in place (no copy)",
                        description=(__doc__ or "").strip().split("\n\n")[1].replace("\n", " "))
    p.add_argument("sources", nargs="+", metavar="SOURCE", help="uncompressed .tar shards, folders of them, brace patterns "
                   "('laion/{00000..00099}.tar', quoted), http(s):// URLs or pipe: commands")
    p.add_argument("--out", required=True, help="folder for the index's manifest.json and rejects.jsonl (data.sources points here)")
    p.add_argument("--validate", action="store_true", help="read every sample and decode its media as `data build` does: leave out "
                   "what the build rejects (and exact duplicates, and samples the build would convert), with reject lines")
    p.add_argument("--no-dedup", action="store_true", help="with --validate: keep exact duplicate samples")
    p.add_argument("--caption-first", action="store_true", help="a caption member before its media instead of after")
    p.add_argument("--max-text-bytes", type=size_type, default="16M", help="largest caption/json member read (default 16M)")
    p.add_argument("--max-image-bytes", type=size_type, default="64M", help="largest image member (default 64M)")
    p.add_argument("--max-video-bytes", type=size_type, default="1G", help="largest video member (default 1G)")
    p.add_argument("--overwrite", action="store_true", help="replace an index already in --out")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from dataclasses import replace

    from .media import MediaLimits
    from .validate import TextPolicy

    st = IngestSettings(text=TextPolicy(max_bytes=args.max_text_bytes), caption_first=args.caption_first,
                        limits=replace(MediaLimits(), max_image_bytes=args.max_image_bytes, max_video_bytes=args.max_video_bytes))
    summary = index_shards(args.sources, args.out, settings=st, validate=args.validate, overwrite=args.overwrite,
                           dedup=not args.no_dedup)
    print(format_index_summary(summary))
    if summary["documents"] == 0:
        print(f"omniloom: error: the index lists no samples; see {args.out}/rejects.jsonl", file=sys.stderr)
        return 2
    return 0


def index_vs_tar_tf(shards: list[str], out: str, *, rounds: int = 5) -> dict:
    """`data index` seconds per shard (headers only) against `tar -tf` of the same shards: one
    untimed run of each, then `rounds` of both in alternating order; medians, and the median of the
    rounds' ratios."""
    import statistics
    import subprocess

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) / len(shards)

    def index() -> float:
        return timed(lambda: index_shards(shards, out, overwrite=True, echo=None))

    def tar_tf() -> float:
        return timed(lambda: [subprocess.run(["tar", "-tf", s], check=True, capture_output=True) for s in shards])

    index(), tar_tf()  # warm-up, untimed
    ix, tf = [], []
    for r in range(rounds):
        if r % 2 == 0:
            ix.append(index())
            tf.append(tar_tf())
        else:
            tf.append(tar_tf())
            ix.append(index())
    return {"index_s_per_shard": statistics.median(ix), "tar_tf_s_per_shard": statistics.median(tf), "rounds": rounds,
            "ratio": statistics.median(a / b for a, b in zip(ix, tf))}
