"""The Hugging Face remote code of an export, generated from omniloom's own modules at export time.

`transformers` runs a model it does not contain from Python files beside the weights
(`trust_remote_code=True`). Rather than a second, hand-kept model that would drift, an export
carries omniloom's own single-device modules, copied with their imports rewritten:

- module `omniloom.<pkg>.<mod>` becomes the file `<pkg>_<mod>.py` of the export folder, and every
  import of one (`from omniloom.model.x import ...` or `from .x import ...`) becomes
  `from .<pkg>_<mod> import ...`: Hugging Face's loader copies exactly the files that such a line
  names (its regex does not follow `from . import x`, so that form becomes two lines);
- the copies start from the thin hand-written wrappers in `remote/` (configuration, modeling,
  processing) and follow every omniloom import from there; a module with a hand-written stand-in
  in `remote/` (`kernels_ops.py`: the PyTorch reference ops only) is not copied, and a module in
  SUBSTITUTES is copied from another omniloom module (`tokenizers_text.py` from
  tokenizers/hf_text.py: the text tokenizer over the export's tokenizer.json, not SentencePiece);
- the files the model needs may import the standard library, torch, numpy, safetensors and
  transformers; the processor's may add Pillow and PyAV. Any other package (triton, accelerate,
  omniloom itself) is refused here at export time when imported at module level; inside a
  function (a backend the export never selects, such as flash-attn) the import is wrapped in
  try/except, which Hugging Face's import check skips and which fails only if that code runs.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

REMOTE_DIR = Path(__file__).resolve().with_name("remote")
PROJECT = "omniloom"
MODEL_ENTRIES = ("configuration_omniloom.py", "modeling_omniloom.py")
PROCESSOR_ENTRIES = ("processing_omniloom.py",)
MODEL_PACKAGES = frozenset({"torch", "numpy", "safetensors", "transformers"})
PROCESSOR_PACKAGES = MODEL_PACKAGES | {"PIL", "av"}
# export file stem -> the omniloom module copied under that name instead of its own
SUBSTITUTES = {"tokenizers_text": "omniloom.tokenizers.hf_text"}
# the lines Hugging Face's loader follows (transformers.dynamic_module_utils.get_relative_imports)
HF_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.(\S+)\s+import", flags=re.MULTILINE)


class RemoteCodeError(ValueError):
    """omniloom's modules cannot be carried into an export as they are (a developer's mistake)."""


def file_stem(module: str) -> str:
    """`omniloom.model.kv_cache` -> `model_kv_cache` (the file name in the export, without .py)."""
    parts = module.split(".")
    if len(parts) != 3 or parts[0] != PROJECT:
        raise RemoteCodeError(f"{module}: only modules omniloom.<package>.<module> can be copied into an export")
    return f"{parts[1]}_{parts[2]}"


def module_of(stem: str) -> str:
    """Inverse of file_stem (omniloom's package names hold no underscore)."""
    package, _, mod = stem.partition("_")
    return f"{PROJECT}.{package}.{mod}"


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _stand_ins() -> dict[str, Path]:
    return {p.stem: p for p in sorted(REMOTE_DIR.glob("*.py"))}


def _walk(node: ast.AST, in_try: bool = False, in_def: bool = False):
    """Every import node with (inside a try block, inside a function or class body)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_try, in_def
        yield from _walk(child, in_try or isinstance(child, ast.Try),
                         in_def or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))


def _internal_targets(node: ast.ImportFrom, package: str) -> tuple[str | None, list[tuple[str, str | None]]]:
    """For an import of omniloom code: (the module imported from, or None when the names are
    modules themselves; [(module or name, alias)]). ((None, []) for anything else.)"""
    if node.level > 1:
        raise RemoteCodeError(f"{package}: `from {'.' * node.level}{node.module or ''} import` reaches above its package")
    if node.level == 1:
        base = f"{package}.{node.module}" if node.module else package
    elif node.module and node.module.split(".")[0] == PROJECT:
        base = node.module
    else:
        return None, []
    if base.count(".") == 2:
        return base, [(a.name, a.asname) for a in node.names]
    # `from . import x` / `from omniloom.tokenizers import layout`: the names must be modules
    mods = []
    for a in node.names:
        if not _is_module(f"{base}.{a.name}"):
            raise RemoteCodeError(f"{package}: `{a.name}` imported from the package {base} is not a module; import it "
                                  "from the module that defines it")
        mods.append((f"{base}.{a.name}", a.asname or a.name))
    return None, mods


def rewrite_module(text: str, module: str, allowed: frozenset[str]) -> tuple[str, set[str]]:
    """One omniloom module's source with its imports rewritten for the export, and the omniloom
    modules it imports. Raises RemoteCodeError for an import the export cannot carry."""
    package = module.rpartition(".")[0]
    lines = text.splitlines(keepends=True)
    edits: list[tuple[int, int, str]] = []
    deps: set[str] = set()
    stdlib = sys.stdlib_module_names
    for node, in_try, in_def in _walk(ast.parse(text)):
        start, end = node.lineno - 1, node.end_lineno
        indent = lines[start][: node.col_offset]
        if indent.strip():
            raise RemoteCodeError(f"{module}:{node.lineno}: an import sharing its line with other code cannot be rewritten")
        if isinstance(node, ast.ImportFrom):
            base, names = _internal_targets(node, package)
            if base is not None:
                deps.add(base)
                listed = ", ".join(n if a is None else f"{n} as {a}" for n, a in names)
                edits.append((start, end, f"{indent}from .{file_stem(base)} import {listed}\n"))
                continue
            if names:
                new = []
                for target, alias in names:
                    deps.add(target)
                    stem = file_stem(target)
                    # the first line is for Hugging Face's loader, which copies the files such a line names
                    new.append(f"{indent}from .{stem} import __name__ as _hf_copies_{stem}  # noqa: F401\n")
                    new.append(f"{indent}from . import {stem} as {alias}\n")
                edits.append((start, end, "".join(new)))
                continue
            tops = [node.module.split(".")[0]] if node.module else []
        else:
            tops = [a.name.split(".")[0] for a in node.names]
            if PROJECT in tops:
                raise RemoteCodeError(f"{module}:{node.lineno}: write `from omniloom.x.y import name`, not `import omniloom...`")
        foreign = [t for t in tops if t not in stdlib and t not in allowed]
        if not foreign or in_try:
            continue
        if not in_def:
            raise RemoteCodeError(f"{module}:{node.lineno} imports {', '.join(foreign)} at module level, which a Hugging "
                                  f"Face export cannot require (it may use {', '.join(sorted(allowed))}); import it "
                                  "inside the function that needs it")
        body = "".join(lines[start:end])
        body = "".join(f"    {line}" if line.strip() else line for line in body.splitlines(keepends=True))
        edits.append((start, end, f"{indent}try:  # optional here: Hugging Face's import check skips try blocks\n{body}"
                                  f"{indent}except ImportError as err:\n"
                                  f"{indent}    raise ImportError(\"{foreign[0]} is not a requirement of this export: \" "
                                  f"+ str(err)) from err\n"))
    for start, end, new in sorted(edits, reverse=True):
        lines[start:end] = [new]
    return "".join(lines), deps


def _template_deps(text: str) -> set[str]:
    return {module_of(m) for m in HF_RELATIVE_IMPORT.findall(text) if "_" in m and m.split("_")[0] != "configuration"
            and not m.startswith(("modeling_", "processing_"))}


def remote_code_files(version: str) -> dict[str, str]:
    """File name -> text of every Python file an export carries: the wrappers of remote/ and the
    omniloom modules they reach. Each closure is checked for the packages it may import."""
    stand_ins = _stand_ins()
    files: dict[str, str] = {}
    deps_of: dict[str, set[str]] = {}

    def add(stem: str, allowed: frozenset[str]) -> None:
        if f"{stem}.py" in files:  # copied already (modules may import each other, lazily: config <-> accounting)
            return
        if stem in stand_ins:
            text = stand_ins[stem].read_text()
            header = (f"# Written by omniloom export (omniloom {version}) from its hand-written "
                      f"omniloom/pretrain/export/hf/remote/{stem}.py.\n")
            deps = _template_deps(text)
        else:
            module = SUBSTITUTES.get(stem, module_of(stem))
            spec = importlib.util.find_spec(module)
            if spec is None or spec.origin is None:
                raise RemoteCodeError(f"{stem}.py: no module {module} to copy")
            text, deps = rewrite_module(Path(spec.origin).read_text(), module, allowed)
            header = (f"# Copied by omniloom export (omniloom {version}) from omniloom/{module.split('.')[1]}/"
                      f"{module.split('.')[2]}.py with its imports rewritten; edit omniloom's file, not this copy.\n")
        files[f"{stem}.py"] = header + text
        deps_of[stem] = {file_stem(d) for d in deps}
        for dep in sorted(deps_of[stem]):
            add(dep, allowed)

    for entries, allowed in ((MODEL_ENTRIES, MODEL_PACKAGES), (PROCESSOR_ENTRIES, PROCESSOR_PACKAGES)):
        for name in entries:
            add(Path(name).stem, allowed)
    for entries, allowed in ((MODEL_ENTRIES, MODEL_PACKAGES), (PROCESSOR_ENTRIES, PROCESSOR_PACKAGES)):
        _check_closure([Path(n).stem for n in entries], files, allowed)
    return files


def _check_closure(entries: list[str], files: dict[str, str], allowed: frozenset[str]) -> None:
    """Every file reachable from `entries` exists in the export and imports at module level only
    the standard library and `allowed` (the model's files load without Pillow or PyAV)."""
    seen, todo = set(), list(entries)
    while todo:
        stem = todo.pop()
        if stem in seen:
            continue
        seen.add(stem)
        name = f"{stem}.py"
        if name not in files:
            raise RemoteCodeError(f"a file of the export imports .{stem}, which the export does not hold")
        text = files[name]
        todo += HF_RELATIVE_IMPORT.findall(text)
        for node, in_try, _ in _walk(ast.parse(text)):
            if in_try or getattr(node, "level", 0):
                continue
            tops = [node.module.split(".")[0]] if isinstance(node, ast.ImportFrom) else [a.name.split(".")[0] for a in node.names]
            bad = [t for t in tops if t not in sys.stdlib_module_names and t not in allowed]
            if bad:
                raise RemoteCodeError(f"{name} imports {', '.join(bad)}, which {entries[0]}.py's users need not have "
                                      f"installed (allowed: {', '.join(sorted(allowed))})")
