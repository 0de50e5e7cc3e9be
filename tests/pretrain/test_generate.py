"""Generation: the KV cache reproduces the full forward (greedy tokens and logits) for a prompt
with an image, window layers keep only their window, sampling, and the `omniloom generate` CLI."""

from __future__ import annotations


import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.kv_cache import CachedDecoder
from omniloom.pretrain.inference.generate import _full_logits, build_prompt, generate, sample_next

WINDOW, BLOCK = 12, 8

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model(tok, backend="blocksparse", pattern="LBG", modality_groups=False, seed=0, kernels="auto", selector="pooled",
               num_selected=2):
    cfg = ModelConfig(
        kernels=kernels,
        dim=32, num_layers=len(pattern), num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size, patch_token_id=tok.patch_id,
        rope_sections=(2, 2, 4), patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim,
        attention=AttentionConfig(backend=backend, pattern=pattern, window=WINDOW, block_size=BLOCK, num_selected_blocks=num_selected,
                                  selector=selector.split("+")[0], indexer_dim=8,
                                  indexer_rope_dim=4 if selector.endswith("+rope") else 0),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32,
                      modality_groups=modality_groups),
    )
    torch.manual_seed(seed)
    return OmniModel(cfg).eval()


@pytest.fixture(scope="module")
def image_prompt(tok):
    from omniloom.tokenizers.testing import make_image_bytes

    p = build_prompt(tok, "A small red square on the left", image=make_image_bytes(32, 24))
    assert p.grids == [(1, 3, 4)] and p.length > WINDOW + BLOCK  # longer than a window, several key blocks
    assert int(p.input_ids[0, 0]) == tok.bos_id and int(p.input_ids[0, -1]) != tok.eos_id
    return p


@pytest.mark.parametrize("backend,selector", [("blocksparse", "pooled"), ("sdpa", "pooled"), ("blocksparse", "indexer"),
                                              ("blocksparse", "indexer+rope")])
def test_greedy_with_and_without_cache_agree_for_an_image_prompt(tok, image_prompt, backend, selector):
    model = tiny_model(tok, backend, pattern="LBGB", modality_groups=backend == "sdpa", selector=selector, num_selected=3)
    n = 24  # the sequence (prompt 33 + 24) spans 8 key blocks and over 4 windows
    cached = generate(model, image_prompt, max_new_tokens=n, use_cache=True, eos_id=-1)
    full = generate(model, image_prompt, max_new_tokens=n, use_cache=False, eos_id=-1)
    assert cached.ids == full.ids and len(cached.ids) == n


@pytest.mark.parametrize("selector,offload", [("pooled", False), ("indexer", False), ("indexer+rope", False),
                                              ("pooled", True), ("indexer+rope", True)])
def test_cached_logits_match_full_forward_every_step(tok, image_prompt, selector, offload):
    model = tiny_model(tok, pattern="LBG", selector=selector, num_selected=3)
    dec = CachedDecoder(model, offload_b=offload)
    p = image_prompt
    logits = dec.prefill(p.input_ids, p.positions, p.modality, p.block_ids, p.patches, p.patch_kind)
    new = []
    g = torch.Generator().manual_seed(0)
    for _ in range(16):
        torch.testing.assert_close(logits, _full_logits(model, p, new), atol=2e-5, rtol=1e-5)
        token = int(sample_next(logits, temperature=1.0, top_p=1.0, generator=g)[0])  # wander off the greedy path
        new.append(token)
        logits = dec.step(torch.tensor([token]))
    torch.testing.assert_close(logits, _full_logits(model, p, new), atol=2e-5, rtol=1e-5)
    # window layers keep only their window; global and block layers keep every key
    total = p.length + len(new)
    for cache in dec.caches:
        assert cache.num_keys == (WINDOW if cache.kind == "L" else total)
        if cache.kind == "B" and selector == "pooled":
            assert cache.kmean_BKnD.shape[2] == total // BLOCK
        elif cache.kind == "B":  # the index key of every token, and a choice of at most num_selected blocks
            assert cache.ik_BKTd.shape[2] == total and cache.blocks_BKn.shape[-1] <= 3 + 1  # + the first block
        if cache.kind == "B":  # the chosen blocks, gathered once per query block
            assert cache.ws_k.shape[2] == cache.blocks_BKn.shape[-1] * BLOCK
    kv = {c.kind: c.store_bytes() for c in dec.caches}
    assert dec.device_bytes() == dec.cache_bytes() - (kv["B"] if offload else 0)


def test_offload_refuses_the_dense_warm_up(tok, image_prompt):
    model = tiny_model(tok, pattern="LBG", selector="indexer", num_selected=3)
    model.dense_b_layers = True
    p = image_prompt
    with pytest.raises(ValueError, match="dense warm-up"):
        CachedDecoder(model, offload_b=True).prefill(p.input_ids, p.positions, p.modality, p.block_ids, p.patches, p.patch_kind)


