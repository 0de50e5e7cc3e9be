"""Text/code training corpus for the SentencePiece trainer, read straight from shard tars.

Tokenizers must not import omniloom.data (imports flow tokenizers <- data), so this module reads the
shard format itself (docs/data-format.md section 1): the `KEY.doc.json` members of each tar, with tarfile, skipping
media members without reading them into memory.
"""

from __future__ import annotations

import json
import logging
import os
import random
import tarfile
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

# Chunks fed to SentencePiece stay under this many UTF-8 bytes; the trainer's max_sentence_length
# is set well above it, so no chunk is ever silently dropped (its default, 4192 bytes, drops long
# code lines).
CHUNK_BYTES = 4096


def resolve_shards(spec: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path]:
    """Shard tar paths from a shard directory (reads manifest.json when present, else `*.tar`),
    a tar file, or a list of either. Sorted order within a directory, so sampling is reproducible."""
    specs = [spec] if isinstance(spec, (str, os.PathLike)) else list(spec)
    out: list[Path] = []
    for s in specs:
        p = Path(s)
        if p.is_dir():
            manifest = p / "manifest.json"
            if manifest.is_file():
                try:
                    names = [sh["name"] for sh in json.loads(manifest.read_text())["shards"]]
                except (ValueError, KeyError, TypeError) as err:
                    raise ValueError(f"{manifest} is not an omniloom shard manifest ({err}); rebuild it with `omniloom data build`") from err
                for i, name in enumerate(names):
                    # the rule of omniloom.data.manifest.shard_path_refusal (this package imports no other
                    # of omniloom's): a build names each shard by its file name inside the folder
                    parts = str(name).replace("\\", "/").split("/")
                    if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in parts:
                        raise ValueError(f"{manifest}: shards[{i}].name {name!r} is not a file name inside the shard folder; "
                                         "rebuild it with `omniloom data build`")
                out.extend(p / n for n in names)
            else:
                out.extend(sorted(p.glob("*.tar")))
        elif p.is_file():
            out.append(p)
        else:
            raise FileNotFoundError(f"no shard directory or tar file at {p}")
    if not out:
        raise ValueError(f"no shard tars found in {', '.join(map(str, specs))}; pass a directory holding NAME-000000.tar files")
    missing = [str(p) for p in out if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"manifest lists shards that are missing: {', '.join(missing[:3])}")
    return out


def iter_shard_docs(shards: Iterable[Path], stats: Counter | None = None) -> Iterator[tuple[str, dict]]:
    """Yield (key, parsed doc.json) for every document of the shards, in tar order.

    Bad members (unparsable JSON, wrong schema) are counted in `stats` and logged, never raised;
    a tar that cannot be opened at all is counted as `bad_shard`.
    """
    stats = stats if stats is not None else Counter()
    for path in shards:
        try:
            tar = tarfile.open(path, mode="r:")
        except (tarfile.TarError, OSError) as err:
            stats["bad_shard"] += 1
            log.warning("skipping unreadable shard %s: %s", path, err)
            continue
        with tar:
            try:
                for member in tar:  # iterating reads headers only; data is read for doc.json alone
                    if not member.name.endswith(".doc.json") or not (member.isfile() or member.issparse()):
                        continue
                    key = member.name.split("/")[-1].split(".", 1)[0]
                    try:
                        if member.issparse():  # its holes would be expanded to zeros in memory; the build writes none
                            raise ValueError(f"a sparse member of {member.size} bytes, left unread")
                        doc = json.loads(tar.extractfile(member).read())
                        if not isinstance(doc, dict) or not isinstance(doc.get("segments"), list):
                            raise ValueError("no segments list")
                    except (ValueError, RecursionError) as err:  # RecursionError: nested too deeply to parse
                        stats["bad_doc_json"] += 1
                        log.warning("skipping %s in %s: %s", member.name, path.name, err)
                        continue
                    stats["documents"] += 1
                    yield key, doc
            except (tarfile.TarError, OSError) as err:  # truncated tar: keep what was read
                stats["truncated_shard"] += 1
                log.warning("shard %s is truncated or corrupt after some documents: %s", path, err)


