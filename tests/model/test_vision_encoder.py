"""Late fusion (issue 42): model.vision_encoder encodes each visual block alone, bidirectionally,
and projects it into the decoder; parameters, FLOPs and config checks follow it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from omniloom.model import OmniModel, accounting
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig, VisionEncoderConfig
from omniloom.model.synthetic import random_packed_batch

# an image of 12 patches and a video of 8 tubelets: blocks of two lengths, so the encoder's
# grouping by length reorders the patch rows
GRIDS = dict(image_grid=(1, 3, 4), video_grid=(2, 2, 2))


def enc_cfg(backend="blocksparse", pattern="LBG", encoder=None, **kw) -> ModelConfig:
    base = dict(
        dim=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2, vocab_size=64, patch_token_id=63,
        rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24,
        attention=AttentionConfig(backend=backend, pattern=pattern, window=12, block_size=8, num_selected_blocks=2),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32),
        vision_encoder=encoder or VisionEncoderConfig(enabled=True, dim=16, num_heads=2, num_layers=2, ffn_dim=24),
    )
    base.update(kw)
    return ModelConfig(**base)


def batch_of(cfg, seed=0, **kw):
    args = dict(batch_size=2, seq_len=64, docs_per_row=2, seed=seed, **GRIDS)
    args.update(kw)
    return random_packed_batch(cfg, **args)


def encoder_outputs(model, batch) -> torch.Tensor:
    """The vision encoder's output rows [P, D] (patch row order) in one forward."""
    got = []
    handle = model.vision.register_forward_hook(lambda mod, args, out: got.append(out.detach().clone()))
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        handle.remove()
    assert len(got) == 1
    return got[0]


def patch_blocks(batch) -> list[torch.Tensor]:
    """The patch rows of each visual block, in patch order: one index tensor per block."""
    is_patch = batch["input_ids"].reshape(-1) == 63
    blk = batch["block_ids"].reshape(-1)[is_patch].long()
    row = torch.arange(batch["input_ids"].numel()).div(batch["input_ids"].shape[1], rounding_mode="floor")[is_patch]
    key = row * 1000 + blk
    return [torch.nonzero(key == k).squeeze(1) for k in key.unique_consecutive()]


@pytest.mark.parametrize("encoder", [
    VisionEncoderConfig(enabled=True),  # sized from the decoder
    VisionEncoderConfig(enabled=True, dim=16, num_heads=2, num_layers=3, ffn_dim=40, projector="linear"),
])
@pytest.mark.parametrize("stem", ["linear", "conv"])
def test_param_count_from_config_equals_numel(encoder, stem):
    cfg = enc_cfg(encoder=encoder, patch_stem=stem, patch_dim=48, tubelet_dim=96)
    model = OmniModel(cfg)
    assert accounting.num_params(cfg) == sum(p.numel() for p in model.parameters()) == model.num_params()
    off = dataclasses.replace(cfg, vision_encoder=VisionEncoderConfig())
    assert accounting.num_active_params(cfg) == accounting.num_active_params(off)  # a text token never meets the encoder
    assert accounting.vision_encoder_params(cfg) == sum(p.numel() for p in model.vision.parameters())
    assert model.embed.patch.out_features == cfg.vision_encoder.resolved(cfg).dim


def test_default_sizing_is_a_quarter_of_the_decoder():
    cfg = enc_cfg(encoder=VisionEncoderConfig(enabled=True), dim=64, num_heads=4, rope_sections=(4, 6, 6), pattern="LGLGLGLG")
    enc = cfg.vision_encoder.resolved(cfg)
    assert (enc.dim, enc.num_heads, enc.ffn_dim) == (64, 4, 256)  # the decoder's width and head dim, 4 x width
    decoder = accounting.num_active_params(cfg) - 2 * cfg.vocab_size * cfg.dim
    layers = enc.num_layers * (4 * enc.dim ** 2 + 3 * enc.dim * enc.ffn_dim)
    assert enc.num_layers >= 1 and abs(layers - decoder / 4) <= (4 * enc.dim ** 2 + 3 * enc.dim * enc.ffn_dim) / 2


