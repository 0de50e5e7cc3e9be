"""The unified layout: ids, modality, M-RoPE positions and blocks of a mixed document,
detokenize back to segments, document errors, and the `omniloom tokenizer` CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omniloom.pretrain.cli import main
from omniloom.tokenizers import layout
from omniloom.tokenizers.image import decode_image
from omniloom.tokenizers.layout import CODE, IMAGE, SPECIAL, TEXT, VIDEO, validate_tokenized_doc
from omniloom.tokenizers.settings import DocumentError, MediaError
from omniloom.tokenizers.testing import make_image_bytes, make_video_bytes, write_doc_shard
from omniloom.tokenizers.unified import detokenize, tokenize_document
from omniloom.tokenizers.video import decode_video


@pytest.fixture(scope="module")
def mixed(tok):
    doc = {"schema": 1, "segments": [
        {"type": "text", "text": "A photo:"},
        {"type": "image", "ref": "img0.png"},
        {"type": "text", "text": " then a clip "},
        {"type": "video", "ref": "vid0.mp4"},
        {"type": "code", "lang": "python", "text": "def f(x):\n\treturn x  # done\n"},
    ], "meta": {}}
    media = {"img0.png": make_image_bytes(40, 24), "vid0.mp4": make_video_bytes(2.5, 10, 32, 24)}
    return doc, media, tokenize_document(doc, media, tok, key="mixed0")


def test_mixed_document_ids_modality_blocks(tok, mixed):
    doc, media, td = mixed
    validate_tokenized_doc(td, tok.patch_dim, tok.tubelet_dim)
    assert td.key == "mixed0" and len(td.blocks) == 2
    img, vid = td.blocks
    t1 = tok.encode("A photo:")
    t2 = tok.encode(" then a clip ")
    code = tok.encode("python\ndef f(x):\n\treturn x  # done\n")
    s = tok.settings
    # image 40x24 at p=8 within 16 patches: grid (1, 3, 5); video 2.5 s at 2 fps -> 5 frames, budget 4 -> 2 groups
    assert img.grid == (1, 3, 5) and img.kind == IMAGE and img.patches_ND.shape == (15, s.patch_dim)
    assert vid.grid[0] == 2 and vid.kind == VIDEO and vid.patches_ND.shape == (vid.length, s.tubelet_dim)
    want_ids = ([layout.BOS_ID] + t1 + [layout.IMAGE_ID] + [layout.PATCH_ID] * 15 + [layout.IMAGE_END_ID] + t2
                + [layout.VIDEO_ID] + [layout.PATCH_ID] * vid.length + [layout.VIDEO_END_ID]
                + [layout.CODE_ID] + code + [layout.CODE_END_ID, layout.EOS_ID])
    assert td.ids_L.tolist() == want_ids
    want_mod = ([SPECIAL] + [TEXT] * len(t1) + [SPECIAL] + [IMAGE] * 15 + [SPECIAL] + [TEXT] * len(t2)
                + [SPECIAL] + [VIDEO] * vid.length + [SPECIAL] + [SPECIAL] + [CODE] * len(code) + [SPECIAL, SPECIAL])
    assert td.modality_L.tolist() == want_mod
    assert img.start == 1 + len(t1) + 1


def test_mixed_document_positions(tok, mixed):
    _, _, td = mixed
    img, vid = td.blocks
    pos = td.positions_3L
    t1 = len(tok.encode("A photo:"))
    t2 = len(tok.encode(" then a clip "))
    # bos, text, <|image|> advance all three axes by one
    assert (pos[:, : img.start] == np.arange(img.start)).all()
    p = img.start  # running position at the first patch
    T, H, W = img.grid
    grid_t, grid_h, grid_w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    np.testing.assert_array_equal(pos[:, img.start : img.start + img.length], np.stack([grid_t.ravel(), grid_h.ravel(), grid_w.ravel()]) + p)
    # </image> and the text after it resume at p + max(T, H, W)
    after = img.start + img.length
    resume = p + max(img.grid)
    assert (pos[:, after : after + 1 + t2 + 1] == np.arange(resume, resume + 2 + t2)).all()
    q = resume + 2 + t2  # first video tubelet
    assert vid.start == after + 1 + t2 + 1 and (pos[:, vid.start - 1] == q - 1).all()
    T, H, W = vid.grid
    grid_t, grid_h, grid_w = np.meshgrid(np.arange(T), np.arange(H), np.arange(W), indexing="ij")
    np.testing.assert_array_equal(pos[:, vid.start : vid.start + vid.length], np.stack([grid_t.ravel(), grid_h.ravel(), grid_w.ravel()]) + q)
    end = vid.start + vid.length
    rest = len(td) - end
    assert (pos[:, end:] == np.arange(q + max(vid.grid), q + max(vid.grid) + rest)).all()
    assert pos[:, -1].tolist() == [int(pos[0, -1])] * 3 and t1 > 0


def test_detokenize_round_trip(tok, mixed):
    doc, media, td = mixed
    segs = detokenize(td, tok)
    assert [s["type"] for s in segs] == ["text", "image", "text", "video", "code"]
    assert segs[0]["text"] == "A photo:" and segs[2]["text"] == " then a clip "
    assert segs[4] == {"type": "code", "lang": "python", "text": "def f(x):\n\treturn x  # done\n"}
    assert np.array_equal(segs[1]["pixels"], decode_image(media["img0.png"], tok.settings))
    frames, _ = decode_video(media["vid0.mp4"], tok.settings)
    assert np.array_equal(segs[3]["frames"][: len(frames)], frames)


def test_text_only_and_edge_documents(tok):
    td = tokenize_document({"segments": [{"type": "text", "text": "hi"}, {"type": "text", "text": "\u2581 there\t"}]}, tok)
    assert detokenize(td, tok) == [{"type": "text", "text": "hi\u2581 there\t"}]
    assert (td.positions_3L == np.arange(len(td))).all() and td.blocks == []
    empty = tokenize_document({"segments": []}, {}, tok)
    assert empty.ids_L.tolist() == [layout.BOS_ID, layout.EOS_ID]
    validate_tokenized_doc(empty)
    code = tokenize_document({"segments": [{"type": "code", "text": "x = 1"}]}, None, tok)
    assert detokenize(code, tok) == [{"type": "code", "lang": "", "text": "x = 1"}]


def test_document_errors(tok):
    with pytest.raises(DocumentError) as err:
        tokenize_document({"segments": [{"type": "image", "ref": "img0.jpg"}]}, {}, tok)
    assert err.value.reason == "missing_media"
    for bad in ({"segments": [{"type": "audio"}]}, {"segments": [{"type": "text"}]}, {"nosegments": 1}, {"segments": [{"type": "code", "lang": "a\nb", "text": ""}]}):
        with pytest.raises(DocumentError) as err:
            tokenize_document(bad, {}, tok)
        assert err.value.reason == "bad_segment"
    doc = {"segments": [{"type": "text", "text": "x"}, {"type": "image", "ref": "a.jpg"}, {"type": "video", "ref": "b.mp4"}]}
    media = {"a.jpg": b"not an image", "b.mp4": b"not a video"}
    with pytest.raises(MediaError) as err:
        tokenize_document(doc, media, tok)
    assert err.value.reason == "undecodable"
    td = tokenize_document(doc, media, tok, media_errors="drop")
    assert td.blocks == [] and td.stats == {"dropped_undecodable": 2}


def test_cli_train_encode_decode_show(tmp_path, capsys):
    shards = tmp_path / "shards"
    shards.mkdir()
    docs = [(f"d{i:03d}", {"schema": 1, "segments": [
        {"type": "text", "text": f"Document {i} talks about rivers, mills and meadows in spring.\n"},
        {"type": "code", "lang": "python", "text": f"for i in range({i}):\n    print(i * {i})\n"},
        {"type": "image", "ref": "img0.png"}], "meta": {}}, {"img0.png": make_image_bytes(32, 32)}) for i in range(30)]
    write_doc_shard(shards / "s-000000.tar", docs)
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--data", str(shards), "--vocab-size", "360", "--out", str(out), "--patch-size", "8", "--image-patch-budget", "16"]) == 0
    assert "vocab 360" in capsys.readouterr().out
    meta = json.loads((out / "omniloom_tokenizer.json").read_text())
    assert meta["patch_dim"] == 192 and meta["media"]["image_patch_budget"] == 16
    # refuses to overwrite without --force: a user error, exit 2
    assert main(["tokenizer", "train", "--data", str(shards), "--vocab-size", "360", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert main(["tokenizer", "encode", "--tokenizer", str(out), "print(i)\n"]) == 0
    ids = capsys.readouterr().out.split()
    assert main(["tokenizer", "decode", "--tokenizer", str(out), *ids]) == 0
    assert capsys.readouterr().out == "print(i)\n\n"
    assert main(["tokenizer", "decode", "--tokenizer", str(out), "999999"]) == 2
    assert main(["tokenizer", "show", "--tokenizer", str(out), "--data", str(shards), "--limit", "2", "--out", str(tmp_path / "look")]) == 0
    shown = capsys.readouterr().out
    assert "d000:" in shown and "image grid (1, 4, 4)" in shown
    assert (tmp_path / "look" / "d000.block0.png").is_file()
    assert main(["tokenizer", "show", "--tokenizer", str(tmp_path / "nope")]) == 2


@pytest.mark.slow
def test_bench_quick_runs():
    from omniloom.tokenizers.bench import run_bench

    figures = run_bench(quick=True, repeats=1)
    names = [r["name"] for r in figures["rows"]]
    assert any(n.startswith("text") for n in names) and any(n.startswith("image") for n in names) and any(n.startswith("video") for n in names)
    assert all(r["ours"] > 0 and r["reference"] > 0 for r in figures["rows"])


def test_train_summary_says_how_much_of_a_long_video_trains(tmp_path, capsys):
    """Issue 41 item 5: long videos trained on their first 7 s by default and nothing said so. The
    build records each video's duration in the document's meta; the tokenizer summary counts the
    videos longer than the span a block keeps and says how to change it."""
    shards = tmp_path / "shards"
    shards.mkdir()
    docs = [(f"d{i:03d}", {"schema": 1, "segments": [
        {"type": "text", "text": f"Document {i} talks about rivers, mills and meadows in spring.\n"},
        {"type": "video", "ref": "vid0.mp4"}], "meta": {"media": {"vid0.mp4": {"duration": float(3 + 2 * i)}}}},
        {"vid0.mp4": b"not read by the tokenizer trainer"}) for i in range(6)]  # 3, 5, 7, 9, 11, 13 s
    write_doc_shard(shards / "s-000000.tar", docs)
    assert main(["tokenizer", "train", "--data", str(shards), "--vocab-size", "360", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "videos: each trains on the first 7 s (14 frames at 2 fps, video_sampling clip); 3 of 6 video(s) in this corpus are longer" in out
    assert "--video-sampling spread" in out
    assert main(["tokenizer", "train", "--data", str(shards), "--vocab-size", "360", "--out", str(tmp_path / "b"),
                 "--video-fps", "1"]) == 0
    assert "the first 14 s (14 frames at 1 fps, video_sampling clip); 0 of 6 video(s)" in capsys.readouterr().out
    assert main(["tokenizer", "train", "--data", str(shards), "--vocab-size", "360", "--out", str(tmp_path / "d"),
                 "--video-clip-start", "2"]) == 0
    assert "each trains on 2-9 s (14 frames at 2 fps" in capsys.readouterr().out
    assert main(["tokenizer", "train", "--data", str(shards), "--vocab-size", "360", "--out", str(tmp_path / "c"),
                 "--video-sampling", "spread"]) == 0
    assert "videos: 14 frames spread over each whole video (video_sampling spread); 6 video(s)" in capsys.readouterr().out
