"""Compile every Triton kernel for a CUDA GPU on a machine that has none:

    python -m omniloom.kernels.compile_check [--arch 90] [--presets large_1b,...] [--json PATH]

The TRITON_INTERPRET=1 tests run the kernels' arithmetic on CPU, but the interpreter never
compiles them: a construct this Triton cannot lower, a block too large for the GPU's registers
or shared memory, or spills, show up only on the GPU, where device time is short. This check
drives every op through its forward and backward, with the shapes and the dtype mixes the model
gives it under bf16 autocast on the GPU presets' widths, while a compile-only stand-in for the
CUDA driver makes each launch compile the kernel for `--arch` (Triton's own ptxas, no GPU, no
launch) and keeps the compiled kernel. It then reads each kernel's registers, local memory (spills)
and shared memory from the cubin, and fails on a compile error or a kernel past the architecture's
limits.

The ops' outputs are never computed (nothing runs), so the check says nothing about values: the
parity tests and `make gpu-check` do. It needs the CUDA build of triton (installed with CUDA
builds of torch on Linux). Under TRITON_INTERPRET=1 (set for the CPU parity tests) `@triton.jit`
hands back interpreted functions, which never compile, from the moment a kernel module is
imported: `main` then runs the check in a child process with the variable cleared.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

# per-architecture limits that decide whether a compiled kernel can launch: registers per thread,
# shared memory per block (bytes, opt-in maximum)
ARCH_LIMITS = {
    80: dict(max_regs=255, max_shared=163 * 1024),
    86: dict(max_regs=255, max_shared=99 * 1024),
    89: dict(max_regs=255, max_shared=99 * 1024),
    90: dict(max_regs=255, max_shared=227 * 1024),
}

# The widths the GPU runs use: `large_1b` (dim 1792, 14 / 2 heads of 128, 64 experts top-6 of 768,
# dense FFN 4864), `long_64k` (dim 1024, 8 / 2 heads of 128, 32 experts top-4 of 512, dense 2816)
# and the d1024 equal-math row (16 / 4 heads of 64), each at vocab 32768. Token counts stay small:
# they only change the launch grid, and divisibility by 16 (which Triton specialises on) is kept.
PRESET_WIDTHS = {
    "large_1b": dict(dim=1792, heads=14, kv_heads=2, head_dim=128, experts=64, top_k=6, expert_dim=768, dense_dim=4864, vocab=32768),
    "long_64k": dict(dim=1024, heads=8, kv_heads=2, head_dim=128, experts=32, top_k=4, expert_dim=512, dense_dim=2816, vocab=32768),
    "equal_math_d1024": dict(dim=1024, heads=16, kv_heads=4, head_dim=64, experts=32, top_k=4, expert_dim=512, dense_dim=2816, vocab=32768),
}
TOKENS = 64  # rows per case (B=2 x S=32 for the attention ops)


@dataclass
class KernelRecord:
    kernel: str
    signature: str  # the argument types and constexprs it was specialised to
    ok: bool = True
    error: str = ""
    registers: int | None = None
    local_bytes: int | None = None  # per-thread local memory: register spills (and stack)
    shared_bytes: int | None = None
    num_warps: int | None = None
    compile_s: float = 0.0
    cases: list = field(default_factory=list)  # which op cases produced this specialisation

    def problems(self, limits: dict) -> list[str]:
        out = []
        if not self.ok:
            out.append(f"compile failed: {self.error}")
        if self.registers is not None and self.registers > limits["max_regs"]:
            out.append(f"{self.registers} registers > {limits['max_regs']}")
        if self.shared_bytes is not None and self.shared_bytes > limits["max_shared"]:
            out.append(f"{self.shared_bytes} B shared > {limits['max_shared']}")
        return out


class _CompileOnlyDriver:
    """Stands in for Triton's CUDA driver: reports `arch` as the current target so that a launch
    compiles for it; `run` below never launches."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def _cuobjdump() -> str | None:
    """The cuobjdump that Triton's CUDA backend carries (or one on PATH)."""
    try:
        import triton.backends.nvidia as nv

        path = os.path.join(os.path.dirname(nv.__file__), "bin", "cuobjdump")
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("cuobjdump")


