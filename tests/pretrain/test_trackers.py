"""Issue 41 item 1: experiment trackers (`logging.trackers`): W&B (offline) and MLflow (its local
file store) get the run config and every scalar metric at every step, under names each accepts;
a resumed run logs into the same tracker run; a typo or a missing package fails at start."""

from __future__ import annotations

import glob
import importlib.util
import json
import struct
from pathlib import Path

import pytest

from omniloom.pretrain.config.run import load_config
from omniloom.pretrain.rundir import METRICS, read_metrics
from omniloom.pretrain.train.trackers import scalars, tracker_name

_spec = importlib.util.spec_from_file_location("train_standin", Path(__file__).resolve().parents[1] / "support" / "train_standin.py")
standin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(standin)


@pytest.fixture(autouse=True)
def _fresh_accelerate_state(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    yield
    standin.reset_accelerate()


def test_metric_names_are_one_group_deep_so_no_name_is_also_a_folder():
    """MLflow's file store failed on `loss` beside `loss/text` (a file and a folder of one name)."""
    assert tracker_name("loss") == "train/loss"
    assert tracker_name("loss/text") == "loss/text"
    assert tracker_name("eval/loss/text") == "eval/loss_text"
    assert tracker_name("moe/max_over_mean/layer0") == "moe/max_over_mean_layer0"
    assert tracker_name("a b:c") == "train/a b_c"
    keys = ["loss", "loss/text", "eval/loss", "eval/loss/text", "moe/max_over_mean", "moe/max_over_mean/layer0/text"]
    names = [tracker_name(k) for k in keys]
    assert len(set(names)) == len(names)
    assert all(n.count("/") == 1 for n in names)
    got = scalars({"loss": 1.5, "moe/counts_LME": [[[1, 2]]], "flag": True, "bad": float("nan"), "step": 3, "n": 2})
    assert got == {"train/loss": 1.5, "train/n": 2}


def test_tracker_names_are_checked_when_the_config_is_read():
    with pytest.raises(ValueError, match=r"logging.trackers: unknown tracker 'wandbb' \(did you mean 'wandb'\?\)"):
        load_config(None, ["logging.trackers=[wandbb]"])
    with pytest.raises(ValueError, match="names 'mlflow' twice"):
        load_config(None, ["logging.trackers=[mlflow, mlflow]"])
    assert load_config(None, []).logging.trackers == ["tensorboard"]
    # the key from before logging.trackers still works
    assert load_config(None, ["logging.tensorboard=false"]).logging.trackers == []
    assert load_config(None, ["logging.trackers=[wandb]", "logging.tensorboard=true"]).logging.trackers == ["tensorboard", "wandb"]


def test_a_tracker_whose_package_is_missing_fails_before_the_model_is_built(tmp_path, monkeypatch):
    built = []
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "aim" else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"logging.trackers names 'aim', but the aim package is not installed: pip install aim"):
        standin.standin_trainer(tmp_path, "logging.trackers=[aim]", build_model=lambda cfg: built.append(cfg))
    assert not built


def _wandb_records(path: str):
    """The records of a W&B offline run file (a LevelDB-style log of protobuf records: 32 KiB
    blocks of [crc32, length, type] chunks after a 7-byte header), as (kind, record) pairs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, pending, block = 7, b"", 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            yield rec.WhichOneof("record_type"), rec


def _wandb_history(run_folder: str) -> tuple[dict, dict]:
    steps, config = {}, {}
    (path,) = glob.glob(str(Path(run_folder) / "run-*.wandb"))
    for kind, rec in _wandb_records(path):
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            steps.setdefault(items["_step"], {}).update(items)
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in rec.config.update if i.key})
    return steps, config


def _expected(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: scalars(row) for row in read_metrics(run_dir / METRICS)}


def test_wandb_offline_gets_the_config_and_every_scalar_at_every_step_and_resumes_into_its_run(tmp_path):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'omniloom[trackers]')")
    standin.standin_trainer(tmp_path, "logging.trackers=[wandb]", "train.num_steps=4", "logging.every=2",
                            "logging.run_name=first").fit()
    run_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]
    standin.reset_accelerate()
    standin.standin_trainer(tmp_path, "logging.trackers=[wandb]", "train.num_steps=6", "logging.every=2",
                            "checkpoint.resume=auto").fit()
    assert json.loads((tmp_path / "trackers.json").read_text())["wandb"] == run_id
    # offline, W&B writes the resumed part into a second folder of the same run id (`wandb sync`
    # uploads both into the one run)
    runs = sorted(glob.glob(str(tmp_path / "wandb" / "offline-run-*")))
    assert len(runs) == 2 and all(r.endswith(run_id) for r in runs), runs
    (steps, config), (later, _) = _wandb_history(runs[0]), _wandb_history(runs[1])
    assert sorted(steps) == [1, 2, 3, 4] and sorted(later) == [5, 6]
    steps.update(later)
    expected = _expected(tmp_path)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    for step, values in expected.items():
        assert {k: steps[step][k] for k in values} == pytest.approx(values), step
    assert "moe/counts_LME" not in steps[2] and any(k.startswith("moe/expert_load") for k in steps[2])
    assert config["train"]["num_steps"] == 4 and config["logging"]["trackers"] == ["wandb"]


def test_mlflow_file_store_gets_the_config_and_every_scalar_at_every_step_and_resumes_into_its_run(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install 'omniloom[trackers]')")
    from mlflow.tracking import MlflowClient

    standin.standin_trainer(tmp_path, "logging.trackers=[mlflow]", "train.num_steps=4", "logging.every=2",
                            "logging.project=proj").fit()
    standin.reset_accelerate()
    standin.standin_trainer(tmp_path, "logging.trackers=[mlflow]", "train.num_steps=6", "logging.every=2",
                            "logging.project=proj", "checkpoint.resume=auto").fit()
    client = MlflowClient(tracking_uri=(tmp_path / "mlflow").resolve().as_uri())
    (exp,) = [e for e in client.search_experiments() if e.name == "proj"]
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_id == json.loads((tmp_path / "trackers.json").read_text())["mlflow"]
    assert run.info.run_name == tmp_path.name
    assert run.data.params["train.num_steps"] == "4" and run.data.params["data.seq_len"] == "16"
    expected = _expected(tmp_path)
    assert sorted(expected) == [1, 2, 3, 4, 5, 6]
    names = {name for values in expected.values() for name in values}
    assert {"train/loss", "loss/text", "moe/max_over_mean_layer0_text"} <= names
    history = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)} for name in names}
    for step, values in expected.items():
        for name, value in values.items():
            assert history[name][step] == pytest.approx(value), (name, step)
