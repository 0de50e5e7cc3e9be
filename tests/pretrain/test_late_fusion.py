"""Late fusion (issue 42) through the pipeline: a model with model.vision_encoder generates with its
KV cache as the full forward does (the prompt's blocks encoded once, at prefill), trains on the
CPU with the loss going down, resumes, exports, reloads with equal logits, evaluates with
--captions, generates from the export, and seeds a new run (train.init_from)."""

from __future__ import annotations

import json

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig, VisionEncoderConfig
from omniloom.model.kv_cache import CachedDecoder
from omniloom.pretrain.cli import main
from omniloom.pretrain.inference.generate import _full_logits, build_prompt, generate, sample_next

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ENCODER = ("model.vision_encoder.enabled=true", "model.vision_encoder.dim=32", "model.vision_encoder.num_heads=2",
           "model.vision_encoder.num_layers=2")


def encoder_model(tok, backend="blocksparse", pattern="LBG", seed=0):
    cfg = ModelConfig(
        dim=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size, patch_token_id=tok.patch_id,
        rope_sections=(2, 2, 4), patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim,
        attention=AttentionConfig(backend=backend, pattern=pattern, window=12, block_size=8, num_selected_blocks=3),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32),
        vision_encoder=VisionEncoderConfig(enabled=True, dim=16, num_heads=2, num_layers=2),
    )
    torch.manual_seed(seed)
    return OmniModel(cfg).eval()


def prompts(tok):
    from omniloom.tokenizers.testing import make_image_bytes, make_video_bytes

    return {"image": build_prompt(tok, "A small red square on the left", image=make_image_bytes(32, 24)),
            "video": build_prompt(tok, "then", image=make_image_bytes(16, 16),
                                  video=make_video_bytes(seconds=1.0, fps=4, width=32, height=16))}


@pytest.mark.parametrize("which", ["image", "video"])
@pytest.mark.parametrize("backend", ["blocksparse", "sdpa"])
def test_cache_and_generation_equal_the_full_forward(tok, which, backend):
    model = encoder_model(tok, backend)
    p = prompts(tok)[which]
    assert (3 in p.patch_kind.tolist()) == (which == "video")
    calls = []
    model.vision.register_forward_hook(lambda mod, args, out: calls.append(args[0].shape[0]))
    cached = generate(model, p, max_new_tokens=12, use_cache=True, eos_id=-1)
    assert calls == [p.patches.shape[0]]  # encoded once, at prefill; decode steps never run the encoder
    full = generate(model, p, max_new_tokens=12, use_cache=False, eos_id=-1)
    assert cached.ids == full.ids and len(cached.ids) == 12
    dec = CachedDecoder(model)
    logits = dec.prefill(p.input_ids, p.positions, p.modality, p.block_ids, p.patches, p.patch_kind)
    new, g = [], torch.Generator().manual_seed(0)
    for _ in range(8):
        torch.testing.assert_close(logits, _full_logits(model, p, new), atol=2e-5, rtol=1e-5)
        new.append(int(sample_next(logits, temperature=1.0, top_p=1.0, generator=g)[0]))
        logits = dec.step(torch.tensor([new[-1]]))
    torch.testing.assert_close(logits, _full_logits(model, p, new), atol=2e-5, rtol=1e-5)


