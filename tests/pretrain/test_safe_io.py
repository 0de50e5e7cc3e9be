"""Safetensors sharding round trip and refusal of malicious pickles."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from omniloom.model.pretrained import read_safetensors
from omniloom.pretrain.checkpoint.safe_io import INDEX_NAME, parse_size, safe_torch_load, save_sharded


def _state():
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.w": torch.randn(64, 32, generator=g) for i in range(5)} | {"head": torch.randn(10, 32, generator=g)}


def test_single_file_round_trip(tmp_path):
    state = _state()
    paths = save_sharded(state, tmp_path, metadata={"format": "pt"})
    assert [p.name for p in paths] == ["model.safetensors"]
    back = read_safetensors(tmp_path)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_sharded_above_limit(tmp_path):
    state = _state()
    paths = save_sharded(state, tmp_path, max_shard_size="10KB", metadata={"omniloom_version": "x"})
    assert len(paths) > 2
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(state) and index["metadata"]["omniloom_version"] == "x"
    back = read_safetensors(tmp_path)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # re-export with one file removes the stale shards and index
    save_sharded(state, tmp_path)
    assert not (tmp_path / INDEX_NAME).exists() and len(list(tmp_path.glob("*.safetensors"))) == 1


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2MiB") == 2 * 2**20 and parse_size("100") == 100
    with pytest.raises(ValueError, match="500MB"):
        parse_size("lots")


class _Evil:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


def test_malicious_pickle_is_refused(tmp_path):
    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        pickle.dump({"w": torch.zeros(2), "x": _Evil()}, f)
    with pytest.raises(ValueError, match="refusing to load"):
        safe_torch_load(path)
    ok = tmp_path / "ok.pt"
    torch.save({"w": torch.ones(3), "step": 4}, ok)
    assert safe_torch_load(ok)["step"] == 4


@pytest.fixture
def umask_027():
    import os

    old = os.umask(0o027)
    try:
        yield 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("limit", ["5GB", "10KB"])
def test_written_weights_honour_the_umask(tmp_path, umask_027, limit):
    """Issue 14 item 20: safetensors writes 0600 whatever the umask; every other file gets 0666 & ~umask."""
    import os

    paths = save_sharded(_state(), tmp_path, max_shard_size=limit)
    assert paths
    for p in tmp_path.iterdir():
        assert os.stat(p).st_mode & 0o777 == umask_027, (p.name, oct(os.stat(p).st_mode))