def iter_text_segments(docs: Iterable[tuple[str, dict]], stats: Counter | None = None, *,
                       video_seconds: float | None = None) -> Iterator[str]:
    """The text of every text and code segment (code prefixed with `lang\\n`, as the layout encodes it).
    Videos are counted on the way (`video_segments`), and with `video_seconds` (the span a video
    block keeps) those whose recorded duration is longer (`videos_longer_than_kept`)."""
    stats = stats if stats is not None else Counter()
    for _key, doc in docs:
        media = doc.get("meta", {}).get("media", {}) if isinstance(doc.get("meta"), dict) else {}
        for seg in doc["segments"]:
            kind = seg.get("type") if isinstance(seg, dict) else None
            text = seg.get("text") if isinstance(seg, dict) else None
            if kind == "video":
                stats["video_segments"] += 1
                info = media.get(seg.get("ref")) if isinstance(media, dict) else None
                duration = info.get("duration") if isinstance(info, dict) else None
                if video_seconds is not None and isinstance(duration, (int, float)) and duration > video_seconds + 1e-6:
                    stats["videos_longer_than_kept"] += 1
            elif kind in ("text", "code") and isinstance(text, str):
                stats[f"{kind}_segments"] += 1
                if kind == "code":
                    text = f"{seg.get('lang') or ''}\n{text}"
                yield text
            elif kind in ("text", "code"):
                stats["bad_segment"] += 1


def chunk_text(text: str, max_bytes: int = CHUNK_BYTES) -> Iterator[str]:
    """Split text into chunks of at most max_bytes UTF-8 bytes, at line ends when possible.

    Lines keep their newline so the trainer learns pieces that contain it; a single line longer
    than the limit is cut at character boundaries rather than dropped.
    """
    if len(text) * 4 <= max_bytes or len(text.encode("utf-8")) <= max_bytes:
        if text:
            yield text
        return
    buf: list[str] = []
    size = 0
    for line in text.splitlines(keepends=True):
        n = len(line.encode("utf-8"))
        if size + n > max_bytes and buf:
            yield "".join(buf)
            buf, size = [], 0
        if n > max_bytes:
            yield from _cut(line, max_bytes)
            continue
        buf.append(line)
        size += n
    if buf:
        yield "".join(buf)


def _cut(line: str, max_bytes: int) -> Iterator[str]:
    start = 0
    step = max(1, max_bytes // 4)  # 4 bytes is the longest UTF-8 character
    while start < len(line):
        end = min(len(line), start + step)
        # grow while it still fits, so ASCII lines give full-size chunks
        while end < len(line) and len(line[start : min(len(line), end + step)].encode("utf-8")) <= max_bytes:
            end = min(len(line), end + step)
        yield line[start:end]
        start = end


def sample_chunks(texts: Iterable[str], max_sentences: int, seed: int = 0, stats: Counter | None = None) -> list[str]:
    """All chunks of the texts if there are at most max_sentences of them, else a uniform sample.

    Reservoir sampling with a fixed seed: the same corpus in the same order gives the same sample,
    in one pass and bounded memory, without knowing the corpus size up front.
    """
    stats = stats if stats is not None else Counter()
    rng = random.Random(seed)
    reservoir: list[str] = []
    seen = 0
    for text in texts:
        for chunk in chunk_text(text):
            seen += 1
            stats["chunk_chars"] += len(chunk)
            if len(reservoir) < max_sentences:
                reservoir.append(chunk)
            else:
                j = rng.randrange(seen)
                if j < max_sentences:
                    reservoir[j] = chunk
    stats["chunks_seen"] += seen
    stats["chunks_sampled"] += len(reservoir)
    return reservoir
