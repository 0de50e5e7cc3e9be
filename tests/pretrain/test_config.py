"""Typed configs: YAML round trip, overrides, helpful errors."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from omniloom.pretrain.config.run import ConfigError, RunConfig, load_config, to_yaml
from omniloom.pretrain.config.io import from_dict, parse_override


def test_defaults_round_trip_through_yaml(tmp_path):
    cfg = load_config("tiny", ["model.num_layers=6", "optim.betas=[0.9,0.99]"])
    path = tmp_path / "run.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config(str(path))
    assert again == cfg
    assert again.model.num_layers == 6 and again.optim.betas == (0.9, 0.99)
    assert isinstance(again.model.rope_sections, tuple)


def test_every_shipped_preset_loads_and_round_trips(tmp_path):
    from omniloom.pretrain.config.run import list_presets

    for name in list_presets():
        cfg = load_config(name)
        path = tmp_path / f"{name}.yaml"
        path.write_text(to_yaml(cfg))
        assert load_config(str(path)) == cfg, name


def test_every_shipped_preset_holds_the_default_tokenizers_largest_blocks():
    """Issue 28.4: a preset's rows hold the largest image and video block a tokenizer trained with
    the default settings makes (tiny's seq_len 512 against a 514-token video block warned on every
    run, with or without video in the data)."""
    import warnings

    from omniloom.data.config import check_visual_budget
    from omniloom.pretrain.config.run import list_presets
    from omniloom.tokenizers.settings import MediaSettings

    media = MediaSettings()
    for name in list_presets():
        seq_len = load_config(name).data.seq_len
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            too_short = check_visual_budget(seq_len, max_image_patches=media.image_patch_budget,
                                            max_video_patches=media.max_video_patches)
        assert too_short == [], f"preset {name}: {too_short}"


def test_override_parsing():
    assert parse_override("model.num_layers=4") == (["model", "num_layers"], 4)
    assert load_config(None, ["optim.lr=1e-3"]).optim.lr == 1e-3  # YAML 1.1 reads 1e-3 as a string
    assert parse_override("train.run_dir=runs/x") == (["train", "run_dir"], "runs/x")
    assert parse_override("model.attention.pattern=LG") == (["model", "attention", "pattern"], "LG")
    with pytest.raises(ConfigError, match="key.path=value"):
        parse_override("model.num_layers")


def test_override_sets_nested_values_and_float_accepts_int():
    cfg = load_config(None, ["model.attention.window=64", "optim.lr=1"])
    assert cfg.model.attention.window == 64
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)


def test_unknown_key_names_key_file_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  num_layer: 3\n")
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    msg = str(err.value)
    assert "model.num_layer" in msg and str(path) in msg and "model.num_layers" in msg


def test_unknown_override_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'optim.warmup_steps'"):
        load_config("tiny", ["optim.warmup_step=3"])


def test_bad_type_names_key_and_origin(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  num_steps: lots\n")
    with pytest.raises(ConfigError, match=r"'train.num_steps' \(from .*bad.yaml\) expects an int"):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"'train.num_steps' \(from command line\) expects an int"):
        load_config("tiny", ["train.num_steps=1.5"])
    with pytest.raises(ConfigError, match="must be one of"):
        load_config(None, ["model.attention.backend=dense"])
    with pytest.raises(ConfigError, match="expects a bool"):
        load_config(None, ["train.deterministic=3"])


def test_configs_are_keyword_only():
    for cls in (RunConfig,):
        with pytest.raises(TypeError):
            cls(None)  # type: ignore[misc]
    assert all(f.kw_only for f in dataclasses.fields(RunConfig))


def test_list_of_dataclasses_loads():
    cfg = from_dict(RunConfig, {"data": {"sources": [{"path": "/x", "weight": 2}]}})
    assert cfg.data.sources[0].path == "/x" and cfg.data.sources[0].weight == 2.0
    with pytest.raises(ConfigError, match="data.sources\\[0\\]"):
        from_dict(RunConfig, {"data": {"sources": [{"pth": "/x"}]}})
    assert yaml.safe_load(to_yaml(cfg))["data"]["sources"][0]["path"] == "/x"


def test_a_source_may_be_given_as_a_path_a_comma_list_or_a_glob(tmp_path, monkeypatch):
    """Issue 41 item 5: `data.sources=shards/train` was refused (it needed YAML flow syntax)."""
    from omniloom.data.stream.reader import _expand

    def paths(text, key="sources"):
        cfg = load_config(None, [f"data.{key}={text}"])
        return [(s.path, s.weight) for s in getattr(cfg.data, key)]

    assert paths("shards/train") == [("shards/train", 1.0)]
    assert paths("shards/a, shards/b") == [("shards/a", 1.0), ("shards/b", 1.0)]
    assert paths("https://h/x-{000000..000003}.tar,/d/y-{a,b}.tar") == [
        ("https://h/x-{000000..000003}.tar", 1.0), ("/d/y-{a,b}.tar", 1.0)]
    assert paths("val", key="eval_sources") == [("val", 1.0)]
    for name in ("b", "a"):
        (tmp_path / name).mkdir()
        for i in range(2):
            (tmp_path / name / f"s-{i}.tar").write_bytes(b"")
    assert paths(f"{tmp_path}/*") == [(f"{tmp_path}/a", 1.0), (f"{tmp_path}/b", 1.0)]  # a folder each
    assert paths(f"{tmp_path}/a/s-*.tar") == [(f"{tmp_path}/a/s-*.tar", 1.0)]  # shard files: one source
    assert _expand(f"{tmp_path}/a/s-*.tar") == [f"{tmp_path}/a/s-0.tar", f"{tmp_path}/a/s-1.tar"]
    with pytest.raises(ValueError, match=r"data.sources.*'/nowhere/\*' matches nothing"):
        load_config(None, ["data.sources=/nowhere/*"])
    # the long form still works
    assert load_config(None, ["data.sources=[{path: a, weight: 2}]"]).data.sources[0].weight == 2.0
