"""The kernel API without Triton: backend selection, and the PyTorch references (the CPU path and
the ground truth of the Triton parity tests) against independent float64 formulas.

Triton parity under TRITON_INTERPRET=1 lives in test_kernels_triton.py (in a subprocess)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from omniloom.kernels import parity, reference
from omniloom.kernels.ops import OP_NAMES, get_ops


def test_get_ops_reference_and_auto_on_cpu():
    ref = get_ops("reference")
    assert ref.name == "reference" and all(callable(getattr(ref, n)) for n in OP_NAMES)
    assert get_ops("auto", device="cpu").name == "reference"
    if not torch.cuda.is_available():
        assert get_ops("auto").name == "reference"


def test_auto_dispatch_sends_cpu_tensors_to_the_reference():
    from omniloom.kernels.ops import _by_device

    op = _by_device("rms_norm", lambda x, *a, **k: "triton", lambda x, *a, **k: "reference")
    assert op(torch.zeros(2), 1, eps=2) == "reference" and op.__name__ == "rms_norm"


def test_get_ops_rejects_unknown_mode():
    with pytest.raises(ValueError, match="auto, reference, triton or compiled"):
        get_ops("cuda")  # type: ignore[arg-type]


def test_compiled_mode_compiles_the_elementwise_ops_and_keeps_the_rest(monkeypatch):
    from omniloom.kernels import ops as ops_mod

    monkeypatch.setattr(ops_mod, "_COMPILED", None)
    monkeypatch.setattr(ops_mod, "cpp_compiler", lambda: None)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a C[+][+] compiler on CPU.*kernels='reference'"):
            get_ops("compiled")
    monkeypatch.setattr(ops_mod, "cpp_compiler", lambda: "g++")
    c = get_ops("compiled")
    assert c.name == "compiled" and get_ops("compiled") is c  # built once per process
    for n in OP_NAMES:
        fn = getattr(c, n)
        if n in ops_mod.COMPILED_OPS:  # a torch.compile wrapper around the reference (compiles lazily)
            assert fn is not getattr(reference, n) and getattr(fn, "_torchdynamo_orig_callable", None) is getattr(reference, n), n
        else:
            assert fn is getattr(reference, n), n


@pytest.mark.slow
def test_compiled_kernels_train_like_the_reference():
    """kernels=compiled (inductor on CPU, seconds per op) gives the reference's loss and
    gradients on a multimodal MoE step, QK-norm and RoPE fused in one compiled op."""
    from omniloom.kernels.ops import cpp_compiler
    from omniloom.model import OmniModel
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
    from omniloom.model.synthetic import random_packed_batch

    if cpp_compiler() is None:
        pytest.skip("no C++ compiler for torch.compile on CPU")
    cfgs = [ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=300, patch_token_id=290,
                        rope_sections=(2, 2, 4), patch_dim=12, tubelet_dim=24, kernels=k,
                        attention=AttentionConfig(backend="blocksparse", pattern="LG", window=16, block_size=8),
                        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=0))
            for k in ("reference", "compiled")]
    torch.manual_seed(0)
    ref, comp = OmniModel(cfgs[0]), OmniModel(cfgs[1])
    comp.load_state_dict(ref.state_dict())
    assert comp.ops.name == "compiled"
    batch = random_packed_batch(cfgs[0], batch_size=2, seq_len=64, seed=4)
    outs = []
    for m in (ref, comp):
        out = m(**batch)
        out.loss.backward()
        outs.append(out.loss.detach())
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    grads = dict(ref.named_parameters())
    for name, p in comp.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs a CPU-only run")
def test_get_ops_triton_without_cuda_says_what_to_use():
    with pytest.raises(ValueError, match="use 'auto' or 'reference'"):
        get_ops("triton")


# ---- independent float64 formulas (plain autograd, no chunking, no custom Function)


def _rms64(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope64(x, cos, sin):
    d = x.shape[-1] // 2
    # the rotation as complex multiplication: (x1 + i x2) * (cos + i sin)
    z = torch.complex(x[..., :d], x[..., d:]) * torch.complex(cos, sin).unsqueeze(2)
    return torch.cat([z.real, z.imag], -1)


def _ce64(h, w, labels, ignore_index=-100):
    logits = h @ w.t()
    ce = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    z = torch.logsumexp(logits, -1).pow(2) * (labels != ignore_index)
    return ce, z


class _Float64Ops:
    """A namespace with the parity-harness interface, built from the formulas above."""

    name = "float64"

    @staticmethod
    def rms_norm(x, w, eps):
        return _rms64(x, w, eps)

    @staticmethod
    def swiglu(g, u):
        return g * torch.sigmoid(g) * u

    @staticmethod
    def apply_rope(x, cos, sin):
        return _rope64(x, cos, sin)

    @staticmethod
    def qk_norm_rope(x, w, cos, sin, eps):
        return _rope64(_rms64(x, w, eps), cos, sin)

    @staticmethod
    def linear_cross_entropy(h, w, labels, *, ignore_index=-100, chunk_size=0):
        return _ce64(h, w, labels, ignore_index)

    @staticmethod
    def moe_permute(x, topk, E):
        flat = topk.reshape(-1)
        # stable sort by expert without argsort: sort the key expert * N + position
        key = flat * flat.numel() + torch.arange(flat.numel())
        perm = torch.sort(key).indices
        return x[perm // topk.shape[1]], perm, torch.stack([(flat == e).sum() for e in range(E)])

    @staticmethod
    def moe_unpermute(y, perm, w):
        T, K = w.shape
        out = torch.zeros(T, y.shape[1], dtype=y.dtype)
        for n, p in enumerate(perm.tolist()):
            out[p // K] = out[p // K] + w[p // K, p % K] * y[n]
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("case", range(len(parity.TINY_CASES)), ids=[op for op, _ in parity.TINY_CASES])
def test_reference_matches_float64_formulas(case, dtype):
    op, shapes = parity.TINY_CASES[case]
    r = parity.run_case(op, shapes, dtype, "cpu", get_ops("reference"), _Float64Ops, ref_dtype=torch.float64)
    assert r.ok, r.line()


def test_reference_ce_is_chunk_size_invariant_and_ignores_labels():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(50, 16, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 50, (37,), generator=g)
    labels[::5] = -100
    outs = []
    for chunk in (1, 7, 37, 4096):
        ce, z = reference.linear_cross_entropy(h, w, labels, chunk_size=chunk)
        gh, gw = torch.autograd.grad((ce * 0.3 + z * 0.01).sum(), (h, w))
        outs.append((ce, z, gh, gw))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            torch.testing.assert_close(a, b)
    ce, z = outs[0][:2]
    assert torch.all(ce[::5] == 0) and torch.all(z[::5] == 0) and torch.all(ce[1::5] > 0)
    assert ce.dtype == torch.float64


def test_reference_ce_fp16_inputs_give_fp32_losses():
    h = torch.randn(4, 8).half()
    w = torch.randn(11, 8).half()
    ce, z = reference.linear_cross_entropy(h, w, torch.tensor([0, 1, -100, 10]))
    assert ce.dtype == torch.float32 and z.dtype == torch.float32


def test_cpu_head_logits_under_bf16_are_rounded_to_bf16_as_the_readme_says():
    """Issue 27 item 18: the README called the head's GEMM "fp32-output"; on CPU its bf16 product
    is rounded to bf16, then upcast (fp32 output only on CUDA). The docs now say so: this holds
    the code and the sentence together."""
    from pathlib import Path

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(8, 64, generator=g).bfloat16(), torch.randn(96, 64, generator=g).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dt = reference.head_dtype(h.float(), w.float())
    logits = reference.head_logits(h.to(dt), w.to(dt))
    assert dt == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.equal(logits, logits.bfloat16().float())  # every logit is a bf16 number
    assert not torch.equal(logits, h.float() @ w.float().t())  # not what an fp32-output GEMM gives
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert "fp32-output GEMM" not in readme and "rounded to bf16 and then upcast" in " ".join(readme.split())


def test_reference_permute_roundtrip_is_identity_with_unit_weights():
    x = torch.randn(9, 6)
    topk = torch.randint(0, 4, (9, 3))
    x_nd, perm, counts = reference.moe_permute(x, topk, 4)
    assert counts.dtype == torch.int64 and int(counts.sum()) == 27
    # rows arrive grouped by expert, in token order inside each expert
    experts = topk.reshape(-1)[perm]
    assert torch.all(experts[1:] >= experts[:-1])
    back = reference.moe_unpermute(x_nd, perm, torch.full((9, 3), 1 / 3))
    torch.testing.assert_close(back, x)


def test_bench_kernels_cli_on_cpu(capsys, tmp_path):
    import json

    from omniloom.pretrain.cli import main

    out_json = tmp_path / "bench.json"
    rc = main(["bench", "kernels", "--ops", "rms_norm,moe", "--tokens", "8", "--check-tokens", "4", "--iters", "1",
               "--no-memory", "--ce-tokens", "64", "--ce-vocab", "500", "--ce-dim", "8", "--ce-chunks", "16",
               "--json", str(out_json)])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "Triton timings need CUDA" in text and "summary: 2 kernels, correct 100%" in text
    data = json.loads(out_json.read_text())
    assert [r["op"] for r in data["rows"]] == ["rms_norm", "moe"]
    mem = data["ce_memory"]
    assert mem["naive"] > 0 and mem["reference/chunk16"] > 0  # fresh-process RSS figures came back


def test_kernel_verdict_follows_the_keep_rule():
    """A kernel stays when correct, >= 1.3x eager and faster than torch.compile of its reference."""
    from omniloom.kernels.bench import KEEP_SPEEDUP, Row, summarize

    def row(op, ms_fast, ms_compiled, correct=True):
        return Row(op, {}, 1e-3, 1e-3, correct, ms_fast, 10.0, None, None, ms_compiled)

    rows = [row("a", 5.0, 6.0), row("b", 5.0, 4.0), row("c", 9.0, None), row("d", 5.0, 6.0, correct=False),
            row("e", 10.0 / KEEP_SPEEDUP, None)]
    assert [r.verdict for r in rows] == ["keep", "use compile", "slow", "wrong", "keep"]
    assert Row("f", {}, None, 1e-3, True, None, 10.0, None, None).verdict == "n/a"
    s = summarize(rows)
    assert s["verdicts"] == {"a": "keep", "b": "use compile", "c": "slow", "d": "wrong", "e": "keep"}
    assert s[f"at_least_{KEEP_SPEEDUP}x"] == 3 / 5  # a, b and e (b is fast but loses to compile)


def test_bench_kernels_compile_column_on_cpu(capsys):
    """--compile times each reference under torch.compile (inductor needs a C++ compiler on CPU)."""
    from omniloom.pretrain.cli import main

    rc = main(["bench", "kernels", "--ops", "rms_norm", "--tokens", "8", "--check-tokens", "4", "--iters", "1",
               "--no-memory", "--skip-ce-memory", "--compile"])
    text = capsys.readouterr().out
    assert rc == 0, text
    header, line = [ln for ln in text.splitlines() if ln.startswith(("kernel ", "rms_norm"))]
    assert header.split()[-2:] == ["ms", "verdict"] and "compiled" in header
    assert float(line.split()[-2]) > 0 and line.split()[-1] == "n/a"  # no Triton on CPU: no verdict


def test_bench_kernels_cli_rejects_unknown_op(capsys):
    from omniloom.pretrain.cli import main

    assert main(["bench", "kernels", "--ops", "softmax"]) == 2
    assert "unknown --ops" in capsys.readouterr().err


def test_cli_op_names_match_the_api():
    from omniloom.kernels import cli, ops

    assert tuple(cli.OP_NAMES) == tuple(ops.OP_NAMES)


def test_linear_ce_kept_softmax_equals_recomputed():
    # small calls keep the forward's softmax for backward; large ones recompute the logits
    from omniloom.kernels import reference

    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, dtype=torch.float64)
    w = torch.randn(70, 16, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 70, (23,), generator=g)
    labels[::5] = -100
    grads = []
    for keep in (0, 2**30):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        ce, z = reference.linear_cross_entropy(hh, ww, labels, chunk_size=6, keep_bytes=keep)
        (ce * torch.linspace(0.5, 1.5, 23, dtype=torch.float64)).sum().add(0.1 * z.sum()).backward()
        grads.append((ce.detach(), hh.grad, ww.grad))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_linear_ce_reuses_logits_buffers_on_cpu_but_never_one_still_in_use():
    """CPU logits buffers come from a pool (a fresh one costs a page fault per page): a second
    call reuses the first's buffer, and two forwards whose kept softmax waits for backward get
    two buffers, with the same results and gradients as with the pool off."""
    from omniloom.kernels import reference

    pool = reference.LOGITS_POOL
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 12, 16, generator=g)
    w = torch.randn(40, 16, generator=g)
    labels = torch.randint(0, 40, (2, 12), generator=g)
    labels[0, ::4] = -100

    def run(pooled: bool):
        pool.clear()
        pool.max_buffers = 2 if pooled else 0
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        taken = []
        real_take = pool.take
        pool.take = lambda *a: taken.append(real_take(*a)) or taken[-1]
        try:
            # two micro-batches in flight (both forwards before either backward), kept softmax
            outs = [reference.linear_cross_entropy(hh[i], ww, labels[i], chunk_size=12) for i in range(2)]
            assert len({t.data_ptr() for t in taken}) == 2  # the second forward did not get the first's buffer
            for ce, z in reversed(outs):
                (ce.sum() + 0.1 * z.sum()).backward()
            # recomputing path (nothing kept): one chunk's buffer serves the next
            n = len(taken)
            ce, z = reference.linear_cross_entropy(hh[0], ww, labels[0], chunk_size=4, keep_bytes=0)
            (ce.sum() + z.sum()).backward()
            ptrs = [t.data_ptr() for t in taken[n:]]
        finally:
            pool.take = real_take
            pool.max_buffers = 2
        return [o[0].detach() for o in outs], hh.grad, ww.grad, ptrs

    ces_p, gh_p, gw_p, ptrs_p = run(True)
    ces_u, gh_u, gw_u, ptrs_u = run(False)
    assert len(ptrs_p) == 6 and len(set(ptrs_p)) == 1  # 3 chunks forward + 3 backward, one buffer
    assert len(set(ptrs_u)) == 6  # (`taken` holds them: without the pool every buffer is new)
    small = reference.LogitsPool(max_buffers=2, max_bytes=350)
    for rows in (10, 5, 20):  # 160, 80 and 320 fp32 bytes: two at most, then the oldest go past 350 bytes
        small.give(torch.empty(rows, 4))
    assert [t.shape[0] for t in small._free] == [20]
    assert small.take(20, 4, torch.float32, torch.device("cpu")).shape == (20, 4) and not small._free
    for a, b in zip(ces_p, ces_u):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    torch.testing.assert_close(gh_p, gh_u, rtol=0, atol=0)
    torch.testing.assert_close(gw_p, gw_u, rtol=0, atol=0)
    pool.clear()
