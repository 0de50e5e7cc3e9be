"""omniloom export: checkpoint -> safetensors folder -> load_pretrained, bit for bit; sharded
exports, FSDP2 (DCP) checkpoints, bf16, model card, and refusal of pickles that carry code."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.pretrained import load_pretrained
from omniloom.model.synthetic import random_packed_batch
from omniloom.pretrain.cli import main
from omniloom.pretrain.export.write import export_checkpoint
from omniloom.pretrain.checkpoint.offline import read_checkpoint_weights, resolve_checkpoint

STEP = 7

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_model_cfg(tok, pattern="LBG") -> ModelConfig:
    return ModelConfig(
        dim=32, num_layers=3, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size, patch_token_id=tok.patch_id,
        rope_sections=(2, 2, 4), patch_dim=tok.patch_dim, tubelet_dim=tok.tubelet_dim,
        attention=AttentionConfig(backend="blocksparse", pattern=pattern, window=12, block_size=8, num_selected_blocks=2),
        moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32),
    )


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return d


def make_run(root: Path, tok_dir: Path, *, layout: str = "safetensors", seed: int = 0,
             recorded_backend: str | None = None) -> tuple[Path, OmniModel]:
    """A run folder shaped like the trainer's: checkpoints/step_N/{accelerate/..., trainer.pt,
    config.yaml, COMPLETE} and metrics.jsonl. The model's weights are random but not default."""
    from safetensors.torch import save_file

    from omniloom.data.config import DataConfig, SourceConfig
    from omniloom.pretrain.config.run import RunConfig, to_yaml
    from omniloom.tokenizers.text import Tokenizer

    tok = Tokenizer.load(tok_dir)
    cfg = RunConfig(model=tiny_model_cfg(tok), data=DataConfig(tokenizer=str(tok_dir), sources=[SourceConfig(path="shards/train")]))
    torch.manual_seed(seed)
    model = OmniModel(cfg.model)
    with torch.no_grad():  # norms and router biases away from their init so a missed tensor shows
        for name, t in model.state_dict().items():
            if t.is_floating_point() and t.dim() == 1:
                t.add_(torch.randn_like(t) * 0.1)
    ckpt = root / "checkpoints" / f"step_{STEP:08d}"
    acc = ckpt / "accelerate"
    acc.mkdir(parents=True)
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    if layout == "safetensors":
        save_file(sd, str(acc / "model.safetensors"))
    elif layout == "dcp":
        import torch.distributed.checkpoint as dcp

        with pytest.warns(UserWarning):
            dcp.save({"model": sd}, checkpoint_id=str(acc / "pytorch_model_fsdp_0"))
    elif layout == "bin":
        torch.save({f"module.{k}": v for k, v in sd.items()}, acc / "pytorch_model.bin")
    torch.save({"step": STEP, "tokens_seen": 12345}, ckpt / "trainer.pt")
    if recorded_backend:  # what a GPU run would have written
        import dataclasses

        att = dataclasses.replace(cfg.model.attention, backend=recorded_backend)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=att))
    (ckpt / "config.yaml").write_text(to_yaml(cfg))
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    (ckpt / "COMPLETE").write_text(json.dumps({"step": STEP, "files": files, "world_size": 1}))
    (root / "metrics.jsonl").write_text(json.dumps({"step": STEP, "loss": 3.25, "loss/text": 3.5}) + "\n")
    return root, model.eval()


def logits_of(model, cfg, seed=3):
    batch = random_packed_batch(cfg, batch_size=2, seq_len=64, docs_per_row=2, image_grid=(1, 2, 3), video_grid=(2, 2, 2), seed=seed)
    with torch.no_grad():
        return model(**batch, return_logits=True).logits


