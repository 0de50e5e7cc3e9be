"""pretrain/bench/gpu_rows.py: the prepared GPU rows. Their commands parse and their presets load here,
and the runner keeps each row to its limit and the whole to its budget (run on CPU with stand-in
rows: the real ones need a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from omniloom.pretrain.bench import gpu_rows


def test_every_row_is_a_command_the_cli_accepts_on_a_preset_that_loads():
    from omniloom.pretrain.cli import build_parser
    from omniloom.pretrain.config.run import load_config

    parser = build_parser()
    assert [name for name, *_ in gpu_rows.ROWS][:2] == ["large_1b", "step_speed"]  # issue 13's centre first
    for name, argv, limit, what in gpu_rows.ROWS:
        assert argv[0] == sys.executable and 0 < limit <= 600 and what, name
        if argv[1:3] != ["-m", "omniloom.pretrain.cli"]:
            continue
        args = parser.parse_args(argv[3:])
        assert args.command == "bench", name
        if args.bench == "train":
            cfg = load_config(args.preset, args.overrides)
            if args.preset == "long_64k":
                assert cfg.model.attention.dense_warmup_steps == 0 and "B" in cfg.model.attention.pattern


def test_runner_keeps_each_row_to_its_limit_and_skips_what_the_budget_cannot_start(tmp_path):
    py = sys.executable
    rows = [
        ("ok", [py, "-c", "print('row one done')"], 30, "prints"),
        ("fails", [py, "-c", "import sys; print('bad'); sys.exit(3)"], 30, "exits 3"),
        ("hangs", [py, "-c", "import time; print('started', flush=True); time.sleep(60)"], 3, "over its limit"),
        ("late", [py, "-c", "print('never')"], 30, "no budget left"),
    ]
    results = gpu_rows.run_rows(rows, str(tmp_path), budget_s=4.0, min_start_s=1.5)
    got = {r["name"]: r for r in results}
    assert got["ok"]["rc"] == 0 and got["fails"]["rc"] == 3
    assert got["hangs"]["timed_out"] and got["hangs"]["seconds"] < 20
    assert got["late"]["rc"] is None  # skipped: under 1.5 s of the 4 s budget left
    summary = (tmp_path / "rows.txt").read_text()
    assert "row one done" in summary and "rc 3" in summary and "(time limit)" in summary and "skipped" in summary
    assert (tmp_path / "hangs.txt").read_text().startswith("started")


def test_list_and_unknown_rows(capsys):
    assert gpu_rows.main(["--list", "--only", "decode"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decode") and "bench decode" in out and "large_1b" not in out
    try:
        gpu_rows.main(["--only", "nope"])
    except SystemExit as e:
        assert e.code == 2
    assert "unknown row(s) nope" in capsys.readouterr().err


def test_gpu_check_step_speed_section_runs_on_cpu_as_a_smoke_test(tmp_path):
    """gpu_check's step-speed section (a gpu_rows row) runs every code path on CPU at tiny sizes
    under TRITON_INTERPRET=1, including the new-batches recompile count."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "omniloom.pretrain.bench.gpu_check", "--smoke", "--only", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "failed sections: none" in proc.stdout
    assert "dynamo stats over 4 new batches" in proc.stdout and (tmp_path / "gpu_check.json").exists()
