"""Feed-forward layers: a dense SwiGLU MLP and a dropless Mixture-of-Experts.

Legend: T tokens (B*S), D width, F expert width, E routed experts, K experts per token,
N = T*K routed rows, M = 5 modalities.

MoE: router in fp32 -> scores (sigmoid or softmax) -> top-K of (scores + balancing bias), the bias
choosing experts only (gate weights come from the unbiased scores) -> sort rows by expert
(kernels moe_permute) -> one grouped matmul per projection (or a loop over experts) -> weighted
scatter back (moe_unpermute) + shared experts. No token is dropped.
"""

from __future__ import annotations

import logging
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import ModelConfig

log = logging.getLogger(__name__)
NUM_MODALITIES = 5
VISUAL_MODALITIES = (2, 3)


class SwiGLUMLP(nn.Module):
    """silu(x W_gate) * (x W_up) W_down, no biases."""

    def __init__(self, dim: int, hidden: int, ops):
        super().__init__()
        self.ops = ops
        self.w_gate = nn.Linear(dim, hidden, bias=False)
        self.w_up = nn.Linear(dim, hidden, bias=False)
        self.w_down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up as one GEMM over the concatenated weights (one wider matmul, x read once)
        gu = F.linear(x, torch.cat([self.w_gate.weight, self.w_up.weight]))
        gate, up = gu.split(self.w_gate.out_features, dim=-1)
        return self.w_down(self.ops.swiglu(gate, up))


def _grouped_mm_fn():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_supported(device: torch.device, in_dim: int, out_dims: tuple[int, ...]) -> bool:
    """Whether torch's grouped matmul serves these shapes on `device`: it exists, every feature dim
    is a 16-byte multiple at bf16 and fp32 (a multiple of 8 elements), and on CUDA the GPU has the
    Hopper-class CUTLASS path (compute capability >= 9.0)."""
    if _grouped_mm_fn() is None or any(d % 8 for d in (in_dim, *out_dims)):
        return False
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (9, 0)
    return device.type == "cpu"