def test_video_and_image_prompt(tok):
    from omniloom.tokenizers.testing import make_image_bytes, make_video_bytes

    p = build_prompt(tok, "then", image=make_image_bytes(16, 16), video=make_video_bytes(seconds=1.0, fps=4, width=32, height=16))
    kinds = sorted(int(k) for k in p.patch_kind.unique())
    assert kinds == [2, 3]
    model = tiny_model(tok, pattern="GL")
    a = generate(model, p, max_new_tokens=6, use_cache=True, eos_id=-1)
    b = generate(model, p, max_new_tokens=6, use_cache=False, eos_id=-1)
    assert a.ids == b.ids


def test_sampling_rules():
    logits = torch.tensor([[0.0, 3.0, 2.9, -5.0]])
    assert int(sample_next(logits, temperature=0.0, top_p=1.0, generator=None)[0]) == 1
    g = torch.Generator().manual_seed(0)
    # top-p small enough keeps only the most likely token
    assert {int(sample_next(logits, temperature=1.0, top_p=0.3, generator=g)[0]) for _ in range(20)} == {1}
    # top-p 0.9 keeps the two leading tokens and never the tail
    seen = {int(sample_next(logits, temperature=1.0, top_p=0.9, generator=g)[0]) for _ in range(200)}
    assert seen == {1, 2}
    draws = [int(sample_next(logits, temperature=2.0, top_p=1.0, generator=torch.Generator().manual_seed(5))[0]) for _ in range(2)]
    assert draws[0] == draws[1]  # a seed reproduces a sample


def test_generation_stops_at_eos_and_checks_arguments(tok, image_prompt):
    model = tiny_model(tok)
    first = generate(model, image_prompt, max_new_tokens=1, eos_id=-1).ids[0]
    res = generate(model, image_prompt, max_new_tokens=5, eos_id=first)
    assert res.ids == [first] and res.stopped_by == "eos"
    with pytest.raises(ValueError, match="top-p"):
        generate(model, image_prompt, top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, image_prompt, temperature=-1)


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_model_that_prefers_patch_never_generates_it(tok, image_prompt, use_cache):
    """<|patch|> stands for pixels that generation cannot give: a model whose most likely next
    token is <|patch|> (a barely trained one) crashed `omniloom generate` on the embedding's
    patch-count check; the token is now never chosen, greedy or sampled."""
    model = tiny_model(tok)
    with torch.no_grad():
        model.head.weight[tok.patch_id] = model.norm.detach().sign() * 5.0  # the argmax everywhere
    for temperature in (0.0, 1.0):
        res = generate(model, image_prompt, max_new_tokens=6, eos_id=-1, temperature=temperature, use_cache=use_cache)
        assert len(res.ids) == 6 and tok.patch_id not in res.ids


def test_generate_cli_on_an_export(tok, tmp_path, capsys):
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.export.write import save_export
    from omniloom.tokenizers.testing import make_image_bytes

    tok.save(tmp_path / "tok")
    save_export(tiny_model(tok), tmp_path / "tok", tmp_path / "export")
    (tmp_path / "img.png").write_bytes(make_image_bytes(32, 24))
    out = tmp_path / "gen.txt"
    argv = ["-qq", "generate", str(tmp_path / "export"), "--image", str(tmp_path / "img.png"), "--prompt", "",
            "--max-new-tokens", "5", "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--out", str(out)]
    assert main(argv) == 0
    first = out.read_text()
    assert main(argv) == 0 and out.read_text() == first  # same seed, same sample
    assert main(argv + ["--offload-b-keys"]) == 0 and out.read_text() == first  # B keys in host memory: same tokens
    assert main(["-qq", "generate", str(tmp_path / "export"), "--image", str(tmp_path / "missing.png")]) == 2
    (tmp_path / "bad.png").write_bytes(b"not an image")
    assert main(["-qq", "generate", str(tmp_path / "export"), "--image", str(tmp_path / "bad.png")]) == 2
    assert "error" in capsys.readouterr().err


