"""Text/code tokenizer: exact round trips, plain-sentencepiece parity, fixed special ids, training
from shard tars, deterministic corpus sampling, files and errors."""

from __future__ import annotations

import json
import pickle
from collections import Counter

import pytest
import sentencepiece as spm

from omniloom.tokenizers import layout
from omniloom.tokenizers.corpus import chunk_text, iter_shard_docs, resolve_shards, sample_chunks
from omniloom.tokenizers.settings import MediaSettings
from omniloom.tokenizers.testing import SAMPLE_CODE, write_doc_shard
from omniloom.tokenizers.text import Tokenizer, train_tokenizer

ROUND_TRIP = [
    "",
    " ",
    "hello world",
    "".join(chr(c) for c in range(128)),  # every ASCII character, all control characters included
    "\x00\x01\x7f",
    "    indented\n\tdef f(x):\n\t\treturn x  \n\n\n",
    "trailing spaces   \n   leading spaces",
    "mixed\r\nline\rends\n",
    "日本語のテキストと中文文本，한국어",
    "emoji 😀👍🏽 🇺🇳 family 👨‍👩‍👧",
    "combining e\u0301 and bom \ufeff and nbsp \u00a0 zwj \u200d",
    "the sentencepiece mark \u2581 itself, twice\u2581\u2581",
    "<|image|> <|patch|> <s></s><pad><unk> typed by a user",
    "\U0010ffff \ue000 private use",
    "x" * 100_000,  # one 100 KB line
    ("long_code_line = [" + ", ".join(str(i) for i in range(2000)) + "]\n"),
    SAMPLE_CODE,
]


@pytest.mark.parametrize("text", ROUND_TRIP, ids=range(len(ROUND_TRIP)))
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_array(text)) == text


def test_encode_batch_matches_encode(tok):
    assert tok.encode_batch(ROUND_TRIP[:14]) == [tok.encode(t) for t in ROUND_TRIP[:14]]


def test_plain_sentencepiece_gives_the_same_ids(tok, tmp_path):
    tok.save(tmp_path)
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert sp.vocab_size() == tok.vocab_size
    for text in ROUND_TRIP:
        if "\u2581" in text:  # the one documented difference (see text.py)
            continue
        assert sp.encode(text) == tok.encode(text)
        assert sp.decode(sp.encode(text)) == text
    for name, idx in tok.special_ids.items():
        piece = {"unk": "<unk>", "bos": "<s>", "eos": "</s>", "pad": "<pad>"}.get(name, f"<|{name}|>")
        assert sp.piece_to_id(piece) == idx
    assert sp.bos_id() == tok.bos_id == 1 and sp.eos_id() == 2 and sp.pad_id() == 3


def test_special_ids_are_fixed_and_never_produced_from_text(tok):
    assert tok.special_ids == {"unk": 0, "bos": 1, "eos": 2, "pad": 3, "image": 4, "/image": 5, "video": 6, "/video": 7, "patch": 8, "code": 9, "/code": 10}
    ids = tok.encode("<|image|><|patch|><|/image|><s></s>")
    assert not set(ids) & set(range(layout.FIRST_BYTE_ID))
    assert tok.id_to_piece(layout.FIRST_BYTE_ID) == "<0x00>" and tok.id_to_piece(layout.FIRST_LEARNED_ID - 1) == "<0xFF>"
    assert tok.decode([1, 4, 8, 5, 2]) == ""
    assert tok.decode([1] + tok.encode("a b") + [2], specials=True) == "<s>a b</s>"


def test_code_settings(tok):
    # identity normalization and no whitespace collapsing: runs of spaces stay as pieces
    pieces = tok.sp.encode("        return x", out_type=str)
    assert "".join(pieces).replace("\u2581", " ") == "        return x"
    assert any(set(p) == {"\u2581"} and len(p) > 1 for p in pieces)  # whitespace-only piece
    digits = tok.sp.encode("12345", out_type=str)
    assert digits == ["1", "2", "3", "4", "5"]  # digits split
    proto = tok.sp.serialized_model_proto()
    pb = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")  # needs protobuf

    m = pb.ModelProto()
    m.ParseFromString(proto)
    t, n = m.trainer_spec, m.normalizer_spec
    assert t.byte_fallback and t.split_digits and t.allow_whitespace_only_pieces and t.max_sentence_length >= 16384
    assert n.name == "identity" and not n.remove_extra_whitespaces and not n.add_dummy_prefix


def test_tokenizer_json_and_load(tok, tmp_path):
    tok.save(tmp_path)
    meta = json.loads((tmp_path / "omniloom_tokenizer.json").read_text())
    assert meta["format"] == "omniloom-tokenizer" and meta["vocab_size"] == tok.vocab_size
    s = tok.settings
    assert meta["patch_dim"] == 3 * s.patch_size**2 and meta["tubelet_dim"] == 3 * s.temporal_patch_size * s.patch_size**2
    for key in ("patch_size", "temporal_patch_size", "image_patch_budget", "video_fps", "video_frame_budget", "pixel_mean", "pixel_std"):
        assert key in meta["media"]
    again = Tokenizer.load(tmp_path)
    assert again.settings == tok.settings and again.encode(SAMPLE_CODE) == tok.encode(SAMPLE_CODE)
    assert Tokenizer.load(tmp_path / "omniloom_tokenizer.json").vocab_size == tok.vocab_size
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("pickled ok") == tok.encode("pickled ok") and clone.settings == tok.settings