def test_export_then_load_gives_bit_identical_logits(tmp_path, tok_dir):
    run, model = make_run(tmp_path / "run", tok_dir)
    out = tmp_path / "export"
    assert main(["-qq", "export", str(run), "--out", str(out)]) == 0
    from omniloom.pretrain.export.hf.files import hf_file_names

    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(["README.md", "config.json", "model.safetensors", "omniloom_tokenizer.json", "special_tokens_map.json",
                            "tokenizer.json", "tokenizer.model", "tokenizer_config.json", *hf_file_names()])
    loaded = load_pretrained(out)
    assert torch.equal(logits_of(loaded, loaded.cfg), logits_of(model, model.cfg))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model"]["vocab_size"] == model.cfg.vocab_size and cfg["omniloom_version"]
    assert cfg["tokenizer"]["special_ids"]["patch"] == model.cfg.patch_token_id
    assert cfg["source"]["step"] == STEP and cfg["source"]["tokens_seen"] == 12345
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["step"] == str(STEP) and json.loads(meta["model_config"])["dim"] == 32
    card = (out / "README.md").read_text()
    assert "steps: 7" in card and "12,345" in card and "3.2500" in card and "shards/train" in card
    assert (out / "tokenizer.model").read_bytes() == (tok_dir / "tokenizer.model").read_bytes()


def test_sharded_export_above_tiny_limit_loads_the_same(tmp_path, tok_dir):
    run, model = make_run(tmp_path / "run", tok_dir)
    res = export_checkpoint(run, tmp_path / "export", max_shard_size="20KB")
    assert len(res.files) > 2
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    for f in res.files:  # the limit bounds the tensor bytes of a shard (one oversized tensor gets its own)
        tensors = _tensors(f)
        assert sum(t.numel() * t.element_size() for t in tensors) <= 20_000 or len(tensors) == 1
    loaded = load_pretrained(tmp_path / "export")
    assert torch.equal(logits_of(loaded, loaded.cfg), logits_of(model, model.cfg))


def _tensors(path):
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return [f.get_tensor(k) for k in f.keys()]


@pytest.mark.parametrize("layout", ["dcp", "bin"])
def test_fsdp2_sharded_and_bin_checkpoints_export_the_same(tmp_path, tok_dir, layout):
    run, model = make_run(tmp_path / "run", tok_dir, layout=layout)
    state = read_checkpoint_weights(resolve_checkpoint(run))
    assert set(state) == set(model.state_dict())  # wrapper prefixes ("module.") are gone
    export_checkpoint(run, tmp_path / "export")
    loaded = load_pretrained(tmp_path / "export")
    assert torch.equal(logits_of(loaded, loaded.cfg), logits_of(model, model.cfg))


def test_bf16_export_stores_bf16_matrices_and_loads_close(tmp_path, tok_dir):
    run, model = make_run(tmp_path / "run", tok_dir)
    export_checkpoint(run, tmp_path / "export", dtype="bf16")
    from safetensors.torch import load_file

    sd = load_file(str(tmp_path / "export" / "model.safetensors"))
    assert sd["head.weight"].dtype == torch.bfloat16 and sd["norm"].dtype == torch.float32
    loaded = load_pretrained(tmp_path / "export")
    assert next(loaded.parameters()).dtype == torch.float32
    torch.testing.assert_close(logits_of(loaded, loaded.cfg), logits_of(model, model.cfg), atol=0.05, rtol=0.05)


