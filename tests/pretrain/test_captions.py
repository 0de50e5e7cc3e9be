"""`omniloom eval --captions` (pretrain/inference/captions.py): the demo's caption grammar, the probes'
pixel transforms, batched greedy decoding against `omniloom generate`, and the scoring."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from omniloom.data.prep.demo_corpus import (DemoCorpusSettings, _captioned_set, _motion_video, _shape_image,
                                            parse_caption)
from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.pretrain.inference import captions as C


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(tok, seed=0):
    cfg = ModelConfig(
        dim=32, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size, patch_token_id=tok.patch_id,
        rope_sections=(2, 2, 4), rope_layout="interleaved", patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim,
        attention=AttentionConfig(backend="blocksparse", pattern="LBG", window=16, block_size=8, num_selected_blocks=2),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32),
    )
    torch.manual_seed(seed)
    return OmniModel(cfg).eval()


def test_parse_caption_inverts_the_demo_generator():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        _, caption = _shape_image(rng, 48)
        attrs = parse_caption(caption)
        assert attrs is not None and attrs["kind"] == "image", caption
        where = "in the center" if (attrs["row"], attrs["column"]) == ("middle", "center") else f"at the {attrs['row']} {attrs['column']}"
        assert caption == f"a {attrs['size']} {attrs['colour']} {attrs['shape']} {where}."
        seen.add((attrs["row"], attrs["column"]))
    assert len(seen) == 9
    _, caption = _motion_video(rng, 32, 4, 4)
    attrs = parse_caption(caption)
    assert attrs["kind"] == "video" and caption == f"a {attrs['colour']} {attrs['shape']} moves {attrs['direction']}."
    for other in ("a large red circle at the middle center.", "a red circle.", "a small red circle at the top left",
                  "A small red circle at the top left.", ""):
        assert parse_caption(other) is None


def test_probes_move_the_pixels_and_nothing_else(tok):
    from omniloom.tokenizers.image import frames_to_patches

    rng = np.random.default_rng(1)
    settings = tok.settings
    p = settings.patch_size
    img = rng.integers(0, 256, (1, 3 * p, 4 * p, 3), dtype=np.uint8)
    patches, grid = frames_to_patches(img, settings, 1)
    for probe, moved in (("mirror", img[:, :, ::-1]), ("flip", img[:, ::-1])):
        want, _ = frames_to_patches(np.ascontiguousarray(moved), settings, 1)
        np.testing.assert_array_equal(C.transform_block(patches, grid, "image", probe, settings, rng), want)
    vid = rng.integers(0, 256, (4, 2 * p, 2 * p, 3), dtype=np.uint8)
    tp = settings.temporal_patch_size
    vpatches, vgrid = frames_to_patches(vid, settings, tp)
    want, _ = frames_to_patches(np.ascontiguousarray(vid[::-1]), settings, tp)
    np.testing.assert_array_equal(C.transform_block(vpatches, vgrid, "video", "reverse", settings, rng), want)
    shuffled = C.transform_block(patches, grid, "image", "shuffle", settings, rng)
    assert not np.array_equal(shuffled, patches)
    assert sorted(map(bytes, shuffled)) == sorted(map(bytes, patches))  # the same patches, elsewhere


def _prompt_docs(tok):
    from omniloom.tokenizers.testing import make_image_bytes, make_video_bytes
    from omniloom.tokenizers.unified import tokenize_document

    media = {"a.png": make_image_bytes(32, 24), "b.png": make_image_bytes(32, 24, seed=3), "c.png": make_image_bytes(16, 16),
             "d.png": make_image_bytes(32, 24, seed=5), "v.mp4": make_video_bytes(seconds=1.0, fps=4, width=32, height=16)}
    return [tokenize_document({"segments": [{"type": "video" if ref.endswith("mp4") else "image", "ref": ref}]},
                              {ref: data}, tok, key=ref) for ref, data in media.items()]


def test_batched_greedy_captions_equal_omniloom_generate_one_by_one(tok):
    from omniloom.pretrain.inference.generate import generate, prompt_from_doc

    model = tiny_model(tok)
    docs = _prompt_docs(tok)
    width = max(tok.patch_dim, tok.tubelet_dim)
    free = [generate(model, prompt_from_doc(d, drop_eos=True, patch_width=width), max_new_tokens=8, eos_id=-1).ids for d in docs]
    eos = free[0][2]  # a token the model really emits: row 0 stops there, others when they meet it
    got = C.greedy_captions(model, docs, max_new_tokens=8, eos_id=eos, patch_width=width)
    for d, ids in zip(docs, got):
        one = generate(model, prompt_from_doc(d, drop_eos=True, patch_width=width), max_new_tokens=8, eos_id=eos).ids
        assert ids == [t for t in one if t != eos][:len(ids)] and (len(ids) == 8 or one[len(ids)] == eos)
    assert len(got[0]) == 2
    assert len({len(d) for d in docs}) >= 3  # several decoding groups


@pytest.fixture(scope="module")
def heldout(tmp_path_factory, tok):
    from omniloom.pretrain.cli import main

    root = tmp_path_factory.mktemp("captions")
    settings = DemoCorpusSettings(image_size=32, video_frames=4, video_fps=4)
    rng = np.random.default_rng(7)
    caps = _captioned_set(root, "shapes", rng, 12, settings, video=False)
    caps += _captioned_set(root, "motion", rng, 6, settings, video=True)
    assert main(["-qq", "data", "build", str(root / "shapes.jsonl"), str(root / "motion.jsonl"), "--out", str(root / "shards")]) == 0
    return root / "shards", caps


def test_scores_an_oracle_that_sees_perfectly(tok, heldout, monkeypatch):
    shards, _ = heldout
    # an oracle that knows the caption of every original, mirrored, flipped and reversed block
    # (by its exact patches) and says nothing for shuffled ones
    docs = C._load_caption_docs(tok, str(shards), None, __import__("collections").Counter())
    assert {d.kind for d in docs} == {"image", "video"} and len(docs) >= 15
    swap = {"mirror": ("column", {"left": "right", "right": "left"}), "flip": ("row", {"top": "bottom", "bottom": "top"}),
            "reverse": ("direction", {"left": "right", "right": "left", "up": "down", "down": "up"})}
    answers = {}
    rng = np.random.default_rng(0)

    def key(patches):
        return hashlib.sha1(np.ascontiguousarray(patches, dtype=np.float32).tobytes()).hexdigest()

    for d in docs:
        (blk,) = d.prompt.blocks
        answers[key(blk.patches_ND)] = d.caption
        for probe, (attr, change) in swap.items():
            if (probe == "reverse") != (d.kind == "video"):
                continue
            moved = C.transform_block(blk.patches_ND, blk.grid, d.kind, probe, tok.settings, rng)
            words = d.caption
            old = parse_caption(d.caption)[attr]
            new = change.get(old, old)
            if attr == "column" and old != new:
                words = words.replace(f" {old}.", f" {new}.")
            elif attr == "row" and old != new:
                words = words.replace(f"the {old} ", f"the {new} ")
            elif attr == "direction":
                words = words.replace(f"moves {old}", f"moves {new}")
            answers[key(moved)] = words

    def oracle(model, prompts, *, max_new_tokens, eos_id, patch_width):
        return [tok.encode(answers.get(key(p.blocks[0].patches_ND), "")) for p in prompts]

    monkeypatch.setattr(C, "greedy_captions", oracle)
    res = C.caption_benchmark(None if False else tiny_model(tok), tok, str(shards))
    assert res["exact"] == {"image": 1.0, "video": 1.0}
    assert res["grammar"] == "demo"
    for rows in res["attributes"].values():
        assert all(r["accuracy"] == 1.0 and 0 < r["majority"] <= 1 for r in rows.values())
    assert set(res["attributes"]["image"]) == {"colour", "size", "shape", "row", "column"}
    assert set(res["attributes"]["video"]) == {"colour", "shape", "direction"}
    pr = res["probes"]
    for probe, attr in (("mirror", "column"), ("flip", "row"), ("reverse", "direction")):
        assert pr[probe][f"{attr}_changed"] == 1.0 and pr[probe][f"{attr}_transformed"] == 1.0, pr[probe]
    assert pr["shuffle"]["changed"] == 1.0
    lines = C.format_captions(res)
    assert lines[0].startswith("exact captions: image 100.0%") and any("| mirror |" in line for line in lines)


def test_eval_captions_cli_writes_the_benchmark(tok, heldout, tmp_path, capsys):
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.export.write import save_export

    shards, caps = heldout
    tok_dir = tmp_path / "tok"
    tok.save(tok_dir)
    save_export(tiny_model(tok), tok_dir, tmp_path / "export")
    out = tmp_path / "eval.json"
    assert main(["-qq", "eval", str(tmp_path / "export"), "--data", str(shards), "--out", str(out), "--no-progress",
                 "--captions"]) == 0
    res = json.loads(out.read_text())["captions"]
    assert res["docs"]["image"] + res["docs"]["video"] == len(caps) - sum(res["skipped"].values())
    assert set(res["probes"]) == {"mirror", "flip", "shuffle", "reverse"}
    assert 0 <= res["exact"]["image"] <= 1 and res["attributes"]["image"]["column"]["majority"] > 0
    printed = capsys.readouterr().out
    assert "exact captions: image" in printed and "| column |" in printed
    # issue 41 item 5: a few captions themselves, true and generated, not only the percentages
    ex = res["examples"][0]
    assert f"true: {ex['true']!r}" in printed and f"generated: {ex['generated']!r}" in printed
    assert printed.count("true: ") == len(res["examples"]) >= 2


def test_generation_never_emits_the_patch_token(tok):
    # a patch token has no pixel vector: emitted, the next step's embedding refused it (a crash)
    from omniloom.pretrain.inference.generate import generate, prompt_from_doc

    model = tiny_model(tok)
    with torch.no_grad():
        model.head.weight[tok.patch_id] = model.norm.detach() * 50.0  # the patch token wins every argmax
    doc = _prompt_docs(tok)[0]
    width = max(tok.patch_dim, tok.tubelet_dim)
    for use_cache in (True, False):
        ids = generate(model, prompt_from_doc(doc, drop_eos=True, patch_width=width), max_new_tokens=4, eos_id=-1,
                       use_cache=use_cache).ids
        assert len(ids) == 4 and tok.patch_id not in ids
    (got,) = C.greedy_captions(model, [doc], max_new_tokens=4, eos_id=-1, patch_width=width)
    assert len(got) == 4 and tok.patch_id not in got
