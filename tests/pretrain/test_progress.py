"""Training shows progress (issue 15.6): a tqdm bar with loss and tokens/s on a terminal, else a
log line every logging.progress_seconds with step, loss, tokens/s and the time left."""

from __future__ import annotations

import logging
import os
import types

import pytest

from omniloom.pretrain.train.metrics import MetricsLogger


def _acc():
    return types.SimpleNamespace(is_main_process=True, log_with=None)


def test_without_a_terminal_progress_is_a_periodic_line(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr", open(tmp_path / "err.txt", "w"))  # not a terminal
    logger = MetricsLogger(_acc(), tmp_path, total_steps=10, start_step=0, trackers=[], run_name="r",
                           progress=True, progress_seconds=1e-6)
    assert logger._bar is None
    with caplog.at_level(logging.INFO, logger="omniloom.pretrain.train.metrics"):
        for step in range(1, 11):
            logger.progress(step, {"loss": 3.14159, "lr": 1e-3}, tokens_seen=step * 2048)
    logger.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert len(lines) == 10
    assert lines[4].startswith("step 5/10 (50%), loss 3.142, lr 0.001, tok/s ") and "left ~" in lines[4]
    assert lines[-1].startswith("step 10/10 (100%)") and "left" not in lines[-1]


def test_lines_are_spaced_and_can_be_turned_off(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr("sys.stderr", open(tmp_path / "err.txt", "w"))
    with caplog.at_level(logging.INFO, logger="omniloom.pretrain.train.metrics"):
        spaced = MetricsLogger(_acc(), tmp_path / "a", total_steps=100, start_step=0, trackers=[], run_name="r",
                               progress_seconds=3600)
        off = MetricsLogger(_acc(), tmp_path / "b", total_steps=100, start_step=0, trackers=[], run_name="r",
                            progress_seconds=0)
        for step in range(1, 51):
            spaced.progress(step, {"loss": 1.0}, tokens_seen=step)
            off.progress(step, {"loss": 1.0}, tokens_seen=step)
    assert not [r for r in caplog.records if r.getMessage().startswith("step ")]


def test_on_a_terminal_the_bar_shows_loss_and_tokens_per_second(tmp_path, monkeypatch):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    err = Tty()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.delenv("COLUMNS", raising=False)
    logger = MetricsLogger(_acc(), tmp_path, total_steps=4, start_step=0, trackers=[], run_name="r", progress=True)
    assert logger._bar is not None
    logger._bar.fp = err  # tqdm bound the stream at creation; make sure it writes here
    for step in range(1, 5):
        logger.progress(step, {"loss": 2.5}, tokens_seen=step * 100)
    logger.close()
    assert "tok/s" in err.getvalue() and "loss" in err.getvalue()


def _lines_from(logger, caplog, steps=4):
    with caplog.at_level(logging.INFO, logger="omniloom.pretrain.train.metrics"):
        for step in range(1, steps + 1):
            logger.progress(step, {"loss": 2.5}, tokens_seen=step * 100)
    logger.close()
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pty")
def test_a_terminal_of_zero_columns_gets_the_periodic_line(tmp_path, caplog, monkeypatch):
    """Issue 15 G8: a pty nobody sized (some CI runners) reports 0 columns; tqdm drew nothing there."""
    master, slave = os.openpty()  # a fresh pty: 0 columns, 0 lines
    err = os.fdopen(slave, "w")
    try:
        assert err.isatty() and os.get_terminal_size(slave).columns == 0
        monkeypatch.setattr("sys.stderr", err)
        monkeypatch.delenv("COLUMNS", raising=False)
        logger = MetricsLogger(_acc(), tmp_path, total_steps=4, start_step=0, trackers=[], run_name="r",
                               progress=True, progress_seconds=1e-6)
        assert logger._bar is None
        lines = _lines_from(logger, caplog)
    finally:
        err.close()
        os.close(master)
    assert len(lines) == 4 and lines[-1].startswith("step 4/4 (100%), loss 2.5, tok/s ")


def test_columns_zero_gets_the_periodic_line(tmp_path, caplog, monkeypatch):
    import io

    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr("sys.stderr", Tty())
    monkeypatch.setenv("COLUMNS", "0")
    logger = MetricsLogger(_acc(), tmp_path, total_steps=4, start_step=0, trackers=[], run_name="r",
                           progress=True, progress_seconds=1e-6)
    assert logger._bar is None
    lines = _lines_from(logger, caplog)
    assert len(lines) == 4 and lines[1].startswith("step 2/4 (50%), loss 2.5, tok/s ")