def test_a_block_sees_only_its_own_patches():
    """Perturbing another block's patches (same row or another) or any text token leaves a
    block's encoder outputs exactly as they were; perturbing one of its own patches (a later one)
    changes its other patches (bidirectional)."""
    cfg = enc_cfg()
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    batch = batch_of(cfg)
    blocks = patch_blocks(batch)
    assert len(blocks) >= 3 and len({len(b) for b in blocks}) == 2
    base = encoder_outputs(model, batch)
    for target in range(len(blocks)):
        others = torch.cat([b for i, b in enumerate(blocks) if i != target])
        changed = dict(batch, patches=batch["patches"].clone())
        changed["patches"][others] += torch.randn(len(others), changed["patches"].shape[1])
        text = batch["block_ids"] < 0
        changed["input_ids"] = torch.where(text, (batch["input_ids"] + 1) % 60, batch["input_ids"])
        out = encoder_outputs(model, changed)
        torch.testing.assert_close(out[blocks[target]], base[blocks[target]], rtol=0, atol=0)
        assert not torch.allclose(out[others], base[others])
        own = dict(batch, patches=batch["patches"].clone())
        own["patches"][blocks[target][-1]] += 1.0
        out = encoder_outputs(model, own)
        assert not torch.allclose(out[blocks[target][0]], base[blocks[target][0]])


def test_gradients_stay_inside_the_block():
    """By gradients: the loss of one block's encoder outputs reaches only that block's patches."""
    cfg = enc_cfg()
    torch.manual_seed(0)
    model = OmniModel(cfg)
    batch = batch_of(cfg, seed=1)
    blocks = patch_blocks(batch)
    patches = batch["patches"].clone().requires_grad_()
    grabbed = []
    model.vision.register_forward_hook(lambda mod, args, out: grabbed.append(out))
    model(**dict(batch, patches=patches))
    grabbed[0][blocks[1]].pow(2).sum().backward()
    g = patches.grad.abs().sum(1)
    assert bool((g[blocks[1]] > 0).all())
    assert float(g[torch.cat([b for i, b in enumerate(blocks) if i != 1])].sum()) == 0.0


def test_grouped_attention_equals_a_block_diagonal_mask():
    """The encoder's grouped, reordered attention equals one dense attention over all patch rows
    under a block-diagonal mask (the reference), forward and gradients."""
    from omniloom.model.vision_encoder import EncoderBlock

    cfg = enc_cfg()
    torch.manual_seed(0)
    model = OmniModel(cfg)
    batch = batch_of(cfg, seed=2)
    blocks = patch_blocks(batch)
    seg = torch.empty(batch["patches"].shape[0], dtype=torch.long)
    for i, b in enumerate(blocks):
        seg[b] = i
    mask = (seg[:, None] == seg[None, :]).view(1, 1, len(seg), len(seg))

    class DenseMask:
        block_size, index_rope = 0, None

        def attend_stats(self, q, k, v, kind, index=None, layer_key=None):
            assert q.shape[2] == len(seg)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask), None

    grabbed = []
    model.vision.register_forward_hook(lambda mod, args, out: grabbed.append((args, out)))
    model(**batch)
    (x_PE, positions, runs), got = grabbed[0]
    # the reference: patch rows in their own order, dense masked attention, same weights
    from omniloom.model.embeddings import mrope_angles

    enc = model.vision.enc
    is_patch = batch["input_ids"].reshape(-1) == cfg.patch_token_id
    pos_3P = positions.transpose(0, 1).reshape(3, -1)[:, is_patch]
    cos, sin = mrope_angles(pos_3P.unsqueeze(0), head_dim=enc.head_dim, sections=enc.rope_sections, base=cfg.rope_base,
                            layout=cfg.rope_layout)
    x = x_PE.unsqueeze(0)
    for layer in model.vision.layers:
        assert isinstance(layer, EncoderBlock)
        x = layer(x, cos, sin, DenseMask())
    want = model.vision.projector(model.ops.rms_norm(x, model.vision.norm, cfg.norm_eps))[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    w = torch.randn_like(want)
    g_got = torch.autograd.grad((got * w).sum(), model.vision.layers[0].attn.wq.weight, retain_graph=True)[0]
    g_want = torch.autograd.grad((want * w).sum(), model.vision.layers[0].attn.wq.weight)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-6)