def test_an_encoder_model_trains_resumes_exports_evaluates_generates_and_seeds_a_run(tmp_path, train_tiny, monkeypatch):
    from omniloom.model.pretrained import load_pretrained
    from omniloom.model.synthetic import random_packed_batch
    from omniloom.pretrain.checkpoint.offline import load_checkpoint_model
    from omniloom.pretrain.rundir import read_metrics

    assert main(["-qq", "data", "demo-corpus", "--out", str(tmp_path / "corpus"), "--num-images", "12", "--num-videos", "3",
                 "--num-heldout-images", "3", "--num-heldout-videos", "1", "--num-interleaved", "1", "--image-size", "32"]) == 0
    for split in ("train", "heldout"):
        assert main(["-qq", "data", "build", str(tmp_path / "corpus" / split), "--out", str(tmp_path / "shards" / split)]) == 0
    tok = tmp_path / "tok"
    assert main(["-qq", "tokenizer", "train", "--data", str(tmp_path / "shards" / "train"), "--vocab-size", "512",
                 "--out", str(tok), "--threads", "1", "--image-patch-budget", "16",
                 "--video-frame-budget", "4", "--video-patch-budget", "8"]) == 0
    # training rows full of visual blocks: the captioned images and clips of the corpus
    corpus = tmp_path / "corpus" / "train"
    assert main(["-qq", "data", "build", str(corpus / "shapes.jsonl"), str(corpus / "motion.jsonl"), "--out",
                 str(tmp_path / "shards" / "visual")]) == 0
    shards, run = tmp_path / "shards" / "visual", tmp_path / "run"
    peak = 1e12  # a CPU has no peak entry: give it one, so MFU is logged
    monkeypatch.setattr("omniloom.pretrain.train.loop.peak_flops_per_device", lambda device: peak)
    # a few CPU steps with each CPU backend; the loss goes down
    for backend in ("sdpa", "blocksparse"):
        where = run if backend == "blocksparse" else tmp_path / "run_sdpa"
        assert train_tiny(where, shards, tok, *ENCODER, f"model.attention.backend={backend}", "train.num_steps=6",
                          "checkpoint.every=3", "optim.lr=3e-3", "optim.warmup_steps=0") == 0
        losses = [m["loss"] for m in read_metrics(where / "metrics.jsonl") if "loss" in m and "step" in m]
        assert len(losses) >= 6 and losses[-1] < losses[0], (backend, losses)
        # MFU counts the encoder: above the decoder's flops_per_token x tokens/s on steps with visual blocks
        fpt = load_checkpoint_model(where)[0].flops_per_token(128)
        over = [m["mfu"] * peak / (fpt * m["tokens_per_s_per_device"]) for m in read_metrics(where / "metrics.jsonl")
                if "mfu" in m]
        assert len(over) >= 6 and min(over) >= 1 - 1e-6 and max(over) > 1.01, over
    ref, *_ = load_checkpoint_model(run)
    assert ref.vision is not None and ref.vision.enc.num_layers == 2
    # resume from the last checkpoint and train on
    assert train_tiny(run, shards, tok, *ENCODER, "train.num_steps=8", "checkpoint.every=4", "optim.lr=3e-3",
                      "optim.warmup_steps=0", "checkpoint.resume=auto") == 0
    steps = [m["step"] for m in read_metrics(run / "metrics.jsonl") if "loss" in m]
    assert steps[-1] == 8
    ref, *_ = load_checkpoint_model(run)
    out = tmp_path / "export"
    assert main(["-qq", "export", str(run), "--out", str(out)]) == 0
    exported = json.loads((out / "config.json").read_text())["model"]["vision_encoder"]
    assert exported == {"enabled": True, "dim": 32, "num_layers": 2, "num_heads": 2, "ffn_dim": 0, "projector": "mlp"}
    assert "late fusion: a vision encoder of 2 layer(s), width 32" in (out / "README.md").read_text()
    model = load_pretrained(out)
    batch = random_packed_batch(model.cfg, batch_size=2, seq_len=64, docs_per_row=2, image_grid=(1, 2, 3),
                                video_grid=(2, 2, 2), seed=3)
    with torch.no_grad():
        assert torch.equal(model(**batch, return_logits=True).logits, ref(**batch, return_logits=True).logits)
    assert model.num_params() == sum(p.numel() for p in model.parameters())
    assert main(["-qq", "eval", str(out), "--data", str(tmp_path / "shards" / "heldout"), "--out", str(tmp_path / "eval.json"),
                 "--no-progress", "--captions", "--no-probes"]) == 0
    assert "captions" in json.loads((tmp_path / "eval.json").read_text())
    image = next((tmp_path / "corpus" / "heldout").rglob("*.png"))
    assert main(["-qq", "generate", str(out), "--image", str(image), "--max-new-tokens", "4", "--out", str(tmp_path / "g.txt")]) == 0
    # a new run starts from the export's weights, encoder included
    seeded = tmp_path / "seeded"
    assert train_tiny(seeded, shards, tok, *ENCODER, f"train.init_from={out}", "train.num_steps=1", "checkpoint.every=1",
                      "optim.lr=0") == 0
    again, *_ = load_checkpoint_model(seeded)
    for name, p in model.state_dict().items():
        if name.startswith("vision."):
            torch.testing.assert_close(again.state_dict()[name], p, msg=name)
