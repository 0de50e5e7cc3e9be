"""`omniloom data merge`: join the shard directories of a `--part I/N` build into one dataset.

Each part's shards are placed in the output folder under contiguous names `NAME-000000.tar ...`
(in part order), by hard link (default; falls back to a copy across file systems), copy or move.
Renaming does not change a tar's bytes (member names hold sample keys, not shard names), so the
sha256 and sample offsets carry over unchanged. The manifest is written last.

Duplicates across parts: each part drops exact duplicates only among its own inputs, so a merge
drops the rest. A part build records each document's content hash and its input's place in the
whole input set; of the documents that share a hash the merge keeps the one whose input comes
first, which is the one a single build keeps, so part builds plus a merge hold the same documents
as one build. A shard that loses documents is rewritten (deterministically) instead of linked.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from collections import Counter

from omniloom.data.manifest import MANIFEST, REJECTS, read_manifest, write_json_atomic
from omniloom.data.outlock import OutputLock

log = logging.getLogger(__name__)

MODES = ("link", "copy", "move")


def merge(part_dirs: list[str], out: str, *, mode: str = "link", name: str | None = None, allow_missing: bool = False) -> dict:
    """Merge part directories into `out`; return {"parts", "shards", "documents", "bytes"}.

    Checks: all parts come from one build (same settings except the part index), no part is given
    twice, every part 0..N-1 is present (unless `allow_missing`), keys are unique across parts."""
    if mode not in MODES:
        raise ValueError(f"--mode must be one of {MODES}, got {mode!r}")
    if not part_dirs:
        raise ValueError("give the part directories to merge")
    out_real = os.path.realpath(out)
    if any(os.path.realpath(d) == out_real for d in part_dirs):
        raise ValueError("--out must be a new folder, not one of the parts")
    mans = []
    for d in part_dirs:
        man = read_manifest(d)
        mans.append((d, man))
    ref_settings = _without_part(mans[0][1]["settings"])
    n_parts = mans[0][1]["settings"].get("part", [0, 1])[1]
    seen_parts = {}
    for d, man in mans:
        st = man["settings"]
        if _without_part(st) != ref_settings:
            diff = sorted(k for k in set(st) | set(ref_settings) if k != "part" and st.get(k) != ref_settings.get(k))
            raise ValueError(f"{d} was built with different settings ({', '.join(diff)}) than {mans[0][0]}; merge parts of one build only")
        i, n = st.get("part", [0, 1])
        if n != n_parts:
            raise ValueError(f"{d} is part {i}/{n} but {mans[0][0]} is of {n_parts} parts")
        if i in seen_parts:
            raise ValueError(f"part {i} is given twice: {seen_parts[i]} and {d}")
        seen_parts[i] = d
    sets = {json.dumps(man.get("inputs", {}).get("set"), sort_keys=True) for _, man in mans}
    if len(sets) > 1:
        raise ValueError("the parts were built from different input sets (files added or removed between part builds); "
                         "rebuild every part from the same inputs")
    missing = sorted(set(range(n_parts)) - set(seen_parts))
    if missing and not allow_missing:
        raise ValueError(f"parts {missing} of {n_parts} are missing; build them first or pass --allow-missing")
    mans.sort(key=lambda dm: dm[1]["settings"].get("part", [0, 1])[0])
    name = name or mans[0][1]["name"]
    os.makedirs(out, exist_ok=True)
    with OutputLock(out, f"data merge into {out}"):
        return _merge_locked(mans, seen_parts, ref_settings, n_parts, out, mode=mode, name=name)


def _merge_locked(mans, seen_parts, ref_settings, n_parts, out, *, mode, name) -> dict:
    if os.path.exists(os.path.join(out, MANIFEST)):
        raise ValueError(f"{out} already holds a manifest; merge into a new folder")

    # Every check runs before the first file is placed: a refused merge leaves the parts untouched
    # (with --mode move, a failure half-way would otherwise strand shards in --out).
    keys: dict[str, str] = {}
    for d, man in mans:
        for shard in man["shards"]:
            for smp in shard["samples"]:
                if smp["key"] in keys:
                    raise ValueError(f"key {smp['key']} is in both {keys[smp['key']]} and {d}; parts overlap")
                keys[smp["key"]] = d
            src = os.path.join(d, shard["name"])
            if not os.path.isfile(src):
                raise ValueError(f"{src} is listed in {d}/{MANIFEST} but missing; run `omniloom data verify {d}`")
            if os.path.getsize(src) != shard["bytes"]:
                raise ValueError(f"{src} is {os.path.getsize(src)} bytes but its manifest says {shard['bytes']}; run `omniloom data verify {d}`")
    drop = _cross_part_duplicates(mans, dedup=bool(ref_settings.get("dedup", True)) and n_parts > 1)
    shards, totals_seg, totals_media, codes = [], Counter(), Counter(), Counter()
    rewritten: list[str] = []
    rejects_tmp = os.path.join(out, REJECTS + ".tmp")
    with open(rejects_tmp, "w", encoding="utf-8") as rej_out:
        for d, man in mans:
            rej_path = os.path.join(d, REJECTS)
            if os.path.exists(rej_path):
                with open(rej_path, encoding="utf-8") as f:
                    shutil.copyfileobj(f, rej_out)
            totals_seg.update(man["totals"]["segments"])
            totals_media.update(man["totals"]["media_bytes"])
            codes.update(man.get("rejects", {}).get("by_code", {}))
            for shard in man["shards"]:
                new_name = f"{name}-{len(shards):06d}.tar"
                src = os.path.join(d, shard["name"])
                samples = [{"key": smp["key"], "offset": smp["offset"]} for smp in shard["samples"]]
                if not any(smp["key"] in drop for smp in shard["samples"]):
                    _place(src, os.path.join(out, new_name), mode)
                    shards.append({**shard, "name": new_name, "samples": samples})
                    continue
                entry = _rewrite_without(src, os.path.join(out, new_name), drop, rej_out, totals_seg, totals_media)
                codes["duplicate"] += shard["num_samples"] - (entry["num_samples"] if entry else 0)
                rewritten.append(src)
                if entry:
                    shards.append({**entry, "name": new_name})
    os.replace(rejects_tmp, os.path.join(out, REJECTS))
    if drop:
        log.info("dropped %d documents that duplicate a document of another part", len(drop))
    settings = {**ref_settings, "merged_parts": sorted(seen_parts), "num_parts": n_parts}
    manifest = {
        "format": mans[0][1]["format"],
        "version": mans[0][1]["version"],
        "name": name,
        "shards": shards,
        "totals": {
            "documents": sum(s["num_samples"] for s in shards),
            "bytes": sum(s["bytes"] for s in shards),
            "segments": {k: totals_seg.get(k, 0) for k in ("text", "code", "image", "video")},
            "media_bytes": {k: totals_media.get(k, 0) for k in ("image", "video")},
        },
        "rejects": {"total": sum(codes.values()), "by_code": dict(sorted(codes.items()))},
        "settings": settings,
        "inputs": {"parts": [m.get("inputs") for _, m in mans]},
    }
    write_json_atomic(os.path.join(out, MANIFEST), manifest)
    if mode == "move":
        for src in rewritten:  # their kept documents now live in the rewritten copies
            os.unlink(src)
    return {"parts": len(mans), "shards": len(shards), "documents": manifest["totals"]["documents"], "bytes": manifest["totals"]["bytes"]}


def _cross_part_duplicates(mans, *, dedup: bool) -> dict[str, str]:
    """{key of a document to drop: key of the document it duplicates} across parts (see the module
    docstring: the document whose input comes first in the whole set wins)."""
    if not dedup:
        return {}
    first: dict[str, tuple[int, str]] = {}
    samples = [smp for _, man in mans for shard in man["shards"] for smp in shard["samples"]]
    if any("fp" not in smp for smp in samples):
        log.warning("some parts' manifests carry no content hashes (built by an older omniloom): duplicates across parts are kept")
        return {}
    for smp in samples:
        best = first.get(smp["fp"])
        if best is None or smp["unit"] < best[0]:
            first[smp["fp"]] = (smp["unit"], smp["key"])
    return {smp["key"]: first[smp["fp"]][1] for smp in samples if first[smp["fp"]][1] != smp["key"]}


def _rewrite_without(src: str, dst: str, drop: dict[str, str], rej_out, totals_seg: Counter, totals_media: Counter) -> dict | None:
    """Copy the shard `src` to `dst` without the samples in `drop` (same deterministic tar headers
    as a build), log each dropped one to rejects, take its segments and media out of the totals,
    and return the new shard entry (None if nothing is left)."""
    from omniloom.data.manifest import iter_shard_samples

    from .shards import DeterministicTarWriter

    tmp = dst + ".tmp"
    writer = DeterministicTarWriter(tmp)
    for _, key, members in iter_shard_samples(src):
        if key not in drop:
            writer.add_sample(key, list(members.items()))
            continue
        doc = json.loads(members["doc.json"])
        for seg in doc["segments"]:
            totals_seg[seg["type"]] -= 1
            if seg["type"] in ("image", "video"):
                totals_media[seg["type"]] -= len(members[seg["ref"]])
        source = doc.get("meta", {}).get("source", key)
        rej_out.write(json.dumps({"path": source, "code": "duplicate", "action": "dropped-doc",
                                  "reason": f"exact duplicate of document {drop[key]} of another part (same prose up to whitespace, same code and media bytes)"},
                                 ensure_ascii=False, allow_nan=False) + "\n")
    size, sha = writer.finish()
    if not writer.samples:
        os.unlink(tmp)
        return None
    os.replace(tmp, dst)
    return {"name": os.path.basename(dst), "num_samples": len(writer.samples), "bytes": size, "sha256": sha, "samples": writer.samples}


def _without_part(settings: dict) -> dict:
    return {k: v for k, v in settings.items() if k != "part"}


def _place(src: str, dst: str, mode: str) -> None:
    if os.path.exists(dst):
        os.unlink(dst)
    if mode == "move":
        shutil.move(src, dst)
        return
    if mode == "link":
        try:
            os.link(src, dst)
            return
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                raise
    shutil.copyfile(src, dst)
