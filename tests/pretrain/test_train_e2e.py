"""From shards to falling loss with the real model and data stream, in one `omniloom train` command
(tiny preset, shrunk by overrides so it fits the test budget on a shared CPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from omniloom.pretrain.checkpoint.manager import latest_checkpoint
from omniloom.pretrain.cli import main
from omniloom.pretrain.rundir import read_metrics

_spec = importlib.util.spec_from_file_location("proctree", (Path(__file__).resolve().parents[1] / "support" / "proctree.py"))
_proctree = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_proctree)
kill_tree = _proctree.kill_tree


@pytest.fixture(autouse=True)
def _fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState, PartialState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


@pytest.fixture(scope="module")
def shards_and_tokenizer(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    assert main(["-qq", "data", "demo-corpus", "--out", str(root / "corpus"), "--num-images", "6", "--num-videos", "2",
                 "--num-heldout-images", "4", "--num-heldout-videos", "2", "--num-interleaved", "2",
                 "--image-size", "32"]) == 0
    for split in ("train", "heldout"):
        assert main(["-qq", "data", "build", str(root / "corpus" / split), "--out", str(root / "shards" / split)]) == 0
    assert main(["-qq", "tokenizer", "train", "--data", str(root / "shards" / "train"), "--vocab-size", "512",
                 "--out", str(root / "tok"), "--threads", "1", "--image-patch-budget", "16",
                 "--video-frame-budget", "4", "--video-patch-budget", "8"]) == 0
    return root


def test_tiny_preset_trains_from_shards_to_falling_loss(shards_and_tokenizer, tmp_path):
    root = shards_and_tokenizer
    run_dir = tmp_path / "run"
    argv = ["-qq", "train", "--no-progress", "--run-dir", str(run_dir), "tiny",
            f"data.sources=[{{path: {root / 'shards' / 'train'}}}]",
            f"data.eval_sources=[{{path: {root / 'shards' / 'heldout'}}}]",
            f"data.tokenizer={root / 'tok'}", "data.seq_len=128", "data.batch_size=2", "data.num_workers=1",
            "model.dim=64", "model.num_heads=2", "model.num_kv_heads=1", "model.rope_sections=[8,12,12]",
            "model.attention.window=64", "model.moe.expert_dim=64", "model.moe.dense_dim=128",
            "model.attention.block_size=16",
            "optim.lr=1e-2", "optim.warmup_steps=2", "train.num_steps=14", "train.eval_every=14",
            "train.eval_steps=1", "checkpoint.every=7", "logging.every=7", "logging.trackers=[tensorboard]"]
    assert main(argv) == 0
    rows = read_metrics(run_dir / "metrics.jsonl")
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 14
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.3, losses
    last = [r for r in rows if "tokens_per_s" in r][-1]
    for key in ("loss/text", "moe/max_over_mean", "final_out_rms", "data/padding_fraction",
                "data/skipped_total", "data_wait_fraction"):
        assert key in last, key
    assert any("eval/loss/text" in r for r in rows)
    assert latest_checkpoint(run_dir / "checkpoints").name == "step_00000014"
    assert list((run_dir / "tb").rglob("events.out.tfevents*")), "no TensorBoard event file"


def _launch(run_dir, root, *extra):
    import sys
    from pathlib import Path

    from omniloom.pretrain.config.run import presets_dir

    return [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file",
            str(presets_dir() / "accelerate" / "cpu_2proc.yaml"), "--main_process_port", str(_proctree.free_port()),
            "-m", "omniloom.pretrain.train",
            "--config", "tiny", "--run-dir", str(run_dir), "--no-progress",
            f"data.sources=[{{path: {root / 'shards' / 'train'}}}]", f"data.tokenizer={root / 'tok'}",
            "data.seq_len=128", "data.batch_size=2", "data.num_workers=2", "model.dim=64", "model.num_heads=2",
            "model.num_kv_heads=1", "model.rope_sections=[8,12,12]", "model.attention.window=64",
            "model.moe.expert_dim=64", "model.moe.dense_dim=128", "model.attention.block_size=16",
            "optim.lr=1e-2", "optim.warmup_steps=2", "train.num_steps=10", "checkpoint.every=3",
            "logging.trackers=[]", "train.deterministic=true", *extra]


@pytest.mark.slow
def test_real_stack_sigkill_resume_matches_uninterrupted_2proc_2workers(shards_and_tokenizer, tmp_path):
    """The key acceptance with the real model and stream: 2 gloo processes x 2 loader workers,
    SIGKILL mid-run, `checkpoint.resume=auto`, and the loss at every step equals the uninterrupted run's."""
    import os
    import signal
    import subprocess
    import time

    root = shards_and_tokenizer
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def losses(run_dir):
        path = run_dir / "metrics.jsonl"
        return {r["step"]: r["loss"] for r in read_metrics(path) if "loss" in r} if path.exists() else {}

    ref = tmp_path / "ref"
    proc = subprocess.run(_launch(ref, root), env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(_launch(killed, root), env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and max(losses(killed), default=0) < 5:
            assert proc.poll() is None, "the run ended before it could be killed"
            time.sleep(0.02)
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
    assert 5 <= max(losses(killed)) < 10
    proc = subprocess.run(_launch(killed, root, "checkpoint.resume=auto"), env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert losses(killed) == losses(ref) and sorted(losses(ref)) == list(range(1, 11))
