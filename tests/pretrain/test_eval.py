"""omniloom eval: per-modality loss/perplexity on held-out shards and the cross-modal gap (own
visual block vs another document's), on tiny models; a slow test trains a tiny model on captioned
images and checks the gap turns positive."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.pretrain.cli import main
from omniloom.pretrain.inference.evaluate import evaluate, resample_patches

COLORS = {"red": (220, 30, 30), "green": (30, 200, 40), "blue": (30, 40, 220), "yellow": (230, 220, 30)}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(tok, seed=0, dim=32):
    cfg = ModelConfig(
        dim=dim, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size, patch_token_id=tok.patch_id,
        rope_sections=(2, 2, 4) if dim == 32 else (4, 6, 6), patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim,
        attention=AttentionConfig(backend="blocksparse", pattern="LG", window=32, block_size=8, num_selected_blocks=2),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=2 * dim),
    )
    torch.manual_seed(seed)
    return OmniModel(cfg).eval()


def _png(rgb, w, h):
    import io

    from PIL import Image

    arr = np.zeros((h, w, 3), np.uint8)
    arr[:] = rgb
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def write_corpus(root, n_images=6, sizes=((32, 24), (32, 24), (24, 24))):
    """Captioned solid-colour images (grids differ by size), two captioned videos, one text doc."""
    from omniloom.tokenizers.testing import make_video_bytes

    root.mkdir(parents=True)
    docs, names = [], list(COLORS)
    for i in range(n_images):
        name = names[i % len(names)]
        w, h = sizes[i % len(sizes)]
        rgb = tuple(min(255, c + i) for c in COLORS[name])  # no two alike (the build drops duplicates)
        (root / f"img{i}.png").write_bytes(_png(rgb, w, h))
        docs.append({"schema": 1, "segments": [{"type": "image", "ref": f"img{i}.png"}, {"type": "text", "text": f"A {name} picture."}]})
    for i in range(2):
        (root / f"vid{i}.mp4").write_bytes(make_video_bytes(seconds=1.0, fps=4, width=32, height=16 + 8 * i))
        docs.append({"schema": 1, "segments": [{"type": "video", "ref": f"vid{i}.mp4"}, {"type": "text", "text": f"clip {i} moves"}]})
    docs.append({"schema": 1, "segments": [{"type": "text", "text": "Plain prose without pictures."},
                                           {"type": "code", "lang": "python", "text": "x = 1\n"}]})
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return len(docs)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    root = tmp_path_factory.mktemp("eval")
    tok = make_tiny_tokenizer(root / "tok")
    n = write_corpus(root / "corpus")
    assert main(["-qq", "data", "build", str(root / "corpus" / "docs.jsonl"), "--out", str(root / "shards")]) == 0
    return root, tok, n


def test_eval_cli_reports_losses_perplexity_and_gap(setup, tmp_path, capsys):
    from omniloom.pretrain.export.write import save_export

    root, tok, n = setup
    save_export(tiny_model(tok), root / "tok", tmp_path / "export")
    out = tmp_path / "eval.json"
    assert main(["-qq", "eval", str(tmp_path / "export"), "--data", str(root / "shards"), "--out", str(out), "--no-progress"]) == 0
    res = json.loads(out.read_text())
    printed = capsys.readouterr().out
    for kind in ("image", "video"):  # issue 28.9: the gap's interval over documents, in the JSON and the print
        d = res["cross_modal_gap_detail"][kind]
        assert d["stderr"] > 0 and d["ci95"][0] < d["gap"] < d["ci95"][1]
        assert d["distinguishable_from_zero"] == (d["ci95"][0] > 0 or d["ci95"][1] < 0)
        assert f"{kind}={res['cross_modal_gap'][kind]:+.4g} (95% CI {d['ci95'][0]:+.4g} to {d['ci95'][1]:+.4g}, {d['docs']} documents" in printed
    assert res["counts"]["docs"] == n and res["counts"]["skipped"] == {}
    for key in ("all", "text", "code", "special"):
        assert res["loss"][key] > 0 and math.isclose(res["perplexity"][key], math.exp(res["loss"][key]), rel_tol=1e-9)
    assert "image" not in res["loss"]  # patches are never targets
    assert set(res["loss_by_doc_kind"]) == {"image", "video", "text"}
    gap = res["cross_modal_gap"]
    assert set(gap) == {"image", "video"} and all(isinstance(v, float) for v in gap.values())
    detail = res["cross_modal_gap_detail"]
    assert detail["image"]["docs"] == 6 and detail["video"]["docs"] == 2
    # a random model reads its pixels a little: swapping them changes the text loss
    assert gap["image"] != 0.0
    # the 24x24 images have no same-grid donor among the recent ones only once; resampling kicks in for videos
    assert res["counts"].get("gap_donors_resampled", 0) >= 2


def test_gap_is_zero_when_the_model_cannot_see_pixels(setup):
    root, tok, _ = setup
    model = tiny_model(tok, seed=1)
    with torch.no_grad():  # every patch embeds to zero: own and donor visual blocks look identical
        model.embed.patch.weight.zero_()
        model.embed.tubelet.weight.zero_()
    res = evaluate(model, tok, str(root / "shards"), progress=False)
    assert res["cross_modal_gap"] == {"image": 0.0, "video": 0.0}
    assert res["cross_modal_gap_detail"]["image"]["text_tokens"] > 0
    assert res["cross_modal_gap_detail"]["image"]["distinguishable_from_zero"] is False


def test_the_gaps_interval_is_the_ratio_estimators_over_documents():
    """Issue 28.9: the gap sum(d) / sum(n) gets its standard error from the documents; with equal
    target counts that is the standard error of the per-document means, and the 95% interval is
    t(m - 1) times it either side."""
    import statistics

    from omniloom.pretrain.inference.evaluate import _t975, gap_interval

    means = [0.9, -0.4, 1.3, 0.1, -0.7, 0.5]  # per-document gaps, 10 targets each
    got = gap_interval([(10 * g, 10) for g in means])
    se = statistics.stdev(means) / math.sqrt(len(means))
    assert math.isclose(got["stderr"], se, rel_tol=1e-9)
    assert got["ci95"] == pytest.approx([statistics.mean(means) - _t975(5) * se, statistics.mean(means) + _t975(5) * se])
    assert got["distinguishable_from_zero"] is False
    assert math.isclose(_t975(5), 2.5706, rel_tol=2e-3) and math.isclose(_t975(30), 2.0423, rel_tol=1e-3)
    steady = gap_interval([(10 * (1.0 + 0.01 * i), 10) for i in range(8)])
    assert steady["distinguishable_from_zero"] is True and steady["ci95"][0] > 0.9
    assert gap_interval([(3.0, 10)]) == {"stderr": None, "ci95": None, "distinguishable_from_zero": False}


def test_eval_on_a_checkpoint_and_max_docs(setup, tmp_path):
    from safetensors.torch import save_file

    from omniloom.data.config import DataConfig
    from omniloom.pretrain.config.run import RunConfig, to_yaml

    root, tok, _ = setup
    model = tiny_model(tok)
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000003"
    (ckpt / "accelerate").mkdir(parents=True)
    save_file(dict(model.state_dict()), str(ckpt / "accelerate" / "model.safetensors"))
    (ckpt / "config.yaml").write_text(to_yaml(RunConfig(model=model.cfg, data=DataConfig(tokenizer=str(root / "tok"), seq_len=256))))
    (ckpt / "COMPLETE").write_text(json.dumps({"files": ["config.yaml"]}))
    res = evaluate(*_open(tmp_path / "run"), str(root / "shards"), max_docs=3, progress=False)
    assert res["counts"]["docs"] == 3
    assert main(["-qq", "eval", str(tmp_path / "run"), "--data", str(root / "nowhere")]) == 2


def _open(path):
    from omniloom.pretrain.inference.load import open_model

    model, tok, _ = open_model(path)
    return model, tok


def test_resample_patches_keeps_content():
    from omniloom.tokenizers.image import frames_to_patches
    from omniloom.tokenizers.settings import MediaSettings

    s = MediaSettings(patch_size=8, temporal_patch_size=2)
    frame = np.zeros((24, 32, 3), np.uint8)
    frame[:, :16] = (200, 10, 10)
    frame[:, 16:] = (10, 10, 200)
    patches, grid = frames_to_patches(frame[None], s, 1)
    out = resample_patches(patches, grid, (1, 2, 2), 2, s)
    assert out.shape == (4, 3 * 8 * 8)
    left, right = out.reshape(2, 2, 3, 64)[:, 0], out.reshape(2, 2, 3, 64)[:, 1]
    assert (left[:, 0].mean() > 0.5) and (right[:, 2].mean() > 0.5)  # red stays left, blue right
    video = np.stack([frame] * 4)
    vp, vgrid = frames_to_patches(video, s, 2)
    assert resample_patches(vp, vgrid, (3, 1, 2), 3, s).shape == (6, 3 * 2 * 8 * 8)


@pytest.mark.slow
def test_gap_turns_positive_after_training_on_captioned_images(setup):
    """Captions name the image's colour: only a model that reads its patches can predict them."""
    from omniloom.data.batch import collate_rows
    from omniloom.data.packing import split_document
    from omniloom.tokenizers.layout import PAD_ID
    from omniloom.tokenizers.unified import tokenize_document

    root, tok, _ = setup
    model = tiny_model(tok, dim=64)
    rng = np.random.default_rng(0)
    docs = []
    for i in range(64):
        name = list(COLORS)[i % 4]
        media = {"a.png": _png(COLORS[name], 32, 24)}
        docs.append(tokenize_document({"segments": [{"type": "image", "ref": "a.png"}, {"type": "text", "text": f"A {name} picture."}]}, media, tok))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    width = max(tok.patch_dim, tok.tubelet_dim)
    before = evaluate(model.eval(), tok, str(root / "shards"), progress=False)["cross_modal_gap"]["image"]
    model.train()
    for step in range(150):
        rows = [[split_document(docs[j], 64)[0]] for j in rng.choice(len(docs), 8)]
        batch, _ = collate_rows(rows, seq_len=64, pad_id=PAD_ID, patch_dim=width, patch_dtype="float32")
        loss = model(**batch.as_dict()).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = evaluate(model.eval(), tok, str(root / "shards"), progress=False)["cross_modal_gap"]["image"]
    print(f"cross-modal gap (image) before training {before:+.4f}, after {after:+.4f} nats/token")
    assert after > 0.5 and after > before + 0.5, (before, after)