def resource_usage(cubin: bytes, tool: str | None) -> dict:
    """{registers, local_bytes, shared_bytes} of the one kernel in `cubin` (cuobjdump
    --dump-resource-usage); empty when no cuobjdump is at hand."""
    if not tool:
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)", out)
    if not m:
        return {}
    reg, stack, shared, local = (int(g) for g in m.groups())
    return dict(registers=reg, local_bytes=max(stack, local), shared_bytes=shared)


class _Recorder:
    """Patches JITFunction.run so that every launch compiles (for the stand-in driver's target)
    and returns without running; records one KernelRecord per (kernel, specialisation)."""

    def __init__(self):
        self.records: dict[tuple[str, str], KernelRecord] = {}
        self.case = ""
        self._orig = None

    def __enter__(self):
        from triton.runtime.jit import JITFunction

        self._orig = JITFunction.run
        recorder = self

        def run(fn, *args, grid, warmup, **kwargs):
            name = fn.fn.__name__
            t0 = time.perf_counter()
            try:
                kernel = recorder._orig(fn, *args, grid=grid, warmup=True, **kwargs)
            except Exception as err:  # noqa: BLE001 - a compile error is the finding
                sig = _signature(fn, args, kwargs)
                rec = recorder.records.setdefault((name, sig), KernelRecord(name, sig))
                rec.ok, rec.error = False, f"{type(err).__name__}: {str(err).strip().splitlines()[-1] if str(err).strip() else ''}"
                rec.cases.append(recorder.case)
                return None
            sig = _signature(fn, args, kwargs)
            rec = recorder.records.get((name, sig))
            if rec is None:
                rec = recorder.records[(name, sig)] = KernelRecord(name, sig, compile_s=time.perf_counter() - t0)
                if hasattr(kernel, "result"):
                    kernel = kernel.result()
                rec.num_warps = getattr(kernel.metadata, "num_warps", None)
                rec.shared_bytes = getattr(kernel.metadata, "shared", None)
                usage = resource_usage(kernel.asm["cubin"], _cuobjdump()) if "cubin" in kernel.asm else {}
                for k, v in usage.items():
                    if k != "shared_bytes" or rec.shared_bytes is None:
                        setattr(rec, k, v)
            rec.cases.append(recorder.case)
            return kernel

        JITFunction.run = run
        return self

    def __exit__(self, *exc):
        from triton.runtime.jit import JITFunction

        JITFunction.run = self._orig


def _signature(fn, args, kwargs) -> str:
    """Readable specialisation key: tensor dtypes, integer arguments' 16-divisibility, constexprs."""
    import torch

    parts = []
    names = [p.name for p in fn.params]
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    for p in fn.params:
        v = values.get(p.name)
        if p.is_constexpr:
            parts.append(f"{p.name}={v}")
        elif isinstance(v, torch.Tensor):
            parts.append(f"{p.name}:{str(v.dtype).replace('torch.', '')}")
        elif isinstance(v, bool) or v is None:
            parts.append(f"{p.name}={v}")
        elif isinstance(v, int):
            parts.append(f"{p.name}:i{'%16' if v % 16 == 0 else ('=1' if v == 1 else '')}")
        elif isinstance(v, float):
            parts.append(f"{p.name}:f")
    extra = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    return ", ".join(parts + [f"{k}={v}" for k, v in sorted(extra.items())])


