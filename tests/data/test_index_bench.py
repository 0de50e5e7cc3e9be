"""`omniloom bench data --index` runs both halves against their references in alternating rounds
and reports medians (the figures in BENCHMARKS.md); a tiny run checks the report's shape."""

from __future__ import annotations

import shutil

import pytest

from omniloom.data.prep.foreign_bench import make_foreign_inputs
from omniloom.data.prep.index import index_vs_tar_tf
from omniloom.data.stream.index_bench import loader_vs_webdataset


@pytest.mark.skipif(shutil.which("tar") is None, reason="needs the tar command")
def test_index_bench_alternates_rounds_and_reports_medians(tmp_path):
    made = make_foreign_inputs(str(tmp_path), samples=12, records=1, image_size=32, shard_samples=6)
    out = str(tmp_path / "index")
    ix = index_vs_tar_tf(made["shards"], out, rounds=2)
    assert ix["rounds"] == 2 and ix["index_s_per_shard"] > 0 and ix["tar_tf_s_per_shard"] > 0 and ix["ratio"] > 0
    ld = loader_vs_webdataset(out, made["shards"], rounds=2)
    assert ld["samples"] == 12 and ld["rounds"] == 2 and ld["loader_sps"] > 0 and ld["webdataset_sps"] > 0 and ld["ratio"] > 0
