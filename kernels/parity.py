"""Parity checks shared by the tests, the GPU check and the bench: run one op through two backends
(or a backend and float64) on the same inputs and cotangents, compare outputs and gradients.

A case is (op, shape dict). `run_case(op, shapes, dtype, device, fast_ops, ref_ops)` builds seeded
inputs, runs forward and backward through both namespaces and returns a `ParityResult` with the
max error of every output and gradient, relative to the largest magnitude of the reference
tensor (so one tolerance per dtype fits every op).

Shapes: T tokens, D width, V vocab, E experts, K experts per token, N = T*K routed rows,
M rows, B batch, S sequence, H heads, Dh head dim, d = Dh/2.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# max |fast - ref| / max |ref| allowed per dtype of the inputs
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 4e-2}

# Tiny shapes for the CPU interpreter: sizes deliberately off the block sizes (RMSNorm block 64 for
# D=37, SwiGLU 1024-column tiles for N=1100, vocab tiles of 2048 for V=2100, several 128-pair
# blocks for the MoE sort).
TINY_CASES: list[tuple[str, dict]] = [
    ("rms_norm", dict(M=7, D=37)),
    ("rms_norm", dict(M=3, D=130)),
    ("swiglu", dict(M=5, N=300)),
    ("swiglu", dict(M=3, N=1100)),
    ("apply_rope", dict(B=2, S=5, H=3, Dh=10)),
    ("apply_rope", dict(B=1, S=3, H=17, Dh=6)),
    ("qk_norm_rope", dict(B=2, S=5, H=3, Dh=10)),
    ("qk_norm_rope", dict(B=1, S=7, H=17, Dh=6)),
    ("linear_cross_entropy", dict(T=13, D=16, V=70, chunk=5)),
    ("linear_cross_entropy", dict(T=9, D=8, V=2100, chunk=4)),
    ("moe", dict(T=11, D=20, E=5, K=3)),
    ("moe", dict(T=50, D=9, E=64, K=4)),
]

# Shapes of a ~1B-active MoE (dim 2048, 16 heads of 128, vocab 64k, 64 experts top-8 of width
# 1024) at 8k tokens per micro-batch, for the GPU check and the bench.
MODEL_CASES: list[tuple[str, dict]] = [
    ("rms_norm", dict(M=8192, D=2048)),
    ("swiglu", dict(M=8192 * 8, N=1024)),
    ("apply_rope", dict(B=4, S=2048, H=16, Dh=128)),
    ("qk_norm_rope", dict(B=4, S=2048, H=16, Dh=128)),
    ("linear_cross_entropy", dict(T=8192, D=2048, V=65536, chunk=4096)),
    ("moe", dict(T=8192, D=2048, E=64, K=8)),
]


@dataclass
class ParityResult:
    op: str
    shapes: dict
    dtype: str
    errors: dict = field(default_factory=dict)  # tensor name -> relative max error
    exact: dict = field(default_factory=dict)  # integer outputs -> equal?
    tolerance: float = 0.0

    @property
    def max_error(self) -> float:
        return max(self.errors.values(), default=0.0)

    @property
    def ok(self) -> bool:
        return all(self.exact.values()) and self.max_error <= self.tolerance

    def line(self) -> str:
        errs = " ".join(f"{k}={v:.1e}" for k, v in self.errors.items())
        ex = " ".join(f"{k}={'eq' if v else 'DIFF'}" for k, v in self.exact.items())
        return f"{'ok  ' if self.ok else 'FAIL'} {self.op:<22} {self.dtype:<9} {self.shapes} {errs} {ex}".rstrip()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| in float64 (0 when both are empty)."""
    if b.numel() == 0:
        return 0.0
    a64, b64 = a.detach().double(), b.detach().double()
    return float((a64 - b64).abs().max() / b64.abs().max().clamp_min(1e-30))


