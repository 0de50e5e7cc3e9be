"""The export's Hugging Face remote code is omniloom's own code (issue 26): which files it holds,
what they may import (checked with transformers' own import scanners), and the rewriting rules."""

from __future__ import annotations

import ast

import pytest

from omniloom.pretrain.export.hf.remote_code import (MODEL_ENTRIES, MODEL_PACKAGES, PROCESSOR_PACKAGES, REMOTE_DIR,
                                                     RemoteCodeError, remote_code_files, rewrite_module)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("remote")
    files = remote_code_files("test")
    for name, text in files.items():
        (out / name).write_text(text)
    return out, files


def test_the_stand_in_ops_are_omniloom_reference_ops():
    from omniloom.kernels.ops import OP_NAMES

    tree = ast.parse((REMOTE_DIR / "kernels_ops.py").read_text())
    names = next(ast.literal_eval(node.value) for node in tree.body
                 if isinstance(node, ast.Assign) and node.targets[0].id == "OP_NAMES")
    assert tuple(names) == OP_NAMES


def test_copies_are_omniloom_modules_with_only_their_imports_rewritten(written):
    """Every copied file is its omniloom module (or the one SUBSTITUTES names for it), changed in
    import lines only (one source)."""
    import importlib.util

    from omniloom.pretrain.export.hf.remote_code import SUBSTITUTES

    _, files = written
    copied = {n: t for n, t in files.items() if t.startswith("# Copied by omniloom export")}
    assert {"model_decoder.py", "model_attention.py", "model_kv_cache.py", "model_moe.py", "kernels_reference.py",
            "tokenizers_unified.py", "tokenizers_image.py", "tokenizers_video.py", "tokenizers_text.py"} <= set(copied)
    assert "omniloom/tokenizers/hf_text.py" in copied["tokenizers_text.py"].splitlines()[0]
    for name, text in copied.items():
        package, _, mod = name[:-3].partition("_")
        module = SUBSTITUTES.get(name[:-3], f"omniloom.{package}.{mod}")
        source = open(importlib.util.find_spec(module).origin).read()
        assert _without_imports(text) == _without_imports(source), name


class _NoImports(ast.NodeTransformer):
    """The syntax tree without import statements, and without a try block that held only one."""

    def visit_Import(self, node):
        return None

    visit_ImportFrom = visit_Import

    def visit_Try(self, node):
        self.generic_visit(node)
        return node if node.body else None


def _without_imports(text: str) -> str:
    return ast.dump(_NoImports().visit(ast.parse(text)))


def test_every_file_imports_only_what_a_hugging_face_user_has(written):
    """transformers' own scanners: the packages each file needs (what a Hub download checks file
    by file), and the files the loader copies for the model's and the processor's entry points."""
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    out, files = written
    model_files = set()
    for entry in MODEL_ENTRIES:
        model_files |= {p.split("/")[-1] for p in get_relative_import_files(str(out / entry))} | {entry}
    assert "model_decoder.py" in model_files and not any(f.startswith("tokenizers_image") for f in model_files)
    for name in files:
        needed = set(get_imports(str(out / name))) - set(__import__("sys").stdlib_module_names)
        allowed = MODEL_PACKAGES if name in model_files else PROCESSOR_PACKAGES
        assert needed <= allowed, (name, needed)
    processor_files = {p.split("/")[-1] for p in get_relative_import_files(str(out / "processing_omniloom.py"))}
    assert all((out / f).is_file() for f in model_files | processor_files)


def test_rewriting_rules():
    text = ("from . import accounting\n"
            "from .masks import (a,\n    b as c)\n"
            "from omniloom.kernels.reference import head_dtype\n"
            "import torch\n"
            "def f():\n"
            "    from flash_attn import varlen\n"
            "    return varlen\n")
    new, deps = rewrite_module(text, "omniloom.model.decoder", MODEL_PACKAGES)
    assert deps == {"omniloom.model.accounting", "omniloom.model.masks", "omniloom.kernels.reference"}
    assert "from .model_accounting import __name__ as _hf_copies_model_accounting" in new
    assert "from . import model_accounting as accounting" in new
    assert "from .model_masks import a, b as c\n" in new and "from .kernels_reference import head_dtype\n" in new
    assert "    try:" in new and "        from flash_attn import varlen" in new
    ast.parse(new)
    with pytest.raises(RemoteCodeError, match="imports triton at module level"):
        rewrite_module("import triton\n", "omniloom.kernels.ops", MODEL_PACKAGES)
    with pytest.raises(RemoteCodeError, match="not `import omniloom"):
        rewrite_module("import omniloom.model.config\n", "omniloom.model.decoder", MODEL_PACKAGES)
    with pytest.raises(RemoteCodeError, match="is not a module"):
        rewrite_module("from omniloom.model import OmniModel\n", "omniloom.pretrain.inference.generate", MODEL_PACKAGES)


def test_config_json_keeps_omniloom_keys_and_gains_hugging_face_ones(tmp_path):
    import json

    import torch

    from omniloom.model import OmniModel
    from omniloom.model.config import ModelConfig
    from omniloom.model.pretrained import load_pretrained
    from omniloom.pretrain.export.write import save_export
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path / "tok")
    cfg = ModelConfig(dim=32, num_layers=1, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size,
                      patch_token_id=tok.patch_id, rope_sections=(2, 2, 4), patch_dim=tok.patch_dim,
                      tubelet_dim=tok.tubelet_dim)
    save_export(OmniModel(cfg), tmp_path / "tok", tmp_path / "export")
    info = json.loads((tmp_path / "export" / "config.json").read_text())
    assert info["format"] == "omniloom-export" and info["model"]["dim"] == 32
    assert info["model_type"] == "omniloom" and info["architectures"] == ["OmniloomForCausalLM"]
    assert info["auto_map"]["AutoModelForCausalLM"] == "modeling_omniloom.OmniloomForCausalLM"
    assert (info["bos_token_id"], info["eos_token_id"], info["pad_token_id"]) == (1, 2, 3)
    gen = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    assert gen["suppress_tokens"] == [tok.patch_id] and gen["eos_token_id"] == 2
    proc = json.loads((tmp_path / "export" / "processor_config.json").read_text())
    assert proc["media"] == tok.to_json()["media"]
    assert isinstance(load_pretrained(tmp_path / "export"), torch.nn.Module)
