"""Issue 39 (hardening, round 3), items 1, 2, 5, 6, 7 and 11: an export folder written by someone
else (config.json, the safetensors shards and their index, omniloom_tokenizer.json) as
`load_pretrained`, `omniloom eval`, `omniloom generate` and `train.init_from` read it. Every
refusal is one line naming the file and the key or tensor (exit status 2 from the CLI), comes
before anything big is allocated or decoded, and leaves nothing behind that a later command trusts."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from omniloom.model import OmniModel
from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
from omniloom.model.pretrained import load_pretrained
from omniloom.pretrain.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

_spec = importlib.util.spec_from_file_location("subproc_budget", Path(__file__).resolve().parents[1] / "support" / "subproc_budget.py")
budget = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(budget)

TOKENIZER_FILE = "omniloom_tokenizer.json"


def tiny_cfg(tok) -> ModelConfig:
    return ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size,
                       patch_token_id=tok.patch_id, pad_token_id=3, rope_sections=(2, 2, 4), patch_dim=tok.patch_dim,
                       tubelet_dim=tok.tubelet_dim,
                       attention=AttentionConfig(backend="blocksparse", pattern="LG", window=16, block_size=8),
                       moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1,
                                     dense_dim=32))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(root, export folder, held-out shards with a video document, the source model)."""
    from omniloom.pretrain.export.write import save_export
    from omniloom.tokenizers.testing import make_tiny_tokenizer, make_video_bytes

    root = tmp_path_factory.mktemp("hostile")
    tok = make_tiny_tokenizer(root / "tok")
    torch.manual_seed(0)
    model = OmniModel(tiny_cfg(tok)).eval()
    save_export(model, root / "tok", root / "export")
    corpus = root / "corpus"
    corpus.mkdir()
    (corpus / "clip.mp4").write_bytes(make_video_bytes(seconds=2.0, fps=8, width=64, height=64))
    docs = [{"schema": 1, "segments": [{"type": "video", "ref": "clip.mp4"}, {"type": "text", "text": "a clip"}]},
            {"schema": 1, "segments": [{"type": "text", "text": "Plain prose without pictures."}]}]
    (corpus / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    assert main(["-qq", "data", "build", str(corpus / "docs.jsonl"), "--out", str(root / "shards")]) == 0
    return root, root / "export", root / "shards", model


def copy_export(src: Path, dst: Path, *, model: dict | None = None, top: dict | None = None) -> Path:
    """A copy of the export folder, with config.json's `model` section (and top level) updated."""
    shutil.copytree(src, dst)
    if model or top:
        info = json.loads((dst / "config.json").read_text())
        info["model"].update(model or {})
        info.update(top or {})
        (dst / "config.json").write_text(json.dumps(info))
    return dst


def edit_tokenizer(folder: Path, **changes) -> Path:
    """Change omniloom_tokenizer.json's keys (a dict value for "media" is merged into it)."""
    path = folder / TOKENIZER_FILE
    meta = json.loads(path.read_text())
    for key, value in changes.items():
        meta[key] = {**meta[key], **value} if isinstance(value, dict) and isinstance(meta.get(key), dict) else value
    path.write_text(json.dumps(meta))
    return folder


def refused_in_one_line(argv: list[str], capsys, *needles: str) -> str:
    """Run the CLI: exit status 2, and a single `error:` line holding every needle."""
    capsys.readouterr()
    assert main(["-qq", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("omniloom: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def rewrite_header(file: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header through `edit(header)`, keeping the tensor bytes."""
    raw = file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])


# `omniloom ARGV` that says its own peak RSS (with any children's) last on stderr
_PEAK = ("import resource, sys\nfrom omniloom.pretrain.cli import main\nrc = 1\ntry:\n    rc = main(sys.argv[1:])\nfinally:\n"
         "    peak = max(resource.getrusage(w).ru_maxrss for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))\n"
         "    print(f'peak_rss_kb {peak}', file=sys.stderr)\nsys.exit(rc)\n")


def run_child(argv: list[str], limit_bytes: int = 3 << 30) -> tuple[int, int, str]:
    """(exit status, peak RSS in bytes, output without the peak line) of `omniloom -qq ARGV` in a
    child process, limited by CPU work (tests/support/subproc_budget.py). The child's data segment
    is capped, so a runaway allocation fails there instead of filling the machine."""
    def cap():
        resource.setrlimit(resource.RLIMIT_DATA, (limit_bytes, limit_bytes))

    res = budget.run([sys.executable, "-c", _PEAK, "-qq", *argv], cpu_budget_s=300, stall_s=120, preexec_fn=cap,
                     env={**os.environ, "OMP_NUM_THREADS": "1"}, stdin=subprocess.DEVNULL)
    lines = (res.stdout + res.stderr).splitlines()
    peak = [int(ln.split()[1]) for ln in lines if ln.startswith("peak_rss_kb ")]
    assert peak, res.stderr[-2000:]
    return res.returncode, peak[-1] * 1024, "\n".join(ln for ln in lines if not ln.startswith("peak_rss_kb "))


# ---- item 1: a tokenizer file that allocates without bound ---------------------------------------
HOSTILE_MEDIA = {"video_fps": 1e4, "video_frame_budget": 1_000_000}
# each setting in its range, the block within the value cap: a 2 s clip became a 15,000-token prompt (2.1 GB)
LONG_MEDIA = {"video_fps": 240, "video_frame_budget": 2048, "video_patch_budget": 64}


@pytest.mark.parametrize("command, media, needle", [("generate", HOSTILE_MEDIA, "video_fps"),
                                                    ("eval", HOSTILE_MEDIA, "video_fps"),
                                                    ("generate", LONG_MEDIA, "largest video block")])
def test_a_tokenizer_file_that_would_allocate_without_bound_is_refused_before_decoding(made, tmp_path, command, media,
                                                                                        needle):
    """video_fps=1e4 with video_frame_budget=1e6: `generate --video` on a 2 s 64x64 clip reached
    8.7 GB and ran on, `eval` 4 GB. Now refused from the settings alone, under 1 GB; and settings
    in range whose video block outgrows the model's context are refused by generate."""
    from omniloom.tokenizers.testing import make_video_bytes

    root, export, shards, _ = made
    bad = edit_tokenizer(copy_export(export, tmp_path / "bad"), media=media)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(make_video_bytes(seconds=2.0, fps=8, width=64, height=64))
    out = tmp_path / "out.txt"
    if command == "generate":
        argv = ["generate", str(bad), "--video", str(clip), "--max-new-tokens", "1", "--out", str(out)]
    else:
        argv = ["eval", str(bad), "--data", str(shards), "--no-progress", "--out", str(out)]
    rc, peak, text = run_child(argv)
    assert rc == 2, text[-2000:]
    assert peak < 1 << 30, f"peak RSS {peak / 2**20:.0f} MiB"
    lines = text.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("omniloom: error: "), text[-2000:]
    assert TOKENIZER_FILE in lines[0] and needle in lines[0], lines[0]
    assert not out.exists()


@pytest.mark.parametrize("media, needle", [
    ({"video_fps": 1e4}, "video_fps=10000.0"),
    ({"video_frame_budget": 1_000_000}, "video_frame_budget=1000000"),
    ({"video_fps": "2"}, "video_fps='2'"),
    ({"image_patch_budget": 10**12}, "image_patch_budget"),
    ({"video_clip_start": float("inf")}, "video_clip_start"),
    ({"pixel_std": [0.5, 0.5, 1e-30]}, "pixel_std"),
    ({"alpha_background": [255, 255, 1000]}, "alpha_background"),
    ({"jpeg_draft": "yes"}, "jpeg_draft"),
    # each within its own range, together a video block of 4096 frames x 65536 patches
    ({"video_frame_budget": 4096, "video_patch_budget": 65536}, "one video block"),
])
def test_every_media_setting_has_a_range_named_with_the_file(made, tmp_path, media, needle):
    from omniloom.tokenizers.text import Tokenizer

    _, export, _, _ = made
    bad = edit_tokenizer(copy_export(export, tmp_path / "bad"), media=media)
    with pytest.raises(ValueError, match="invalid media settings") as err:
        Tokenizer.load(bad)
    assert str(bad / TOKENIZER_FILE) in str(err.value) and needle in str(err.value), str(err.value)


# ---- item 2: integer-typed weights ----------------------------------------------------------------
def test_a_float_tensor_relabelled_as_int32_is_refused_everywhere(made, tmp_path, capsys):
    from omniloom.pretrain.config.run import RunConfig
    from omniloom.data.config import DataConfig
    from omniloom.pretrain.train.init_from import check_init_from, load_init_weights

    root, export, shards, model = made
    bad = copy_export(export, tmp_path / "bad")
    name = "head.weight"

    def relabel(header):
        assert header[name]["dtype"] == "F32"
        header[name]["dtype"] = "I32"

    rewrite_header(bad / "model.safetensors", relabel)
    with pytest.raises(ValueError, match=rf"model\.safetensors: tensor {name} has dtype I32"):
        load_pretrained(bad)
    out = tmp_path / "eval.json"
    refused_in_one_line(["eval", str(bad), "--data", str(shards), "--no-progress", "--out", str(out)], capsys,
                        "model.safetensors", name, "I32")
    assert not out.exists()
    cfg = RunConfig(model=model.cfg, data=DataConfig(tokenizer=str(root / "tok")))
    with pytest.raises(ValueError, match=rf"init_from=.*tensor {name} has dtype I32"):
        check_init_from(str(bad))  # before any setup: the headers are read with config.json
    with pytest.raises(ValueError, match=rf"init_from=.*tensor {name} has dtype I32"):
        load_init_weights(OmniModel(cfg.model), bad, cfg)


# ---- item 5: a tensor in two shards ---------------------------------------------------------------
def _sharded(export: Path, dst: Path, model) -> tuple[Path, str]:
    """The export as two shards and an index; returns (folder, the name of one tensor)."""
    from safetensors.torch import save_file

    dst = copy_export(export, dst)
    (dst / "model.safetensors").unlink()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    names = sorted(state)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: state[k] for k in first}, str(dst / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in second}, str(dst / "model-00002-of-00002.safetensors"))
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first} | {k: "model-00002-of-00002.safetensors" for k in second}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst, first[0]


