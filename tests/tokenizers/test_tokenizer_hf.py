"""Hugging Face compatibility of the tokenizer and export folders (issue 15.3), the renamed
metadata file with back-compat for old folders, and the model_sha256 check on load (issue 14.15).

`transformers` is a test-only dependency (the `dev` extra); nothing here touches the network."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from omniloom.tokenizers import layout
from omniloom.tokenizers.testing import SAMPLE_TEXTS, make_tiny_tokenizer
from omniloom.tokenizers.text import Tokenizer, train_tokenizer
from omniloom.tokenizers.unified import tokenize_document

try:
    import transformers
except ModuleNotFoundError as err:  # a hard failure, not a skip: the acceptance runs this test
    raise ModuleNotFoundError("tests/tokenizers/test_tokenizer_hf.py needs transformers, a test dependency: "
                              "pip install -e '.[dev]'") from err

CODE = "class A:\n    def f(self, x):\n\tif x:\n\t\treturn  x  # two spaces\n        pass\n\n\n"
TEXTS = [
    "Hello world.", "  leading and trailing  ", "tabs\tand\t\tmore\ttabs\n", CODE,
    "emoji 🎉👍🏽🧑‍💻 and accents: café, naïve, Grüße, 東京", "digits 1234567890 3.14159 1e-9",
    "the whitespace mark \u2581 itself, and \u2581\u2581 twice", "", " ", "\n", "\r\n\r\n", "a" * 300,
]


def _sample_strings(seed=0, n=150):
    src = "".join(SAMPLE_TEXTS) + Path(layout.__file__).read_text(encoding="utf-8")
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        a = rnd.randrange(len(src))
        out.append(src[a:a + rnd.randrange(1, 300)])
    return TEXTS + out


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    make_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def code_tok_dir(tmp_path_factory):
    """A larger vocabulary, trained on Python source: long whitespace runs and many merges."""
    d = tmp_path_factory.mktemp("codetok")
    root = Path(layout.__file__).parent.parent
    texts = [p.read_text(encoding="utf-8") for p in sorted((root / "pretrain").rglob("*.py"))][:12] + list(SAMPLE_TEXTS)
    train_tokenizer(texts, d, 1200, num_threads=1)
    return d


_SPECIAL_TEXTS = layout.META_TOKENS + layout.CONTROL_TOKENS


def _assert_same_ids(hf, tok, strings):
    """Every string gives omniloom's ids (strings holding special-token text: through
    split_special_tokens, which treats them as text as omniloom does) and decodes back."""
    raw = transformers.AutoTokenizer.from_pretrained(hf.name_or_path, split_special_tokens=True)
    plain = 0
    for s in strings:
        ids = tok.encode(s)
        assert raw(s)["input_ids"] == ids, repr(s[:80])
        if not any(t in s for t in _SPECIAL_TEXTS):
            assert hf(s)["input_ids"] == ids, repr(s[:80])
            plain += 1
        assert hf.decode(ids) == s
    assert plain >= len(strings) // 2


@pytest.mark.parametrize("which", ["tok_dir", "code_tok_dir"])
def test_autotokenizer_gives_omniloom_ids(which, request):
    d = request.getfixturevalue(which)
    tok = Tokenizer.load(d)
    hf = transformers.AutoTokenizer.from_pretrained(str(d))
    _assert_same_ids(hf, tok, _sample_strings())
    assert len(hf) == tok.vocab_size
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id, hf.unk_token_id) == (1, 2, 3, 0)
    for name, idx in layout.SPECIAL_IDS.items():
        assert hf.convert_ids_to_tokens(idx) == tok.id_to_piece(idx)
        assert hf.convert_tokens_to_ids(tok.id_to_piece(idx)) == idx


def test_the_exports_text_tokenizer_gives_omniloom_ids(tok_dir):
    """tokenizers/hf_text.py (an export's tokenizers_text.py) over tokenizer.json: the ids, arrays and
    decoding of omniloom's SentencePiece Tokenizer (whole documents: test_hf_export's processor tests)."""
    import numpy as np

    from omniloom.tokenizers.hf_text import HFTextTokenizer

    tok = Tokenizer.load(tok_dir)
    hft = HFTextTokenizer(transformers.AutoTokenizer.from_pretrained(str(tok_dir)), tok.settings)
    assert (hft.vocab_size, hft.patch_dim, hft.tubelet_dim) == (tok.vocab_size, tok.patch_dim, tok.tubelet_dim)
    for s in _sample_strings(n=60):  # typed tag text included: ordinary text for both
        ids = tok.encode(s)
        assert hft.encode(s) == ids, repr(s[:80])
        assert np.array_equal(hft.encode_array(s), tok.encode_array(s))
        assert hft.decode(ids) == tok.decode(ids)


def test_tag_tokens_match_the_layout(tok_dir):
    """A document written out with its tags gives the layout's ids; with split_special_tokens typed
    tag text is ordinary text, as omniloom treats it."""
    tok = Tokenizer.load(tok_dir)
    doc = {"segments": [{"type": "text", "text": "Look at this:\n"}, {"type": "code", "lang": "python", "text": CODE},
                        {"type": "text", "text": " done 🎉"}]}
    ids = tokenize_document(doc, tok).ids_L.tolist()
    assert ids[0] == layout.BOS_ID and ids[-1] == layout.EOS_ID
    written = "<s>Look at this:\n<|code|>python\n" + CODE + "<|/code|> done 🎉</s>"
    hf = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    assert hf(written)["input_ids"] == ids
    assert hf.decode(ids, skip_special_tokens=True) == "Look at this:\npython\n" + CODE + " done 🎉"
    typed = "a user typing <|image|> and <|patch|> and </s> gets text"
    raw = transformers.AutoTokenizer.from_pretrained(str(tok_dir), split_special_tokens=True)
    assert raw(typed)["input_ids"] == tok.encode(typed)
    assert layout.IMAGE_ID not in tok.encode(typed)


def _tiny_export(tok_dir: Path, out: Path) -> None:
    import torch

    from omniloom.model import OmniModel
    from omniloom.model.config import AttentionConfig, ModelConfig, MoEConfig
    from omniloom.pretrain.export.write import save_export

    tok = Tokenizer.load(tok_dir)
    cfg = ModelConfig(dim=32, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=tok.vocab_size,
                      patch_token_id=tok.patch_id, rope_sections=(2, 2, 4), patch_dim=tok.patch_dim,
                      tubelet_dim=tok.tubelet_dim,
                      attention=AttentionConfig(backend="sdpa", pattern="LG", window=12, block_size=8, num_selected_blocks=2),
                      moe=MoEConfig(num_experts=4, num_experts_per_token=2, expert_dim=16, num_dense_layers=1, dense_dim=32))
    torch.manual_seed(0)
    save_export(OmniModel(cfg), tok_dir, out)


def test_export_folder_loads_in_autotokenizer(tok_dir, tmp_path):
    tok = Tokenizer.load(tok_dir)
    out = tmp_path / "export"
    _tiny_export(tok_dir, out)
    # the export's config.json names its remote code (issue 26), which AutoTokenizer reads too
    hf = transformers.AutoTokenizer.from_pretrained(str(out), trust_remote_code=True)  # was: KeyError 'added_tokens'
    _assert_same_ids(hf, tok, _sample_strings(seed=1, n=30))
    assert (out / "tokenizer.model").read_bytes() == (tok_dir / "tokenizer.model").read_bytes()
    assert json.loads((out / "omniloom_tokenizer.json").read_text())["format"] == "omniloom-tokenizer"
    assert Tokenizer.load(out).encode(CODE) == tok.encode(CODE)


def test_python_started_in_the_checkout_root_gets_the_real_tokenizers_and_loads_an_export(tok_dir, tmp_path):
    """Python started in the checkout (a REPL, a notebook, `python -c`, where `./demo_out` lands)
    puts the root first on sys.path, where the repo's tokenizers/ folder shadowed Hugging Face's
    package: `AutoTokenizer.from_pretrained` died with "cannot import name 'Encoding' from
    'tokenizers' (.../tokenizers/__init__.py)". The folder now hands the name to the real one."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    out = tmp_path / "export"
    _tiny_export(tok_dir, out)
    text = "Hello world. café 🎉\n" + CODE
    script = ("import json, sys, tokenizers\n"
              "from transformers import AutoTokenizer\n"
              "ids = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)(sys.argv[2])['input_ids']\n"
              "try:\n    import kernels\nexcept ModuleNotFoundError as err:\n    kern = str(err)\n"
              "else:\n    kern = kernels.__file__\n"
              "print(json.dumps({'file': tokenizers.__file__, 'ids': ids, 'kernels': kern}))\n")
    res = subprocess.run([sys.executable, "-c", script, str(out), text], cwd=root, capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in __import__("os").environ.items() if k != "PYTHONSAFEPATH"})
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(got["file"]).resolve().parent != root / "tokenizers"
    assert got["ids"] == Tokenizer.load(tok_dir).encode(text)
    # a name with no real package behind it says what the folder is (or is the real package, if one
    # is installed: Hugging Face's `kernels`, which newer transformers require; the virtual
    # environment may live inside the checkout, as `make` puts it, so compare with the folder itself)
    assert ("is omniloom.kernels, not that package" in got["kernels"]
            or Path(got["kernels"]).resolve().parent != (root / "kernels").resolve())