def test_generate_logs_its_torch_threads_and_honours_threads(tok, tmp_path, capsys):
    """Issue 15.1: `omniloom generate` says in one line how many torch threads it runs, and --threads N wins."""
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.export.write import save_export

    tok.save(tmp_path / "tok")
    save_export(tiny_model(tok), tmp_path / "tok", tmp_path / "export")
    # without -q, main() logs at INFO to this test's stderr (conftest restores the root logger after)
    assert main(["generate", str(tmp_path / "export"), "--prompt", "hi", "--max-new-tokens", "2", "--threads", "2"]) == 0
    assert torch.get_num_threads() == 2
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "torch threads per process:" in ln]
    assert len(lines) == 1 and "torch threads per process: 2 (set by --threads; override with --threads N" in lines[0], lines


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "sdpa"])
def test_cache_parity_on_cuda_with_triton_kernels(tok, image_prompt, backend):
    # kernels="auto" would pick Triton per CUDA tensor but names itself "auto": ask for Triton outright
    model = tiny_model(tok, backend, pattern="LBGB", kernels="triton").cuda()
    assert model.ops.name == "triton"
    cached = generate(model, image_prompt, max_new_tokens=12, use_cache=True, eos_id=-1)
    full = generate(model, image_prompt, max_new_tokens=12, use_cache=False, eos_id=-1)
    assert cached.ids == full.ids


