"""Issue 42: a text-first start (`data.text_first_steps=N`) in a real training run on shards built by
`omniloom data build` (captioned shapes and prose): no image before step N, the full mix after, and a
run stopped before the switch and resumed trains on exactly the uninterrupted run's pieces."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from omniloom.pretrain.cli import main
from omniloom.pretrain.rundir import read_metrics


@pytest.fixture(scope="module")
def mixed_shards(tmp_path_factory):
    from omniloom.data.prep.demo_corpus import DemoCorpusSettings, _captioned_set
    from omniloom.tokenizers.testing import SAMPLE_PROSE, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("text_first")
    _captioned_set(root, "shapes", np.random.default_rng(0), 24, DemoCorpusSettings(image_size=32), video=False)
    lines, rng = SAMPLE_PROSE.splitlines(), random.Random(0)
    (root / "prose").mkdir()
    for i in range(24):
        (root / "prose" / f"d{i:03d}.txt").write_text(" ".join(rng.choice(lines) for _ in range(rng.randint(1, 4))))
    assert main(["-qq", "data", "build", str(root / "shapes.jsonl"), str(root / "prose"), "--out", str(root / "shards"),
                 "--shuffle", "0"]) == 0
    make_tiny_tokenizer(root / "tok")
    return root / "shards", root / "tok"


def _trace(run) -> dict[int, list]:
    rows = [json.loads(line) for line in (run / "data_trace" / "rank00000.jsonl").read_text().splitlines()]
    return {r["step"]: r["pieces"] for r in rows}


def test_text_first_run_has_no_image_before_the_switch_and_resumes_across_it_exactly(mixed_shards, tmp_path, train_tiny):
    shards, tok = mixed_shards
    common = ["logging.data_trace=true", "data.shuffle_buffer=4", "data.pack_buffer=4", "data.text_first_steps=3",
              "train.grad_accum_steps=2"]
    whole = tmp_path / "whole"
    assert train_tiny(whole, shards, tok, *common, "train.num_steps=6", "checkpoint.every=6") == 0
    rows = {r["step"]: r for r in read_metrics(whole / "metrics.jsonl") if "loss" in r}
    # trained steps 1..3 are training steps 0..2, before the switch: text and code only
    # (data/token_share is the loader's window, which includes the batch the trainer stages one
    # step ahead: the logged step 3 already sees the switch's first batch; the trace below is exact)
    assert all(rows[s]["data/token_share/image"] == 0 for s in (1, 2)), rows
    assert any(rows[s]["data/token_share/image"] > 0 for s in (4, 5, 6)), "the full mix never came"
    trace = _trace(whole)
    assert {p[0][0] for s in (1, 2, 3) for p in trace[s]} == {0}  # the text-and-code copy only
    assert min(s for s, pieces in trace.items() if any(p[0][0] == 1 for p in pieces)) >= 4

    cut = tmp_path / "cut"
    assert train_tiny(cut, shards, tok, *common, "train.num_steps=2") == 0  # stopped before the switch
    assert train_tiny(cut, shards, tok, *common, "train.num_steps=6", "checkpoint.resume=auto") == 0
    assert _trace(cut) == trace

    other = tmp_path / "other"  # another schedule cannot continue this run's data
    assert train_tiny(other, shards, tok, *common, "train.num_steps=2") == 0
    assert train_tiny(other, shards, tok, *common[:-2], "data.text_first_steps=4", "train.grad_accum_steps=2",
                      "train.num_steps=4", "checkpoint.resume=auto") == 2
