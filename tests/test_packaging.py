"""The distribution installs everything under `omniloom.*` and nothing under bare folder names."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ["pretrain", "data", "tokenizers", "model", "kernels", "configs"]


@pytest.mark.parametrize("name", PACKAGES)
def test_package_maps_to_its_folder(name):
    module = importlib.import_module(f"omniloom.{name}")
    assert Path(module.__file__).resolve().parent == REPO / name


def test_bare_names_do_not_resolve_to_repo_folders():
    # `tokenizers` and `kernels` are PyPI names; our folders must never shadow them.
    for name in ("tokenizers", "kernels", "model", "data", "pretrain"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            # Hugging Face's `tokenizers` installed into a venv inside the checkout is fine; the
            # repo's own folder is not
            assert (REPO / name).resolve() not in Path(spec.origin).resolve().parents, f"bare '{name}' resolves into the repo"


def test_presets_ship_as_package_data():
    from omniloom.pretrain.config.run import list_presets, presets_dir

    assert "tiny" in list_presets()
    assert (presets_dir() / "accelerate").is_dir()


def test_wheel_top_level_is_only_omniloom(tmp_path):
    # the build runs without isolation (no network), so this environment must meet
    # pyproject's build requirements itself: setuptools >= 68, and bdist_wheel (the `wheel`
    # package, or setuptools >= 70.1, which carries it)
    import setuptools

    major, minor = (int(p) for p in setuptools.__version__.split(".")[:2])
    has_bdist_wheel = (major, minor) >= (70, 1) or importlib.util.find_spec("wheel") is not None
    if major < 68 or not has_bdist_wheel:
        pytest.skip(f"setuptools {setuptools.__version__} here cannot build the wheel offline: pip install 'setuptools>=70.1'")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("omniloom-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names if not n.split("/", 1)[0].endswith(".dist-info")}
    assert tops == {"omniloom"}, tops
    assert "omniloom/tokenizers/__init__.py" in names
    # the Hugging Face wrappers an export copies (package data, issue 26)
    assert {"omniloom/pretrain/export/hf/remote/modeling_omniloom.py", "omniloom/pretrain/export/hf/remote/kernels_ops.py"} <= set(names)
    assert "omniloom/configs/tiny.yaml" in names
    assert any(n.startswith("omniloom/configs/accelerate/") for n in names)
