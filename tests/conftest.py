"""Shared pytest setup: `gpu` tests skip without CUDA; `slow` tests are opt-in."""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    run_slow = config.getoption("--run-slow") or os.environ.get("OMNILOOM_RUN_SLOW") == "1"
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # torch missing or broken: gpu tests cannot run either way
        has_cuda = False
    skip_slow = pytest.mark.skip(reason="slow: pass --run-slow or set OMNILOOM_RUN_SLOW=1")
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(skip_slow)
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