def allowed_experts(cfg: ModelConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """[M, E] bool: the experts each modality may route to (all, or its group with
    model.moe.modality_groups). A non-persistent buffer of every MoE layer, rebuilt from the config
    (not saved in checkpoints); a loader that creates the model on the meta device refills it here."""
    E = cfg.moe.num_experts
    allowed_ME = torch.ones(NUM_MODALITIES, E, dtype=torch.bool, device=device)
    if cfg.moe.modality_groups:
        n_text = cfg.num_text_experts()
        experts_E = torch.arange(E, device=device)
        for m in range(NUM_MODALITIES):
            allowed_ME[m] = (experts_E >= n_text) if m in VISUAL_MODALITIES else (experts_E < n_text)
    return allowed_ME


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: grouped_mm's backward
    rejects expanded (stride-0) gradients such as `y.sum().backward()` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _eager_grouped(moe: "MoE", x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    """fp32 grouped matmul under torch.compile, run eagerly between graphs: the CPU kernel takes
    fp32, but torch's fake-tensor rule for grouped_mm admits only bf16/fp16, so tracing it fails.
    Wrapped in `torch.compiler.disable` by `_eager_grouped_disabled`, not at import: the decorator
    imports torch._dynamo, 1.1 s of every eval, generate and training process's start."""
    return moe.experts_grouped(x_ND, counts_E)


_EAGER_GROUPED_DISABLED: list = []  # [torch.compiler.disable(_eager_grouped)] once torch._dynamo is loaded


def _eager_grouped_disabled():
    """The disabled wrapper, made outside compiled code (MoE.prepare) once torch._dynamo is
    imported, as it is before anything compiles. Made inside a compiled region instead (a model
    compiled whole, prepare included), the call to torch.compiler.disable is one more graph break."""
    if not _EAGER_GROUPED_DISABLED:
        _EAGER_GROUPED_DISABLED.append(torch.compiler.disable(_eager_grouped))
    return _EAGER_GROUPED_DISABLED[0]


class MoE(nn.Module):
    """Routed experts + shared experts for one layer. forward(x_BSD, modality_BS) -> (y_BSD, stats)
    where stats holds counts_ME (tokens per modality and expert), aux_loss and router_z_loss."""

    def __init__(self, cfg: ModelConfig, ops, expert_range: tuple[int, int] | None = None):
        super().__init__()
        moe, D = cfg.moe, cfg.dim
        self.ops, self.cfg = ops, moe
        E, Fdim = moe.num_experts, moe.expert_dim
        self.num_experts, self.top_k = E, moe.num_experts_per_token
        # `expert_range` [lo, hi): hold only those experts' weights (expert parallelism builds
        # each rank's shard directly; OmniModel.reset_parameters fills them as the full model's)
        lo, hi = expert_range if expert_range is not None else (0, E)
        if not 0 <= lo < hi <= E:
            raise ValueError(f"expert_range {expert_range} is not within the {E} experts")
        if expert_range is not None:
            self.expert_range = (lo, hi)
        self.router = nn.Parameter(torch.empty(E, D))
        # balancing bias: changes which experts are chosen, never the gate weights; fp32 buffer,
        # saved in checkpoints, moved by update_bias outside autograd
        self.register_buffer("router_bias", torch.zeros(E, dtype=torch.float32))
        self.w_gate = nn.Parameter(torch.empty(hi - lo, D, Fdim))
        self.w_up = nn.Parameter(torch.empty(hi - lo, D, Fdim))
        self.w_down = nn.Parameter(torch.empty(hi - lo, Fdim, D))
        self.shared = SwiGLUMLP(D, Fdim * moe.num_shared_experts, ops) if moe.num_shared_experts else None
        n_text = cfg.num_text_experts()
        self.register_buffer("allowed_ME", allowed_experts(cfg), persistent=False)
        self.groups = [torch.arange(n_text), torch.arange(n_text, E)] if moe.modality_groups else [torch.arange(E)]
        self.dispatch_mode = moe.dispatch
        if moe.dispatch == "grouped" and (_grouped_mm_fn() is None or D % 8 or Fdim % 8):
            raise ValueError(
                f"model.moe.dispatch=grouped needs torch grouped_mm and dim ({D}) / expert_dim ({Fdim}) multiples of 8; "
                "use dispatch=auto or loop"
            )
        self._use_grouped: dict[str, bool] = {}  # per device type, decided on first use
        # Expert parallelism (issue 16): pretrain/ shards w_gate/w_up/w_down to this rank's experts
        # and sets a dispatcher `(x_ND, counts_E, run_experts) -> y_ND` that sends the expert-sorted
        # rows to the ranks owning their experts and brings the results back. None: all experts here.
        self.expert_dispatcher = None

    def use_grouped(self, device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
        """Grouped matmul or per-expert loop; decided once per (device, dtype) from what torch's
        grouped_mm serves: fp32/bf16/fp16 only (a float64 model, e.g. a parity check, loops)."""
        if self.dispatch_mode == "loop":
            return False
        key = f"{device}:{dtype}"
        if key not in self._use_grouped:
            ok = grouped_mm_supported(device, self.w_gate.shape[1], (self.w_gate.shape[2],))
            ok = ok and dtype in (torch.float32, torch.bfloat16, torch.float16)
            if self.dispatch_mode == "grouped" and not ok:
                raise ValueError(
                    f"model.moe.dispatch=grouped is not supported on {device} in {dtype} (grouped_mm takes fp32/bf16/fp16); "
                    "use dispatch=auto or loop"
                )
            # on CUDA one CUTLASS kernel with no host sync; on CPU fewer ops than the loop (3x faster
            # on the tiny test model, 0.75-0.93x at dim 128 x 16 experts: see omniloom bench model)
            self._use_grouped[key] = ok
        return self._use_grouped[key]

    def prepare(self, x: torch.Tensor) -> None:
        """Make the lazy per-(device, dtype) choice for inputs like `x` now. OmniModel.forward calls
        it before the blocks run: made inside a checkpointed, compiled block, storing the choice
        would be a side effect that dynamo refuses there (the block then runs uncompiled)."""
        self.use_grouped(x.device, self._compute_dtype(x))
        if "torch._dynamo" in sys.modules:  # compile is (or may be) in use: make the wrapper here, not in a graph
            _eager_grouped_disabled()

    def run_experts(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """The experts this module holds (all of them, or this rank's shard under expert
        parallelism) over rows sorted by expert; `counts_E` has one entry per expert held."""
        dtype = self._compute_dtype(x_ND)
        if self.use_grouped(x_ND.device, dtype):
            if dtype == torch.float32 and torch.compiler.is_compiling():
                return _eager_grouped_disabled()(self, x_ND, counts_E)
            return self.experts_grouped(x_ND, counts_E)
        return self.experts_loop(x_ND, counts_E)

    def experts_grouped(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """All experts in one grouped matmul per projection over the expert-sorted rows."""
        gmm = _grouped_mm_fn()
        offs = counts_E.cumsum(0).to(torch.int32)
        dt = self._compute_dtype(x_ND)
        x = x_ND.to(dt)
        # gate and up in one grouped GEMM over [E, D, 2F] (the concatenation copies E*D*2F weights
        # per step, far less than the rows it multiplies), then split as strided views
        w_gu = torch.cat([self.w_gate, self.w_up], dim=2).to(dt)
        gu = _ContiguousGrad.apply(gmm(x, w_gu, offs=offs))
        gate, up = gu.split(self.w_gate.shape[2], dim=-1)
        h = self.ops.swiglu(gate, up)
        return _ContiguousGrad.apply(gmm(h, self.w_down.to(dt), offs=offs))

    def experts_loop(self, x_ND: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Reference dispatch: one matmul chain per non-empty expert."""
        dt = self._compute_dtype(x_ND)
        outs = []
        for e, x in enumerate(torch.split(x_ND.to(dt), counts_E.tolist())):
            # an expert with no rows still runs (empty GEMMs): every weight gets a (zero)
            # gradient each step, as with grouped dispatch, so DDP needs no unused-parameter search
            h = self.ops.swiglu(x @ self.w_gate[e].to(dt), x @ self.w_up[e].to(dt))
            outs.append(h @ self.w_down[e].to(dt))
        return torch.cat(outs)

    @staticmethod
    def _compute_dtype(x: torch.Tensor) -> torch.dtype:
        # grouped_mm is not on autocast's lists: cast by hand to the autocast dtype
        if torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def route(self, x_TD: torch.Tensor, modality_T: torch.Tensor):
        """fp32 routing. Returns (topk_idx_TK, weights_TK fp32, logits_TE fp32, probs_TE fp32)."""
        logits_TE = x_TD.float() @ self.router.float().t()
        allowed_TE = self.allowed_ME[modality_T]
        if self.cfg.score_func == "softmax":
            probs_TE = torch.softmax(logits_TE.masked_fill(~allowed_TE, float("-inf")), dim=-1)
        else:
            probs_TE = torch.sigmoid(logits_TE) * allowed_TE
        choice_TE = (probs_TE + self.router_bias.float()).masked_fill(~allowed_TE, float("-inf"))
        topk_idx_TK = choice_TE.topk(self.top_k, dim=-1).indices
        w_TK = probs_TE.gather(1, topk_idx_TK)
        w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)  # gates of the chosen experts sum to 1
        return topk_idx_TK, w_TK, logits_TE, probs_TE

    def forward(self, x_BSD: torch.Tensor, modality_BS: torch.Tensor, real_BS: torch.Tensor | None = None):
        """`real_BS` (bool, optional) marks non-padding tokens: padding is routed like any token
        (dropless, static shapes) but left out of the expert counts, the balancing they drive and
        the aux / router-z losses, so it cannot skew the load toward the experts it lands on."""
        B, S, D = x_BSD.shape
        E, K = self.num_experts, self.top_k
        x_TD = x_BSD.reshape(-1, D)
        modality_T = modality_BS.reshape(-1).long()
        topk_idx_TK, w_TK, logits_TE, probs_TE = self.route(x_TD, modality_T)
        x_ND, perm_N, counts_E = self.ops.moe_permute(x_TD, topk_idx_TK, E)
        if self.expert_dispatcher is None:
            y_ND = self.run_experts(x_ND, counts_E)
        else:
            y_ND = self.expert_dispatcher(x_ND, counts_E, self.run_experts)
        y_TD = self.ops.moe_unpermute(y_ND, perm_N, w_TK).to(x_TD.dtype)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)
        # statistics over real tokens by weighting, not boolean indexing: fixed shapes, no host sync
        T = x_TD.shape[0]
        real_T = torch.ones(T, dtype=torch.bool, device=x_TD.device) if real_BS is None else real_BS.reshape(-1)
        pair_N = (modality_T.unsqueeze(1) * E + topk_idx_TK).reshape(-1)
        real_N = real_T.long().unsqueeze(1).expand(T, K).reshape(-1)
        counts_ME = torch.zeros(NUM_MODALITIES * E, dtype=torch.int64, device=x_TD.device).index_add_(0, pair_N, real_N)
        counts_ME = counts_ME.view(NUM_MODALITIES, E)
        stats = {"counts_ME": counts_ME.detach()}
        real_f_T = real_T.float()
        n_real = real_f_T.sum().clamp(min=1.0)
        if self.cfg.aux_loss_coef > 0:
            # Switch-style balance: E * sum_e (share of routed rows to e) * (mean gate prob of e)
            frac_E = counts_ME.sum(0).float() / (n_real * K)
            p_TE = probs_TE / (probs_TE.sum(-1, keepdim=True) + 1e-20)
            stats["aux_loss"] = E * (frac_E * (p_TE * real_f_T.unsqueeze(1)).sum(0) / n_real).sum()
        if self.cfg.router_z_loss_coef > 0:
            allowed_logits = logits_TE.masked_fill(~self.allowed_ME[modality_T], float("-inf"))
            stats["router_z_loss"] = (torch.logsumexp(allowed_logits, dim=-1).pow(2) * real_f_T).sum() / n_real
        return y_TD.view(B, S, D), stats

    @torch.no_grad()
    def update_bias(self, counts_E: torch.Tensor) -> None:
        """bias += rate * sign(mean load - load) within each expert group, then re-centred
        (DeepSeek-V3 / torchtitan); counts already summed over ranks and modalities."""
        counts_E = counts_E.to(self.router_bias.device, torch.float32)
        for group in self.groups:
            group = group.to(counts_E.device)
            load = counts_E[group]
            if load.numel() == 0 or load.sum() == 0:
                continue
            delta = self.cfg.bias_update_rate * torch.sign(load.mean() - load)
            new = self.router_bias[group] + delta
            self.router_bias[group] = new - new.mean()
