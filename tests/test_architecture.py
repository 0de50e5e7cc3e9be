"""The house's import rules (docs/architecture.md), read from the source with `ast`: every import
statement of every module, at module level or inside a function, is checked. A new module that
belongs to no room fails here until docs/architecture.md and LAYERS below say where it lives."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("kernels", "model", "tokenizers", "data", "pretrain", "configs")

# Across rooms: which other rooms each may import (its own always).
ROOM_MAY_IMPORT = {
    "kernels": set(),
    "model": {"kernels"},
    "tokenizers": set(),
    "data": {"tokenizers"},
    "pretrain": {"kernels", "model", "tokenizers", "data", "configs"},
    "configs": set(),
}

# pretrain/, lowest layer first: a module imports only its own layer or lower ones, less FORBIDDEN.
LAYERS = {
    "console": 1, "rundir": 1, "config": 1,
    "runtime": 2, "checkpoint": 2,
    "train": 3,
    "export": 4,
    "inference": 5,
    "bench": 6, "report": 6, "demo": 6,
    "cli": 7,
}
FORBIDDEN = {"export": {"train"}, "inference": {"train", "export"}}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return "omniloom." + ".".join(parts)


def all_modules() -> dict[str, Path]:
    found = {}
    for room in ROOMS:
        for path in sorted((ROOT / room).rglob("*.py")):
            if "remote" in path.relative_to(ROOT).parts:  # the export's hand-written HF wrappers: not omniloom modules
                continue
            found[module_name(path)] = path
    return found


MODULES = all_modules()


def imports_of(name: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) for every omniloom module `path` imports; `from pkg import sub` counts as
    an import of the submodule `pkg.sub` when that is a module."""
    is_pkg = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("omniloom")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not target.startswith("omniloom"):
                continue
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in MODULES]
            out += [(node.lineno, s) for s in subs] or [(node.lineno, target)]
    return out


def room_of(module: str) -> str:
    return module.split(".")[1]


def pretrain_part(module: str) -> str | None:
    """The layer key of a pretrain module (its subfolder, or its file at the top), None for the package."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else None


def data_part(module: str) -> str:
    parts = module.split(".")
    return parts[2] if len(parts) > 3 or parts[2:3] in (["prep"], ["stream"]) else "root"


def violations() -> list[str]:
    bad = []
    for name, path in MODULES.items():
        room = room_of(name)
        where = f"{path.relative_to(ROOT)}"
        for line, target in imports_of(name, path):
            if target == "omniloom":
                continue
            other = room_of(target)
            if other != room and other not in ROOM_MAY_IMPORT[room]:
                bad.append(f"{where}:{line}: {room}/ imports {target} ({other}/ is not below it)")
                continue
            if room == "data" and other == "data":
                mine, theirs = data_part(name), data_part(target)
                if name == "omniloom.data.cli":
                    continue  # the dispatcher registers both prep and stream commands
                if (mine, theirs) in (("root", "prep"), ("root", "stream"), ("prep", "stream"), ("stream", "prep")):
                    bad.append(f"{where}:{line}: data/{mine} imports {target}")
            if room == "pretrain" and other == "pretrain":
                mine, theirs = pretrain_part(name), pretrain_part(target)
                if mine is None:  # the package itself (sets the OpenMP wait policy first)
                    continue
                if mine not in LAYERS:
                    continue  # test_every_pretrain_module_has_a_layer names it once
                if theirs is None or theirs == mine:
                    continue
                if theirs == "cli":
                    bad.append(f"{where}:{line}: imports pretrain/cli.py, which only dispatches (nothing imports it)")
                elif theirs not in LAYERS:
                    bad.append(f"{where}:{line}: imports {target}, in no layer")
                elif LAYERS[theirs] > LAYERS[mine] or theirs in FORBIDDEN.get(mine, ()):
                    bad.append(f"{where}:{line}: pretrain/{mine} (layer {LAYERS[mine]}) imports {target} "
                               f"(layer {LAYERS[theirs]})")
    return bad


def loaded_by_name(path: Path) -> set[str]:
    """Modules a file loads with importlib by their name: the string constants of a module-level
    tuple or list (the CLI dispatcher's COMMAND_MODULES) and the constant argument of
    `importlib.import_module(...)` that name a module (not the file's own, which a script names to
    start itself in a subprocess)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, (ast.Tuple, ast.List)):
            names |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
                and node.args and isinstance(node.args[0], ast.Constant)):
            names.add(node.args[0].value)
    return {n for n in names if n in MODULES and n != module_name(path)}


def cycles(prefix: str) -> list[list[str]]:
    """Import cycles among the modules under `prefix` (strongly connected components of two or
    more, or a module importing itself), with every import counted: lazy ones inside functions, and
    modules loaded by name."""
    graph = {n: sorted({t for _, t in imports_of(n, p) if t.startswith(prefix) and t in MODULES}
                       | {t for t in loaded_by_name(p) if t.startswith(prefix)})
             for n, p in MODULES.items() if n.startswith(prefix)}
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):  # Tarjan, iterative enough for a few hundred modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph[v]:
                comps.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return comps


def test_imports_follow_the_rooms_and_layers():
    bad = violations()
    assert not bad, "import rules broken (docs/architecture.md):\n" + "\n".join(bad)


@pytest.mark.parametrize("prefix", ["omniloom.pretrain", "omniloom.data"])
def test_no_import_cycles(prefix):
    found = cycles(prefix)
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_every_pretrain_module_has_a_layer():
    parts = {pretrain_part(n) for n in MODULES if room_of(n) == "pretrain"} - {None}
    assert parts <= set(LAYERS), f"pretrain/ holds {sorted(parts - set(LAYERS))}, in no layer of docs/architecture.md"


def test_the_rules_catch_a_climbing_import(tmp_path, monkeypatch):
    """The checker itself: a kernels module importing the model, and an export module importing the
    trainer, are both reported."""
    fake = {"omniloom.kernels.fake": tmp_path / "kernels" / "fake.py",
            "omniloom.pretrain.export.fake": tmp_path / "pretrain" / "export" / "fake.py"}
    for p in fake.values():
        p.parent.mkdir(parents=True)
    fake["omniloom.kernels.fake"].write_text("from omniloom.model.config import ModelConfig\n")
    fake["omniloom.pretrain.export.fake"].write_text("def f():\n    from omniloom.pretrain.train.loop import Trainer\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    monkeypatch.setitem(globals(), "MODULES", fake)
    bad = violations()
    assert any("kernels/ imports omniloom.model.config" in b for b in bad), bad
    assert any("pretrain/export (layer 4) imports omniloom.pretrain.train.loop (layer 3)" in b for b in bad), bad


def test_the_names_users_import_keep_working():
    """What README and docs promise survives the move: the package faces, and `python -m` of the
    trainer (a package whose __main__ runs it)."""
    import subprocess
    import sys

    from omniloom.data.stream import StreamLoader, build_loader  # noqa: F401
    from omniloom.model import OmniModel, load_pretrained  # noqa: F401
    from omniloom.pretrain.config import RunConfig, load_config  # noqa: F401
    from omniloom.pretrain.export import export_checkpoint, load_checkpoint_model, save_export  # noqa: F401
    from omniloom.pretrain.train import Trainer, main, run  # noqa: F401

    code = ("import runpy, sys; sys.argv = ['x', '--help']\n"
            "try:\n    runpy.run_module('omniloom.pretrain.train', run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "--config" in out.stdout and out.stdout.strip().endswith("exit 0"), out.stdout