def make_inputs(op: str, s: dict, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Seeded inputs for one op; floating leaves require grad. Generated in fp32, then cast, so
    every dtype sees the same values up to rounding."""
    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape, scale=1.0, grad=True):
        t = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    if op == "rms_norm":
        return dict(x=rnd(s["M"], s["D"]), weight=(1 + rnd(s["D"], scale=0.1, grad=False)).requires_grad_())
    if op == "swiglu":
        # gate and up as the two halves of one projection: strided views, as the model makes them
        return dict(h=rnd(s["M"], 2 * s["N"]))
    if op == "apply_rope":
        B, S, H, Dh = s["B"], s["S"], s["H"], s["Dh"]
        ang = torch.rand(B, S, Dh // 2, generator=g) * 6.0
        # q sliced out of a fused qkv projection: a non-contiguous [B, S, H, Dh] view
        return dict(qkv=rnd(B, S, 3 * H * Dh), cos=ang.cos().to(device, dtype), sin=ang.sin().to(device, dtype))
    if op == "qk_norm_rope":
        B, S, H, Dh = s["B"], s["S"], s["H"], s["Dh"]
        ang = torch.rand(B, S, Dh // 2, generator=g) * 6.0
        return dict(qkv=rnd(B, S, 3 * H * Dh), weight=(1 + rnd(Dh, scale=0.1, grad=False)).requires_grad_(),
                    cos=ang.cos().to(device, dtype), sin=ang.sin().to(device, dtype))
    if op == "linear_cross_entropy":
        T, D, V = s["T"], s["D"], s["V"]
        labels = torch.randint(0, V, (T,), generator=g)
        labels[torch.rand(T, generator=g) < 0.25] = -100
        return dict(h=rnd(T, D), weight=rnd(V, D, scale=D**-0.5), labels=labels.to(device))
    if op == "moe":
        T, D, E, K = s["T"], s["D"], s["E"], s["K"]
        # top-k of random scores: K distinct experts per token, uneven loads
        scores = torch.rand(T, E, generator=g) + torch.linspace(0, 0.5, E)
        topk = scores.topk(K, dim=1).indices
        w_dtype = torch.promote_types(dtype, torch.float32)  # router weights stay fp32 (fp64 in fp64 checks)
        w = torch.softmax(torch.randn(T, K, generator=g), -1).to(device=device, dtype=w_dtype)
        return dict(x=rnd(T, D), topk=topk.to(device), weights=w.requires_grad_(), expert_scale=rnd(E, D, grad=False))
    raise ValueError(f"unknown op {op}")


def forward(op: str, ops, inp: dict, s: dict) -> dict:
    """Run one op (and for `moe` the permute -> per-expert scale -> unpermute round trip) and
    return its named outputs."""
    if op == "rms_norm":
        return dict(y=ops.rms_norm(inp["x"], inp["weight"], 1e-6))
    if op == "swiglu":
        gate, up = inp["h"].chunk(2, dim=-1)
        return dict(y=ops.swiglu(gate, up))
    if op == "apply_rope":
        H, Dh = s["H"], s["Dh"]
        q = inp["qkv"][..., : H * Dh].unflatten(-1, (H, Dh))
        return dict(y=ops.apply_rope(q, inp["cos"], inp["sin"]))
    if op == "qk_norm_rope":
        H, Dh = s["H"], s["Dh"]
        q = inp["qkv"][..., : H * Dh].unflatten(-1, (H, Dh))
        return dict(y=ops.qk_norm_rope(q, inp["weight"], inp["cos"], inp["sin"], 1e-6))
    if op == "linear_cross_entropy":
        ce, z = ops.linear_cross_entropy(inp["h"], inp["weight"], inp["labels"], chunk_size=s["chunk"])
        return dict(ce=ce, z=z)
    if op == "moe":
        x_ND, perm_N, counts_E = ops.moe_permute(inp["x"], inp["topk"], s["E"])
        expert_N = torch.repeat_interleave(torch.arange(s["E"], device=x_ND.device), counts_E)
        y_ND = x_ND * inp["expert_scale"][expert_N]  # stands in for the grouped expert matmul
        return dict(x_ND=x_ND, perm=perm_N, counts=counts_E, y=ops.moe_unpermute(y_ND, perm_N, inp["weights"]))
    raise ValueError(f"unknown op {op}")


def make_cotangents(out: dict, seed: int = 1) -> dict:
    """Seeded cotangents (generated in fp32 on CPU, then moved) for the differentiable outputs."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {
        name: torch.randn(o.shape, generator=g).to(o.device, o.dtype)
        for name, o in out.items()
        if o.is_floating_point() and o.requires_grad
    }


def run(op: str, ops, inp: dict, s: dict, seed: int = 1, cots: dict | None = None) -> tuple[dict, dict]:
    """Forward, then backward with seeded cotangents (or the given ones: timing loops pass them
    in so that generating them is not timed); returns (outputs, grads of the leaves)."""
    out = forward(op, ops, inp, s)
    if cots is None:
        cots = make_cotangents(out, seed)
    leaves = {k: v for k, v in inp.items() if isinstance(v, torch.Tensor) and v.requires_grad}
    loss = sum((out[name] * c).sum() for name, c in cots.items())
    grads = torch.autograd.grad(loss, list(leaves.values())) if leaves else ()
    return {k: v.detach() for k, v in out.items()}, {f"d{k}": v for k, v in zip(leaves, grads)}


def run_case(op: str, s: dict, dtype: torch.dtype, device, fast_ops, ref_ops, ref_dtype: torch.dtype | None = None) -> ParityResult:
    """Compare `fast_ops` in `dtype` against `ref_ops` in `ref_dtype` (default: the same dtype)."""
    ref_dtype = ref_dtype or dtype
    out_f, grad_f = run(op, fast_ops, make_inputs(op, s, dtype, device), s)
    out_r, grad_r = run(op, ref_ops, make_inputs(op, s, ref_dtype, device), s)
    res = ParityResult(op=op, shapes=s, dtype=str(dtype).replace("torch.", ""), tolerance=TOLERANCE[dtype])
    for name in out_r:
        if out_r[name].is_floating_point():
            res.errors[name] = rel_err(out_f[name], out_r[name])
        else:
            res.exact[name] = bool(torch.equal(out_f[name].cpu(), out_r[name].cpu()))
    for name in grad_r:
        res.errors[name] = rel_err(grad_f[name], grad_r[name])
    return res
