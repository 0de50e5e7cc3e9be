"""`omniloom report`: the HTML page references PNGs that exist and decode."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser

import pytest
from PIL import Image

from omniloom.pretrain.report import write_report


class _Imgs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.srcs = []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.srcs.append(dict(attrs)["src"])


def _fake_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = []
    for step in range(10, 110, 10):
        rows.append({
            "step": step, "loss": 5.0 - step / 50, "loss/text": 5.2 - step / 50, "loss/image": 4.0, "lr": 1e-3 * step / 100,
            "grad_norm": 1.0 + step / 100, "tokens_per_s": 1000.0 + step, "tokens_per_s_per_device": 500.0 + step,
            "data/padding_fraction": 0.03, "data_wait_fraction": 0.1, "final_out_rms": 1.0,
            "moe/counts_LME": [[[0] * 4] * 5, [[10, 20, 30, 40], [1, 2, 3, 4], [5, 5, 5, 5], [0] * 4, [2, 2, 2, 2]]],
        })
    rows.append({"step": 100, "eval/loss": 4.5, "eval/loss/text": 4.6})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 11')  # truncated tail
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({"loss": {"text": 4.0}, "cross_modal_gap": {"image": 1.7, "video": 0.4}}))
    return run, ev


def test_report_html_renders_its_images(tmp_path):
    run, ev = _fake_run(tmp_path)
    index = write_report(run, eval_json=ev)
    parser = _Imgs()
    parser.feed(index.read_text())
    expected = {"loss.png", "eval_loss.png", "lr.png", "grad_norm.png", "throughput.png", "experts.png", "padding.png", "gap.png"}
    assert expected <= set(parser.srcs)
    for src in parser.srcs:
        with Image.open(index.parent / src) as img:
            img.verify()  # a real PNG, not an empty placeholder
        with Image.open(index.parent / src) as img:
            assert img.format == "PNG" and img.size[0] > 200 and img.size[1] > 100
    assert re.search(r"cross_modal_gap", index.read_text())


def test_report_errors_are_actionable(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="no metrics"):
        write_report(tmp_path)