def _legacy_copy(tok_dir: Path, dest: Path) -> Path:
    """A folder as omniloom wrote it before the rename: tokenizer.model + its metadata as tokenizer.json."""
    dest.mkdir()
    shutil.copyfile(tok_dir / "tokenizer.model", dest / "tokenizer.model")
    shutil.copyfile(tok_dir / "omniloom_tokenizer.json", dest / "tokenizer.json")
    return dest


def test_old_folders_still_load_everywhere(tok_dir, tmp_path):
    from omniloom.pretrain.train.build import resolve_model_config
    from omniloom.pretrain.config.run import load_config

    old = _legacy_copy(tok_dir, tmp_path / "old")
    tok = Tokenizer.load(old)
    assert tok.encode(CODE) == Tokenizer.load(tok_dir).encode(CODE)
    assert Tokenizer.load(old / "tokenizer.json").vocab_size == tok.vocab_size
    cfg = resolve_model_config(load_config("tiny", [f"data.tokenizer={old}"]))
    assert cfg.model.vocab_size == tok.vocab_size and cfg.model.patch_token_id == layout.PATCH_ID
    # saving anew writes the new names and Hugging Face's tokenizer.json over the old file
    tok.save(old)
    assert "added_tokens" in json.loads((old / "tokenizer.json").read_text())
    assert Tokenizer.load(old).vocab_size == tok.vocab_size


