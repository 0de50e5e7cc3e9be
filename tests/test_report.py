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


def test_report_top_names_the_run_and_its_settings_and_eval_is_a_table(tmp_path):
    """Issue 15.7: no raw JSON dump with 16-digit floats; the run's folder and key settings on top;
    the gap chart's title fits the figure."""
    from omniloom.pretrain.config import load_config, to_yaml
    from omniloom.pretrain.report import _gap_figure

    run, _ = _fake_run(tmp_path)
    ckpt = run / "checkpoints" / "step_00000100"
    ckpt.mkdir(parents=True)
    (ckpt / "config.yaml").write_text(to_yaml(load_config("tiny", ["data.sources=[{path: shards/train, weight: 3}]",
                                                                  "model.vocab_size=2048"])))
    (ckpt / "COMPLETE").write_text(json.dumps({"step": 100, "files": ["config.yaml"], "world_size": 2}))
    ev = tmp_path / "eval.json"
    ev.write_text(json.dumps({
        "loss": {"all": 1.2345678901234567, "text": 0.3187654321987654, "special": 2.0},
        "perplexity": {"all": 3.4367890123456789, "text": 1.3753456789012345, "special": 7.38905609893065},
        "cross_modal_gap": {"image": 1.5612345678901234, "video": None},
        "cross_modal_gap_detail": {"image": {"own_visual_loss": 0.41234567, "donor_visual_loss": 1.97358024,
                                             "gap": 1.5612345678901234, "text_tokens": 1234, "docs": 200}},
        "counts": {"docs": 298, "docs_available": 298, "skipped": {}}}))
    page = write_report(run, eval_json=ev).read_text()
    assert "<h1>omniloom run report: " + run.parent.name + "/run</h1>" in page  # not just "run"
    assert str(run.resolve()) in page
    for setting in ("4 layers, width 128", "pattern LLLG", "8 experts, top-2", "shards/train (weight 3)",
                    "4 rows x 512 tokens per rank, 2 process(es)", "lr 0.001"):
        assert setting in page, setting
    assert "<pre>" not in page and "1.2345678901234567" not in page and "0.3187654321987654" not in page
    assert "<td>text</td><td>0.3188</td><td>1.375</td>" in page
    assert "<td>image</td><td>1.561</td><td>0.4123</td><td>1.974</td><td>200</td><td>1,234</td>" in page
    assert "<td>video</td><td>n/a</td>" in page and "298 documents scored of 298 available" in page
    fig = _gap_figure(json.loads(ev.read_text()))
    fig.canvas.draw()
    box, title = fig.bbox, fig.axes[0].title.get_window_extent()
    assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, (title, box)