def test_load_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="omniloom tokenizer train"):
        Tokenizer.load(tmp_path / "nothing")
    tok.save(tmp_path)
    meta = json.loads((tmp_path / "omniloom_tokenizer.json").read_text())
    meta["vocab_size"] += 1
    (tmp_path / "omniloom_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="do not belong together"):
        Tokenizer.load(tmp_path)
    meta["vocab_size"] -= 1
    meta["media"]["patch_sise"] = 8
    (tmp_path / "omniloom_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="did you mean 'patch_size'"):
        Tokenizer.load(tmp_path)


def test_media_settings_validation():
    with pytest.raises(ValueError, match="video_sampling"):
        MediaSettings(video_sampling="random")
    with pytest.raises(ValueError, match="patch_size"):
        MediaSettings(patch_size=0)
    s = MediaSettings(patch_size=14, temporal_patch_size=2)
    assert s.patch_dim == 588 and s.tubelet_dim == 1176
    assert MediaSettings.from_dict(s.to_dict()) == s


def test_chunking_never_drops_long_lines():
    text = "a" * 10_000 + "\n" + "short line\n" * 3 + "é" * 5000
    chunks = list(chunk_text(text, 4096))
    assert "".join(chunks) == text
    assert all(len(c.encode("utf-8")) <= 4096 for c in chunks)
    assert list(chunk_text("tiny")) == ["tiny"] and list(chunk_text("")) == []


def test_sampling_is_deterministic_and_bounded():
    texts = [f"document number {i}\n" for i in range(1000)]
    a = sample_chunks(texts, 50, seed=1)
    assert a == sample_chunks(texts, 50, seed=1)
    assert a != sample_chunks(texts, 50, seed=2)
    assert len(a) == 50 and len(set(a)) == 50
    assert sample_chunks(texts[:10], 50) == texts[:10]


def test_train_from_shards(tmp_path):
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    long_line = "value = " + " + ".join(f"item_{i}" for i in range(1500)) + "\n"  # ~15 KB, one line
    docs = []
    for i in range(40):
        segs = [{"type": "text", "text": f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n"},
                {"type": "image", "ref": "img0.jpg"},
                {"type": "code", "lang": "python", "text": f"def f{i}(x):\n    return x * {i}\n" + (long_line if i == 0 else "")}]
        docs.append((f"doc{i:04d}", {"schema": 1, "segments": segs, "meta": {}}, {"img0.jpg": b"\xff\xd8not really a jpeg"}))
    write_doc_shard(shard_dir / "t-000000.tar", docs[:20])
    write_doc_shard(shard_dir / "t-000001.tar", docs[20:])
    (shard_dir / "t-000002.tar").write_bytes(b"garbage, not a tar")
    manifest = {"format": "omniloom-shards", "version": 1, "name": "t", "shards": [{"name": f"t-00000{i}.tar"} for i in range(3)]}
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    assert len(resolve_shards(shard_dir)) == 3
    stats = Counter()
    assert len(list(iter_shard_docs(resolve_shards(shard_dir), stats))) == 40
    assert stats["bad_shard"] == 1

    tok = train_tokenizer(shard_dir, tmp_path / "tok", 400, settings=MediaSettings(patch_size=8))
    corpus = tok.info["training"]["corpus"]
    assert corpus["documents"] == 40 and corpus["text_segments"] == 40 and corpus["code_segments"] == 40
    assert corpus["chunks_seen"] > 80  # the long line was cut into chunks, not dropped
    assert (tmp_path / "tok" / "tokenizer.model").is_file()
    loaded = Tokenizer.load(tmp_path / "tok")
    assert loaded.vocab_size == 400 and loaded.settings.patch_size == 8
    assert loaded.decode(loaded.encode(long_line)) == long_line
    # same corpus, same seed: byte-identical model
    again = train_tokenizer(shard_dir, tmp_path / "tok2", 400)
    assert (tmp_path / "tok2" / "tokenizer.model").read_bytes() == (tmp_path / "tok" / "tokenizer.model").read_bytes()
    assert again.vocab_size == 400


def test_train_errors(tmp_path):
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["some text"], tmp_path, 100)
    with pytest.raises(FileNotFoundError):
        train_tokenizer(tmp_path / "missing", tmp_path / "out", 400)
    with pytest.raises(ValueError, match="no shard tars"):
        train_tokenizer(tmp_path, tmp_path / "out", 400)


@pytest.mark.parametrize("name", ["../outside.tar", "ABSOLUTE"])
def test_a_manifest_naming_a_shard_outside_its_folder_is_refused(tmp_path, name):
    """Issue 39 item 3, for `omniloom tokenizer train --data DIR`: a shard name that leaves DIR was
    read from wherever it pointed."""
    (tmp_path / "outside.tar").write_bytes(b"")
    shard_dir = tmp_path / "shards"
    shard_dir.mkdir()
    name = str(tmp_path / "outside.tar") if name == "ABSOLUTE" else name
    manifest = {"format": "omniloom-shards", "version": 1, "name": "t", "shards": [{"name": name}]}
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json: shards\[0\].name .* is not a file name inside the shard folder"):
        resolve_shards(shard_dir)
