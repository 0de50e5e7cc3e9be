"""`omniloom data build|merge|inspect|stats|verify` and `omniloom bench data` (data prep, docs/data-format.md section 1).

Heavy imports (PIL, av, tqdm) happen inside the handlers so `omniloom --help` stays fast.
"""

from __future__ import annotations

import argparse
import json
import re
import sys

_BUILD_EPILOG = """\
inputs:
  folders are walked recursively (hidden dot-names and __pycache__/.pyc caches skipped and counted,
  unless --include-hidden; symlinked folders not followed):
    .txt .md .rst              -> text documents
    .py .c .cpp .rs .go .java .js .ts .sh .sql .yaml .json .toml ... -> code documents (language by extension)
    .jpg .png .webp .gif .bmp .tiff .ppm .pgm .pbm .xbm .sgi .ras .tga .ico .pcx .qoi .exr
                               -> image documents; a sidecar STEM.txt is the caption, STEM.json the meta
                                  (and the caption from its caption/text key when there is no STEM.txt)
                                  (.exr and other stills PIL cannot read are stored as PNG)
    .mp4 .webm .mkv .mov .avi ... and anything else PyAV opens -> video documents (same sidecars);
                                  a file PyAV opens as one still image is an image document
    .html                      -> one interleaved document: text blocks and local <img>/<video> in order
    .jsonl .ndjson             -> one document per line: {"schema":1,"segments":[...]}, OBELICS
                                  {"texts":[...],"images":[...]} (media paths relative to the JSONL file), or a
                                  text-corpus record {"text": ..., other keys -> meta} (Dolma, RedPajama, FineWeb;
                                  --text-field NAME for another key; a "lang"/"ext"/"path" naming a programming
                                  language makes it code); layouts: docs/data-format.md in the repository
    .jsonl.gz .json.gz .jsonl.zst .jsonl.bz2 .jsonl.xz (any of .gz .zst .bz2 .xz), .txt.gz, .py.zst, ...
                               -> decompressed as they are read (streamed; a .json.gz is JSONL)
    .tar .tar.gz .tgz .tar.zst -> WebDataset shards (img2dataset, video2dataset, webdataset.TarWriter): one
                                  document per sample; key = member path up to the first dot of its base name:
                                  jpg/png/webp/... -> image, mp4/webm/... -> video, txt/text/caption -> caption
                                  (after the media; --caption-first), json -> meta (its "caption"/"text" the
                                  caption when there is no text member; an OBELICS texts/images json with its
                                  images as members -> one interleaved document), cls and small text members ->
                                  meta, anything else counted as unmapped:EXT; a tar is never a video.
                                  Patterns: 'shard-{000000..000099}.tar' (quote it). Remote shards as for
                                  training: 'http(s)://HOST/laion/{000000..000099}.tar' and 'pipe:CMD' (a
                                  command printing the tar, e.g. 'pipe:aws s3 cp s3://b/laion/x.tar -'),
                                  read front to back through webdataset's gopen (twice: at discovery and
                                  at the build), like a compressed tar; their keys are those of a local
                                  copy in a folder of the same name (laion/). Only tars are read remotely.
    .parquet (files, folders)  -> one document per row, as datasets / the Hugging Face Hub write it; columns from
                                  the file's huggingface features metadata, else Arrow types: Image columns and
                                  lists of them ({bytes, path}) -> images, the text column (--text-column; else
                                  text/content/caption/txt) -> caption after the images, or a text/code document
                                  (FineWeb, The Stack); texts+images lists -> one interleaved document (OBELICS);
                                  other scalar columns -> meta. An image given only by URL is a remote-ref reject
                                  unless --fetch-media (then a url/URL/image_url column is the image, or video by
                                  the URL's extension, with the caption column).
                                  Read one row group at a time. Layout not found? pass --text-column/--image-column
  an animated GIF / APNG / WebP is a video document (--animated-images first-frame keeps it an image).
  STEM.txt beside a medium is its caption and STEM.json its meta; a file PyAV opens as a video is a
  video with its sidecar whatever its extension. An earlier build's manifest.json / rejects.jsonl and
  img2dataset's NNNNN_stats.json / NNNNN.parquet beside NNNNN.tar are skipped and counted.
  MMC4 JSONL ({"text_list": [...], "image_info": [{"raw_url", "matched_text_index"}]}): each image before its
  sentence. Media by http(s) URL (OBELICS, MMC4, LAION/DataComp/COYO parquet, omniloom schema) are
  remote-ref rejects unless --fetch-media downloads them (see "media by URL" below).
  media that an HTML page or JSONL record references is not also made a standalone document
  (--standalone-referenced changes that; otherwise its caption sidecar is listed in rejects.jsonl).

policies:
  text encoding: a BOM (UTF-8/16/32) decides; else, for HTML, a declared charset (<meta charset>,
  http-equiv Content-Type, <?xml encoding>); else bytes that are valid UTF-8 are UTF-8; else
  (text, code, HTML and .txt captions, not JSON) the encoding is detected and used only when the
  guess is confident (--undeclared-encoding), counted as encoding-detected and recorded in the
  document's meta (encoding, encoding_source). Bytes that still do not decode follow --bad-utf8;
  NUL bytes reject the file (--nul). JSONL and .json sidecars are UTF-8 by specification.
  file names that are not UTF-8 are kept, written in JSON with each undecodable byte as \\xNN.
  NaN/Infinity in JSONL or sidecar JSON become null (counted as non-finite-number).
  media references must stay inside their SOURCE folder (no '..', no symlinks out).
  a document with a bad media segment keeps the rest (--on-bad-media drop-segment) or is dropped.
  exact duplicates (same prose up to whitespace, same code byte for byte, same media bytes) are
  dropped (--no-dedup keeps them).
  every rejection is a line of DIR/rejects.jsonl with the input path and the reason; so is each
  notice about an input that was kept (encoding-detected, non-finite-number).

media by URL (--fetch-media): fetched by --fetch-workers threads ahead of the decode workers, then
  validated by decoding exactly as local files (never by Content-Type), stored in the shards in input
  order (byte-identical for any --workers / --fetch-workers). Retries (--fetch-retries, doubling
  waits) after 429 (Retry-After honoured, capped at 30s), 5xx, timeouts and broken connections; the
  body is refused past --max-image-bytes / --max-video-bytes (Content-Length first, then while read);
  at most 5 redirects, a loop is a reject; X-Robots-Tag noai/noimageai/noindex/noimageindex (for all
  agents or "omniloom:") opts out, as img2dataset decides (--fetch-ignore-robots-tag). User-Agent:
  omniloom/VERSION. Every answer, failures too, is cached by URL in --fetch-cache (default
  DIR/.fetch-cache; --overwrite keeps it): a rerun or a resumed build fetches nothing twice;
  --fetch-retry-transient asks cached timeouts / 5xx / 429 / connection errors again. A failed URL
  is a reject line (http-404, http-500, http-429, timeout, connection-error, too-large,
  not-an-image, opted-out, redirect-loop, bad-redirect, bad-url, tls-error) and its document keeps
  its other segments (--on-bad-media); the summary's fetch: line gives the figures, and
  `omniloom data fetch-stats DIR` what the cache holds.

output: DIR/NAME-000000.tar ... (WebDataset, one sample per document), DIR/manifest.json,
DIR/rejects.jsonl. Same inputs and settings give byte-identical shards for any --workers.
Documents are written in input order (sorted paths, then lines), or with --shuffle SEED in an order
drawn from SEED (the same for the same inputs): use it when inputs come grouped by kind.
Interrupted (even kill -9)? Run the same command again: it resumes after the last finished shard.
Many machines? Run `--part I/N --out DIR_I` for I = 0..N-1, then `omniloom data merge DIR_* --out DIR`
(merge drops duplicates across parts, so the result holds what one build would; with --shuffle each
part is shuffled on its own, and the copy of a duplicate kept may differ from one build's).
A build locks DIR (a second build into it is refused), and exits 2 if it wrote no documents, and 3 if
every image or every video its inputs referenced was dropped (--allow-dropped-media accepts that).
The summary counts each decision taken on the inputs (notes: unmapped members, captions taken from
json, animated images made videos, files probed as video) and skips (an earlier build's files).
"""