def test_a_tensor_in_a_shard_the_index_does_not_name_for_it_is_refused(made, tmp_path, capsys):
    """omniloom took the later shard's copy; transformers follows the index. Neither is right for
    a folder that holds two different copies: refused, naming the tensor and both files."""
    from safetensors.torch import load_file, save_file

    _, export, shards, model = made
    good, name = _sharded(export, tmp_path / "good", model)
    loaded = load_pretrained(good)
    assert torch.equal(loaded.state_dict()[name], model.state_dict()[name])

    bad, name = _sharded(export, tmp_path / "bad", model)
    second = bad / "model-00002-of-00002.safetensors"
    tensors = load_file(str(second))
    tensors[name] = torch.full_like(model.state_dict()[name], 7.0)  # a second, different copy
    save_file(tensors, str(second))
    with pytest.raises(ValueError, match=rf"model-00002-of-00002\.safetensors holds {name}, which "
                                         rf"model\.safetensors\.index\.json places in model-00001-of-00002\.safetensors"):
        load_pretrained(bad)
    refused_in_one_line(["generate", str(bad), "--prompt", "hi", "--max-new-tokens", "1"], capsys, name,
                        "model-00002-of-00002.safetensors")

    stray, _ = _sharded(export, tmp_path / "stray", model)
    first = stray / "model-00001-of-00002.safetensors"
    tensors = load_file(str(first))
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, str(first))
    with pytest.raises(ValueError, match=r"model-00001-of-00002\.safetensors holds extra\.weight, which "
                                         r"model\.safetensors\.index\.json does not name"):
        load_pretrained(stray)


