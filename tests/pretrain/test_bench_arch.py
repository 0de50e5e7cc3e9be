"""Issue 42: `omniloom bench arch`, the architecture comparison at equal training FLOPs: the step
computation, the dense width at the MoE's active compute, and a smoke run of 2 arms x 2 seeds on
built shards (with an arm the config cannot express, skipped with a line)."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import numpy as np
import pytest

from omniloom.model.accounting import num_active_params
from omniloom.model.config import ModelConfig, MoEConfig
from omniloom.pretrain.bench.arch import (ARMS, bench_arch, dense_equal_active_width, equal_flops_steps, parse_arm,
                                          plan_point)
from omniloom.pretrain.cli import main

TINY = ["data.seq_len=128", "data.batch_size=2", "data.num_workers=0", "model.dim=32", "model.num_heads=2",
        "model.num_kv_heads=1", "model.num_layers=2", "model.rope_sections=[4,6,6]", "model.attention.pattern=LG",
        "model.attention.window=64", "model.attention.block_size=16", "model.moe.num_experts=4",
        "model.moe.expert_dim=32", "model.moe.dense_dim=64", "optim.warmup_steps=1"]


def test_equal_flops_steps_spend_the_budget():
    assert equal_flops_steps(1e9, 1e3, 1000) == 1000
    assert equal_flops_steps(1e9, 2e3, 1000) == 500  # twice the FLOPs per token: half the steps
    assert equal_flops_steps(1e9, 3e3, 1000) == 333
    assert equal_flops_steps(1.0, 1e3, 1000) == 1  # at least one step
    with pytest.raises(ValueError):
        equal_flops_steps(0, 1e3, 1000)


@pytest.mark.parametrize("moe", [MoEConfig(), MoEConfig(num_experts=16, num_experts_per_token=4, expert_dim=96, num_dense_layers=2),
                                 MoEConfig(num_shared_experts=0, num_dense_layers=0)])
def test_the_dense_arm_matches_the_moe_active_parameters(moe):
    cfg = ModelConfig(dim=128, num_layers=4, num_heads=4, rope_sections=(8, 12, 12), vocab_size=1000, patch_token_id=8, moe=moe)
    width = dense_equal_active_width(cfg)
    dense = dataclasses.replace(cfg, moe=dataclasses.replace(moe, num_experts=0, dense_dim=width))
    step = 3 * cfg.dim * cfg.num_layers  # one more unit of width
    assert abs(num_active_params(dense) - num_active_params(cfg)) <= step / 2
    assert dense.num_moe_layers == 0


def test_arms_are_data():
    assert parse_arm("early_moe") is ARMS["early_moe"]
    wide = parse_arm("wide:model.moe.expert_dim=64,model.dim=64")
    assert wide.overrides == ("model.moe.expert_dim=64", "model.dim=64")
    with pytest.raises(ValueError, match="unknown arm"):
        parse_arm("early_mo")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from omniloom.data.prep.demo_corpus import DemoCorpusSettings, _captioned_set
    from omniloom.tokenizers.testing import SAMPLE_PROSE, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("bench_arch")
    lines, rng = SAMPLE_PROSE.splitlines(), random.Random(0)
    for part, n in (("train", 24), ("held", 6)):
        _captioned_set(root / part, "shapes", np.random.default_rng(len(part)), n, DemoCorpusSettings(image_size=32), video=False)
        (root / part / "prose").mkdir()
        for i in range(n):
            (root / part / "prose" / f"d{i:03d}.txt").write_text(" ".join(rng.choice(lines) for _ in range(rng.randint(1, 4))))
        assert main(["-qq", "data", "build", str(root / part / "shapes.jsonl"), str(root / part / "prose"),
                     "--out", str(root / part / "shards"), "--shuffle", "0"]) == 0
    make_tiny_tokenizer(root / "tok")
    return str(root / "train" / "shards"), str(root / "held" / "shards"), str(root / "tok")


def test_bench_arch_smoke_two_arms_two_seeds(shards, tmp_path):
    train, held, tok = shards
    base = [f"data.sources=[{{path: {train}}}]", f"data.tokenizer={tok}", *TINY]
    one = plan_point("tiny", base, ARMS["early_moe"], None, 0, 1.0)
    budget = 4 * one.flops_per_token * one.tokens_per_step  # four steps of early_moe
    arms = [ARMS["early_moe"], ARMS["late_moe"], parse_arm("wide:model.moe.expert_dim=96,model.moe.dense_dim=192")]
    said: list[str] = []
    kw = dict(preset="tiny", overrides=TINY, arms=arms, sizes=[], seeds=2, budget=budget, train=[train], heldout=held,
              tokenizer=tok, eval_points=2, max_eval_docs=8, say=said.append)
    t0 = time.perf_counter()
    result = bench_arch(tmp_path, **kw)
    assert time.perf_counter() - t0 < 120
    arms_out = {a["label"]: a for a in result["arms"]}
    assert set(arms_out) == {"early_moe", "late_moe", "wide"}
    # the encoder's FLOPs count (the share of patch tokens measured on the training stream)
    mix = next(line for line in said if line.startswith("visual tokens: "))
    assert "0.0%" not in mix, mix
    cols = [k for k, _ in result["columns"]]
    for key in ("loss/all", "loss/text", "loss/text_only_docs", "exact/image", "attr/image/colour",
                "train_flops", "params", "active_params", "tokens_per_s"):
        assert key in cols, key
        for a in arms_out.values():
            s = a["figures"][key]
            assert s["n"] == 2 and set(s) == {"mean", "std", "min", "max", "n"}
    # equal training FLOPs: steps inversely proportional to FLOPs per token (to the nearest step)
    fpt = {k: a["figures"]["flops_per_token"]["mean"] for k, a in arms_out.items()}
    steps = {k: a["figures"]["steps"]["mean"] for k, a in arms_out.items()}
    assert fpt["wide"] > fpt["early_moe"] and steps["wide"] < steps["early_moe"] == 4
    assert fpt["late_moe"] > fpt["early_moe"]  # the steps follow from it by the budget check below
    for k in arms_out:
        assert abs(steps[k] * fpt[k] * one.tokens_per_step - budget) <= fpt[k] * one.tokens_per_step / 2
    # the curve: the evaluations during training, on the first held-out set, mean and spread over seeds
    for a in arms_out.values():
        assert f"data.eval_sources=[{{path: {held}}}]" in a["overrides"]
        assert len(a["curve"]) >= 2 and all(len(c) == 3 and c[1] > 0 and c[2] >= 0 for c in a["curve"]), a["curve"]
        assert [c[0] for c in a["curve"]] == sorted(c[0] for c in a["curve"])
    md = (tmp_path / "arch.md").read_text()
    assert "| arm | seeds |" in md and "±" in md and "loss text-only docs" in md
    assert json.loads((tmp_path / "arch.json").read_text())["format"] == "omniloom-bench-arch/1"
    assert (tmp_path / "loss_vs_flops.png").stat().st_size > 0
    # a rerun trains nothing: every point is done
    said.clear()
    assert bench_arch(tmp_path, **kw)["arms"] == result["arms"]
    assert not [line for line in said if line.startswith("train ")], said


def test_plan_derives_the_dense_and_text_first_arms_and_trains_identical_configs_once(shards):
    from omniloom.pretrain.bench.arch import plan

    train, _, tok = shards
    base = [f"data.sources=[{{path: {train}}}]", f"data.tokenizer={tok}", *TINY]
    said: list[str] = []
    points = plan("tiny", base, [ARMS[a] for a in ("early_moe", "early_dense", "moe_no_grouping", "text_first")],
                  [], 1, 1e9, say=said.append)
    by = {p.arm: p for p in points}
    dense = by["early_dense"]
    assert "model.moe.num_experts=0" in dense.overrides
    assert abs(dense.active_params - by["early_moe"].active_params) <= 3 * 32 * 2 / 2
    assert by["moe_no_grouping"].same_as == "early_moe/seed0"  # tiny has no modality groups: the same runs
    assert any("moe_no_grouping has the config of early_moe" in line for line in said)
    tf = by["text_first"]
    assert f"data.text_first_steps={round(0.3 * tf.steps)}" in tf.overrides and tf.steps == by["early_moe"].steps


def test_the_digits_corpus_is_real_labelled_pictures_with_their_captions(tmp_path):
    """`--corpus digits` (issue 42: real pictures from a package): scikit-learn's digits become
    one picture + caption per document, every fifth held out, the pixels upscaled, not invented."""
    pytest.importorskip("sklearn", reason="scikit-learn is not installed (pip install scikit-learn)")
    from PIL import Image
    from sklearn.datasets import load_digits

    from omniloom.pretrain.bench.arch_digits import WORDS, _write_corpus

    _write_corpus(tmp_path)
    digits = load_digits()
    rows = {part: [json.loads(x) for x in (tmp_path / part / "digits.jsonl").read_text().splitlines()]
            for part in ("train", "heldout")}
    assert len(rows["train"]) + len(rows["heldout"]) == len(digits.target) == 1797
    assert len(rows["heldout"]) == 1797 // 5
    doc = rows["heldout"][0]
    i, label = int(doc["meta"]["source"].split("/")[1]), doc["meta"]["label"]
    assert i == 4 and label == digits.target[4]
    assert doc["segments"][1] == {"type": "text", "text": f"a handwritten digit {WORDS[label]}."}
    img = np.asarray(Image.open(tmp_path / "heldout" / doc["segments"][0]["ref"]))
    assert img.shape == (64, 64, 3)
    np.testing.assert_array_equal(img[::8, ::8, 0], np.clip(digits.images[4] * (255.0 / 16.0), 0, 255).astype(np.uint8))
    assert list((tmp_path / "text_heldout").iterdir()) and list((tmp_path / "text_train").iterdir())