class _Evil:
    """A pickle that would create a file when unpickled."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("where", ["weights", "trainer", "dcp_metadata"])
def test_malicious_pickle_is_refused(tmp_path, tok_dir, where):
    layout = {"weights": "bin", "trainer": "safetensors", "dcp_metadata": "dcp"}[where]
    run, _ = make_run(tmp_path / "run", tok_dir, layout=layout)
    ckpt = resolve_checkpoint(run)
    marker = tmp_path / "pwned"
    payload = pickle.dumps({"w": _Evil(marker)})
    if where == "weights":
        torch.save({"w": _Evil(marker)}, ckpt / "accelerate" / "pytorch_model.bin")
    elif where == "trainer":
        torch.save({"step": _Evil(marker)}, ckpt / "trainer.pt")
    else:
        (ckpt / "accelerate" / "pytorch_model_fsdp_0" / ".metadata").write_bytes(payload)
    with pytest.raises(ValueError, match="refusing"):
        export_checkpoint(run, tmp_path / "export")
    assert not marker.exists()
    # the CLI reports it as a one-line user error
    assert main(["-qq", "export", str(run), "--out", str(tmp_path / "export2")]) == 2
    assert not marker.exists()


def test_user_errors(tmp_path, tok_dir, capsys):
    assert main(["-qq", "export", str(tmp_path / "nope"), "--out", str(tmp_path / "x")]) == 2
    run, _ = make_run(tmp_path / "run", tok_dir)
    ckpt = resolve_checkpoint(run)
    os.remove(ckpt / "COMPLETE")
    with pytest.raises(ValueError, match="no complete checkpoint"):
        export_checkpoint(run, tmp_path / "x")
    with pytest.raises(ValueError, match="incomplete"):
        export_checkpoint(ckpt, tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="omniloom export"):
        load_pretrained(tmp_path / "run")
    with pytest.raises(ValueError, match="size"):
        main(["-v", "export", str(run), "--out", str(tmp_path / "x"), "--max-shard-size", "lots"])


def test_run_folder_picks_newest_complete_checkpoint(tmp_path, tok_dir):
    run, _ = make_run(tmp_path / "run", tok_dir)
    (run / "checkpoints" / "step_00000009" / "accelerate").mkdir(parents=True)  # cut off before COMPLETE
    (run / "checkpoints" / ".tmp-step_00000011").mkdir()
    assert resolve_checkpoint(run).name == f"step_{STEP:08d}"
    assert resolve_checkpoint(run / "checkpoints").name == f"step_{STEP:08d}"


def test_real_training_run_exports_evaluates_and_generates(tmp_path, train_tiny):
    """The trainer's own checkpoint layout (accelerate save_state, trainer.pt with scheduler state)
    goes through export, load_pretrained, eval and generate."""
    assert main(["-qq", "data", "demo-corpus", "--out", str(tmp_path / "corpus"), "--num-images", "4", "--num-videos", "1",
                 "--num-heldout-images", "3", "--num-heldout-videos", "1", "--num-interleaved", "1", "--image-size", "32"]) == 0
    for split in ("train", "heldout"):
        assert main(["-qq", "data", "build", str(tmp_path / "corpus" / split), "--out", str(tmp_path / "shards" / split)]) == 0
    assert main(["-qq", "tokenizer", "train", "--data", str(tmp_path / "shards" / "train"), "--vocab-size", "512",
                 "--out", str(tmp_path / "tok"), "--threads", "1", "--image-patch-budget", "16",
                 "--video-frame-budget", "4", "--video-patch-budget", "8"]) == 0
    run = tmp_path / "run"
    assert train_tiny(run, tmp_path / "shards" / "train", tmp_path / "tok") == 0
    out = tmp_path / "export"
    assert main(["-qq", "export", str(run), "--out", str(out), "--max-shard-size", "200KB"]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    model = load_pretrained(out)
    from omniloom.pretrain.checkpoint.offline import load_checkpoint_model

    ref, *_ = load_checkpoint_model(run)
    assert torch.equal(logits_of(model, model.cfg), logits_of(ref, ref.cfg))
    assert "steps: 2" in (out / "README.md").read_text()
    assert main(["-qq", "eval", str(out), "--data", str(tmp_path / "shards" / "heldout"), "--out", str(tmp_path / "eval.json"),
                 "--no-progress"]) == 0
    assert set(json.loads((tmp_path / "eval.json").read_text())["cross_modal_gap"]) == {"image", "video"}
    image = next((tmp_path / "corpus" / "heldout").rglob("*.png"))
    assert main(["-qq", "generate", str(out), "--image", str(image), "--max-new-tokens", "4", "--out", str(tmp_path / "g.txt")]) == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback for a GPU-only backend")
def test_a_flex_trained_run_exports_and_loads_on_cpu(tmp_path, tok_dir):
    run, model = make_run(tmp_path / "run", tok_dir, recorded_backend="flex")
    export_checkpoint(run, tmp_path / "export")
    assert json.loads((tmp_path / "export" / "config.json").read_text())["model"]["attention"]["backend"] == "flex"
    loaded = load_pretrained(tmp_path / "export")
    assert loaded.cfg.attention.backend == "blocksparse"
    assert torch.equal(logits_of(loaded, loaded.cfg), logits_of(model, model.cfg))


# ---- loading what others wrote (issue 14 items 14 and 16) -----------------------------------------
@pytest.fixture(scope="module")
def export_dir(tmp_path_factory, tok_dir):
    root = tmp_path_factory.mktemp("exported")
    run, _ = make_run(root / "run", tok_dir)
    export_checkpoint(run, root / "export")
    return root / "export"


def _copy_export(export_dir, dst, **model_changes):
    import shutil

    shutil.copytree(export_dir, dst)
    if model_changes:
        info = json.loads((dst / "config.json").read_text())
        info["model"].update(model_changes)
        (dst / "config.json").write_text(json.dumps(info))
    return dst


@pytest.fixture
def no_real_model(monkeypatch):
    """Fails the test if an OmniModel is built anywhere but on the meta device (no allocation)."""
    _forbid_real_models(monkeypatch)


def _forbid_real_models(monkeypatch):
    import omniloom.model.decoder as decoder

    init = decoder.OmniModel.__init__

    def guarded(self, *args, **kwargs):
        if torch.empty(0).device.type != "meta":
            raise AssertionError("an OmniModel was allocated before config.json was checked against the weights")
        init(self, *args, **kwargs)

    monkeypatch.setattr(decoder.OmniModel, "__init__", guarded)


@pytest.mark.parametrize("changes, match", [
    ({"dim": 8192, "num_layers": 16, "num_heads": 4, "num_kv_heads": 2, "rope_sections": [512, 768, 768]},
     "num_layers=16, the weights hold 3"),
    ({"dim": 8192, "num_heads": 4, "num_kv_heads": 2, "rope_sections": [512, 768, 768]}, "has shape"),
    ({"vocab_size": 4_000_000_000}, r"model\.vocab_size=4000000000 .* out of range"),
    ({"vocab_size": 100_000}, r"embed\.tok\.weight has shape"),
    ({"dim": -8}, r"model\.dim=-8 .* out of range"),
    ({"moe": {"num_experts": -4}}, r"model\.moe\.num_experts=-4 .* out of range"),
])
def test_hostile_config_is_refused_before_anything_is_allocated(export_dir, tmp_path, no_real_model, changes, match):
    """A config.json that disagrees with the safetensors headers (or is absurd) is refused from the
    headers alone; before, the model was built first (GBs for dim 8192 x 16 layers, TBs for a 4e9 vocab)."""
    if "moe" in changes:
        info = json.loads((export_dir / "config.json").read_text())
        changes = {"moe": {**info["model"]["moe"], **changes["moe"]}}
    bad = _copy_export(export_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=match):
        load_pretrained(bad)


@pytest.mark.parametrize("changes, match", [
    ({"dim": "32"}, r"model\.dim='32' in config\.json is not of type int"),
    ({"vocab_size": 512.0}, r"model\.vocab_size=512\.0 in config\.json is not of type int"),
    ({"rope_sections": [4, 6]}, r"model\.rope_sections=\(4, 6\) in config\.json is not of type tuple"),
    ({"attention": {"backend": 3}}, r"model\.attention\.backend=3 in config\.json is not of type Literal"),
])
def test_a_config_value_of_the_wrong_type_is_one_clear_error(export_dir, tmp_path, no_real_model, changes, match):
    """Issue 14 item 14: `"dim": "32"` ended in a raw TypeError traceback from a constructor."""
    if "attention" in changes:
        info = json.loads((export_dir / "config.json").read_text())
        changes = {"attention": {**info["model"]["attention"], **changes["attention"]}}
    bad = _copy_export(export_dir, tmp_path / "bad", **changes)
    with pytest.raises(ValueError, match=match):
        load_pretrained(bad)
    assert main(["-qq", "generate", str(bad), "--prompt", "hi", "--max-new-tokens", "1"]) == 2


@pytest.mark.parametrize("changes, match", [
    ({"vocab_size": 4_000_000_000}, r"model\.vocab_size=4000000000 in config\.yaml is out of range"),
    ({"vocab_size": 4_000_000}, r"embed\.tok\.weight has shape .*, config\.yaml implies"),
    ({"num_layers": 64}, r"config\.yaml says model\.num_layers=64, the weights hold 3 layers"),
])
def test_a_checkpoint_config_yaml_is_checked_against_its_weights_before_building(tmp_path, tok_dir, monkeypatch,
                                                                                  changes, match):
    """Issue 14 item 14 for `omniloom export` and `omniloom eval` on a checkpoint: they built the
    model from config.yaml before any check (a vocabulary of 4e6 took ~870 MB before the refusal)."""
    import yaml

    from omniloom.pretrain.checkpoint.offline import load_checkpoint_model

    run, _ = make_run(tmp_path / "run", tok_dir)
    ckpt = resolve_checkpoint(run)
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["model"].update(changes)
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    _forbid_real_models(monkeypatch)
    with pytest.raises(ValueError, match=match):
        export_checkpoint(run, tmp_path / "export")
    with pytest.raises(ValueError, match=match):
        load_checkpoint_model(run)


def test_a_faithful_config_still_loads_after_the_header_check(export_dir):
    model = load_pretrained(export_dir)
    assert model.cfg.num_layers == 3


@pytest.mark.parametrize("what", ["model.safetensors", "config.json", "tokenizer.model", "omniloom_tokenizer.json"])
def test_a_file_linked_from_outside_the_export_folder_is_refused(export_dir, tmp_path, capsys, what):
    """Issue 14 item 16: a symlink that leaves the folder is refused, as `../` shard names are:
    by load_pretrained (weights, config) and by generate and eval (tokenizer files too)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    exp = _copy_export(export_dir, tmp_path / "exp")
    (exp / what).rename(outside / what)
    (exp / what).symlink_to(outside / what)
    if what in ("model.safetensors", "config.json"):
        with pytest.raises(ValueError, match="outside the export folder"):
            load_pretrained(exp)
    for argv in (["generate", str(exp), "--prompt", "hi", "--max-new-tokens", "1"],
                 ["eval", str(exp), "--data", str(tmp_path)]):
        assert main(["-qq", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert f"{what} links to" in err and "outside the export folder" in err, err


def test_links_inside_the_export_folder_and_a_linked_folder_still_load(export_dir, tmp_path):
    exp = _copy_export(export_dir, tmp_path / "exp")
    (exp / "model.safetensors").rename(exp / "weights.bin.safetensors")
    (exp / "model.safetensors").symlink_to("weights.bin.safetensors")
    (tmp_path / "alias").symlink_to(exp)
    assert load_pretrained(tmp_path / "alias").cfg.num_layers == 3


def test_a_sharded_export_with_an_outside_shard_link_is_refused(tmp_path, tok_dir):
    run, _ = make_run(tmp_path / "run", tok_dir)
    res = export_checkpoint(run, tmp_path / "export", max_shard_size="20KB")
    shard = res.files[1]
    outside = tmp_path / "outside.safetensors"
    shard.rename(outside)
    shard.symlink_to(outside)
    with pytest.raises(ValueError, match="outside the export folder"):
        load_pretrained(tmp_path / "export")


def test_export_into_a_non_empty_folder_needs_force(tmp_path, tok_dir, capsys):
    """Issue 15.10: an existing export (or any non-empty folder) is not silently overwritten."""
    run, _ = make_run(tmp_path / "run", tok_dir)
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert main(["-qq", "export", str(run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already exists and is not empty; pass --force" in err and err.count("\n") == 1
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert main(["-qq", "export", str(run), "--out", str(out), "--force"]) == 0
    assert (out / "config.json").is_file() and (out / "notes.txt").read_text() == "mine"
    assert main(["-qq", "export", str(run), "--out", str(out)]) == 2  # a finished export too
    capsys.readouterr()


def test_the_model_card_describes_only_the_layer_kinds_of_its_pattern(tmp_path):
    """Issue 28.10: the card described B layers (top-k blocks) for `LLLG`, which has none."""
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.export.card import model_card

    def card(pattern: str) -> str:
        cfg = load_config("tiny", [f"model.attention.pattern={pattern}"])
        return model_card(cfg, tmp_path / "run" / "checkpoints" / "step_00000001", step=1, tokens_seen=10,
                          num_params=10, num_active=10, dtype="fp32")

    line = next(x for x in card("LLLG").splitlines() if x.startswith("- attention pattern"))
    assert line == "- attention pattern `LLLG` (L: sliding window of 128 tokens, G: global)"
    assert "B: the top 4 of 32-token blocks" in card("LLBG") and "sliding window" not in card("GGBG")


def test_the_model_card_has_the_hubs_front_matter(tmp_path, tok_dir):
    """Issue 41 item 5: the export's README had no Hub front matter (license, library_name,
    pipeline_tag, tags); it is read here by huggingface_hub's own ModelCard parser."""
    from huggingface_hub import ModelCard

    from omniloom.pretrain.cli import main
    from omniloom.pretrain.config.run import load_config
    from omniloom.pretrain.export.card import model_card

    def card(*overrides, **kw) -> str:
        cfg = load_config("tiny", list(overrides))
        return model_card(cfg, tmp_path / "run" / "checkpoints" / "step_00000001", step=1, tokens_seen=10,
                          num_params=10, num_active=10, dtype="fp32", **kw)

    data = ModelCard(card()).data.to_dict()
    assert data["license"] == "unknown" and data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "image-text-to-text"
    assert {"omniloom", "multimodal", "mixture-of-experts", "custom_code"} <= set(data["tags"])
    assert ModelCard(card("model.moe.num_experts=0", license="apache-2.0")).data.to_dict()["license"] == "apache-2.0"
    assert "mixture-of-experts" not in ModelCard(card("model.moe.num_experts=0")).data.to_dict()["tags"]
    with pytest.raises(ValueError, match="is not a Hub license id"):
        card(license="Apache 2.0\nlicense: mit")
    run, _ = make_run(tmp_path / "run", tok_dir)
    assert main(["-qq", "export", str(run), "--out", str(tmp_path / "out"), "--license", "mit"]) == 0
    assert ModelCard.load(tmp_path / "out" / "README.md").data.to_dict()["license"] == "mit"


# ---- issue 39 item 12: an export killed while it writes -----------------------------------------
def _digests(folder: Path) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def _killed_export(run: Path, out: Path, *args: str) -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "support" / "export_killed.py"
    proc = subprocess.run([sys.executable, str(script), str(run), "--out", str(out), *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, (proc.returncode, proc.stderr[-2000:])


def test_an_export_force_killed_mid_write_leaves_the_old_export_whole(tmp_path, tok_dir):
    """`export --force` over an export, SIGKILLed once its new weights are written: the old
    config.json sat beside the new (bf16) weights, and loaded as good. Now the old export is left
    byte for byte, the next export replaces it whole, and files that are not the export's stay."""
    from omniloom.pretrain.export.complete import incomplete_reason, staging_dir

    run, model = make_run(tmp_path / "run", tok_dir)
    out = tmp_path / "export"
    assert main(["-qq", "export", str(run), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("mine")
    before = _digests(out)
    _killed_export(run, out, "--force", "--dtype", "bf16")
    assert _digests(out) == before, "the old export was overwritten in part"
    assert incomplete_reason(out) is None
    loaded = load_pretrained(out)
    assert torch.equal(logits_of(loaded, loaded.cfg), logits_of(model, model.cfg))
    assert main(["-qq", "export", str(run), "--out", str(out), "--force", "--dtype", "bf16", "--max-shard-size", "100KB"]) == 0
    assert not staging_dir(out).exists() and incomplete_reason(out) is None
    after = _digests(out)
    assert after["notes.txt"] == before["notes.txt"] and "model.safetensors" not in after  # sharded now: no stale single file
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    load_pretrained(out)
    # killed with no export there before: nothing at --out, the demo's check says so
    fresh = tmp_path / "fresh"
    _killed_export(run, fresh)
    assert not fresh.exists() or incomplete_reason(fresh) is not None


def test_the_demo_counts_an_export_done_only_when_it_is_whole(tmp_path, tok_dir):
    """The demo took an export as finished once its config.json existed; an export cut off after
    it (or with a weight file cut short) was never redone."""
    from omniloom.pretrain.demo import demo_stages

    run, _ = make_run(tmp_path / "run", tok_dir)
    out = tmp_path / "demo"
    stage = next(s for s in demo_stages(out, steps=2, processes=1, overrides=[]) if s.name == "export")
    assert not stage.done()
    assert main(["-qq", "export", str(run), "--out", str(out / "export")]) == 0
    assert stage.done()
    weights = out / "export" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])  # cut short, config.json still there
    assert not stage.done()
    weights.unlink()
    assert not stage.done()
    weights.write_bytes(data)
    (out / "export" / "tokenizer.model").unlink()
    assert not stage.done()


def test_an_export_over_a_link_to_a_folder_replaces_the_folder_and_keeps_the_link(tmp_path, tok_dir):
    run, _ = make_run(tmp_path / "run", tok_dir)
    real = tmp_path / "disk" / "export"
    assert main(["-qq", "export", str(run), "--out", str(real)]) == 0
    link = tmp_path / "export"
    link.symlink_to(real, target_is_directory=True)
    assert main(["-qq", "export", str(run), "--out", str(link), "--force", "--dtype", "bf16"]) == 0
    assert link.is_symlink() and json.loads((real / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["export"]
