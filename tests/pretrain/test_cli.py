"""The `omniloom` CLI: help, version, user errors as one line with exit 2."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from omniloom.pretrain.cli import main

OMNILOOM = shutil.which("omniloom") or str(Path(sys.executable).with_name("omniloom"))


def run(*args):
    return subprocess.run([OMNILOOM, *args], capture_output=True, text=True, timeout=120)


def test_version_and_help():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.startswith("omniloom ")
    out = run("--help")
    assert out.returncode == 0
    for cmd in ("config", "bench"):
        assert cmd in out.stdout


def test_user_error_is_one_line_without_traceback():
    out = run("config", "show", "tiny", "model.num_layer=3")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0, out.stderr
    assert "Traceback" not in out.stderr and "did you mean 'model.num_layers'" in out.stderr


def test_verbose_shows_traceback():
    out = run("-v", "config", "show", "tiny", "model.num_layer=3")
    assert out.returncode != 0 and "Traceback" in out.stderr


def test_config_show_in_process(capsys):
    assert main(["config", "show", "tiny", "train.num_steps=7"]) == 0
    assert "num_steps: 7" in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "usage" in capsys.readouterr().out


@pytest.mark.parametrize("group", ["config"])
def test_subcommand_help(group):
    assert run(group, "--help").returncode == 0


def test_help_does_not_import_torch():
    # every package's cli.py imports heavy libraries inside its handlers, so --help stays instant
    code = "import sys; from omniloom.pretrain.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_bench_all_runs_each_and_writes_one_table(tmp_path, capsys):
    import argparse

    from omniloom.pretrain.cli import _bench_all

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    ok = sub.add_parser("fast")
    ok.set_defaults(func=lambda a: print("fast: 3.0x faster than reference"))
    bad = sub.add_parser("broken")
    bad.set_defaults(func=lambda a: 1 / 0)
    out = tmp_path / "bench.md"
    args = argparse.Namespace(out=str(out), verbose=0, quiet=0)
    assert _bench_all(args, sub) == 1  # a failure is reported, and the other figures are kept
    text = out.read_text()
    assert "3.0x faster" in text and "| `omniloom bench fast` | ok |" in text and "| `omniloom bench broken` | exit 1 |" in text


@pytest.mark.parametrize("verbosity, ours, theirs", [(0, True, False), (1, True, True), (-1, False, False)])
def test_the_console_keeps_to_omniloom_lines_unless_verbose(verbosity, ours, theirs, capsys):
    """Issue 28.7: accelerate's INFO lines at every checkpoint and matplotlib's font-cache line
    reached the console at the default verbosity; other libraries' INFO now shows only at -v."""
    import logging

    from omniloom.pretrain.console import setup_logging

    own_level = logging.getLogger("omniloom").level
    try:
        setup_logging(verbosity)
        logging.getLogger("omniloom.pretrain.checkpoint.manager").info("saved checkpoint step_1")
        logging.getLogger("accelerate.checkpointing").info("Model weights saved in x")
        logging.getLogger("matplotlib.font_manager").info("generated new fontManager")
        logging.getLogger("accelerate.checkpointing").warning("a warning always shows")
        err = capsys.readouterr().err
    finally:
        logging.getLogger("omniloom").setLevel(own_level)
    assert ("saved checkpoint step_1" in err) == ours
    assert ("Model weights saved" in err) == theirs and ("fontManager" in err) == theirs
    assert "a warning always shows" in err


def test_train_help_lists_every_shipped_preset(capsys):
    """Issue 28.10: `train --help` named three of the five presets; the list now comes from the
    shipped folder, in the description and in --config's help."""
    from omniloom.pretrain.config.run import list_presets

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert len(list_presets()) >= 5
    assert f"a shipped preset name: {', '.join(list_presets())};" in text
    assert f"preset name ({', '.join(list_presets())}) or YAML path" in text


def test_a_reader_that_closes_the_pipe_ends_any_command_quietly(tmp_path):
    """Issue 28.10: `omniloom tokenizer encode ... | head` ended in a BrokenPipeError traceback. One
    handler in the entry point covers every command that prints: exit 141, as a command killed by
    SIGPIPE, and nothing on stderr (argparse's --help swallows the error itself and exits 0)."""
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path / "tok")
    for args in (["tokenizer", "encode", "--tokenizer", str(tmp_path / "tok"), "a few words " * 50],
                 ["config", "show", "tiny"], ["--help"]):
        proc = subprocess.Popen([sys.executable, "-m", "omniloom.pretrain.cli", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # the reader is gone before the command writes a byte
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == (0 if args == ["--help"] else 141), (args, err)
        assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, (args, err)
