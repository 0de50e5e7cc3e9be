"""The model card (README.md) of an export."""

from __future__ import annotations

from pathlib import Path

from omniloom.pretrain.checkpoint.safe_io import safe_torch_load
from omniloom.pretrain.rundir import METRICS


def _trainer_state(ckpt: Path) -> dict:
    path = ckpt / "trainer.pt"
    if not path.is_file():
        return {}
    state = safe_torch_load(path)  # refuses a pickle that carries code
    return state if isinstance(state, dict) else {}


def _final_losses(run_dir: Path) -> dict[str, float]:
    from omniloom.pretrain.rundir import read_metrics

    path = run_dir / METRICS
    if not path.is_file():
        return {}
    out: dict[str, float] = {}
    for row in read_metrics(path):  # later rows overwrite earlier ones: the last value of each key wins
        for k, v in row.items():
            if isinstance(v, (int, float)) and (k == "loss" or k.startswith(("loss/", "eval/loss"))):
                out[k] = float(v)
    return out


def _pattern_kinds(attention) -> str:
    """What the layer kinds of the pattern are, for those it holds only (a pattern without B layers
    says nothing of blocks)."""
    words = {"L": f"L: sliding window of {attention.window} tokens", "G": "G: global",
             "B": f"B: the top {attention.num_selected_blocks} of {attention.block_size}-token blocks"}
    return ", ".join(words[k] for k in "LGB" if k in attention.pattern.upper())


def _vision_lines(m) -> list[str]:
    """The card's line on late fusion (model.vision_encoder), none when the model fuses early."""
    if not m.vision_encoder.enabled:
        return []
    enc = m.vision_encoder.resolved(m)
    return [f"- late fusion: a vision encoder of {enc.num_layers} layer(s), width {enc.dim}, {enc.num_heads} heads, "
            f"{enc.projector} projector, over each visual block"]


def front_matter(cfg, *, license: str = "unknown") -> list[str]:
    """The YAML block the Hugging Face Hub reads from a README: license, library, pipeline, tags."""
    import re

    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", license):
        raise ValueError(f"--license {license!r} is not a Hub license id (lowercase, e.g. apache-2.0, mit, other)")
    fusion = "late-fusion" if cfg.model.vision_encoder.enabled else "early-fusion"
    tags = ["omniloom", "multimodal", fusion, "custom_code"]
    if cfg.model.moe.num_experts > 1:
        tags.append("mixture-of-experts")
    if "B" in cfg.model.attention.pattern.upper():
        tags.append("sparse-attention")
    return ["---", f"license: {license}", "library_name: transformers", "pipeline_tag: image-text-to-text",
            "tags:", *[f"- {t}" for t in tags], "---", ""]


def model_card(cfg, ckpt: Path, *, step: int, tokens_seen: int, num_params: int, num_active: int, dtype: str,
               license: str = "unknown") -> str:
    """A short README: the Hub's front matter, what the model is, what it saw, how it ended, how to load it."""
    m = cfg.model
    sources = [f"  - `{s.path}` (weight {s.weight:g})" for s in cfg.data.sources] or ["  - (not recorded)"]
    heldout = [f"  - `{s.path}`" for s in cfg.data.eval_sources]
    losses = _final_losses(ckpt.parent.parent)
    loss_lines = [f"| {k} | {v:.4f} |" for k, v in sorted(losses.items())]
    lines = [
        *front_matter(cfg, license=license),
        "# omniloom model",
        "",
        f"A native multimodal sparse-attention MoE decoder (text, code, images, videos in one token stream), "
        f"trained from scratch with omniloom.",
        "",
        "## Model",
        f"- {num_params / 1e6:.2f} M parameters, {num_active / 1e6:.2f} M active per token; {m.num_layers} layers, "
        f"width {m.dim}, {m.num_heads} heads ({m.num_kv_heads} kv), vocabulary {m.vocab_size}",
        f"- attention pattern `{m.attention.pattern}` ({_pattern_kinds(m.attention)})",
        f"- MoE: {m.moe.num_experts} experts, top-{m.moe.num_experts_per_token}, {m.moe.num_shared_experts} shared, "
        f"first {m.moe.num_dense_layers} layer(s) dense",
        *_vision_lines(m),
        f"- weights: {dtype}, WEIGHT_FILES",
        "",
        "## Training",
        f"- steps: {step}",
        f"- tokens seen: {tokens_seen:,}",
        f"- sequence length {cfg.data.seq_len}, {cfg.data.batch_size} rows per rank per step",
        "- data:",
        *sources,
    ]
    if heldout:
        lines += ["- held-out data:", *heldout]
    lines += ["", "## Final losses (nats/token, from metrics.jsonl)", ""]
    lines += (["| metric | value |", "|---|---|", *loss_lines] if loss_lines else ["(no metrics.jsonl found beside the checkpoint)"])
    lines += [
        "",
        "## Use",
        "```",
        "from omniloom.model import load_pretrained",
        "model = load_pretrained('THIS_FOLDER')",
        "```",
        "`omniloom generate THIS_FOLDER --prompt TEXT [--image PATH]`, `omniloom eval THIS_FOLDER --data SHARDS`.",
        "",
        "Without omniloom, with Hugging Face transformers (the model's code is in this folder):",
        "```",
        "from transformers import AutoModelForCausalLM, AutoProcessor",
        "model = AutoModelForCausalLM.from_pretrained('THIS_FOLDER', trust_remote_code=True)",
        "processor = AutoProcessor.from_pretrained('THIS_FOLDER', trust_remote_code=True)",
        "```",
        "",
    ]
    return "\n".join(lines)
