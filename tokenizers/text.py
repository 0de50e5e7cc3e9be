"""The omniloom tokenizer: SentencePiece BPE for text and code plus the layout's special ids and the
image/video settings (docs/data-format.md), saved as `tokenizer.model` + `omniloom_tokenizer.json`,
with the Hugging Face view of the same ids beside them (`tokenizer.json`, `tokenizer_config.json`,
`special_tokens_map.json`; tokenizers/hf.py).

Folders written before the rename hold omniloom's metadata as `tokenizer.json` (format
"omniloom-tokenizer"); they still load. `model_sha256` in the metadata is checked on every load:
a tokenizer.model that was replaced or corrupted is refused with the file named.

Encoding then decoding any UTF-8 string gives it back exactly (identity normalization, byte
fallback, no dummy prefix, no whitespace collapsing). The one character SentencePiece cannot carry
through is U+2581 (its own whitespace mark): the wrapper encodes it as its three UTF-8 byte pieces,
so only text containing U+2581 gets ids that differ from a bare SentencePiece encode.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from omniloom.tokenizers import layout
from omniloom.tokenizers.settings import MediaSettings, MediaSizes

log = logging.getLogger(__name__)

FORMAT = "omniloom-tokenizer"
VERSION = 1
MODEL_FILE, META_FILE = "tokenizer.model", "omniloom_tokenizer.json"
# every file `Tokenizer.save` writes (an export carries them all); the last three are tokenizers/hf.py's HF_FILES
SAVED_FILES = (MODEL_FILE, META_FILE, "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
LEGACY_META_FILE = "tokenizer.json"  # omniloom's metadata before it moved aside for Hugging Face's file
JSON_FILE = META_FILE  # the old constant's name
WS_MARK = "\u2581"
_WS_MARK_BYTE_IDS = [layout.FIRST_BYTE_ID + b for b in WS_MARK.encode("utf-8")]

# SentencePiece settings fit for code (FIELD-NOTES "SentencePiece for text + code").
SP_TRAINER_DEFAULTS = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    add_dummy_prefix=False,
    max_sentence_length=16384,  # bytes; corpus chunks are cut at 4096 so none is ever dropped
    input_sentence_size=0,  # we sample deterministically ourselves (corpus.sample_chunks)
    shuffle_input_sentence=False,
    max_sentencepiece_length=16,
)


class Tokenizer(MediaSizes):
    """Text/code ids, special ids and media settings of one trained tokenizer (patch_dim and
    tubelet_dim from MediaSizes).

    `Tokenizer.load(dir)` reads tokenizer.model + omniloom_tokenizer.json. Picklable (DataLoader workers get
    a copy of the serialized model, not a file path).
    """

    def __init__(self, model_proto: bytes, settings: MediaSettings | None = None, info: dict | None = None):
        import sentencepiece as spm

        self._proto = bytes(model_proto)
        self.sp = spm.SentencePieceProcessor(model_proto=self._proto)
        self.settings = settings or MediaSettings()
        self.info = dict(info or {})
        self.vocab_size = int(self.sp.vocab_size())
        self.special_ids = dict(layout.SPECIAL_IDS)
        for name, idx in self.special_ids.items():
            piece = layout.META_TOKENS[idx] if idx < len(layout.META_TOKENS) else layout.CONTROL_TOKENS[idx - len(layout.META_TOKENS)]
            if idx >= self.vocab_size or self.sp.id_to_piece(idx) != piece:
                raise ValueError(f"tokenizer model does not hold {piece!r} at id {idx} (special {name!r}); retrain it with `omniloom tokenizer train`")
        self.bos_id, self.eos_id, self.pad_id = layout.BOS_ID, layout.EOS_ID, layout.PAD_ID
        self.patch_id = layout.PATCH_ID
        self._encode = self.sp.encode
        self._special_set = frozenset(range(layout.FIRST_BYTE_ID))

    # -- text ----------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Ids of `text` (no bos/eos). decode(encode(s)) == s for every str s."""
        if WS_MARK not in text:
            return self._encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(WS_MARK)):
            if i:
                ids.extend(_WS_MARK_BYTE_IDS)
            if part:
                ids.extend(self._encode(part))
        return ids

    def encode_array(self, text: str) -> np.ndarray:
        """encode() as an int32 array, straight from SentencePiece's buffer (no Python list)."""
        if WS_MARK not in text:
            return self._encode(text, out_type="numpy")
        return np.asarray(self.encode(text), dtype=np.int32)

    def encode_batch(self, texts: Sequence[str], num_threads: int = -1) -> list[list[int]]:
        """encode() for many texts, in SentencePiece's thread pool for the common case."""
        plain = [i for i, t in enumerate(texts) if WS_MARK not in t]
        out: list[list[int] | None] = [None] * len(texts)
        if plain:
            for i, ids in zip(plain, self.sp.encode([texts[i] for i in plain], num_threads=num_threads)):
                out[i] = ids
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.encode(t)
        return out  # type: ignore[return-value]

    def decode(self, ids: Iterable[int], specials: bool = False) -> str:
        """Text of `ids`. Special ids decode to nothing, or to their tag text with specials=True."""
        ids = [int(i) for i in ids]
        if not specials:
            return self.sp.decode(ids)
        out, run = [], []
        for i in ids:
            if i in self._special_set:
                out.append(self.sp.decode(run))
                out.append(self.sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        out.append(self.sp.decode(run))
        return "".join(out)

    def id_to_piece(self, idx: int) -> str:
        return self.sp.id_to_piece(int(idx))

    def piece_to_id(self, piece: str) -> int:
        return int(self.sp.piece_to_id(piece))

    # -- files ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        """The omniloom_tokenizer.json object: vocab layout, special ids, media settings, training record."""
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_file": MODEL_FILE,
            "model_sha256": hashlib.sha256(self._proto).hexdigest(),
            "vocab_size": self.vocab_size,
            "special_ids": dict(self.special_ids),
            "special_tokens": {name: self.id_to_piece(i) for name, i in self.special_ids.items()},
            "reserved_ids": [len(layout.META_TOKENS) + len(layout.SPECIAL_TOKENS), layout.FIRST_BYTE_ID],  # [start, end)
            "byte_fallback_ids": [layout.FIRST_BYTE_ID, layout.FIRST_BYTE_ID + 256],
            "modalities": {name: i for i, name in enumerate(layout.MODALITY_NAMES)},
            "patch_dim": self.patch_dim,
            "tubelet_dim": self.tubelet_dim,
            "patch_layout": {"image": "c,y,x", "video": "c,t,y,x"},
            "media": self.settings.to_dict(),
            "training": self.info.get("training", {}),
        }

    def save(self, out_dir: str | os.PathLike) -> Path:
        """Write tokenizer.model, omniloom_tokenizer.json and the Hugging Face files into out_dir."""
        from omniloom.tokenizers.hf import hf_files

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / MODEL_FILE).write_bytes(self._proto)
        (out / META_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")
        for name, obj in hf_files(self.sp).items():
            (out / name).write_text(json.dumps(obj, indent=None if name == "tokenizer.json" else 2, ensure_ascii=False) + "\n",
                                    encoding="utf-8")
        return out

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Read a tokenizer folder (or the path of its omniloom_tokenizer.json). Refuses, naming the
        file, metadata of another format, a tokenizer.model whose sha256 differs from the recorded
        one, and a tokenizer.model SentencePiece cannot read."""
        jpath = find_meta_file(path)
        mpath = jpath.parent / MODEL_FILE
        meta = read_meta(jpath)
        if not mpath.is_file():
            raise FileNotFoundError(f"{jpath.parent} holds {jpath.name} but no {MODEL_FILE}; copy it from the tokenizer folder or retrain with `omniloom tokenizer train`")
        proto = mpath.read_bytes()
        want = meta.get("model_sha256")
        if want is not None:
            got = hashlib.sha256(proto).hexdigest()
            if got != want:
                raise ValueError(f"{mpath} does not belong to {jpath.name}: its sha256 is {got[:12]}..., the tokenizer recorded "
                                 f"{str(want)[:12]}... (the file was replaced or corrupted); restore the original {MODEL_FILE} "
                                 "or retrain with `omniloom tokenizer train`")
        try:
            settings = MediaSettings.from_dict(meta.get("media", {}))
        except ValueError as err:
            raise ValueError(f"{jpath}: {err}") from err
        try:
            tok = cls(proto, settings, {"training": meta.get("training", {})})
        except ValueError as err:
            raise ValueError(f"{mpath}: {err}") from err
        except Exception as err:  # sentencepiece raises RuntimeError (or a protobuf error) on a corrupt model
            raise ValueError(f"{mpath} is not a valid SentencePiece model ({type(err).__name__}: {str(err).strip()[:200]}); "
                             "restore it or retrain with `omniloom tokenizer train`") from err
        if meta.get("vocab_size") not in (None, tok.vocab_size):
            raise ValueError(f"{jpath} says vocab_size {meta['vocab_size']} but {mpath} has {tok.vocab_size}; the two files do not belong together")
        if meta.get("special_ids") not in (None, tok.special_ids):
            raise ValueError(f"{jpath} special ids differ from this omniloom's fixed layout; retrain the tokenizer")
        return tok

    def __getstate__(self):
        return {"proto": self._proto, "settings": self.settings.to_dict(), "info": self.info}

    def __setstate__(self, state):
        self.__init__(state["proto"], MediaSettings.from_dict(state["settings"]), state["info"])

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size}, patch_size={self.settings.patch_size}, temporal_patch_size={self.settings.temporal_patch_size})"


TextTokenizer = Tokenizer  # the name the brief uses; one class serves text, code and media settings


def find_meta_file(path: str | os.PathLike) -> Path:
    """omniloom's metadata file of a tokenizer folder (or the file itself): omniloom_tokenizer.json,
    else a legacy tokenizer.json written by omniloom (format "omniloom-tokenizer"). A tokenizer.json
    that is Hugging Face's is never taken for omniloom's."""
    p = Path(path)
    if p.suffix == ".json" and p.is_file():
        if p.name == META_FILE or _is_omniloom_meta_file(p):
            return p
        if (p.parent / META_FILE).is_file():  # e.g. a config that named the folder's tokenizer.json
            return p.parent / META_FILE
        raise ValueError(f"{p} is not omniloom's tokenizer metadata; pass the tokenizer folder (with {MODEL_FILE} + {META_FILE})")
    if (p / META_FILE).is_file():
        return p / META_FILE
    if (p / LEGACY_META_FILE).is_file() and _is_omniloom_meta_file(p / LEGACY_META_FILE):
        return p / LEGACY_META_FILE
    if not p.exists():
        raise FileNotFoundError(f"tokenizer folder {p} does not exist; make one with `omniloom tokenizer train`")
    extra = f" ({LEGACY_META_FILE} there is a Hugging Face file, not omniloom's)" if (p / LEGACY_META_FILE).is_file() else ""
    raise FileNotFoundError(f"{p} holds no {MODEL_FILE} + {META_FILE}{extra}; make one with `omniloom tokenizer train`")


def _is_omniloom_meta_file(path: Path) -> bool:
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return f'"format": "{FORMAT}"'.encode() in head or f'"format":"{FORMAT}"'.encode() in head


def read_meta(jpath: str | os.PathLike) -> dict:
    """Parse and check omniloom's tokenizer metadata (format and version), naming the file on error."""
    jpath = Path(jpath)
    try:
        meta = json.loads(jpath.read_text(encoding="utf-8"))
    except RecursionError:  # the parser recurses per level: 100,000 nested lists
        raise ValueError(f"{jpath} is nested too deep to be a file omniloom wrote; refusing to read it") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{jpath} is not valid JSON: {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(f"{jpath} is not an omniloom tokenizer (format {got!r}, want {FORMAT!r})")
    for key, tp in META_TYPES.items():
        value = meta.get(key)
        if key in meta and (isinstance(value, bool) or not isinstance(value, tp)):
            want = {int: "a whole number", str: "a string", dict: "an object"}[tp]
            raise ValueError(f"{jpath}: '{key}' must be {want}, got {value!r} (a {_JSON_NAMES.get(type(value), type(value).__name__)}); "
                             "the file is corrupt or was not written by omniloom")
    if meta.get("version", 0) > VERSION:
        raise ValueError(f"{jpath} has version {meta.get('version')}, newer than this omniloom reads ({VERSION}); upgrade omniloom")
    return meta


# The keys of omniloom_tokenizer.json that are read, and their JSON types.
META_TYPES = {"version": int, "vocab_size": int, "model_sha256": str, "special_ids": dict, "media": dict, "training": dict}
_JSON_NAMES = {str: "string", list: "list", dict: "object", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def has_tokenizer(folder: str | os.PathLike) -> bool:
    """Whether `folder` already holds an omniloom tokenizer (new or legacy names)."""
    try:
        find_meta_file(folder)
        return True
    except (FileNotFoundError, ValueError):
        return (Path(folder) / MODEL_FILE).exists()


def _is_path_source(source) -> bool:
    if isinstance(source, (str, os.PathLike)):
        return True
    if isinstance(source, (list, tuple)) and source and all(isinstance(s, os.PathLike) for s in source):
        return True
    return False


def train_tokenizer(
    source,
    out_dir: str | os.PathLike,
    vocab_size: int,
    *,
    settings: MediaSettings | None = None,
    max_sentences: int = 300_000,
    seed: int = 0,
    character_coverage: float = 0.99995,
    num_threads: int | None = None,
    progress: bool = False,
) -> Tokenizer:
    """Train the SentencePiece BPE model and write tokenizer.model + omniloom_tokenizer.json (and the
    Hugging Face files) to out_dir.

    `source` is a shard directory or tar (str or Path), a list of Paths, or any iterable of text
    strings. Text and code segments are cut into chunks of <= 4 KB at line ends; when there are
    more than `max_sentences` chunks a deterministic uniform sample (seeded reservoir) is used.
    Returns the loaded Tokenizer.
    """
    import sentencepiece as spm

    from omniloom.tokenizers import corpus

    if vocab_size < layout.FIRST_LEARNED_ID + 64:
        raise ValueError(f"vocab_size {vocab_size} is too small: {layout.FIRST_LEARNED_ID} ids are fixed (specials + 256 byte pieces); use at least {layout.FIRST_LEARNED_ID + 64}")
    if max_sentences < 1:
        raise ValueError("max_sentences must be >= 1")
    stats: Counter = Counter()
    t0 = time.perf_counter()
    if _is_path_source(source):
        shards = corpus.resolve_shards(source)
        docs = corpus.iter_shard_docs(shards, stats)
        if progress:
            from tqdm import tqdm

            docs = tqdm(docs, desc="reading documents", unit="doc", mininterval=1.0)
        kept = settings or MediaSettings()
        # the span a video block keeps: clip sampling keeps frame_budget frames at fps from the clip start
        span = kept.video_frame_budget / kept.video_fps if kept.video_sampling == "clip" else None
        texts = corpus.iter_text_segments(docs, stats, video_seconds=span)
        source_desc = [str(p) for p in shards]
    else:
        texts = source
        source_desc = "in-memory texts"
    sentences = corpus.sample_chunks(texts, max_sentences, seed, stats)
    if not sentences:
        raise ValueError(f"no text or code found to train on ({dict(stats)}); check that the shards hold text/code segments")
    options = dict(SP_TRAINER_DEFAULTS)
    options.update(
        vocab_size=vocab_size,
        character_coverage=character_coverage,
        unk_id=layout.UNK_ID,
        bos_id=layout.BOS_ID,
        eos_id=layout.EOS_ID,
        pad_id=layout.PAD_ID,
        control_symbols=list(layout.CONTROL_TOKENS),
        num_threads=num_threads or min(16, os.cpu_count() or 1),
        minloglevel=0 if log.isEnabledFor(logging.DEBUG) else 2,
    )
    log.info("training SentencePiece BPE: vocab %d on %d chunks (%d chars)", vocab_size, len(sentences), stats["chunk_chars"])
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model, **options)
    except RuntimeError as err:
        msg = str(err)
        if "Vocabulary size" in msg or "vocab_size" in msg:
            raise ValueError(f"SentencePiece cannot build {vocab_size} pieces from this corpus ({msg.strip()}); use a smaller --vocab-size or more text") from err
        raise
    info = {
        "training": {
            "vocab_size": vocab_size,
            "seed": seed,
            "max_sentences": max_sentences,
            "character_coverage": character_coverage,
            "sentencepiece": {k: v for k, v in options.items() if k not in ("control_symbols", "minloglevel", "num_threads")},
            "corpus": {"source": source_desc, **{k: int(v) for k, v in sorted(stats.items())}},
            "seconds": round(time.perf_counter() - t0, 3),
        }
    }
    tok = Tokenizer(model.getvalue(), settings or MediaSettings(), info)
    tok.save(out_dir)
    log.info("wrote %s (%d pieces) in %.1fs", Path(out_dir) / MODEL_FILE, tok.vocab_size, time.perf_counter() - t0)
    return tok
