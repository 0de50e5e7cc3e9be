"""`omniloom tokenizer train|encode|decode|show` and `omniloom bench tokenizers`.

Heavy imports (sentencepiece, PIL, av) happen inside handlers so `omniloom --help` stays fast.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

log = logging.getLogger("omniloom.tokenizers")

_MEDIA_FLAGS = (
    # flag, settings field, type, help
    ("--patch-size", "patch_size", int, "image/video patch side p in pixels (default 16)"),
    ("--temporal-patch-size", "temporal_patch_size", int, "frames per video tubelet tp (default 2)"),
    ("--image-patch-budget", "image_patch_budget", int, "most patches per image (default 256)"),
    ("--video-fps", "video_fps", float, "video sampling rate in frames per second (default 2)"),
    ("--video-frame-budget", "video_frame_budget", int, "most sampled frames per video (default 14: a 450-token block fits seq_len 512)"),
    ("--video-patch-budget", "video_patch_budget", int, "most patches per video frame (default 64)"),
    ("--video-sampling", "video_sampling", str, "long videos: 'clip' keeps the first frames (default: the first 7 s), "
     "'spread' spreads the budget over the whole video"),
    ("--video-clip-start", "video_clip_start", float, "with clip sampling: the second the clip starts at (default 0)"),
)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "tokenizer",
        help="train and use the text/code/image/video tokenizer",
        description="Train the SentencePiece BPE tokenizer on the text and code of a shard set, "
        "encode/decode text with it, and inspect how documents tokenize. The token layout and the tokenizer folder's files are "
        "described in docs/data-format.md of the omniloom repository.",
    )
    sub = p.add_subparsers(dest="tokenizer_command", metavar="ACTION")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])

    t = sub.add_parser(
        "train",
        help="train tokenizer.model + omniloom_tokenizer.json (+ Hugging Face files) from shards",
        description="Stream the text and code segments of SHARDS into SentencePiece BPE training "
        "(byte fallback, split digits, identity normalization, whitespace kept for code) and write "
        "OUT/tokenizer.model and OUT/omniloom_tokenizer.json with the fixed special ids and the image/video "
        "settings, plus tokenizer.json, tokenizer_config.json and special_tokens_map.json so that Hugging Face's "
        "AutoTokenizer.from_pretrained(OUT) gives the same ids. A corpus of more than --max-sentences chunks (<= 4 KB each) is sampled "
        "deterministically by --seed.",
    )
    t.add_argument("--data", nargs="+", required=True, metavar="SHARDS", help="shard directories (with manifest.json) or .tar files")
    t.add_argument("--vocab-size", type=int, required=True, help="total ids, specials and 256 byte pieces included (at least 352)")
    t.add_argument("--out", required=True, help="output folder for tokenizer.model + omniloom_tokenizer.json and the Hugging Face files")
    t.add_argument("--max-sentences", type=int, default=300_000, help="most text chunks given to the trainer (default 300000)")
    t.add_argument("--seed", type=int, default=0, help="seed of the corpus sample (default 0)")
    t.add_argument("--character-coverage", type=float, default=0.99995, help="share of characters that get their own piece; the rest use byte fallback")
    t.add_argument("--threads", type=int, default=None, help="trainer threads (default: CPU count, at most 16)")
    t.add_argument("--force", action="store_true", help="overwrite an existing tokenizer in --out")
    for flag, field, typ, help_ in _MEDIA_FLAGS:
        t.add_argument(flag, type=typ, default=None, help=help_, choices=("clip", "spread") if field == "video_sampling" else None)
    t.set_defaults(func=_train)

    e = sub.add_parser("encode", help="print the ids (or pieces) of a text", description="Encode TEXT (or --file, or stdin) and print the ids, one line. TEXT is taken literally: a "
                       "typed \\n is a backslash and an n; for newlines and tabs use bash's $'...' quoting, --file or stdin.")
    e.add_argument("--tokenizer", required=True, help="tokenizer folder")
    e.add_argument("text", nargs="?", help="text to encode (default: --file or stdin)")
    e.add_argument("--file", help="read the text from this file")
    e.add_argument("--pieces", action="store_true", help="print pieces instead of ids")
    e.set_defaults(func=_encode)

    d = sub.add_parser("decode", help="print the text of ids", description="Decode ids (space or comma separated) to text.")
    d.add_argument("--tokenizer", required=True, help="tokenizer folder")
    d.add_argument("ids", nargs="+", help="token ids")
    d.add_argument("--specials", action="store_true", help="show special tokens as their tags")
    d.set_defaults(func=_decode)

    s = sub.add_parser(
        "show",
        help="summarize a tokenizer, and how shard documents tokenize",
        description="Print the tokenizer's vocabulary layout and media settings. With --data, "
        "tokenize the first --limit documents and print their token counts per modality and "
        "visual blocks; with --out also write each visual block back as PNG for inspection.",
    )
    s.add_argument("--tokenizer", required=True, help="tokenizer folder")
    s.add_argument("--data", nargs="+", metavar="SHARDS", help="shard directories or tars to sample documents from")
    s.add_argument("--limit", type=int, default=5, help="documents to show (default 5)")
    s.add_argument("--out", help="folder for reconstructed images / video frames (PNG)")
    s.set_defaults(func=_show)


def register_bench(bench_subparsers) -> None:
    b = bench_subparsers.add_parser(
        "tokenizers",
        help="tokenizer throughput against bare SentencePiece, PIL and PyAV",
        description="Text MB/s against bare SentencePiece encoding, images/s against bare PIL "
        "decode+resize, video frames/s against bare PyAV decode, each measured in the same run on "
        "generated data; prints each ratio.",
    )
    b.add_argument("--quick", action="store_true", help="small inputs and few repeats (a smoke run)")
    b.add_argument("--repeats", type=int, default=5, help="timed repeats per row; the best is kept (default 5)")
    b.add_argument("--json", help="also write the figures to this JSON file")
    b.set_defaults(func=_bench)


def _settings_from_args(args):
    from omniloom.tokenizers.settings import MediaSettings

    changes = {f: getattr(args, f) for _flag, f, _t, _h in _MEDIA_FLAGS if getattr(args, f, None) is not None}
    return MediaSettings(**changes)


def video_span_line(settings, videos: int, longer: int) -> str:
    """What a video block keeps of a long video, said once where the settings are chosen (issue 41:
    long videos trained on their first 7 s and nothing said so)."""
    n, fps = settings.video_frame_budget, settings.video_fps
    if settings.video_sampling == "spread":
        return (f"videos: {n} frames spread over each whole video (video_sampling spread); {videos} video(s) in "
                "this corpus")
    start = settings.video_clip_start
    span = f"{start:g}-{start + n / fps:g} s" if start else f"the first {n / fps:g} s"
    found = f"{longer} of {videos} video(s) in this corpus are longer and lose the rest" if videos else "no videos in this corpus"
    return (f"videos: each trains on {span} ({n} frames at {fps:g} fps, video_sampling clip); {found}. "
            "To keep more: --video-sampling spread (the frames spread over the whole video), or a larger "
            "--video-frame-budget / smaller --video-fps (a longer video block: mind data.seq_len)")


def _train(args) -> int:
    from omniloom.tokenizers.text import META_FILE, MODEL_FILE, has_tokenizer, train_tokenizer

    out = Path(args.out)
    if not args.force and has_tokenizer(out):
        raise ValueError(f"{out} already holds a tokenizer; pass --force to overwrite it or choose another --out")
    settings = _settings_from_args(args)
    tok = train_tokenizer(
        [Path(d) for d in args.data],
        out,
        args.vocab_size,
        settings=settings,
        max_sentences=args.max_sentences,
        seed=args.seed,
        character_coverage=args.character_coverage,
        num_threads=args.threads,
        progress=sys.stderr.isatty(),
    )
    corpus = tok.info["training"]["corpus"]
    print(
        f"wrote {out}/{MODEL_FILE} and {META_FILE} (+ Hugging Face tokenizer.json, tokenizer_config.json, special_tokens_map.json): vocab {tok.vocab_size}, "
        f"{corpus.get('documents', 0)} documents, {corpus.get('chunks_sampled', 0)}/{corpus.get('chunks_seen', 0)} chunks used, "
        f"patch_dim {tok.patch_dim}, tubelet_dim {tok.tubelet_dim}"
    )
    print(video_span_line(tok.settings, corpus.get("video_segments", 0), corpus.get("videos_longer_than_kept", 0)))
    skipped = {k: v for k, v in corpus.items() if k.startswith("bad") or k.startswith("truncated")}
    if skipped:
        print(f"skipped: {skipped}")
    return 0


def _encode(args) -> int:
    from omniloom.tokenizers.text import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    if args.text is not None:
        text = args.text
    elif args.file:
        text = Path(args.file).read_text(encoding="utf-8")
    else:
        text = sys.stdin.read()
    ids = tok.encode(text)
    print(" ".join(tok.id_to_piece(i) for i in ids) if args.pieces else " ".join(map(str, ids)))
    return 0


def _decode(args) -> int:
    from omniloom.tokenizers.text import Tokenizer

    tok = Tokenizer.load(args.tokenizer)
    try:
        ids = [int(x) for part in args.ids for x in part.replace(",", " ").split()]
    except ValueError as err:
        raise ValueError(f"ids must be integers: {err}") from err
    bad = [i for i in ids if not 0 <= i < tok.vocab_size]
    if bad:
        raise ValueError(f"ids out of range 0..{tok.vocab_size - 1}: {bad[:5]}")
    sys.stdout.write(tok.decode(ids, specials=args.specials) + "\n")
    return 0


def _show(args) -> int:
    import numpy as np

    from omniloom.tokenizers import corpus
    from omniloom.tokenizers.layout import MODALITY_NAMES
    from omniloom.tokenizers.settings import DocumentError
    from omniloom.tokenizers.text import Tokenizer
    from omniloom.tokenizers.unified import tokenize_document

    tok = Tokenizer.load(args.tokenizer)
    meta = tok.to_json()
    print(f"vocab_size {tok.vocab_size}; special ids {json.dumps(meta['special_ids'])}")
    print(f"patch_dim {tok.patch_dim}, tubelet_dim {tok.tubelet_dim}; media {json.dumps(meta['media'])}")
    if not args.data:
        return 0
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    shown = 0
    for shard in corpus.resolve_shards([Path(d) for d in args.data]):
        for key, doc, media in _iter_samples(shard):
            if shown >= args.limit:
                return 0
            shown += 1
            try:
                td = tokenize_document(doc, media, tok, key=key)
            except DocumentError as err:
                print(f"{key}: skipped ({err.reason}: {err})")
                continue
            counts = np.bincount(td.modality_L, minlength=len(MODALITY_NAMES))
            per = ", ".join(f"{n} {c}" for n, c in zip(MODALITY_NAMES, counts) if c)
            blocks = "; ".join(f"{MODALITY_NAMES[b.kind]} grid {b.grid}" for b in td.blocks)
            print(f"{key}: {len(td)} tokens ({per}); max position {int(td.positions_3L.max())}" + (f"; {blocks}" if blocks else "") + (f"; {td.stats}" if td.stats else ""))
            if out:
                _write_blocks(td, tok, out)
    return 0


def _iter_samples(shard: Path):
    """(key, doc, media) per sample of one tar, members grouped by key (adjacent in the tar)."""
    import tarfile

    key, doc, media = None, None, {}
    with tarfile.open(shard, mode="r:") as tar:
        for m in tar:
            if not m.isfile():
                continue
            k, _, suffix = m.name.split("/")[-1].partition(".")
            if k != key:
                if key is not None and doc is not None:
                    yield key, doc, media
                key, doc, media = k, None, {}
            data = tar.extractfile(m).read()
            if suffix == "doc.json":
                try:
                    doc = json.loads(data)
                except ValueError:
                    log.warning("%s: unparsable doc.json in %s", k, shard)
            else:
                media[suffix] = data
    if key is not None and doc is not None:
        yield key, doc, media


def _write_blocks(td, tok, out: Path) -> None:
    import numpy as np
    from PIL import Image

    from omniloom.tokenizers.unified import detokenize

    n = 0
    for seg in detokenize(td, tok):
        if seg["type"] == "image":
            Image.fromarray(seg["pixels"]).save(out / f"{td.key}.block{n}.png")
            n += 1
        elif seg["type"] == "video":
            Image.fromarray(np.concatenate(list(seg["frames"]), axis=1)).save(out / f"{td.key}.block{n}.frames.png")
            n += 1


def _bench(args) -> int:
    from omniloom.tokenizers.bench import run_bench

    figures = run_bench(quick=args.quick, repeats=args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0
