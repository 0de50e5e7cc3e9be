"""No host sync in a training step, and no fp32 GEMM over the vocabulary under bf16 autocast.

A CPU run cannot time a GPU stall, but it can list the ops that would cause one: the recorder
(omniloom.kernels.hostsync) sees every aten op of forward and backward, on any device."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omniloom.kernels.hostsync import HostSyncRecorder
from omniloom.kernels.reference import linear_cross_entropy
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.decoder import OmniModel
from omniloom.model.embeddings import accelerator_shapes
from omniloom.model.synthetic import random_packed_batch

VOCAB = 997  # a width no other dimension of the model has: a GEMM with it is the head


def multimodal_cfg(backend: str, patch_dim: int = 12, tubelet_dim: int = 24, **kw) -> ModelConfig:
    return ModelConfig(
        dim=64, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=VOCAB, patch_token_id=VOCAB - 1,
        pad_token_id=3, rope_sections=(4, 6, 6), patch_dim=patch_dim, tubelet_dim=tubelet_dim,
        attention=AttentionConfig(backend=backend, pattern="LGB", window=16, block_size=8, num_selected_blocks=3),
        moe=MoEConfig(num_experts=8, num_experts_per_token=2, expert_dim=32, num_shared_experts=1,
                      num_dense_layers=1, dense_dim=64, aux_loss_coef=0.01, router_z_loss_coef=1e-3),
        **kw,
    )


def step_inputs(cfg: ModelConfig):
    batch = random_packed_batch(cfg, batch_size=2, seq_len=96, docs_per_row=3, pad=7, seed=3)
    # what the test promises to cover: several documents, an image, a video and padding
    assert int(batch["doc_ids"].max()) >= 2 and set(batch["patch_kind"].tolist()) == {2, 3}
    assert bool((batch["input_ids"] == cfg.pad_token_id).any())
    return batch


def test_recorder_sees_the_ops_that_sync():
    x = torch.tensor([0.0, 1.0, 2.0])
    found = []
    for fn in (
        lambda: x.sum().item(),
        lambda: bool(x.any()),
        lambda: x.tolist(),
        lambda: x.nonzero(),
        lambda: x[x > 0],
        lambda: torch.bincount(x.long()),
        lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 0])),
        lambda: x.unique(),
    ):
        with HostSyncRecorder() as rec:
            fn()
        found.append(len(rec.events))
    assert all(n >= 1 for n in found), found
    with HostSyncRecorder() as rec:  # and stays quiet on the sync-free forms
        torch.repeat_interleave(x, torch.tensor([1, 2, 0]), output_size=3)
        torch.zeros(3).index_add_(0, torch.tensor([0, 2, 2]), x)
        torch._assert_async(x.sum() > 0)
        x[torch.tensor([0, 2])]
    assert rec.events == [], rec.report()


@pytest.mark.parametrize("backend,selector", [("sdpa", "pooled"), ("blocksparse", "pooled"), ("blocksparse", "indexer")])
def test_training_step_forward_and_backward_make_no_host_sync(backend, selector):
    """selector=indexer adds the index branch, its block scoring, KL loss and coverage."""
    torch.manual_seed(0)
    cfg = multimodal_cfg(backend)
    cfg.attention.selector, cfg.attention.indexer_dim = selector, 8
    model = OmniModel(cfg)
    batch = step_inputs(cfg)
    # as the trainer does: the host-side layout comes from the CPU batch before any device copy
    layout = model.batch_layout(batch["doc_ids"], batch["block_ids"])
    for layer in model.layers:  # decide grouped-vs-loop dispatch outside the measured step
        if layer.is_moe:
            layer.ffn.use_grouped(torch.device("cpu"), torch.float32)
    with accelerator_shapes(), HostSyncRecorder() as rec:  # the path an accelerator takes
        out = model(**batch, layout=layout)
        out.loss.backward()
    assert rec.events == [], rec.report()
    assert (out.indexer_loss is not None) == (selector == "indexer")
    assert torch.isfinite(out.loss) and model.embed.patch.weight.grad is not None and model.embed.tubelet.weight.grad is not None


@pytest.mark.parametrize("patch_stem,video", [("linear", "channels"), ("conv", "channels"), ("conv", "frames")])
def test_the_cpus_row_selection_gives_the_accelerators_loss_and_gradients(patch_stem, video):
    """On the CPU the head runs on the labelled rows only and each patch row through its own
    kind's projection (`data_dependent_shapes_are_free`); an accelerator runs every row through
    both at fixed shapes. Same loss, same metrics, same gradients."""
    torch.manual_seed(0)
    p = 4
    cfg = multimodal_cfg("blocksparse", patch_stem=patch_stem) if patch_stem == "linear" else \
        multimodal_cfg("blocksparse", patch_stem=patch_stem, patch_dim=3 * p * p, tubelet_dim=6 * p * p, conv_stem_video=video)
    model = OmniModel(cfg)
    batch = step_inputs(cfg)
    layout = model.batch_layout(batch["doc_ids"], batch["block_ids"])
    runs = []
    for fixed in (False, True):
        model.zero_grad(set_to_none=True)
        with accelerator_shapes() if fixed else contextlib.nullcontext(), HostSyncRecorder() as rec:
            out = model(**batch, layout=layout)
            out.loss.backward()
        selected = sum("nonzero" in e.op for e in rec.events)
        assert selected == (0 if fixed else 3), rec.report()  # the CPU's path: image rows, video rows, labelled rows
        runs.append((out, {n: q.grad.clone() for n, q in model.named_parameters() if q.grad is not None}))
    (cpu, g_cpu), (acc, g_acc) = runs
    for field in ("loss", "ce_loss", "z_loss", "ce_sum_by_modality", "tokens_by_modality"):
        torch.testing.assert_close(getattr(cpu, field), getattr(acc, field), rtol=1e-5, atol=1e-6)
    assert g_cpu.keys() == g_acc.keys() and {"embed.patch.weight", "embed.tubelet.weight", "head.weight"} <= g_cpu.keys()
    for name in g_cpu:
        torch.testing.assert_close(g_cpu[name], g_acc[name], rtol=1e-4, atol=1e-6, msg=name)


class _GemmDtypes(TorchDispatchMode):
    """Records (op, operand dtypes, shapes) of every matmul-like op."""

    GEMMS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "_grouped_mm", "linear"}

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket.__name__ in self.GEMMS:
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            self.calls.append((func._overloadpacket.__name__, [t.dtype for t in ts], [tuple(t.shape) for t in ts]))
        return func(*args, **(kwargs or {}))


def test_no_fp32_gemm_over_the_vocabulary_under_bf16_autocast():
    torch.manual_seed(0)
    cfg = multimodal_cfg("blocksparse")
    model = OmniModel(cfg)
    batch = step_inputs(cfg)
    with _GemmDtypes() as rec:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**batch)
        out.loss.backward()
    head = [c for c in rec.calls if any(VOCAB in shape for shape in c[2])]
    assert len(head) >= 3, rec.calls  # forward logits, backward logits, grad_h, grad_W
    fp32 = [c for c in head if torch.float32 in c[1]]
    assert fp32 == [], fp32
    assert out.loss.dtype == torch.float32 and model.head.weight.grad.dtype == torch.float32


def test_chunked_ce_backward_runs_inside_an_autocast_region():
    # the loss's backward() called inside autocast used to fail in scatter() (bf16 vs fp32)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(10, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (10,), generator=g)
    labels[3] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ce, z = linear_cross_entropy(h, w, labels, chunk_size=4)
        (ce.sum() + 1e-3 * z.sum()).backward()
    assert ce.dtype == torch.float32 and h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    # against fp32 math on the same bf16-rounded operands
    hb, wb = h.detach().bfloat16().float().requires_grad_(), w.detach().bfloat16().float().requires_grad_()
    ce_r, z_r = linear_cross_entropy(hb, wb, labels, chunk_size=4)
    (ce_r.sum() + 1e-3 * z_r.sum()).backward()
    torch.testing.assert_close(ce, ce_r, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(h.grad, hb.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(w.grad, wb.grad, rtol=5e-2, atol=5e-2)