@pytest.mark.parametrize("chunk", [64, 3])
def test_documents_of_one_length_share_forwards_and_score_as_alone(setup, tmp_path, monkeypatch, chunk):
    """Documents of one length are scored together, a row each: the same losses, gaps and counts
    as one document a forward (up to float summation order), in fewer forwards; also when the
    read-ahead chunk ends between documents (chunk=3: donors then come from earlier chunks)."""
    import omniloom.pretrain.inference.evaluate as ev
    from omniloom.data.packing import PackingError

    from omniloom.tokenizers.testing import make_video_bytes

    _, tok, _ = setup
    root = tmp_path / "corpus"
    root.mkdir()
    docs = []
    for i in range(8):  # images of one size and caption length, then clips of one size, then text
        (root / f"img{i}.png").write_bytes(_png((10 * i, 200 - 10 * i, 90), 32, 24))
        docs.append({"schema": 1, "segments": [{"type": "image", "ref": f"img{i}.png"}, {"type": "text", "text": f"A shape, number {i}."}]})
    for i in range(3):
        (root / f"vid{i}.mp4").write_bytes(make_video_bytes(seconds=1.0, fps=4 + i, width=32, height=16))
        docs.append({"schema": 1, "segments": [{"type": "video", "ref": f"vid{i}.mp4"}, {"type": "text", "text": f"clip {i} moves"}]})
    docs.append({"schema": 1, "segments": [{"type": "text", "text": "Plain prose without pictures."}]})
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    assert main(["-qq", "data", "build", str(root / "docs.jsonl"), "--out", str(tmp_path / "shards")]) == 0
    root, n = tmp_path, len(docs)
    model = tiny_model(tok)
    forwards = []
    real_forward = model.forward
    monkeypatch.setattr(model, "forward", lambda *a, **k: forwards.append(k["input_ids"].shape) or real_forward(*a, **k))
    monkeypatch.setattr(ev, "EVAL_CHUNK_DOCS", chunk)
    batched = evaluate(model, tok, str(root / "shards"), progress=False)
    batched_forwards, forwards[:] = list(forwards), []

    def one_at_a_time(model, docs, max_len, patch_width, coverage=None):
        out = []
        for doc in docs:
            try:
                out.append(ev._token_losses(model, doc, max_len, patch_width, coverage))
            except PackingError as err:
                out.append(err)
        return out

    monkeypatch.setattr(ev, "_token_losses_many", one_at_a_time)
    alone = evaluate(model, tok, str(root / "shards"), progress=False)
    assert len(forwards) == n + 11  # every document, then the 11 with a visual block once more with a donor's
    assert len(batched_forwards) < len(forwards) and any(shape[0] > 1 for shape in batched_forwards)
    assert batched["counts"] == alone["counts"]
    for key in ("loss", "loss_by_doc_kind", "cross_modal_gap"):
        assert batched[key] == pytest.approx(alone[key], rel=1e-5, abs=1e-6), key
    for kind in ("image", "video"):
        b, a = batched["cross_modal_gap_detail"][kind], alone["cross_modal_gap_detail"][kind]
        assert b.keys() == a.keys()
        for k in b:
            assert b[k] == (pytest.approx(a[k], rel=1e-5, abs=1e-6) if isinstance(a[k], (float, list)) else a[k]), (kind, k)


