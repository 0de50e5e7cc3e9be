"""Helpers for tests that run an export through Hugging Face in hf_worker.py (a `python -I`
process outside the checkout where omniloom cannot be imported). Loaded by file path
(importlib), as the tests' other helpers are."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

WORKER = Path(__file__).with_name("hf_worker.py")


def hf_env(cache: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_"))}
    env.update(HF_MODULES_CACHE=str(cache / "modules"), HF_HOME=str(cache / "home"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return env


def run_worker(runs: dict, workdir: Path, inputs: dict | None = None) -> dict:
    """Run hf_worker.py in a fresh `python -I` outside the checkout; its results by run name.
    runs: {name: {"export": DIR, "tasks": [(task, arg), ...]}}."""
    workdir.mkdir(parents=True, exist_ok=True)
    request = {"runs": {k: {"export": str(v["export"]), "tasks": v["tasks"]} for k, v in runs.items()}, "inputs": None}
    if inputs is not None:
        request["inputs"] = str(workdir / "inputs.pt")
        torch.save(inputs, request["inputs"])
    (workdir / "request.json").write_text(json.dumps(request))
    res = subprocess.run([sys.executable, "-I", str(WORKER), str(workdir / "request.json"), str(workdir / "out.pt")],
                         cwd=workdir, env=hf_env(workdir), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return torch.load(workdir / "out.pt", weights_only=True)


def assert_hf_logits_match(export: Path, workdir: Path) -> None:
    """The export loads in Hugging Face (omniloom not importable there) and gives load_pretrained's
    logits on a random packed batch with images and videos, within 1e-5."""
    from omniloom.model.pretrained import load_pretrained
    from omniloom.model.synthetic import random_packed_batch

    model = load_pretrained(export)
    batch = random_packed_batch(model.cfg, batch_size=2, seq_len=64, docs_per_row=2, image_grid=(1, 2, 3),
                                video_grid=(2, 2, 2), seed=3)
    fields = ("input_ids", "positions", "doc_ids", "block_ids", "modality", "patches", "patch_kind")
    res = run_worker({"x": {"export": export, "tasks": [["omniloom_absent", None], ["logits", "b"]]}}, workdir,
                     {f"b.{k}": batch[k] for k in fields})["x"]
    assert "No module named 'omniloom'" in res["omniloom_absent"]["error"]
    with torch.no_grad():
        want = model(**batch, return_logits=True).logits
    torch.testing.assert_close(res["logits"]["logits"], want, rtol=0, atol=1e-5)