def _size(text: str) -> int:
    """'512M', '1G', '64k', '1048576' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 512M, 1G, 1048576)")
    return int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2)])


def register(sub) -> None:
    """Add the `data` command group."""
    data = sub.add_parser("data", help="prepare, merge, inspect and verify WebDataset shards",
                          description="Data prep: raw text, code, images, videos and interleaved documents into WebDataset shards.")
    dsub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    data.set_defaults(func=lambda args: (data.print_help(), 2)[1])

    b = dsub.add_parser("build", help="validate inputs and write shards + manifest + rejects",
                        description="Validate every input and write WebDataset shards, manifest.json and rejects.jsonl.",
                        epilog=_BUILD_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("sources", nargs="+", metavar="SOURCE", help="folders (walked recursively), single files (.jsonl, .html, ...), "
                   "or tar shards by brace pattern, http(s):// URL or pipe: command")
    b.add_argument("--out", required=True, help="output folder for shards, manifest.json, rejects.jsonl")
    b.add_argument("--name", default="data", help="shard name prefix: NAME-000000.tar (default: data)")
    b.add_argument("--workers", type=int, default=1, help="processes that decode and validate (output is identical for any value; default 1)")
    b.add_argument("--part", default="0/1", help="build only part I of N (0-based, e.g. $SLURM_ARRAY_TASK_ID/8) into its own shard range; join with `data merge`")
    b.add_argument("--shard-size", type=_size, default="1G", help="max bytes per shard (a larger single document gets its own shard; default 1G)")
    b.add_argument("--shard-docs", type=int, default=10_000, help="max documents per shard (default 10000)")
    b.add_argument("--on-bad-media", choices=("drop-segment", "drop-doc"), default="drop-segment", help="a bad media segment in an interleaved document drops just the segment (default) or the whole document")
    b.add_argument("--shuffle", type=int, default=None, metavar="SEED",
                   help="write the documents in an order drawn from SEED instead of input order: inputs that come grouped "
                        "(all images, then all videos) otherwise give each training rank long runs of one kind, as a rank "
                        "reads a contiguous range of the shards (default: input order)")
    b.add_argument("--no-dedup", action="store_true", help="keep exact duplicate documents")
    b.add_argument("--caption-first", action="store_true", help="put a caption (STEM.txt sidecar, a shard sample's txt member) before its media instead of after")
    b.add_argument("--animated-images", choices=("video", "first-frame"), default="video",
                   help="an animated GIF/APNG/WebP becomes a video document (default) or stays an image, whose first frame training reads")
    b.add_argument("--text-field", default="text", metavar="NAME", help="the text of a text-corpus JSONL record (default: text; The Stack: content)")
    b.add_argument("--text-column", default="", metavar="NAME", help="parquet: the column holding the text or caption "
                   "(default: from the file: text, content, caption or txt)")
    b.add_argument("--image-column", action="append", default=[], metavar="NAME", help="parquet: a column holding images "
                   "(Image structs, bytes, paths, or lists of them); repeat for several (default: the file's Image columns)")
    b.add_argument("--allow-dropped-media", action="store_true", help="exit 0 even when every image or every video reference was dropped "
                   "(by default such a build exits 3: its captions would train without their media)")
    b.add_argument("--standalone-referenced", action="store_true", help="also make media referenced by HTML/JSONL documents standalone image/video documents")
    b.add_argument("--bad-utf8", choices=("reject", "replace"), default="reject", help="text that is not valid UTF-8: reject the file (default) or replace bad bytes with U+FFFD")
    b.add_argument("--undeclared-encoding", choices=("detect", "utf-8"), default="detect",
                   help="text with no BOM and no declared charset that is not valid UTF-8: detect its legacy encoding "
                        "(windows-1252, Shift_JIS, GB18030, ...) and keep it when the guess is confident, counted as "
                        "encoding-detected (default), or treat it as bad UTF-8 (utf-8); an unconfident guess follows --bad-utf8")
    b.add_argument("--nul", choices=("reject", "strip"), default="reject", help="text with NUL bytes: reject it as binary (default) or strip the NULs")
    b.add_argument("--max-text-bytes", type=_size, default="16M", help="largest text/code/HTML file or JSONL line (default 16M)")
    b.add_argument("--max-image-pixels", type=int, default=8192 * 8192, help="decompression-bomb guard, checked before decoding (default 67108864 = 8192x8192)")
    b.add_argument("--min-image-side", type=int, default=16, help="reject images whose shorter side is smaller (default 16)")
    b.add_argument("--max-image-aspect", type=float, default=10.0, help="reject images with long/short side ratio above this (default 10)")
    b.add_argument("--max-image-bytes", type=_size, default="64M", help="largest image file (default 64M)")
    b.add_argument("--min-video-seconds", type=float, default=0.0, help="reject shorter videos (default 0)")
    b.add_argument("--max-video-seconds", type=float, default=600.0, help="reject longer videos (default 600)")
    b.add_argument("--min-video-side", type=int, default=16, help="reject videos whose shorter side is smaller (default 16)")
    b.add_argument("--max-video-side", type=int, default=4096, help="reject videos whose longer side is larger (default 4096)")
    b.add_argument("--max-video-bytes", type=_size, default="1G", help="largest video file (default 1G)")
    f = b.add_argument_group("media by URL (see 'media by URL' below)")
    f.add_argument("--fetch-media", action="store_true", help="download media referenced by http(s) URL (JSONL: omniloom schema, "
                   "OBELICS, MMC4; parquet: url columns, URL lists) and build them like local media (default: a remote-ref reject)")
    f.add_argument("--fetch-workers", type=int, default=16, metavar="N", help="requests in flight at once (default 16)")
    f.add_argument("--fetch-timeout", type=float, default=10.0, metavar="SECONDS", help="seconds to connect and for each wait for "
                   "bytes before a try counts as a timeout (default 10)")
    f.add_argument("--fetch-deadline", type=float, default=120.0, metavar="SECONDS", help="seconds one try may take in all, "
                   "redirects and the whole body included: a server that trickles bytes is a timeout, not tried again in "
                   "this build (default 120)")
    f.add_argument("--fetch-retries", type=int, default=3, metavar="N", help="more tries after a 429, 5xx, timeout or broken "
                   "connection, waiting 0.5s, 1s, 2s, ... or what Retry-After asks (capped at 30s) (default 3)")
    f.add_argument("--fetch-cache", default="", metavar="DIR", help="where fetched bodies and failures are kept by URL "
                   "(default: OUT/.fetch-cache); share it between builds so no URL is fetched twice")
    f.add_argument("--fetch-ignore-robots-tag", action="store_true", help="fetch media whose X-Robots-Tag says noai, noimageai, "
                   "noindex or noimageindex (by default they are opted-out rejects, img2dataset's rule)")
    f.add_argument("--fetch-retry-transient", action="store_true", help="ask URLs again whose cached failure was transient "
                   "(timeout, 5xx, 429, connection error); by default a rerun reuses every cached answer")
    b.add_argument("--overwrite", action="store_true", help="delete this build's previous outputs in --out (finished or not) and start over")
    b.add_argument("--include-hidden", action="store_true", help="also build hidden files and folders (names starting with '.') and "
                   "caches (__pycache__, .pyc/.pyo), which are skipped and counted by default")
    b.add_argument("--progress-seconds", type=float, default=30.0, help="when stderr is not a terminal (a log file, a Slurm job): "
                   "a progress line every N seconds (default 30; 0: none; a terminal gets a bar)")
    b.set_defaults(func=_build)

    fs = dsub.add_parser("fetch-stats", help="what a --fetch-media cache holds: URLs fetched, bytes, failures by reason",
                         description="Count the answers in a fetch cache (a build's --out, or its --fetch-cache folder).")
    fs.add_argument("dir", metavar="DIR")
    fs.add_argument("--json", action="store_true", help="print the figures as JSON")
    fs.set_defaults(func=_fetch_stats)

    m = dsub.add_parser("merge", help="join the shard folders of a --part build into one dataset",
                        description="Join part folders (from `data build --part I/N`) into one folder with contiguous shard names and one manifest.")
    m.add_argument("parts", nargs="+", metavar="PART_DIR")
    m.add_argument("--out", required=True, help="new folder for the merged dataset")
    m.add_argument("--mode", choices=("link", "copy", "move"), default="link", help="how shards get there: hard link (default; copies across file systems), copy, or move")
    m.add_argument("--name", default=None, help="shard name prefix of the merged set (default: the parts' name)")
    m.add_argument("--allow-missing", action="store_true", help="merge even if some parts of the N are absent")
    m.set_defaults(func=_merge)

    i = dsub.add_parser("inspect", help="show documents as text, or as a self-contained HTML page",
                        description="Show documents from a shard folder: text on stdout, or an HTML page with images inline and a frame strip per video.")
    i.add_argument("dir", metavar="DIR")
    g = i.add_mutually_exclusive_group()
    g.add_argument("--key", help="the document with this sample key")
    g.add_argument("--index", type=int, default=None, help="the document at this position in manifest order (default 0)")
    i.add_argument("--count", type=int, default=None, help="how many documents from --index (default 1; 20 with --html and "
                   "neither --index nor --key, a page to browse)")
    i.add_argument("--html", metavar="OUT", help="write a self-contained HTML page to OUT instead of printing")
    i.set_defaults(func=_inspect)

    s = dsub.add_parser("stats", help="per-modality counts, bytes, image-size and video-duration distributions",
                        description="Summarize a shard folder (reads doc.json members only).")
    s.add_argument("dir", metavar="DIR")
    s.add_argument("--json", action="store_true", help="print the figures as JSON")
    s.set_defaults(func=_stats)

    v = dsub.add_parser("verify", help="check checksums, sample listing and decodability (exit 1 on problems)",
                        description="Check every shard's size and sha256, that each sample is listed at its offset, that every doc.json is valid and its media decode. Exits 1 if anything is wrong, an empty set included.")
    v.add_argument("dir", metavar="DIR")
    v.add_argument("--no-media", action="store_true", help="skip decoding images and videos (faster)")
    v.set_defaults(func=_verify)
    from omniloom.data.prep.index import register_index  # `data index`: foreign shards in place (issue 38)

    register_index(dsub, _size)

    try:
        from omniloom.data.prep.demo_corpus import register_demo_corpus
    except ModuleNotFoundError as err:
        if not (err.name or "").endswith("demo_corpus"):
            raise
    else:
        register_demo_corpus(dsub)


def register_bench(bench_sub) -> None:
    """Add `omniloom bench data`."""
    p = bench_sub.add_parser("data", help="data build throughput (docs/s, MB/s) for 1 and 2 workers",
                             description="Generate a corpus of text, code, images and videos, build it with each worker count, and print docs/s and MB/s, with the speedup over 1 worker.")
    p.add_argument("--docs", type=int, default=400, help="approximate number of input documents to generate (default 400)")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts; the first is the reference (default 1,2)")
    p.add_argument("--image-size", type=int, default=384, help="width of generated images in pixels (default 384)")
    p.add_argument("--keep", metavar="DIR", help="generate and build under DIR and keep it (default: a temp folder, removed)")
    p.add_argument("--foreign", action="store_true", help="instead: build docs/s from WebDataset shards (img2dataset layout) and a "
                   ".jsonl.zst corpus against reading them with webdataset (decode rgb8) and zstandard+json alone, in the same run")
    p.add_argument("--parquet", action="store_true", help="instead: build docs/s from parquet (an Image + caption file and a FineWeb-like "
                   "text file) against reading the same rows with pyarrow alone (images decoded with PIL), in the same run")
    p.add_argument("--index", action="store_true", help="instead: `data index` s/shard against `tar -tf`, and loader samples/s on "
                   "the indexed shards against webdataset (decode rgb8), 1 worker each, in the same run")
    p.add_argument("--fetch", action="store_true", help="instead: images/s `data build --fetch-media` gets from a local HTTP server "
                   "(url + caption parquet) against img2dataset on the same URLs at the same concurrency, in the same run")
    p.add_argument("--img2dataset", default="", metavar="PATH", help="with --fetch: img2dataset's executable (from its own venv: it "
                   "pins webdataset<0.3); without it that half is skipped")
    p.add_argument("--fetch-workers", type=int, default=16, help="with --fetch: requests in flight for both (default 16)")
    p.add_argument("--latency-ms", type=float, default=10.0, help="with --fetch: the server answers after this long (default 10)")
    p.add_argument("--repeats", type=int, default=3, help="with --fetch: alternating rounds (default 3)")
    p.add_argument("--samples", type=int, default=600, help="with --foreign / --parquet / --index / --fetch: image samples (rows) to generate (default 600)")
    p.add_argument("--records", type=int, default=20000, help="with --foreign / --parquet: text records (rows) to generate (default 20000)")
    p.set_defaults(func=_bench)
    from .stream import stream_bench

    p = bench_sub.add_parser("stream", help="stream tokens/s, best-fit vs sequential padding, restore vs replay",
                             description=(stream_bench.__doc__ or "").strip().split("\n\n")[0] or None)
    stream_bench.add_arguments(p)
    p.set_defaults(func=stream_bench.run)


def _progress(args) -> bool:
    return getattr(args, "quiet", 0) == 0 and sys.stderr.isatty()


def _build(args) -> int:
    from omniloom.data.prep.units import IngestSettings
    from omniloom.data.prep.media import MediaLimits
    from omniloom.data.prep.shards import build, parse_part
    from omniloom.data.prep.validate import TextPolicy

    ingest = IngestSettings(
        text=TextPolicy(bad_utf8=args.bad_utf8, nul=args.nul, max_bytes=args.max_text_bytes, undeclared_encoding=args.undeclared_encoding),
        limits=MediaLimits(
            max_image_pixels=args.max_image_pixels, min_image_side=args.min_image_side, max_image_aspect=args.max_image_aspect,
            max_image_bytes=args.max_image_bytes, min_video_seconds=args.min_video_seconds, max_video_seconds=args.max_video_seconds,
            min_video_side=args.min_video_side, max_video_side=args.max_video_side, max_video_bytes=args.max_video_bytes,
        ),
        on_bad_media=args.on_bad_media, caption_first=args.caption_first, animated=args.animated_images, text_field=args.text_field,
        text_column=args.text_column, image_columns=tuple(c for a in args.image_column for c in a.split(",") if c),
    )
    fetch = None
    if args.fetch_media:
        from omniloom.data.prep.fetch import FetchOptions

        fetch = FetchOptions(workers=args.fetch_workers, timeout=args.fetch_timeout, deadline=args.fetch_deadline,
                             retries=args.fetch_retries, cache=args.fetch_cache,
                             honour_robots=not args.fetch_ignore_robots_tag, retry_transient=args.fetch_retry_transient)
    elif args.fetch_cache or args.fetch_ignore_robots_tag or args.fetch_retry_transient:
        raise ValueError("--fetch-cache, --fetch-ignore-robots-tag and --fetch-retry-transient need --fetch-media")
    summary = build(
        args.sources, args.out, name=args.name, workers=args.workers, part=parse_part(args.part), fetch=fetch,
        shard_max_docs=args.shard_docs, shard_max_bytes=args.shard_size, dedup=not args.no_dedup, ingest=ingest,
        standalone_referenced=args.standalone_referenced, overwrite=args.overwrite,
        progress=getattr(args, "quiet", 0) == 0, progress_seconds=args.progress_seconds, include_hidden=args.include_hidden,
        shuffle=args.shuffle,
    )
    print(format_summary(args.out, summary))
    if summary["documents"] == 0:
        # Nothing to train on is a failed build, even though every input was handled: a pipeline
        # must not go on to train on an empty set. One part of a --part build may be empty (few
        # inputs, many parts); `data merge` refuses if all of them are.
        part = parse_part(args.part)
        if part[1] > 1:
            print(f"omniloom: warning: part {part[0]}/{part[1]} holds no documents; `data merge` needs the other parts to hold some", file=sys.stderr)
            return 0
        print(f"omniloom: error: the build wrote no documents (every input was rejected or a duplicate, or none was found); "
              f"see {args.out}/rejects.jsonl", file=sys.stderr)
        return 2
    lost = dropped_media_kinds(summary)
    if lost:
        refs = summary.get("notes", {})
        print(f"omniloom: error: every {' and every '.join(lost)} reference was dropped ("
              + ", ".join(f"{refs.get('media-refs:' + k, 0)} {k}s, 0 kept" for k in lost)
              + f"); see the reasons in {args.out}/rejects.jsonl, or pass --allow-dropped-media to accept it",
              file=sys.stderr if not args.allow_dropped_media else sys.stdout)
        return 0 if args.allow_dropped_media else 3
    return 0


def dropped_media_kinds(summary: dict) -> list[str]:
    """The media kinds ("image", "video") that the inputs referenced and the build kept none of."""
    notes, segs = summary.get("notes") or {}, summary.get("segments") or {}
    return [k for k in ("image", "video") if notes.get(f"media-refs:{k}", 0) > 0 and not segs.get(k)]


def format_summary(out: str, s: dict) -> str:
    """The build summary printed at the end of `data build`."""
    if s.get("already"):
        return f"{out}: already complete ({s['documents']} documents in {s['shards']} shards); nothing to do"
    secs = max(s["seconds"], 1e-9)
    lines = [
        f"{out}: {s['documents']} documents from {s['units']} inputs in {s['shards']} shards, {s['bytes'] / 1e6:.2f} MB"
        f" in {s['seconds']:.1f}s ({s['documents'] / secs:.1f} docs/s, {s['bytes'] / secs / 1e6:.2f} MB/s){' (resumed)' if s.get('resumed') else ''}",
        "segments: " + ", ".join(f"{k} {v}" for k, v in s["segments"].items()),
    ]
    from omniloom.data.prep.ingest import NOTICE_CODES

    rej = {k: v for k, v in s["rejects"].items() if k not in NOTICE_CODES}
    notes = {k: v for k, v in s["rejects"].items() if k in NOTICE_CODES}
    if rej:
        lines.append(f"rejected: {sum(rej.values())} (" + ", ".join(f"{k} {v}" for k, v in rej.items()) + f"); details in {out}/rejects.jsonl")
    else:
        lines.append("rejected: 0")
    if notes:  # inputs kept, with something done to them (an encoding guessed, NaN nulled)
        lines.append("notices: " + ", ".join(f"{k} {v}" for k, v in notes.items()) + f" (inputs kept; details in {out}/rejects.jsonl)")
    decided = {k: v for k, v in (s.get("notes") or {}).items() if not k.startswith("media-refs:") and v}
    decided.update({k: v for k, v in (s.get("skipped") or {}).items() if k.startswith("probed-")})
    if decided:  # what was decided about inputs that could be read more than one way (docs/data-format.md)
        lines.append("notes: " + ", ".join(f"{k} {v}" for k, v in sorted(decided.items())))
    if s.get("fetch"):
        from omniloom.data.prep.fetch import format_figures

        lines.append(format_figures(s["fetch"]))
    if s.get("skipped"):
        from omniloom.data.prep.ingest import describe_skipped
        from omniloom.data.prep.sniff import describe_other_skips

        if describe_skipped(s["skipped"]):
            lines.append(f"skipped: {describe_skipped(s['skipped'])}; --include-hidden builds them")
        if describe_other_skips(s["skipped"]):
            lines.append(f"skipped: {describe_other_skips(s['skipped'])}")
    return "\n".join(lines)


def _merge(args) -> int:
    from omniloom.data.prep.merge import merge

    r = merge(args.parts, args.out, mode=args.mode, name=args.name, allow_missing=args.allow_missing)
    print(f"{args.out}: merged {r['parts']} parts -> {r['shards']} shards, {r['documents']} documents, {r['bytes'] / 1e6:.2f} MB")
    if r["documents"] == 0:
        print(f"omniloom: error: the merged set holds no documents; see the parts' rejects.jsonl", file=sys.stderr)
        return 2
    return 0


def _inspect(args) -> int:
    from omniloom.data.prep.inspect import render_html, render_text, select_samples

    # a document asked for by --index or --key is that one document, as on the terminal; --html
    # alone is a page of the first 20 to browse
    chosen = args.key is not None or args.index is not None
    count = args.count if args.count is not None else (20 if args.html and not chosen else 1)
    docs = select_samples(args.dir, key=args.key, index=args.index or 0, count=count)
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(render_html(docs, title=f"{args.dir}: {len(docs)} documents"))
        print(f"wrote {args.html} ({len(docs)} documents)")
    else:
        print("\n\n".join(render_text(k, d, m) for k, d, m in docs))
    return 0


def _stats(args) -> int:
    from omniloom.data.prep.inspect import compute_stats, format_stats

    st = compute_stats(args.dir, progress=_progress(args))
    print(json.dumps(st, indent=1) if args.json else format_stats(st))
    return 0


def _fetch_stats(args) -> int:
    from omniloom.data.prep.fetch import cache_stats

    st = cache_stats(args.dir)
    if args.json:
        print(json.dumps(st, indent=1))
    else:
        failed = ", ".join(f"{k} {v}" for k, v in st["failed"].items())
        print(f"{st['cache']}: {st['urls']} URLs: {st['ok']} fetched ({st['bytes'] / 1e6:.2f} MB), "
              f"{sum(st['failed'].values())} failed{f' ({failed})' if failed else ''}, {st['transient']} of them transient "
              f"(--fetch-retry-transient asks again); {st['ok_with_opt_out']} kept bodies carry an opting-out X-Robots-Tag")
    return 0


def _verify(args) -> int:
    from omniloom.data.prep.inspect import verify

    problems, counts = verify(args.dir, media=not args.no_media, progress=_progress(args))
    for p in problems:
        print(f"PROBLEM {p}")
    n = counts.get("problems", 0)
    print(f"{args.dir}: {counts.get('shards', 0)} shards, {counts.get('documents', 0)} documents, "
          f"{counts.get('media_decoded', 0)} media decoded: " + ("OK" if not n else f"{n} problems"))
    return 1 if n else 0


def _bench(args) -> int:
    from omniloom.data.prep.build_bench import run_bench

    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    if not workers or min(workers) < 1:
        raise ValueError(f"--workers must be a comma-separated list of positive ints, got {args.workers!r}")
    if args.fetch:
        from omniloom.data.prep.fetch_bench import run_fetch_bench

        print(run_fetch_bench(images=args.samples, image_size=args.image_size, workers=args.fetch_workers, latency_ms=args.latency_ms,
                              repeats=args.repeats, img2dataset=args.img2dataset, keep=args.keep, build_workers=workers[0]))
        return 0
    if args.parquet:
        from omniloom.data.prep.parquet_bench import run_parquet_bench

        print(run_parquet_bench(rows=args.samples, text_rows=args.records, image_size=args.image_size, workers=workers[0], keep=args.keep))
        return 0
    if args.index:
        return _bench_index(args)
    if args.foreign:
        from omniloom.data.prep.foreign_bench import run_foreign_bench

        print(run_foreign_bench(samples=args.samples, records=args.records, image_size=args.image_size, workers=workers[0], keep=args.keep))
        return 0
    print(run_bench(docs=args.docs, workers=workers, image_size=args.image_size, keep=args.keep))
    return 0


def _bench_index(args) -> int:
    """`bench data --index`: the prep half (index vs tar -tf) and the stream half (loader vs webdataset)."""
    import os
    import tempfile

    from omniloom.data.prep.foreign_bench import make_foreign_inputs
    from omniloom.data.prep.index import index_vs_tar_tf
    from omniloom.data.stream.index_bench import loader_vs_webdataset

    root = args.keep or tempfile.mkdtemp(prefix="omniloom-index-bench-")
    made = make_foreign_inputs(root, samples=args.samples, records=1, image_size=args.image_size)
    out = os.path.join(root, "index")
    ix = index_vs_tar_tf(made["shards"], out)
    ld = loader_vs_webdataset(out, made["shards"])
    print(f"data index: {ix['index_s_per_shard'] * 1e3:.1f} ms/shard, tar -tf {ix['tar_tf_s_per_shard'] * 1e3:.1f} ms/shard "
          f"({ix['ratio']:.2f}x the time; {len(made['shards'])} shards of {args.samples // len(made['shards'])} {args.image_size}px JPEG samples; "
          f"medians of {ix['rounds']} alternating rounds)")
    print(f"loader on the index: {ld['loader_sps']:.0f} samples/s, webdataset decode rgb8: {ld['webdataset_sps']:.0f} samples/s "
          f"({ld['ratio']:.2f}x; {ld['samples']} samples, 1 process each, warm cache; medians of {ld['rounds']} alternating rounds)")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m omniloom.data.cli SUBCOMMAND ...`: the `data` commands without loading the
    other packages' CLIs (fast start-up on many workers, e.g. a Slurm array running `build --part`)."""
    import logging

    parser = argparse.ArgumentParser(prog="python -m omniloom.data.cli")
    parser.add_argument("-q", "--quiet", action="count", default=0)
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["data", *(argv if argv is not None else sys.argv[1:])])
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        print(f"omniloom: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
