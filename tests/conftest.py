"""Shared pytest setup: `gpu` tests skip without CUDA; `slow` tests are opt-in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# `python -m pytest` from the repository root puts the working directory first on sys.path, where
# the repo's tokenizers/ and kernels/ folders would shadow Hugging Face's `tokenizers` (which
# transformers imports) and PyPI's `kernels`. omniloom itself is imported as `omniloom.*` through
# its install, never from the root, so the root comes off the path.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _ROOT]


@pytest.fixture(autouse=True)
def _restore_process_settings():
    """`omniloom.pretrain.cli.main` configures the process it runs in: the root logger (a handler
    on the stderr of the moment), the `omniloom` logger's level and torch's thread count. In a test that stream is
    pytest's capture, closed when the test ends (a later test's INFO line would print '--- Logging
    error ---'), and a changed thread count would change the tests after it."""
    import logging

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    own = logging.getLogger("omniloom")  # setup_logging sets omniloom's level apart from the root's
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch is not None else None
    yield
    if threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    for h in handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(level)
    # back to the session's start, not to the level before this test: a module-scoped fixture that
    # runs the CLI (`-qq`) is set up before this fixture records anything, and would leak ERROR
    own.setLevel(logging.NOTSET)


@pytest.fixture
def one_torch_thread():
    """Tiny decode-sized ops: on a shared CPU, OpenMP thread hand-offs cost more than the math.
    A module opts in with `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """A tiny trained omniloom Tokenizer (tokenizers/testing.py), once per test module (a module
    may define its own `tok`)."""
    from omniloom.tokenizers.testing import make_tiny_tokenizer

    return make_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def train_tiny():
    """`omniloom train tiny` in this process on a small model (width 64, 128-token rows, 2 steps by
    default; `overrides` after these win; `verbosity` "-qq" unless given: "-v" to read the log), for
    tests that need a real run on their data. Returns
    the exit code; accelerate's process-wide state is reset after, so the next test starts clean."""

    def run(run_dir, sources, tokenizer, *overrides, verbosity: str = "-qq") -> int:
        from accelerate.state import AcceleratorState, GradientState, PartialState

        from omniloom.pretrain.cli import main

        paths = ", ".join(f"{{path: {s}}}" for s in ([sources] if isinstance(sources, (str, Path)) else sources))
        try:
            return main([verbosity, "train", "--no-progress", "--run-dir", str(run_dir), "tiny", f"data.sources=[{paths}]",
                         f"data.tokenizer={tokenizer}", "data.seq_len=128", "data.batch_size=2", "data.num_workers=0",
                         "model.dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.rope_sections=[8,12,12]",
                         "model.attention.window=64", "model.attention.block_size=16", "model.moe.expert_dim=64",
                         "model.moe.dense_dim=128", "train.num_steps=2", "checkpoint.every=2", "logging.every=1",
                         "logging.trackers=[]", *overrides])
        finally:
            AcceleratorState._reset_state(True)
            GradientState._reset_state()
            PartialState._reset_state()

    return run


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
