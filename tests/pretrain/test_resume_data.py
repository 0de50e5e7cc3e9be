"""Issue 41 item 4: changing the data mix on resume. Adding a source was refused ("data-loader
state does not match") and `init_from` loses the optimizer and schedule; `checkpoint.resume_data`
resumes the model, optimizer, schedule and step and either keeps the state of the sources that did
not change (`keep_unchanged`) or starts the data anew (`restart`), saying which in the log."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from omniloom.pretrain.cli import main
from omniloom.pretrain.rundir import read_metrics


@pytest.fixture(scope="module")
def two_sources(tmp_path_factory):
    """Two shard sets of short text documents built by `data build`, and the tiny test tokenizer."""
    from omniloom.tokenizers.testing import SAMPLE_PROSE, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("resume_data")
    lines = SAMPLE_PROSE.splitlines()
    for name, n, seed in (("web", 30, 0), ("books", 20, 1)):
        rng = random.Random(seed)
        (root / name).mkdir()
        for i in range(n):
            (root / name / f"{name}{i:03d}.txt").write_text(f"{name} {i}: " + " ".join(rng.choice(lines) for _ in range(3)))
        assert main(["-qq", "data", "build", str(root / name), "--out", str(root / "shards" / name)]) == 0
    make_tiny_tokenizer(root / "tok")
    return root / "shards" / "web", root / "shards" / "books", root / "tok"


def _pieces(run) -> list[tuple]:
    rows = [json.loads(line) for line in (run / "data_trace" / "rank00000.jsonl").read_text().splitlines()]
    return [(r["step"], tuple(p)) for r in rows for p in r["pieces"]]


def test_an_added_source_with_keep_unchanged_resumes_the_rest_exactly(two_sources, tmp_path, train_tiny, capsys):
    web, books, tok = two_sources
    trace = ["logging.data_trace=true", "data.shuffle_buffer=4", "data.pack_buffer=4"]
    run = tmp_path / "run"
    assert train_tiny(run, web, tok, *trace, "train.num_steps=2") == 0
    capsys.readouterr()
    both = [web, books]
    assert train_tiny(run, both, tok, *trace, "train.num_steps=4", "checkpoint.resume=auto") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint.resume_data=keep_unchanged" in err[0] and "=restart" in err[0], err
    assert train_tiny(run, both, tok, *trace, "train.num_steps=8", "checkpoint.resume=auto",
                      "checkpoint.resume_data=keep_unchanged", verbosity="-v") == 0
    log = capsys.readouterr().err
    assert f"data mix changed on resume (checkpoint.resume_data=keep_unchanged): continuing where they were: {web}; " \
           f"starting at their beginning (new or changed): {books}; weights now {web} 1, {books} 1" in log
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))  # the step and schedule went on
    pieces = _pieces(run)
    assert {ref[0] for step, (ref, _) in pieces if step > 2} == {0, 1}  # both sources after the change
    web_epoch0 = Counter((ref[2], idx) for _, (ref, idx) in pieces if ref[0] == 0 and ref[1] == 0)
    assert max(web_epoch0.values()) == 1  # nothing of the kept source trained twice


def test_restart_resumes_the_model_and_schedule_and_starts_the_data_anew(two_sources, tmp_path, train_tiny, capsys):
    web, books, tok = two_sources
    trace = ["logging.data_trace=true", "data.shuffle_buffer=4", "data.pack_buffer=4"]
    run = tmp_path / "run"
    assert train_tiny(run, web, tok, *trace, "train.num_steps=2") == 0
    capsys.readouterr()
    # another shuffle buffer is more than a change of sources: only restart resumes
    assert train_tiny(run, books, tok, *trace, "train.num_steps=4", "checkpoint.resume=auto",
                      "checkpoint.resume_data=keep_unchanged", "data.shuffle_buffer=8") == 2
    err = capsys.readouterr().err
    assert "shuffle_buffer" in err and "checkpoint.resume_data=restart" in err
    assert train_tiny(run, books, tok, *trace, "train.num_steps=4", "checkpoint.resume=auto",
                      "checkpoint.resume_data=restart", "data.shuffle_buffer=8", verbosity="-v") == 0
    assert "checkpoint.resume_data=restart: the model, optimizer, schedule and step 2 come from" in capsys.readouterr().err
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r] == [1, 2, 3, 4]
    after = [ref for step, (ref, _) in _pieces(run) if step > 2]
    assert after and all(ref[0] == 0 and ref[1] == 0 for ref in after)  # the new mix, from its first epoch


def test_restart_counts_the_source_schedules_from_the_runs_step(two_sources, tmp_path, train_tiny, capsys):
    """`restart` under a schedule: web ends at step 2, so after a restart at step 2 only books is drawn
    (the fresh stream counted its steps from 0 and drew web again)."""
    web, books, tok = two_sources
    trace = ["logging.data_trace=true", "data.shuffle_buffer=1", "data.pack_buffer=1"]  # each draw trained at once
    run = tmp_path / "run"
    assert train_tiny(run, web, tok, *trace, "train.num_steps=2") == 0
    scheduled = f"data.sources=[{{path: {web}, end_step: 2}}, {{path: {books}}}]"
    assert train_tiny(run, web, tok, *trace, scheduled, "train.num_steps=5", "checkpoint.resume=auto",
                      "checkpoint.resume_data=restart", verbosity="-v") == 0
    assert "source schedules count from step 2" in capsys.readouterr().err
    after = [ref for step, (ref, _) in _pieces(run) if step > 2]
    assert after and {ref[0] for ref in after} == {1}  # books only: web's end_step has passed