# ---- item 6: hostile JSON -------------------------------------------------------------------------
def test_config_json_that_is_a_list_or_nested_too_deep_is_one_line(made, tmp_path, capsys):
    _, export, _, _ = made
    listed = copy_export(export, tmp_path / "listed")
    (listed / "config.json").write_text("[1, 2, 3]")
    deep = copy_export(export, tmp_path / "deep")
    (deep / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    for folder, needle in ((listed, "must be a JSON object, got a list"), (deep, "nested too deep")):
        with pytest.raises(ValueError, match=needle):
            load_pretrained(folder)
        refused_in_one_line(["generate", str(folder), "--prompt", "hi", "--max-new-tokens", "1"], capsys,
                            str(folder / "config.json"), needle)
    index = copy_export(export, tmp_path / "index")
    (index / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json is nested too deep"):
        load_pretrained(index)
    (index / "model.safetensors.index.json").write_text('{"weight_map": ["a"]}')
    with pytest.raises(ValueError, match=r"model\.safetensors\.index\.json: weight_map must be an object"):
        load_pretrained(index)


@pytest.mark.parametrize("section", ["tokenizer", "source"])
def test_config_json_sections_of_the_wrong_type_are_named(made, tmp_path, capsys, section):
    _, export, shards, _ = made
    bad = copy_export(export, tmp_path / "bad", top={section: ["x"]})
    refused_in_one_line(["eval", str(bad), "--data", str(shards), "--no-progress"], capsys,
                        str(bad / "config.json"), f"'{section}' must be an object")


def test_a_seq_len_that_is_no_whole_number_is_named(made, tmp_path, capsys):
    _, export, shards, _ = made
    bad = copy_export(export, tmp_path / "bad", top={"source": {"seq_len": "512"}})
    refused_in_one_line(["eval", str(bad), "--data", str(shards), "--no-progress"], capsys, str(bad / "config.json"),
                        "source.seq_len='512'")


def test_a_patch_token_id_past_the_vocabulary_is_refused_naming_the_key(made, tmp_path, capsys):
    """eval ended in a RuntimeError traceback (index out of range in the embedding)."""
    _, export, shards, model = made
    bad = copy_export(export, tmp_path / "bad", model={"patch_token_id": model.cfg.vocab_size + 5})
    with pytest.raises(ValueError, match=r"model\.patch_token_id=517 .*vocab_size"):
        load_pretrained(bad)
    refused_in_one_line(["eval", str(bad), "--data", str(shards), "--no-progress"], capsys, "config.json",
                        "model.patch_token_id")


@pytest.mark.parametrize("changes, needle", [
    ({"version": "1"}, "'version' must be a whole number"),
    ({"media": ["video_fps", 2]}, "'media' must be an object"),
    ({"vocab_size": "512"}, "'vocab_size' must be a whole number, got '512' (a string)"),
])
def test_tokenizer_keys_of_the_wrong_type_are_one_line(made, tmp_path, capsys, changes, needle):
    _, export, _, _ = made
    bad = edit_tokenizer(copy_export(export, tmp_path / "bad"), **changes)
    refused_in_one_line(["generate", str(bad), "--prompt", "hi", "--max-new-tokens", "1"], capsys,
                        str(bad / TOKENIZER_FILE), needle)


def test_a_tokenizer_file_nested_too_deep_is_one_line(made, tmp_path, capsys):
    _, export, _, _ = made
    bad = copy_export(export, tmp_path / "bad")
    text = (bad / TOKENIZER_FILE).read_text()
    (bad / TOKENIZER_FILE).write_text(text.rstrip().rstrip("}") + ', "training": ' + "[" * 100_000 + "]" * 100_000 + "}")
    refused_in_one_line(["generate", str(bad), "--prompt", "hi", "--max-new-tokens", "1"], capsys,
                        str(bad / TOKENIZER_FILE), "nested too deep")


# ---- item 7: nonsense floats ----------------------------------------------------------------------
@pytest.mark.parametrize("changes, needle", [
    # a whole number in JSON was refused with the integer bounds on main ("between 1 and 2147483647")
    ({"norm_eps": -1}, "model.norm_eps=-1 must be > 0"),
    ({"norm_eps": -1.0}, "model.norm_eps=-1.0 must be > 0"),
    ({"rope_base": 0}, "model.rope_base=0 must be > 1"),
    ({"rope_base": 0.0}, "model.rope_base=0.0 must be > 1"),
    ({"rope_base": 1}, "model.rope_base=1 must be > 1"),
    ({"init_std": -0.5}, "model.init_std=-0.5 must be >= 0"),
    ({"z_loss_coef": -1.0}, "model.z_loss_coef=-1.0 must be >= 0"),
])
def test_nonsense_model_floats_are_refused_where_config_json_is_read(made, tmp_path, capsys, changes, needle):
    """eval exited 0 with every loss NaN, and wrote NaN (not JSON) into eval.json."""
    _, export, shards, _ = made
    bad = copy_export(export, tmp_path / "bad", model=changes)
    with pytest.raises(ValueError, match="config.json"):
        load_pretrained(bad)
    out = tmp_path / "eval.json"
    refused_in_one_line(["eval", str(bad), "--data", str(shards), "--no-progress", "--out", str(out)], capsys,
                        "config.json", needle)
    assert not out.exists()


def test_the_run_config_refuses_the_same_floats():
    from omniloom.pretrain.config.io import ConfigError
    from omniloom.pretrain.config.run import load_config

    with pytest.raises(ConfigError, match=r"model\.norm_eps=-1.0 must be > 0"):
        load_config("tiny", ["model.norm_eps=-1"])
    with pytest.raises(ConfigError, match=r"model\.moe\.bias_update_rate=-0.1 must be >= 0"):
        load_config("tiny", ["model.moe.bias_update_rate=-0.1"])


def test_eval_never_writes_nan_into_json(made, tmp_path, capsys):
    """A model whose weights give NaN (a NaN is a float: safetensors holds it) is reported in one
    line and eval.json is not written; non-finite values that are not losses become null."""
    _, export, shards, _ = made
    bad = copy_export(export, tmp_path / "bad")

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(bad / "model.safetensors"))
    tensors["norm"] = torch.full_like(tensors["norm"], float("nan"))
    save_file(tensors, str(bad / "model.safetensors"))
    out = tmp_path / "eval.json"
    refused_in_one_line(["eval", str(bad), "--data", str(shards), "--no-progress", "--out", str(out)], capsys,
                        "loss", "not finite", "loss.all")
    assert not out.exists()
    from omniloom.pretrain.inference.evaluate import json_safe

    clean, bad_keys = json_safe({"loss": {"all": 800.0}, "perplexity": {"all": float("inf")}, "x": [1.0, float("nan")]})
    assert clean == {"loss": {"all": 800.0}, "perplexity": {"all": None}, "x": [1.0, None]}
    assert bad_keys == ["perplexity.all", "x.1"]
    json.dumps(clean, allow_nan=False)


# ---- item 11: messages that say what is wrong -----------------------------------------------------
def test_a_format_version_that_is_no_number_names_file_and_key(made, tmp_path, capsys):
    _, export, _, _ = made
    bad = copy_export(export, tmp_path / "bad", top={"format_version": "abc"})
    err = refused_in_one_line(["generate", str(bad), "--prompt", "hi", "--max-new-tokens", "1"], capsys,
                              str(bad / "config.json"), "format_version 'abc'")
    assert "invalid literal" not in err


def test_weights_under_a_model_prefix_say_how_to_strip_it(made, tmp_path, capsys):
    """A transformers-style wrapper saves `model.embed...`; the message said 'the weights hold 0 layers'."""
    from safetensors.torch import load_file, save_file

    _, export, _, _ = made
    bad = copy_export(export, tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    save_file({f"model.{k}": v for k, v in tensors.items()}, str(bad / "model.safetensors"))
    err = refused_in_one_line(["generate", str(bad), "--prompt", "hi", "--max-new-tokens", "1"], capsys,
                              str(bad), "safetensors", "'model.'", "strip the prefix")
    assert "0 layers" not in err
