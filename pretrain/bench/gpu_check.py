"""The whole GPU check in one script, sized for a lent H200 (< 8 minutes):

    python -m omniloom.pretrain.bench.gpu_check [--out DIR] [--budget-s 420]

1. kernel parity on CUDA: Triton against the reference in fp32, fp16 and bf16 (tiny shapes off
   the block sizes, then model-width shapes), outputs, gradients and exact permutations;
2. the kernel bench at ~1B-active widths (error vs float64, Triton vs eager time, speedup, peak
   memory, KernelBench summary) and the chunked-CE memory at vocab 64k x 16k tokens;
3. the model's attention backends (whatever `omniloom.model` exposes; skipped when absent):
   agreement with sdpa on one packed multimodal batch, then forward+backward timings;
4. one training step of a small OmniModel with kernels=triton against kernels=reference on the
   same weights and batch (loss and gradient agreement), then the trainer's throughput with each;
5. step speed: host syncs in one forward+backward (CUDA sync-debug mode), flex L vs G at 4k, 16k
   and 64k tokens with the recompile count of a repeat pass, and the d1024 equal-math step
   against Hugging Face Qwen3-MoE (when transformers is installed).

Each section runs in its own try block so one failure does not hide the others; sections are
skipped once the time budget is spent. Everything printed also goes to DIR/gpu_check.txt and the
figures to DIR/gpu_check.json when --out is given (default: $OUT when set).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

RESULTS: dict = {}

# Sizes per mode: "gpu" for the real check, "smoke" to run every code path on CPU under
# TRITON_INTERPRET=1 with tiny sizes (how this script is tested without a GPU).
PLANS = {
    "gpu": dict(device="cuda", parity_tokens=512, bench_tokens=8192, check_tokens=2048, bench_iters=10,
                bench_ops=None, ce_tokens=16384, ce_vocab=65536, ce_dim=2048, attn_seq=1024,
                attn_seq_lens=[4096, 16384], attn_iters=5, sdpa_max=16384, dtypes=("float32", "float16", "bfloat16"),
                model_dim=512, seq_len=2048, train_backends=("blocksparse", "flex"), train_steps=5, autocast=True,
                train_overrides=[]),
    "smoke": dict(device="cpu", parity_tokens=0, bench_tokens=8, check_tokens=4, bench_iters=1,
                  bench_ops=["rms_norm", "swiglu", "apply_rope", "qk_norm_rope", "moe"], ce_tokens=64, ce_vocab=300, ce_dim=16,
                  attn_seq=256, attn_seq_lens=[256], attn_iters=1, sdpa_max=256, dtypes=("float32",), model_dim=64, seq_len=128,
                  train_backends=("blocksparse",), train_steps=1, autocast=False,
                  train_overrides=["data.seq_len=64", "data.batch_size=1", "model.dim=32", "model.num_layers=2",
                                   "model.rope_sections=[2,2,4]", "model.moe.expert_dim=16", "model.moe.dense_dim=32"]),
}
PLAN: dict = PLANS["gpu"]


class _Tee:
    """Copy everything printed (ours and the bench's) into a log file as well."""

    def __init__(self, stream, path: str):
        self.stream, self.file = stream, open(path, "w")

    def write(self, text: str) -> int:
        self.file.write(text)
        self.file.flush()
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def say(msg: str = "") -> None:
    print(msg, flush=True)


def section_kernel_parity() -> None:
    from omniloom.kernels import parity
    from omniloom.kernels.bench import case_at
    from omniloom.kernels.ops import get_ops

    fast, ref = get_ops("triton"), get_ops("reference")
    cases = list(parity.TINY_CASES)
    if PLAN["parity_tokens"]:
        cases += [(op, case_at(op, s, PLAN["parity_tokens"])) for op, s in parity.MODEL_CASES]
    fails, lines = 0, []
    for dtype in [getattr(torch, d) for d in PLAN["dtypes"]]:
        for op, s in cases:
            r = parity.run_case(op, s, dtype, PLAN["device"], fast, ref)
            fails += not r.ok
            lines.append(r.line())
            if not r.ok:
                say(r.line())
    say(f"parity: {len(lines) - fails}/{len(lines)} cases ok (fp32/fp16/bf16, Triton vs reference, outputs + grads)")
    RESULTS["parity"] = {"ok": len(lines) - fails, "total": len(lines), "lines": lines}


def section_kernel_bench() -> None:
    from dataclasses import asdict

    from omniloom.kernels import bench

    on_cuda = PLAN["device"] == "cuda"
    rows = bench.bench_kernels(device=PLAN["device"], dtype=torch.bfloat16 if on_cuda else torch.float32,
                               tokens=PLAN["bench_tokens"], check_tokens=PLAN["check_tokens"], warmup=3 if on_cuda else 0,
                               iters=PLAN["bench_iters"], ops_filter=PLAN["bench_ops"], measure_memory=on_cuda)
    bench.print_summary(rows, fast_available=on_cuda)
    RESULTS["bench"] = {"rows": [asdict(r) for r in rows], "summary": bench.summarize(rows)}
    RESULTS["ce_memory"] = bench.ce_memory(device=PLAN["device"], tokens=PLAN["ce_tokens"], vocab=PLAN["ce_vocab"],
                                           dim=PLAN["ce_dim"], chunks=[1024, 4096] if on_cuda else [16],
                                           naive_backward=on_cuda)


def section_attention() -> None:
    try:
        from omniloom.model import attention as A
        from omniloom.model.bench import bench_attention, format_attention
        from omniloom.model.masks import build_mask_info
    except ImportError as err:
        say(f"attention: skipped, the model does not expose what this needs ({err})")
        return
    backends = []
    for b in ("sdpa", "blocksparse", "flex", "flash"):
        try:
            A.check_backend(b)
            backends.append(b)
        except (ValueError, ImportError) as err:
            say(f"attention: backend {b} unavailable: {err}")
    # agreement with sdpa on a packed batch with documents and a visual block
    dev = PLAN["device"]
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    S, H, KV, Dh = PLAN["attn_seq"], 8, 2, 64
    doc = torch.zeros(1, S, dtype=torch.int32, device=dev)
    doc[:, S * 2 // 5:] = 1
    blk = torch.full((1, S), -1, dtype=torch.int32, device=dev)
    blk[:, S // 2: S // 2 + S // 10] = 0
    q = torch.randn(1, H, S, Dh, generator=g, device=dev, dtype=dt)
    k = torch.randn(1, KV, S, Dh, generator=g, device=dev, dtype=dt)
    v = torch.randn(1, KV, S, Dh, generator=g, device=dev, dtype=dt)
    info = build_mask_info(doc, blk, block_size=64, window=256)
    agree = {}
    for kind in ("L", "G", "B"):
        want = A.AttnContext(info, "sdpa", 4, q.device).attend(q, k, v, kind).float()
        for b in backends:
            if b == "sdpa":
                continue
            try:
                got = A.AttnContext(info, b, 4, q.device).attend(q, k, v, kind).float()
                agree[f"{kind}/{b}"] = float((got - want).abs().max() / want.abs().max())
            except Exception as err:  # report and keep checking the other backends
                agree[f"{kind}/{b}"] = f"error: {err!r}"[:200]
    say(f"attention max rel diff vs sdpa ({str(dt)[6:]}, 2 docs + a visual block): "
        + ", ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in agree.items()))
    seq_lens, kinds = PLAN["attn_seq_lens"], "LGB"
    res = bench_attention(device=torch.device(dev), seq_lens=seq_lens, kinds=kinds, backends=backends, num_heads=16,
                          num_kv_heads=4, head_dim=128, window=1024, block_size=128, num_selected=8, warmup=2 if dev == "cuda" else 0,
                          iters=PLAN["attn_iters"], sdpa_max=PLAN["sdpa_max"], dtype=dt)
    for line in format_attention(res, seq_lens, kinds, backends):
        say(line)
    RESULTS["attention"] = {"agreement": agree, "seconds": {"/".join(map(str, k)): v for k, v in res.items()}}


def _small_model_config(kernels: str, backend: str):
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig

    dim = PLAN["model_dim"]
    return ModelConfig(
        dim=dim, num_layers=4, num_heads=8, num_kv_heads=2, vocab_size=32768 if dim >= 512 else 512, patch_token_id=8,
        rope_sections=(16, 24, 24) if dim >= 512 else (2, 2, 4), patch_dim=3 * 16 * 16, tubelet_dim=3 * 2 * 16 * 16,
        kernels=kernels,
        attention=AttentionConfig(backend=backend, pattern="LLBG", window=256, block_size=64 if dim >= 512 else 16,
                                  num_selected_blocks=4),
        moe=MoEConfig(num_experts=16, num_experts_per_token=4, expert_dim=dim // 2, num_shared_experts=1,
                      num_dense_layers=1, dense_dim=2 * dim),
    )


def section_train_step() -> None:
    import contextlib

    from omniloom.model.decoder import OmniModel
    from omniloom.model.synthetic import random_packed_batch

    dev = PLAN["device"]
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if PLAN["autocast"] else contextlib.nullcontext
    out = {}
    for backend in PLAN["train_backends"]:
        cfg_t, cfg_r = _small_model_config("triton", backend), _small_model_config("reference", backend)
        torch.manual_seed(0)
        model_t = OmniModel(cfg_t).to(dev)
        model_r = OmniModel(cfg_r).to(dev)
        model_r.load_state_dict(model_t.state_dict())
        assert model_t.ops.name == "triton" and model_r.ops.name == "reference"
        batch = {k: v.to(dev) for k, v in random_packed_batch(cfg_t, batch_size=2, seq_len=PLAN["seq_len"], docs_per_row=3).items()}
        losses, grads = {}, {}
        for name, model in (("triton", model_t), ("reference", model_r)):
            with amp():
                loss = model(**batch).loss
            loss.backward()
            losses[name] = float(loss.detach())
            grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        worst = max(float((grads["triton"][n] - g).abs().max() / g.abs().max().clamp_min(1e-12))
                    for n, g in grads["reference"].items())
        opt = torch.optim.AdamW(model_t.parameters(), lr=1e-3)
        opt.step()  # one optimizer step with the Triton-path gradients
        with amp():
            loss_after = float(model_t(**batch).loss)
        say(f"train step [{backend}]: loss triton {losses['triton']:.5f} reference {losses['reference']:.5f}; "
            f"worst grad rel diff {worst:.2e}; loss after one AdamW step {loss_after:.5f}")
        out[backend] = {"loss": losses, "worst_grad_rel_diff": worst, "loss_after_step": loss_after}
        del model_t, model_r, grads
    RESULTS["train_step"] = out
    try:
        from .train import bench_train
    except ImportError as err:
        say(f"trainer throughput: skipped ({err})")
        return
    backend = PLAN["train_backends"][-1]
    for kernels in ("triton", "reference"):
        report = bench_train("tiny", [f"model.kernels={kernels}", f"model.attention.backend={backend}"] + PLAN["train_overrides"],
                             steps=PLAN["train_steps"], warmup=2 if dev == "cuda" else 0)
        say(f"-- bench train tiny, kernels={kernels}, attention {backend}")
        for line in report.splitlines():
            say(line)
        RESULTS.setdefault("bench_train", {})[kernels] = report


def section_step_speed() -> None:
    """Issue 13's GPU rows: host syncs in one training step (CUDA sync-debug mode), flex L vs G
    at 4k-64k with the recompile count after warm-up, and the d1024 equal-math step against
    Hugging Face Qwen3-MoE (when transformers is installed)."""
    import warnings

    from omniloom.model import OmniModel
    from omniloom.model.bench import bench_attention, format_attention
    from omniloom.model.synthetic import random_packed_batch

    dev = PLAN["device"]
    # (a) host syncs inside forward + backward, counted by CUDA's sync-debug warnings
    backend = "flex" if dev == "cuda" else "blocksparse"
    cfg = _small_model_config("auto", backend)
    model = OmniModel(cfg).to(dev)
    batch = random_packed_batch(cfg, batch_size=2, seq_len=PLAN["seq_len"], docs_per_row=3, seed=0)
    layout = model.batch_layout(batch["doc_ids"], batch["block_ids"])
    batch = {k: v.to(dev) for k, v in batch.items()}
    for _ in range(2):  # warm-up: compile, autotune, grouped-vs-loop decision
        model(**batch, layout=layout).loss.backward()
    syncs = "n/a on CPU"
    if dev == "cuda":
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                model(**batch, layout=layout).loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        msgs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message)]
        syncs = f"{len(msgs)}" + (f" (first: {msgs[0][:120]})" if msgs else "")
    say(f"host syncs in one forward+backward ({backend}, 2 x {PLAN['seq_len']} multimodal): {syncs}")
    RESULTS["step_syncs"] = syncs
    # (a2) new batches, new layouts (documents, visual blocks: the B layer's slot bound moves):
    # the compiled flex kernels must serve them without compiling again
    try:
        import torch._dynamo.utils as du

        mark = sum(du.counters["stats"].values())
        for seed in range(1, 5):
            new = random_packed_batch(cfg, batch_size=2, seq_len=PLAN["seq_len"], docs_per_row=1 + seed, seed=seed)
            new_layout = model.batch_layout(new["doc_ids"], new["block_ids"])
            model(**{k: v.to(dev) for k, v in new.items()}, layout=new_layout).loss.backward()
        n = sum(du.counters["stats"].values()) - mark
        say(f"dynamo stats over 4 new batches (other documents and visual blocks, {backend}): {n} (0: nothing recompiled)")
        RESULTS["recompiles_new_batches"] = n
    except Exception as err:  # noqa: BLE001 - report and go on to the other rows of this section
        say(f"new-batch recompile check failed: {type(err).__name__}: {err}")
    # (b) flex sliding-window vs global, and recompiles after warm-up
    if dev == "cuda":
        import torch._dynamo.utils as du

        lens = [4096, 16384, 65536]
        res = bench_attention(device=torch.device(dev), seq_lens=lens[:1], kinds="LG", backends=["flex"], num_heads=16,
                              num_kv_heads=4, head_dim=64, window=1024, block_size=128, num_selected=8, warmup=2,
                              iters=1, sdpa_max=0, dtype=torch.bfloat16, warmup_each=True)
        before = sum(du.counters["stats"].values())
        res = bench_attention(device=torch.device(dev), seq_lens=lens, kinds="LG", backends=["flex"], num_heads=16,
                              num_kv_heads=4, head_dim=64, window=1024, block_size=128, num_selected=8, warmup=2,
                              iters=PLAN["attn_iters"], sdpa_max=0, dtype=torch.bfloat16, warmup_each=True)
        for line in format_attention(res, lens, "LG", ["flex"]):
            say(line)
        for S in lens:
            say(f"flex L/G time at {S}: {res[('L', 'flex', S)] / res[('G', 'flex', S)]:.2f} (below 1: window layers faster)")
        # a second pass over the same shapes must compile nothing new
        mark = sum(du.counters["stats"].values())
        bench_attention(device=torch.device(dev), seq_lens=lens, kinds="LG", backends=["flex"], num_heads=16,
                        num_kv_heads=4, head_dim=64, window=1024, block_size=128, num_selected=8, warmup=0,
                        iters=1, sdpa_max=0, dtype=torch.bfloat16)
        after = sum(du.counters["stats"].values())
        say(f"dynamo stats during warm-up {mark - before}, during a repeat pass {after - mark} (0: no recompiles)")
        RESULTS["flex_l_vs_g"] = {str(S): res[("L", "flex", S)] / res[("G", "flex", S)] for S in lens}
        RESULTS["recompiles_after_warmup"] = after - mark
    # (c) equal math against Hugging Face
    from .hf import EQUAL_MATH, EQUAL_MATH_GPU, bench_hf, import_transformers

    try:
        import_transformers()
    except ImportError:
        say("equal-math row vs Hugging Face: skipped (transformers not installed)")
        return

    shape = EQUAL_MATH_GPU if dev == "cuda" else dict(EQUAL_MATH, layers=1, vocab=512)
    cases = [(4096, 4)] if dev == "cuda" else [(64, 1)]
    patterns = ["G" * shape["layers"], "LLLG"]
    rows = bench_hf(cases=cases, patterns=patterns, backend=backend, steps=3 if dev == "cuda" else 1, warmup=2 if dev == "cuda" else 0,
                    shape=shape, device=dev)
    for r in rows:
        say(f"equal math {r['seq_len']}x{r['batch']} {r['pattern']}: omniloom {r['omni_tps']:,.0f} tok/s, "
            f"HF ({r['hf_impl']}) {r['hf_tps']:,.0f} tok/s -> {r['speedup']:.2f}x")
    RESULTS["equal_math"] = rows


SECTIONS = [
    ("kernel parity", section_kernel_parity),
    ("kernel bench", section_kernel_bench),
    ("attention backends", section_attention),
    ("training step", section_train_step),
    ("step speed (issue 13)", section_step_speed),
]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m omniloom.pretrain.bench.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for gpu_check.txt and gpu_check.json")
    p.add_argument("--budget-s", type=float, default=420.0, help="skip the remaining sections after this many seconds")
    p.add_argument("--only", default="", help="comma-separated section numbers to run (1-4); default all")
    p.add_argument("--smoke", action="store_true",
                   help="run every section on CPU at tiny sizes (needs TRITON_INTERPRET=1): tests this script without a GPU")
    args = p.parse_args(argv)
    global PLAN
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("--smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1")
            return 2
        PLAN = PLANS["smoke"]
    elif not torch.cuda.is_available():
        print("gpu_check needs a CUDA device; on CPU run `pytest tests/test_kernels*.py`, `omniloom bench kernels`, "
              "or this script with --smoke under TRITON_INTERPRET=1")
        return 2
    import triton

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        sys.stdout = _Tee(sys.stdout, os.path.join(args.out, "gpu_check.txt"))
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name() if PLAN["device"] == "cuda" else "CPU smoke run (TRITON_INTERPRET=1)"
    say(f"gpu_check: {name}, torch {torch.__version__}, triton {triton.__version__}")
    only = {int(x) for x in args.only.split(",") if x}
    failed = []
    for i, (name, fn) in enumerate(SECTIONS, 1):
        if only and i not in only:
            continue
        spent = time.perf_counter() - t0
        if spent > args.budget_s:
            say(f"== {i}. {name}: skipped, {spent:.0f}s spent of a {args.budget_s:.0f}s budget")
            continue
        say(f"\n== {i}. {name} ({spent:.0f}s in)")
        try:
            fn()
        except Exception:  # a check script: report the failure, run the other sections
            failed.append(name)
            tb = traceback.format_exc()
            say(f"{name}: FAILED\n{tb}")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    say(f"\ngpu_check done in {time.perf_counter() - t0:.0f}s; failed sections: {failed or 'none'}")
    RESULTS["failed_sections"] = failed
    if args.out:
        with open(os.path.join(args.out, "gpu_check.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