def test_long_documents_are_scored_in_pieces(setup):
    root, tok, n = setup
    model = tiny_model(tok)
    full = evaluate(model, tok, str(root / "shards"), progress=False)
    short = evaluate(model, tok, str(root / "shards"), max_len=20, progress=False)
    assert short["counts"]["gap_docs_too_long"] > 0
    # every document still counts (a block longer than a piece is skipped and counted)
    assert short["counts"]["docs"] + sum(short["counts"]["skipped"].values()) == n
    assert short["counts"]["tokens"]["all"] <= full["counts"]["tokens"]["all"]


def test_eval_scores_every_document_by_default_and_says_how_many(setup, tmp_path, capsys):
    """Issue 15.5: no silent 200-document cap; the count scored out of the count available is printed."""
    import inspect

    from omniloom.pretrain.cli import build_parser
    from omniloom.pretrain.export.write import save_export

    assert build_parser().parse_args(["eval", "x", "--data", "y"]).max_docs is None
    assert inspect.signature(evaluate).parameters["max_docs"].default is None
    root, tok, n = setup
    save_export(tiny_model(tok), root / "tok", tmp_path / "export")
    out = tmp_path / "eval.json"
    assert main(["-qq", "eval", str(tmp_path / "export"), "--data", str(root / "shards"), "--no-progress",
                 "--max-docs", "3", "--out", str(out)]) == 0
    assert f"scored 3 of {n} documents (--max-docs 3)" in capsys.readouterr().out
    counts = json.loads(out.read_text())["counts"]
    assert (counts["docs"], counts["docs_read"], counts["docs_available"]) == (3, 3, n)


def test_eval_logs_its_torch_threads_and_honours_threads(setup, tmp_path, capsys):
    """Issue 15.1: `omniloom eval` says in one line how many torch threads it runs, and --threads N wins."""
    from omniloom.pretrain.export.write import save_export

    root, tok, _ = setup
    save_export(tiny_model(tok), root / "tok", tmp_path / "export")
    # without -q, main() logs at INFO to this test's stderr (conftest restores the root logger after)
    assert main(["eval", str(tmp_path / "export"), "--data", str(root / "shards"), "--no-progress", "--max-docs", "1",
                 "--threads", "2", "--out", str(tmp_path / "eval.json")]) == 0
    assert torch.get_num_threads() == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "torch threads per process:" in ln]
    assert len(lines) == 1 and "torch threads per process: 2 (set by --threads; override with --threads N" in lines[0], lines