def test_a_bad_media_file_is_named_in_one_line(tok, tmp_path, capsys):
    """Issue 15.9: not 'cannot identify image file <_io.BytesIO object at 0x...>'."""
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.export.write import save_export
    from omniloom.tokenizers.testing import make_image_bytes

    tok.save(tmp_path / "tok")
    save_export(tiny_model(tok), tmp_path / "tok", tmp_path / "export")
    bad, good = tmp_path / "bad.png", tmp_path / "good.png"
    bad.write_bytes(b"not an image at all")
    good.write_bytes(make_image_bytes(32, 24))
    assert main(["-qq", "generate", str(tmp_path / "export"), "--image", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--image {bad}: undecodable: not a readable image" in err and "BytesIO" not in err
    assert main(["-qq", "generate", str(tmp_path / "export"), "--image", str(good), "--video", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--video {bad}: undecodable" in err
    # issue 15 G7: PyAV's '[Errno 1094995529] Invalid data found when processing input: '<none>'' is said plainly
    bad_video = tmp_path / "bad.mp4"
    bad_video.write_bytes(b"garbage" * 50)
    assert main(["-qq", "generate", str(tmp_path / "export"), "--video", str(bad_video)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--video {bad_video}: undecodable: not a readable video container: Invalid data found" in err, err
    assert "Errno" not in err and "<none>" not in err, err


def test_pyav_errors_on_a_video_become_one_plain_line_naming_it(tok, monkeypatch):
    """Whether the tokenizer wrapped PyAV's error (a MediaError) or it escaped as is."""
    import av

    from omniloom.pretrain.inference import generate as G
    from omniloom.tokenizers.settings import MediaError

    av_err = av.error.InvalidDataError(1094995529, "Invalid data found when processing input", "<none>",
                                       (16, "h264", "no frame!\n"))
    assert "Errno" in str(av_err) and "<none>" in str(av_err) and "last error log" in str(av_err)
    wrapped = MediaError("undecodable", f"video decode failed: {av_err}")
    wrapped.__cause__ = av_err
    other = av.FFmpegError(5, "Input/output error", "<none>")
    for raised, want in ((wrapped, "--video clip.mp4: undecodable: video decode failed: Invalid data found when processing input"),
                         (av_err, "--video clip.mp4: undecodable: Invalid data found when processing input"),
                         (other, "--video clip.mp4: undecodable: Input/output error")):
        monkeypatch.setattr(G, "build_prompt", lambda *a, _e=raised, **k: (_ for _ in ()).throw(_e))
        with pytest.raises(ValueError) as got:
            G._build_prompt_naming_files(tok, "", {"video": b"x"}, {"video": "clip.mp4"})
        assert str(got.value) == want
    monkeypatch.setattr(G, "build_prompt", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # not PyAV's: not a user error
        G._build_prompt_naming_files(tok, "", {"video": b"x"}, {"video": "clip.mp4"})


def test_bench_decode_fills_each_layer_kind_and_counts_the_cache_exactly():
    from omniloom.pretrain.bench.decode import bench_decode, format_rows

    over = ["model.dim=32", "model.num_heads=2", "model.num_kv_heads=1", "model.moe.num_experts=4", "model.moe.num_experts_per_token=2", "model.moe.expert_dim=16",
            "model.moe.dense_dim=32", "model.rope_sections=[4,6,6]", "model.vocab_size=64", "model.patch_token_id=8",
            "model.attention.window=128", "model.attention.block_size=32", "model.attention.num_selected_blocks=2",
            "model.attention.indexer_dim=8", "model.attention.indexer_rope_dim=4"]
    rows = bench_decode("long_64k", over, contexts=[512], steps=2, device="cpu")
    sparse, offloaded, full = rows
    assert full["variant"].startswith("full") and sparse["variant"] == "pattern GGGLLBLLBLLBLLB"
    T = 512 + 2  # measured after the two decode steps
    kv = 1 * 16 * 2 * 4  # bytes per token and layer: K x D x (k, v) x fp32
    index_keys = T * 1 * 8 * 4  # index width 8
    MB = 2**20
    assert full["mb"]["G"] * MB == 15 * T * kv and full["mb"]["L"] == full["mb"]["B"] == 0
    assert sparse["mb"]["G"] * MB == 3 * T * kv
    assert sparse["mb"]["L"] * MB == 8 * 128 * kv  # a window layer keeps its window
    working_set = 3 * 32 * kv  # the 3 blocks of 32 the current query block reads, gathered once
    assert sparse["mb"]["B"] * MB == 4 * (T * kv + index_keys + working_set)
    assert sparse["device_mb"] == sparse["cache_mb"] and full["device_mb"] == full["cache_mb"]
    # offloaded: the B layers' keys leave the device; their index keys and working sets stay
    assert offloaded["device_mb"] * MB == 3 * T * kv + 8 * 128 * kv + 4 * (index_keys + working_set)
    assert offloaded["cache_mb"] == sparse["cache_mb"]
    assert all(r["tok_s"] > 0 for r in rows) and len(format_rows(rows)) == 5


@pytest.mark.parametrize("backend,blocks", [("blocksparse", 5), ("blocksparse", 7), ("sdpa", 5)])
def test_exact_score_ties_pick_the_same_blocks_cached_and_full(tok, backend, blocks):
    """Issue 27 item 16: pattern BB, an index without positions, and every block holding the same
    tokens: each candidate block of the first B layer scores exactly the same (the max over equal
    index keys). The full forward's choice over all blocks and the cache's over blocks 1..qb-1
    broke those ties differently (torch's topk), so decoding read other blocks than training;
    one rule (masks.top_blocks: ties to the later block) now decides both. Checked over the
    prompt's last, started block, whose choice the cache makes from the prefill's index keys (the
    keys of decoded tokens come from another matmul shape, so ties among them are not exact)."""
    from omniloom.pretrain.inference.generate import Prompt

    model = tiny_model(tok, backend, pattern="BB", selector="indexer", num_selected=3)
    assert model.cfg.attention.indexer_rope_dim == 0
    period = [tok.encode(c)[-1] for c in "abcdefgh"][:BLOCK]  # one block's worth of distinct tokens, repeated
    assert len(set(period)) == BLOCK
    S = blocks * BLOCK + 3  # the cache chooses the started block's reads at prefill
    p = Prompt(input_ids=torch.tensor([[period[i % BLOCK] for i in range(S)]]),
               positions=torch.arange(S, dtype=torch.int32).view(1, 1, S).expand(1, 3, S).contiguous(),
               modality=torch.zeros(1, S, dtype=torch.uint8), block_ids=torch.full((1, S), -1, dtype=torch.int32),
               patches=torch.zeros(0, max(tok.patch_dim, tok.tubelet_dim)), patch_kind=torch.zeros(0, dtype=torch.uint8), grids=[])
    dec = CachedDecoder(model)
    logits = dec.prefill(p.input_ids, p.positions, p.modality, p.block_ids, p.patches, p.patch_kind)
    new = []
    for i in range(S, (blocks + 1) * BLOCK):
        torch.testing.assert_close(logits, _full_logits(model, p, new), atol=2e-5, rtol=1e-5)
        new.append(period[i % BLOCK])
        logits = dec.step(torch.tensor([new[-1]]))


def test_top_blocks_breaks_ties_toward_the_later_block():
    """One tie-break rule for every selection: the backends' (select_blocks_compact, which flex,
    blocksparse and the sdpa B masks share) and the cache's."""
    from omniloom.model.masks import build_mask_info, select_blocks_compact, top_blocks

    s = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, float("-inf")], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    assert top_blocks(s, 2).tolist() == [[4, 2], [5, 4]]
    assert top_blocks(s, 4).tolist() == [[4, 2, 1, 0], [5, 4, 3, 2]]
    # the cache scores blocks 1..qb-1 only; the full forward all blocks, the others at -inf
    tied = torch.tensor([float("-inf"), 0.0, 0.0, 0.0, float("-inf"), float("-inf")])
    assert (top_blocks(tied[1:4], 2) + 1).tolist() == top_blocks(tied, 2).tolist() == [3, 2]
    nb, bs = 6, 4
    info = build_mask_info(torch.zeros(1, nb * bs, dtype=torch.int32), torch.full((1, nb * bs), -1, dtype=torch.int32),
                           block_size=bs, window=bs)
    q, k = torch.zeros(1, 2, nb * bs, 8), torch.zeros(1, 1, nb * bs, 8)
    sel = select_blocks_compact(info, q, k, 3, scores_BKQn=torch.zeros(1, 1, nb, nb))  # every score equal
    # query block 5: candidates 1..4 (block 0 is the document's first, always kept): the two latest
    assert sel.hit_BKQn[0, 0, 5].nonzero().flatten().tolist() == [3, 4]