def test_another_documents_patches_leave_a_documents_logits_unchanged():
    cfg = enc_cfg(backend="sdpa")
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    batch = batch_of(cfg, batch_size=1, seq_len=96, docs_per_row=2)
    doc = batch["doc_ids"][0]
    assert int(doc.max()) >= 1
    is_patch = batch["input_ids"].reshape(-1) == cfg.patch_token_id
    second = (batch["doc_ids"].reshape(-1) == 1)[is_patch]
    assert 0 < int(second.sum()) < int(is_patch.sum())
    changed = dict(batch, patches=batch["patches"].clone())
    changed["patches"][second] += 1.0
    with torch.no_grad():
        a = model(**batch, return_logits=True).logits[0, doc == 0]
        b = model(**changed, return_logits=True).logits[0, doc == 0]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("visual", [False, True])
def test_every_parameter_gets_a_gradient_and_backends_agree(visual):
    grads = {}
    for backend in ("sdpa", "blocksparse"):
        cfg = enc_cfg(backend=backend)
        torch.manual_seed(0)
        model = OmniModel(cfg)
        out = model(**batch_of(cfg, visual=visual, seed=4))
        out.loss.backward()
        assert [n for n, p in model.named_parameters() if p.grad is None] == []
        grads[backend] = (out.loss.detach(), {n: p.grad for n, p in model.named_parameters() if n.startswith("vision.")})
    torch.testing.assert_close(grads["sdpa"][0], grads["blocksparse"][0])
    for name, g in grads["sdpa"][1].items():
        torch.testing.assert_close(grads["blocksparse"][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
        assert visual or float(g.abs().sum()) == 0.0  # text only: in the graph, a zero gradient


def test_activation_checkpointing_wraps_the_encoder_layers_and_keeps_the_gradients():
    from omniloom.pretrain.train.parallel import apply_activation_checkpointing, encoder_blocks

    cfg = enc_cfg(backend="blocksparse")
    torch.manual_seed(0)
    ref = OmniModel(cfg)
    ckpt = OmniModel(cfg)
    ckpt.load_state_dict(ref.state_dict())
    assert len(encoder_blocks(ckpt)) == 2 and encoder_blocks(OmniModel(enc_cfg(vision_encoder=VisionEncoderConfig()))) == []
    assert apply_activation_checkpointing(ckpt) == cfg.num_layers + 2
    assert all(getattr(b, "_omniloom_ac", False) for b in encoder_blocks(ckpt))
    grads = []
    for model in (ref, ckpt):
        model(**batch_of(cfg, seed=6)).loss.backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, msg=name)


def test_accelerator_shapes_give_the_cpu_result():
    from omniloom.model.embeddings import accelerator_shapes

    cfg = enc_cfg()
    torch.manual_seed(0)
    model = OmniModel(cfg).eval()
    batch = batch_of(cfg, seed=5)
    layout = model.batch_layout(batch["doc_ids"], batch["block_ids"])
    with torch.no_grad():
        a = model(**batch, return_logits=True).logits
        with accelerator_shapes():
            b = model(**batch, return_logits=True, layout=layout).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_flops_add_the_encoder_by_hand_count():
    enc = VisionEncoderConfig(enabled=True, dim=16, num_heads=2, num_layers=2, ffn_dim=24, projector="mlp")
    cfg = enc_cfg(encoder=enc)
    off = dataclasses.replace(cfg, vision_encoder=VisionEncoderConfig())
    E, F_, D, L, N = 16, 24, 32, 2, 12
    # per layer wq wk wv wo (E x E) + SwiGLU (3 x E x F); projector E x D + D x D; x 6 (fwd + bwd)
    matmul = L * (4 * E * E + 3 * E * F_) + E * D + D * D
    per_visual_token = 6 * matmul + L * 12 * E * N  # + block-local attention: QK^T and PV over N keys
    assert accounting.vision_encoder_flops(cfg, N) == per_visual_token == 6 * 5888 + 4608 == 39936
    assert accounting.flops_per_token(cfg, 128) == accounting.flops_per_token(off, 128)  # no visual tokens
    got = accounting.flops_per_token(cfg, 128, visual_fraction=0.25, visual_block_len=N)
    assert got - accounting.flops_per_token(off, 128) == pytest.approx(0.25 * per_visual_token)
    assert OmniModel(cfg).flops_per_token(128, visual_fraction=0.25, visual_block_len=N) == got
    # per batch, from the layout the trainer already has: sum over blocks of n x per-token(n)
    model = OmniModel(cfg)
    batch = batch_of(cfg)
    lens = [len(b) for b in patch_blocks(batch)]
    want = sum(n * (6 * matmul + L * 12 * E * n) for n in lens)
    assert model.visual_flops(model.batch_layout(batch["doc_ids"], batch["block_ids"])) == want
    assert OmniModel(off).visual_flops(model.batch_layout(batch["doc_ids"], batch["block_ids"])) == 0.0


@pytest.mark.parametrize("encoder,match", [
    (VisionEncoderConfig(enabled=True, dim=-1), "model.vision_encoder.dim=-1"),
    (VisionEncoderConfig(enabled=True, dim=20, num_heads=3), "model.vision_encoder.dim=20 must be a multiple"),
    (VisionEncoderConfig(enabled=True, projector="qformer"), "model.vision_encoder.projector='qformer'"),
])
def test_config_errors_name_the_key(encoder, match):
    with pytest.raises(ValueError, match=match):
        enc_cfg(encoder=encoder).validate()
    with pytest.raises(ValueError, match="model.visual_pos_max=0"):
        enc_cfg(visual_pos_max=4).validate()
    enc_cfg(encoder=dataclasses.replace(encoder, enabled=False)).validate()  # off: its fields are not read


def test_patch_tokens_outside_a_block_are_refused():
    cfg = enc_cfg()
    model = OmniModel(cfg)
    batch = batch_of(cfg)
    broken = dict(batch, block_ids=torch.where(batch["input_ids"] == cfg.patch_token_id, -1, batch["block_ids"]))
    with pytest.raises(ValueError, match="every <|patch|> token must carry its block's id"):
        model(**broken)


def test_a_hostile_encoder_depth_is_refused_before_building():
    """An export's config.json claiming a deep encoder the weights do not hold is refused from the
    safetensors headers, before a module is built (even on the meta device)."""
    from omniloom.model.pretrained import check_config_against_shapes

    cfg = enc_cfg()
    shapes = {k: tuple(v.shape) for k, v in OmniModel(cfg).state_dict().items()}
    check_config_against_shapes(cfg, shapes, "export")
    deep = dataclasses.replace(cfg, vision_encoder=dataclasses.replace(cfg.vision_encoder, num_layers=2**30))
    with pytest.raises(ValueError, match="implies 1073741824 model.vision_encoder layers, the weights hold 2"):
        check_config_against_shapes(deep, shapes, "export")
    off = dataclasses.replace(cfg, vision_encoder=VisionEncoderConfig())
    with pytest.raises(ValueError, match="implies 0 model.vision_encoder layers, the weights hold 2"):
        check_config_against_shapes(off, shapes, "export")