def op_cases(widths: dict, tokens: int = TOKENS) -> list[tuple[str, callable]]:
    """(case name, thunk) pairs: each thunk runs one op forward and backward with the model's
    tensors at these widths (dtypes as under bf16 autocast, plus all-fp32 for fp32 training)."""
    import torch

    from . import custom_ops

    ops = SimpleNamespace(**custom_ops.OPS)  # the Triton ops themselves (get_ops refuses them without a GPU)
    D, H, Hk, Dh = widths["dim"], widths["heads"], widths["kv_heads"], widths["head_dim"]
    E, K, F, Fd, V = widths["experts"], widths["top_k"], widths["expert_dim"], widths["dense_dim"], widths["vocab"]
    B, S = 2, tokens // 2
    T = B * S

    def leaf(*shape, dtype):
        return torch.empty(*shape, dtype=dtype).requires_grad_()

    def back(*outs):
        torch.autograd.backward([o for o in outs if o.requires_grad], [torch.zeros_like(o) for o in outs if o.requires_grad])

    # RMSNorm: the residual stream stays fp32 under autocast (and in fp32 training); fp32 weights
    cases = [(f"rms_norm x float32 D={D}", lambda: back(ops.rms_norm(leaf(B, S, D, dtype=torch.float32), leaf(D, dtype=torch.float32))))]
    for act in (torch.bfloat16, torch.float32):
        a = str(act).replace("torch.", "")
        if act != torch.float32:
            cases.append((f"rms_norm x {a} D={D}", lambda act=act: back(ops.rms_norm(leaf(T, D, dtype=act), leaf(D, dtype=torch.float32)))))
        # q / k: strided views of the fused qkv projection (activation dtype), fp32 angles and norm weights
        for heads in (H, Hk):
            def qk(heads=heads, act=act, fused=True):
                qkv = leaf(B, S, (H + 2 * Hk) * Dh, dtype=act)
                x = qkv[..., : heads * Dh].view(B, S, heads, Dh)
                ang = torch.zeros(B, S, Dh // 2)
                if fused:
                    back(ops.qk_norm_rope(x, leaf(Dh, dtype=torch.float32), ang.cos(), ang.sin(), 1e-6))
                else:
                    back(ops.apply_rope(x, ang.cos(), ang.sin()))
            cases.append((f"qk_norm_rope {a} H={heads} Dh={Dh}", qk))
            cases.append((f"apply_rope {a} H={heads} Dh={Dh}", lambda qk=qk: qk(fused=False)))
        # SwiGLU: gate and up as halves of one grouped-GEMM output (routed experts), and the dense FFN
        for width, rows in ((F, T * K), (Fd, T)):
            def sw(width=width, rows=rows, act=act):
                gu = leaf(rows, 2 * width, dtype=act)
                back(ops.swiglu(gu[:, :width], gu[:, width:]))
            cases.append((f"swiglu {a} N={width}", sw))
        # linear + CE: h and W in the compute dtype, int64 labels
        def ce(act=act):
            labels = torch.randint(0, V, (T,))
            out = ops.linear_cross_entropy(leaf(T, D, dtype=act), leaf(V, D, dtype=act), labels, chunk_size=T // 2)
            back(*out)
        cases.append((f"linear_cross_entropy {a} D={D} V={V}", ce))
        # MoE: permute the (fp32) normed rows, un-permute the experts' output (activation dtype) with fp32 gates
        def moe(act=act):
            topk = torch.stack([torch.randperm(E)[:K] for _ in range(T)])
            x_ND, perm_N, _ = ops.moe_permute(leaf(T, D, dtype=torch.float32), topk, E)
            y_ND = x_ND.detach().to(act).requires_grad_()
            back(ops.moe_unpermute(y_ND, perm_N, leaf(T, K, dtype=torch.float32)), x_ND)
        cases.append((f"moe {a} D={D} E={E} K={K}", moe))
    return cases


TRITON_MODULES = ("triton_norm", "triton_ce", "triton_moe")


def all_kernels() -> set[str]:
    """The name of every @triton.jit function in the Triton backend's modules (JIT functions, or
    the interpreter's stand-ins when the modules were imported under TRITON_INTERPRET=1)."""
    import importlib

    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    names = set()
    for mod in TRITON_MODULES:
        m = importlib.import_module(f"{__package__}.{mod}")
        names |= {v.fn.__name__ for v in vars(m).values() if isinstance(v, (JITFunction, InterpretedFunction))}
    return names


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def run_check(arch: int = 90, presets: list[str] | None = None, tokens: int = TOKENS, log=print,
              extra_cases: list | None = None) -> tuple[list[KernelRecord], list[str]]:
    """Compile every kernel the cases (and `extra_cases`, (name, thunk) pairs) reach for
    sm_`arch`. Returns (records, problems); a kernel of the backend that no case reached is a
    problem too."""
    if _interpreting():  # main() runs in a child without it; a caller in-process must unset it first
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter runs kernels instead of compiling them")
    try:
        import triton
        from triton.runtime import driver
    except ImportError as err:
        raise RuntimeError("triton is not installed (it comes with CUDA builds of torch on Linux)") from err
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as err:
        raise RuntimeError(f"this triton ({triton.__version__}) has no CUDA backend") from err
    if arch not in ARCH_LIMITS:
        raise ValueError(f"unknown --arch {arch}; one of {sorted(ARCH_LIMITS)}")

    from . import triton_norm

    interp, triton_norm.INTERPRET = triton_norm.INTERPRET, True  # let the ops take CPU tensors
    # put back exactly what was there: reset_active() would build the default driver, which
    # raises on a machine without a GPU
    before = driver.__dict__.get("_active")
    driver.set_active(_CompileOnlyDriver(arch))
    errors = []
    try:
        with _Recorder() as rec:
            cases = [(f"{preset}: {name}", thunk) for preset in (list(PRESET_WIDTHS) if presets is None else presets)
                     for name, thunk in op_cases(PRESET_WIDTHS[preset], tokens)]
            for name, thunk in cases + list(extra_cases or []):
                rec.case = name
                try:
                    thunk()
                except Exception as err:  # noqa: BLE001 - reported, the other cases still run
                    errors.append(f"{rec.case}: {type(err).__name__}: {err}")
                log(f"  {rec.case}")
        records = list(rec.records.values())
    finally:
        driver._active = before
        triton_norm.INTERPRET = interp
    limits = ARCH_LIMITS[arch]
    problems = errors + [f"{r.kernel} [{r.signature}]: {p}" for r in records for p in r.problems(limits)]
    missed = sorted(all_kernels() - {r.kernel for r in records})
    if missed:
        problems.append(f"no case reached {', '.join(missed)}: add one to op_cases")
    return records, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m omniloom.kernels.compile_check",
        description="Compile every Triton kernel for a CUDA architecture without a GPU (Triton's own ptxas, no launch): "
        "compile errors, registers, spills and shared memory against the architecture's limits, at the GPU presets' widths.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200, 80: A100)")
    p.add_argument("--presets", default=",".join(PRESET_WIDTHS), help="comma-separated widths to compile at: " + ", ".join(PRESET_WIDTHS))
    p.add_argument("--json", default=None, help="also write the records here")
    args = p.parse_args(argv)
    presets = [s for s in args.presets.split(",") if s]
    unknown = [s for s in presets if s not in PRESET_WIDTHS]
    if unknown:
        p.error(f"unknown preset(s) {unknown}; choose from {', '.join(PRESET_WIDTHS)}")
    if _interpreting():
        # the kernels would be imported as interpreted functions, which cannot compile: run the
        # check where TRITON_INTERPRET is cleared, before this process imports any of them
        print("TRITON_INTERPRET is set (CPU parity runs): compiling in a child process without it", flush=True)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        argv = sys.argv[1:] if argv is None else argv
        return subprocess.run([sys.executable, "-m", "omniloom.kernels.compile_check", *argv], env=env).returncode
    import triton

    print(f"compiling for sm_{args.arch} with triton {triton.__version__} (no GPU, nothing launched)")
    t0 = time.perf_counter()
    try:
        records, problems = run_check(args.arch, presets)
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"\n{len(records)} kernel specialisations in {time.perf_counter() - t0:.0f} s")
    print(f"{'kernel':<28} {'warps':>5} {'regs':>5} {'local B':>7} {'shared B':>8}  signature")
    for r in sorted(records, key=lambda r: (r.kernel, r.signature)):
        status = "" if r.ok else f"  FAILED: {r.error}"
        print(f"{r.kernel:<28} {r.num_warps or '-':>5} {r.registers if r.registers is not None else '-':>5} "
              f"{r.local_bytes if r.local_bytes is not None else '-':>7} {r.shared_bytes if r.shared_bytes is not None else '-':>8}  "
              f"{r.signature}{status}")
    spills = [r for r in records if r.local_bytes]
    if spills:
        print(f"\n{len(spills)} specialisation(s) use local memory (register spills): " + ", ".join(sorted({r.kernel for r in spills})))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(arch=args.arch, triton=triton.__version__, records=[asdict(r) for r in records], problems=problems), f, indent=1)
    if problems:
        print("\nPROBLEMS:\n  " + "\n  ".join(problems))
        return 1
    print(f"\nall kernels compile for sm_{args.arch} within its limits")
    return 0


if __name__ == "__main__":
    sys.exit(main())
