"""`omniloom report`: one self-contained HTML page whose inline PNGs decode; readable plots."""

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
        self.srcs, self.names, self.links = [], [], []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "img":
            self.srcs.append(attrs["src"])
            self.names.append(attrs.get("title"))
        for key in ("href", "src"):
            if key in attrs:
                self.links.append(attrs[key])


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
    """Issue 28.8: index.html is the whole report (images inline as data: URIs), so it can be mailed
    or attached to an issue; the PNGs are also written beside it."""
    import base64
    import io
    import shutil

    run, ev = _fake_run(tmp_path)
    index = write_report(run, eval_json=ev)
    alone = tmp_path / "mailed" / "index.html"  # the page without its folder
    alone.parent.mkdir()
    shutil.copy(index, alone)
    parser = _Imgs()
    parser.feed(alone.read_text())
    expected = {"loss.png", "eval_loss.png", "lr.png", "grad_norm.png", "throughput.png", "experts.png", "padding.png", "gap.png"}
    assert expected <= set(parser.names) and all((index.parent / n).is_file() for n in parser.names)
    assert parser.links and all(link.startswith("data:image/png;base64,") for link in parser.links)
    for src in parser.srcs:
        data = base64.b64decode(src.split(",", 1)[1])
        with Image.open(io.BytesIO(data)) as img:
            img.verify()  # a real PNG, not an empty placeholder
        with Image.open(io.BytesIO(data)) as img:
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
    from omniloom.pretrain.config.run import load_config, to_yaml
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
    assert "<td>image</td><td>1.561</td><td>n/a</td><td>n/a</td><td>0.4123</td><td>1.974</td><td>200</td><td>1,234</td>" in page
    assert "<td>video</td><td>n/a</td>" in page and "298 documents scored of 298 available" in page
    fig = _gap_figure(json.loads(ev.read_text()))
    fig.canvas.draw()
    box, title = fig.bbox, fig.axes[0].title.get_window_extent()
    assert box.x0 <= title.x0 and title.x1 <= box.x1 and title.y1 <= box.y1, (title, box)


def test_the_gap_table_and_chart_carry_the_interval(tmp_path):
    """Issue 28.9: the report says when the gap is not distinguishable from 0."""
    from omniloom.pretrain.report import _gap_figure

    run, _ = _fake_run(tmp_path)
    ev = {"cross_modal_gap": {"image": 0.1655, "video": 1.2},
          "cross_modal_gap_detail": {"image": {"gap": 0.1655, "ci95": [-0.28, 0.61], "distinguishable_from_zero": False, "docs": 12},
                                     "video": {"gap": 1.2, "ci95": [0.9, 1.5], "distinguishable_from_zero": True, "docs": 40}}}
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    page = write_report(run, eval_json=tmp_path / "eval.json").read_text()
    assert "<td>image</td><td>0.1655</td><td>-0.28 to 0.61</td><td>no</td>" in page
    assert "<td>video</td><td>1.2</td><td>0.9 to 1.5</td><td>yes</td>" in page and "not distinguishable from 0" in page
    fig = _gap_figure(ev)
    (caps,) = [c for c in fig.axes[0].containers if type(c).__name__ == "ErrorbarContainer"]
    segments = caps.lines[2][0].get_segments()
    assert [tuple(round(v, 6) for v in (seg[0][1], seg[1][1])) for seg in segments] == [(-0.28, 0.61), (0.9, 1.5)]


def test_loss_is_smoothed_over_the_raw_curve_and_norm_jumps_are_told_from_growth():
    """Issue 28.8: per-step losses of mixed modalities jump (0.94 -> 4.8 between points): the plot
    draws a moving average over the raw curve. The output-norm plot calls steady growth normal and
    marks only sudden jumps against the trend."""
    from omniloom.pretrain.report import norm_jumps, smooth

    raw = [0.9 if i % 2 else 4.8 for i in range(60)]
    avg = smooth(raw, 10)
    assert avg[0] == raw[0] and max(avg[20:]) - min(avg[20:]) < 0.5 < max(raw) - min(raw)
    assert smooth([2.0] * 5, 3) == pytest.approx([2.0] * 5)  # debiased: no ramp up from 0
    steps = list(range(0, 500, 10))
    growth = [0.5 + 4.3 * i / 49 for i in range(50)]  # the demo's 0.5 -> 4.8
    assert norm_jumps(steps, growth) == []
    spiked = growth[:30] + [growth[30] * 3] + growth[31:]
    assert norm_jumps(steps, spiked) == [30]
    early = [0.5, 1.6, 3.1] + [3.0 + (0.8 if i % 3 else -0.8) for i in range(47)]  # the demo's: fast start, noisy plateau
    assert norm_jumps(steps, early) == []


def test_expert_heatmaps_are_readable():
    """Issue 28.8: one full-width panel per modality, every cell labelled with its share."""
    from omniloom.pretrain.report import _expert_figure

    counts = [[[0] * 8] * 5] + [[[i + 1 for i in range(8)], [8 - i for i in range(8)], [1] * 8, [0] * 8, [0] * 8]] * 3
    fig = _expert_figure([{"step": 10, "moe/counts_LME": counts}])
    panels = [ax for ax in fig.axes if ax.get_label() != "<colorbar>"]
    assert len(panels) == 3  # text, code, image
    assert all(len(ax.texts) == 3 * 8 for ax in panels)
    width, height = fig.get_size_inches() * fig.dpi
    assert width / 8 >= 35 and height / (3 * 3) >= 40  # pixels per expert column and per layer row