def test_hf_tokenizer_json_is_not_taken_for_omniloom_metadata(tok_dir, tmp_path):
    d = tmp_path / "hf_only"
    d.mkdir()
    for name in ("tokenizer.model", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, d / name)
    with pytest.raises(FileNotFoundError, match="Hugging Face file"):
        Tokenizer.load(d)


# ---- issue 14.15: tokenizer.model is checked against the recorded sha256 ----------------------
@pytest.fixture()
def swapped(tok_dir, tmp_path):
    """A tokenizer folder whose tokenizer.model was replaced by another of the same vocabulary size."""
    d = tmp_path / "swapped"
    shutil.copytree(tok_dir, d)
    other = tmp_path / "other"
    train_tokenizer(["completely different corpus text " * 50, "zzz yyy xxx www " * 80, *SAMPLE_TEXTS[:1]], other,
                    Tokenizer.load(tok_dir).vocab_size, num_threads=1, character_coverage=0.995)
    shutil.copyfile(other / "tokenizer.model", d / "tokenizer.model")
    assert Tokenizer.load(other).vocab_size == Tokenizer.load(tok_dir).vocab_size
    return d


def test_swapped_model_is_refused_naming_the_file(swapped):
    with pytest.raises(ValueError, match=r"swapped/tokenizer.model does not belong to omniloom_tokenizer.json: its sha256"):
        Tokenizer.load(swapped)


def test_corrupt_model_gives_one_clear_error(tok_dir, tmp_path):
    d = tmp_path / "corrupt"
    shutil.copytree(tok_dir, d)
    (d / "tokenizer.model").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"corrupt/tokenizer.model does not belong"):
        Tokenizer.load(d)
    meta = json.loads((d / "omniloom_tokenizer.json").read_text())
    del meta["model_sha256"]  # no hash recorded: sentencepiece's own error is wrapped, naming the file
    (d / "omniloom_tokenizer.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"corrupt/tokenizer.model is not a valid SentencePiece model"):
        Tokenizer.load(d)


def test_sha_is_checked_by_train_eval_generate_and_cli(tok_dir, swapped, tmp_path, capsys):
    from omniloom.pretrain.train.build import resolve_model_config
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.config.run import load_config

    with pytest.raises(ValueError, match="does not belong"):  # train: before any model is built
        resolve_model_config(load_config("tiny", [f"data.tokenizer={swapped}"]))
    export = tmp_path / "export"
    _tiny_export(tok_dir, export)
    shutil.copyfile(swapped / "tokenizer.model", export / "tokenizer.model")
    for argv in (["tokenizer", "encode", "--tokenizer", str(swapped), "x"],
                 ["tokenizer", "decode", "--tokenizer", str(swapped), "5"],
                 ["tokenizer", "show", "--tokenizer", str(swapped)],
                 ["eval", str(export), "--data", str(tmp_path)],
                 ["generate", str(export), "--prompt", "x"]):
        assert main(["-q", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "tokenizer.model does not belong" in err and err.count("\n") == 1, (argv, err)


def test_an_export_refuses_a_whole_other_tokenizer_folder(tok_dir, swapped, tmp_path, capsys):
    """A swapped tokenizer.model whose metadata was swapped with it passes the folder's own hash
    check, but it is not the tokenizer the export's config.json recorded: eval and generate gave
    the model other ids without a word. They now refuse, as does eval's --tokenizer elsewhere."""
    from omniloom.pretrain.cli import main
    from omniloom.pretrain.inference.load import open_model

    other = tmp_path / "other"  # the tokenizer trained by the `swapped` fixture: a valid folder of its own
    export = tmp_path / "export"
    _tiny_export(tok_dir, export)
    for name in ("tokenizer.model", "omniloom_tokenizer.json"):
        shutil.copyfile(other / name, export / name)
    assert Tokenizer.load(export).vocab_size == Tokenizer.load(tok_dir).vocab_size  # loads on its own
    for argv in (["eval", str(export), "--data", str(tmp_path)], ["generate", str(export), "--prompt", "x"]):
        assert main(["-q", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert "is not the one" in err and "config.json was exported with" in err and err.count("\n") == 1, (argv, err)
    good = tmp_path / "good"
    _tiny_export(tok_dir, good)
    assert open_model(good)[1].vocab_size == Tokenizer.load(tok_dir).vocab_size
    with pytest.raises(ValueError, match=r"the tokenizer in .*other is not the one"):
        open_model(good, tokenizer=other)
