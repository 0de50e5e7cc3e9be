"""Positions for images and video (issue 29): rotary layouts per axis, learned visual positions,
text unchanged, old exports unchanged, cache parity under every layout."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import ROPE_LAYOUTS, AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.embeddings import mrope_angles, rope_axes
from omniloom.model.synthetic import random_packed_batch


def _cfg(layout="interleaved", visual_pos_max=0, pattern="LBG", selector="pooled", **kw) -> ModelConfig:
    base = dict(
        dim=48, num_layers=len(pattern), num_heads=3, num_kv_heads=1, vocab_size=64, patch_token_id=63,
        rope_sections=(4, 6, 6), patch_dim=12, tubelet_dim=24, rope_layout=layout, visual_pos_max=visual_pos_max,
        attention=AttentionConfig(backend="blocksparse", pattern=pattern, window=12, block_size=8, num_selected_blocks=2,
                                  selector=selector, indexer_dim=8, indexer_rope_dim=6 if selector == "indexer" else 0),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32),
    )
    base.update(kw)
    return ModelConfig(**base)


def _legacy_mrope_angles(positions_B3S, *, head_dim, sections, base):
    """mrope_angles as it was before `rope_layout` existed (frozen here as the reference that
    models trained then must keep): t on the fastest frequencies, then h, then w."""
    d = head_dim // 2
    inv_freq_d = base ** (-torch.arange(d, dtype=torch.float64) * 2.0 / head_dim)
    i_d = torch.arange(d)
    axis_d = (i_d >= sections[0] // 2).long() + (i_d >= (sections[0] + sections[1]) // 2).long()
    pos_BSd = positions_B3S.to(torch.float64).index_select(1, axis_d).transpose(1, 2)
    ang = pos_BSd * inv_freq_d
    return ang.cos().float(), ang.sin().float()


def _fastest_turn_per_axis(layout, head_dim, sections, base=10000.0) -> list[float]:
    """Radians per unit step of each axis's fastest frequency."""
    d = head_dim // 2
    axes = rope_axes(d, tuple(s // 2 for s in sections), layout)
    return [max((base ** (-2 * i / head_dim) for i in range(d) if axes[i] == a), default=0.0) for a in range(3)]


@pytest.mark.parametrize("head_dim,sections", [(32, (8, 12, 12)), (64, (16, 24, 24)), (128, (32, 48, 48))])
def test_interleaved_layouts_give_every_axis_fast_frequencies(head_dim, sections):
    # the old layout leaves columns only the slowest frequencies: a column step turns them by
    # ~1e-3 rad at head dim 32, invisible over a 4-16 patch grid
    t, h, w = _fastest_turn_per_axis("sections", head_dim, sections)
    assert t == 1.0 and w < 0.02
    # interleaved: every axis turns by at least ~0.3 rad per step at head dim 32 (three axes share
    # the three fastest frequencies, 1, 0.56 and 0.32 rad), at least 0.5 from head dim 64 on;
    # rows and columns (more frequencies in these splits) take the two fastest
    turns = _fastest_turn_per_axis("interleaved", head_dim, sections)
    assert min(turns) >= (0.3 if head_dim == 32 else 0.5), turns
    assert turns[1] == 1.0 and turns[2] > turns[0]
    # and each axis spans the range: its slowest frequency is among the slowest few
    d = head_dim // 2
    axes = rope_axes(d, tuple(s // 2 for s in sections), "interleaved")
    assert all(max(i for i in range(d) if axes[i] == a) >= d - 4 for a in range(3)), axes
    assert [axes.count(a) for a in range(3)] == [s // 2 for s in sections]


def test_interleaved_with_equal_counts_takes_turns_t_h_w():
    assert rope_axes(9, (3, 3, 3), "interleaved") == [0, 1, 2] * 3
    assert rope_axes(4, (0, 2, 2), "interleaved") == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="sum to"):
        rope_axes(8, (2, 2, 2), "interleaved")


@pytest.mark.parametrize("layout", ROPE_LAYOUTS)
def test_text_is_plain_1d_rope_under_every_layout(layout):
    head_dim, base = 32, 10000.0
    n = torch.arange(0, 700, 7, dtype=torch.int32)
    positions = n.view(1, 1, -1).expand(2, 3, -1)  # text: t = h = w
    cos, sin = mrope_angles(positions, head_dim=head_dim, sections=(8, 12, 12), base=base, layout=layout)
    inv = base ** (-torch.arange(head_dim // 2, dtype=torch.float64) * 2 / head_dim)
    ang = n.double()[:, None] * inv
    torch.testing.assert_close(cos[0], ang.cos().float(), rtol=0, atol=0)
    torch.testing.assert_close(sin[1], ang.sin().float(), rtol=0, atol=0)


def test_the_sections_layout_is_the_old_rotary_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 5000, (2, 3, 50), generator=g, dtype=torch.int32)
    for head_dim, sections in ((32, (8, 12, 12)), (8, (2, 2, 4)), (64, (16, 24, 24))):
        new = mrope_angles(positions, head_dim=head_dim, sections=sections, base=10000.0, layout="sections")
        old = _legacy_mrope_angles(positions, head_dim=head_dim, sections=sections, base=10000.0)
        assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])


def test_an_image_patch_rotates_by_its_row_and_column_under_the_interleaved_layout():
    # a query at text position q looks at two patches of one row: under `sections` at head dim 32
    # their column difference barely moves any angle; interleaved, it moves one by ~0.3 rad or more
    head_dim, sections = 32, (8, 12, 12)
    p = 10
    patches = torch.tensor([[[p, p], [p + 1, p + 1], [p + 0, p + 1]]], dtype=torch.int32)  # (t, h, w) x 2 columns
    for layout, least in (("sections", 0.0), ("interleaved", 0.5)):
        cos, sin = mrope_angles(patches, head_dim=head_dim, sections=sections, base=10000.0, layout=layout)
        ang = torch.atan2(sin[0], cos[0])
        delta = (ang[1] - ang[0]).abs()
        delta = torch.minimum(delta, 2 * math.pi - delta).max().item()
        if layout == "sections":
            assert delta < 0.01
        else:
            assert delta >= least


def test_learned_visual_positions_take_each_patchs_grid_coordinates():
    cfg = _cfg(visual_pos_max=6)
    model = OmniModel(cfg).eval()
    batch = random_packed_batch(cfg, batch_size=2, seq_len=90, seed=3)
    emb = model.embed
    with torch.no_grad():
        emb.pos_t.weight.copy_(torch.arange(6.0).view(6, 1) * torch.tensor([1.0] + [0.0] * 47))
        emb.pos_h.weight.copy_(torch.arange(6.0).view(6, 1) * torch.tensor([0.0, 1.0] + [0.0] * 46))
        emb.pos_w.weight.copy_(torch.arange(6.0).view(6, 1) * torch.tensor([0.0, 0.0, 1.0] + [0.0] * 45))
        is_patch = batch["input_ids"] == cfg.patch_token_id
        got = emb._grid_embedding(is_patch, batch["positions"]).view(2, 90, -1)[..., :3]
    # expected: per block (a run of patches), coordinates relative to its first patch
    seen = 0
    for b in range(2):
        s = 0
        while s < 90:
            if not is_patch[b, s]:
                s += 1
                continue
            e = s
            while e < 90 and is_patch[b, e]:
                e += 1
            origin = batch["positions"][b, :, s].long()
            want = (batch["positions"][b, :, s:e].long() - origin[:, None]).T.float()
            torch.testing.assert_close(got[b, s:e], want)
            assert want.max() > 0  # the grid really varies inside the block
            seen += 1
            s = e
    assert seen >= 3


@pytest.mark.parametrize("layout,visual_pos_max,selector", [("interleaved", 0, "pooled"), ("interleaved", 8, "indexer"),
                                                             ("sections", 8, "pooled")])
def test_cache_and_generation_equal_the_full_forward(layout, visual_pos_max, selector, tmp_path):
    from omniloom.pretrain.inference.generate import _full_logits, build_prompt, generate
    from omniloom.model.kv_cache import CachedDecoder
    from omniloom.tokenizers.testing import make_image_bytes, make_tiny_tokenizer, make_video_bytes

    tok = make_tiny_tokenizer(tmp_path / "tok")
    cfg = _cfg(layout, visual_pos_max, pattern="LBGB", selector=selector, vocab_size=tok.vocab_size,
               patch_token_id=tok.patch_id, patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim)
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    prompt = build_prompt(tok, "a shape", image=make_image_bytes(32, 24),
                          video=make_video_bytes(seconds=1.0, fps=4, width=32, height=16))
    dec = CachedDecoder(model)
    logits = dec.prefill(prompt.input_ids, prompt.positions, prompt.modality, prompt.block_ids, prompt.patches, prompt.patch_kind)
    new = []
    for _ in range(6):
        torch.testing.assert_close(logits, _full_logits(model, prompt, new), atol=2e-5, rtol=1e-5)
        new.append(int(logits.argmax(-1)[0]))
        logits = dec.step(torch.tensor([new[-1]]))
    a = generate(model, prompt, max_new_tokens=12, use_cache=True, eos_id=-1)
    b = generate(model, prompt, max_new_tokens=12, use_cache=False, eos_id=-1)
    assert a.ids == b.ids


def test_the_index_branch_rotates_text_alike_under_every_layout():
    from omniloom.model.indexer import index_rope_angles

    n = torch.arange(40, dtype=torch.int32).view(1, 1, -1).expand(1, 3, -1)
    ref = index_rope_angles(n[:, 0], 8)
    for layout in ROPE_LAYOUTS:
        got = index_rope_angles(n, 8, layout=layout)
        torch.testing.assert_close(got[0], ref[0])
        torch.testing.assert_close(got[1], ref[1])
    img = torch.tensor([[[5, 5, 5], [5, 6, 7], [5, 5, 5]]], dtype=torch.int32)  # one row of three patches
    legacy = index_rope_angles(img, 8, layout="sections")  # as trained before: time alone
    assert torch.equal(legacy[0][0, 0], legacy[0][0, 2])
    moved = index_rope_angles(img, 8, layout="interleaved")
    assert not torch.equal(moved[0][0, 0], moved[0][0, 2])  # the index now sees rows and columns


def test_an_export_without_rope_layout_loads_with_the_old_layout_and_gives_the_old_logits(tmp_path):
    from safetensors.torch import save_file

    from omniloom.model.pretrained import load_pretrained, model_config_from_dict

    cfg = _cfg("sections")
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    data = dataclasses.asdict(cfg)
    del data["rope_layout"], data["visual_pos_max"]  # as an export written before the keys existed
    assert model_config_from_dict(json.loads(json.dumps(data))).rope_layout == "sections"
    out = tmp_path / "export"
    out.mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({"format": "omniloom-export", "format_version": 1, "model": data}))
    loaded = load_pretrained(out)
    assert loaded.cfg.rope_layout == "sections"
    batch = random_packed_batch(cfg, batch_size=2, seq_len=80, seed=1)
    # the reference: the same weights with the rotary computed by the frozen old formula
    ref_model = OmniModel(cfg).eval()
    ref_model.load_state_dict(model.state_dict())
    ref_model.rope = lambda pos: _legacy_mrope_angles(pos, head_dim=cfg.head_dim, sections=cfg.rope_sections, base=cfg.rope_base)
    with torch.no_grad():
        got = loaded(**batch, return_logits=True).logits
        want = ref_model(**batch, return_logits=True).logits
        other = OmniModel(dataclasses.replace(cfg, rope_layout="interleaved")).eval()
        other.load_state_dict(model.state_dict())
        moved = other(**batch, return_logits=True).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert (moved - want).abs().max() > 1e-3  # the layout matters for these visual batches


def test_resuming_under_other_position_settings_is_refused(tmp_path):
    from omniloom.pretrain.config.run import ConfigError, check_resume_positions, load_config, to_yaml

    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    saved = [line for line in to_yaml(load_config("tiny")).splitlines() if "rope_layout" not in line]
    (ckpt / "config.yaml").write_text("\n".join(saved) + "\n")  # written before model.rope_layout existed
    with pytest.raises(ConfigError, match=r"trained with model.rope_layout=sections.*use model.rope_layout=sections"):
        check_resume_positions(load_config("tiny", ["model.rope_layout=interleaved"]), ckpt)
    check_resume_positions(load_config("tiny", ["model.rope_layout=sections"]), ckpt)


def test_the_conv_stem_reads_each_patch_row_as_the_tokenizers_pixels():
    """`model.patch_stem: conv` (issue 29, what else limits learning) convolves each patch's pixels:
    a row of the patch matrix must be read back as (channel x frame, y, x), the tokenizer's order
    (tokenizers/image.py frames_to_patches), or the convolutions would slide over scrambled pixels."""
    import numpy as np
    import torch.nn.functional as F

    from omniloom.model.embeddings import ConvStem
    from omniloom.tokenizers.image import frames_to_patches
    from omniloom.tokenizers.settings import MediaSettings

    p, tp = 4, 2
    settings = MediaSettings(patch_size=p, temporal_patch_size=tp)
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, size=(tp, 2 * p, 3 * p, 3), dtype=np.uint8)  # one tubelet group, 2 x 3 patches
    rows, grid = frames_to_patches(frames, settings, temporal_patch_size=tp)
    assert grid == (1, 2, 3)
    torch.manual_seed(0)
    stem = ConvStem(3 * tp, p)
    mean, std = np.asarray(settings.pixel_mean, np.float32), np.asarray(settings.pixel_std, np.float32)
    norm = (frames.astype(np.float32) / 255.0 - mean) / std  # [t, y, x, c]
    for k, (hi, wi) in enumerate([(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]):
        crop = norm[:, hi * p:(hi + 1) * p, wi * p:(wi + 1) * p, :]  # [t, y, x, c]
        img = torch.from_numpy(np.ascontiguousarray(crop.transpose(3, 0, 1, 2))).reshape(1, 3 * tp, p, p)  # c t y x
        want = F.gelu(stem.conv2(F.gelu(stem.conv1(img)))).flatten(1)
        torch.testing.assert_close(stem(torch.from_numpy(rows[k:k + 1])), want, atol=1e-5, rtol=1e-5)
    assert stem.out_features == want.shape[1] == 32 * 1 * 1


def test_conv_stem_video_frames_reads_each_frame_of_a_tubelet_as_an_image_patch():
    """`model.conv_stem_video: frames`: a tubelet row's frames go through the image stem one by one,
    each exactly as the tokenizer would have cut that frame as an image, and the tubelet projection
    reads their features in frame order."""
    import numpy as np

    from omniloom.model.embeddings import MultimodalEmbedding
    from omniloom.tokenizers.image import frames_to_patches
    from omniloom.tokenizers.settings import MediaSettings

    p, tp = 8, 2
    settings = MediaSettings(patch_size=p, temporal_patch_size=tp)
    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, size=(tp, 2 * p, 2 * p, 3), dtype=np.uint8)
    tubelets, _ = frames_to_patches(frames, settings, temporal_patch_size=tp)
    per_frame = [frames_to_patches(frames[f:f + 1], settings, temporal_patch_size=1)[0] for f in range(tp)]
    torch.manual_seed(0)
    emb = MultimodalEmbedding(vocab_size=16, dim=8, patch_dim=3 * p * p, tubelet_dim=3 * tp * p * p, patch_token_id=15,
                              patch_stem="conv", conv_stem_width=4, conv_stem_video="frames")
    assert emb.tubelet_stem is None and emb.tubelet.in_features == tp * emb.patch_stem.out_features
    with torch.no_grad():
        got = emb._video(torch.from_numpy(tubelets))
        feats = torch.cat([emb.patch_stem(torch.from_numpy(rows)) for rows in per_frame], dim=1)
        torch.testing.assert_close(got, emb.tubelet(feats), atol=1e-5, rtol=1e-5)
        # and not the frames swapped: the projection must know which frame came first
        swapped = torch.cat([emb.patch_stem(torch.from_numpy(rows)) for rows in per_frame[::-1]], dim=1)
        assert not torch.allclose(got, emb.tubelet(swapped), atol=1e-3)


@pytest.mark.parametrize("video", ["channels", "frames"])
def test_a_conv_stem_model_counts_its_parameters_and_decodes_as_its_full_forward(tmp_path, video):
    from omniloom.model.accounting import num_params
    from omniloom.model.kv_cache import CachedDecoder
    from omniloom.pretrain.inference.generate import _full_logits, build_prompt, generate
    from omniloom.tokenizers.testing import make_image_bytes, make_tiny_tokenizer, make_video_bytes

    tok = make_tiny_tokenizer(tmp_path / "tok")
    cfg = _cfg(vocab_size=tok.vocab_size, patch_token_id=tok.patch_id, patch_dim=tok.patch_dim,
               tubelet_dim=tok.tubelet_dim, patch_stem="conv", conv_stem_video=video)
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    assert num_params(cfg) == sum(p.numel() for p in model.parameters())
    if video == "channels":
        assert model.embed.patch_stem is not None and model.embed.tubelet_stem.in_channels == 3 * (cfg.tubelet_dim // cfg.patch_dim)
    else:
        assert model.embed.tubelet_stem is None and not any("tubelet_stem" in n for n, _ in model.named_parameters())
    prompt = build_prompt(tok, "a shape", image=make_image_bytes(32, 24),
                          video=make_video_bytes(seconds=1.0, fps=4, width=32, height=16))
    dec = CachedDecoder(model)
    logits = dec.prefill(prompt.input_ids, prompt.positions, prompt.modality, prompt.block_ids, prompt.patches, prompt.patch_kind)
    torch.testing.assert_close(logits, _full_logits(model, prompt, []), atol=2e-5, rtol=1e-5)
    a = generate(model, prompt, max_new_tokens=8, use_cache=True, eos_id=-1)
    b = generate(model, prompt, max_new_tokens=8, use_cache=False, eos_id=-1)
    assert a.ids == b.ids
    with pytest.raises(ValueError, match="patch_stem"):
        _cfg(patch_stem="conv", patch_dim=10).validate()
    # model.conv_stem_width: the stem's channels, counted and built alike
    wide = dataclasses.replace(cfg, conv_stem_width=32)
    stem = OmniModel(wide).embed.patch_stem
    assert (stem.conv1.out_channels, stem.conv2.out_channels) == (32, 64)
    assert num_params(wide) == sum(p.numel() for p in OmniModel(wide).parameters()) > num_params(cfg)
    with pytest.raises(ValueError, match="conv_stem_width"):
        dataclasses.replace(cfg, conv_stem_width=0).validate()
    with pytest.raises(ValueError, match="needs model.patch_stem=conv"):
        dataclasses.replace(cfg, patch_stem="linear", conv_stem_video="frames").validate()
