"""The README's commands are ones a user can paste (issue 15.11) and it points nowhere outside
the repository (issue 15.4)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_tokenizer_encode_examples_pass_real_newlines():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [ln for ln in readme.splitlines() if "tokenizer encode" in ln]
    assert lines
    for ln in lines:
        # a "..." argument holding \n or \t reaches the tokenizer as a backslash and a letter
        assert not re.search(r'"[^"]*\\[nt][^"]*"', ln), ln


def _all_parsers():
    import argparse

    from omniloom.pretrain.cli import build_parser
    from omniloom.pretrain.train import build_arg_parser

    todo, seen = [build_parser(), build_arg_parser()], []
    while todo:
        p = todo.pop()
        seen.append(p)
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return seen


def test_no_help_text_or_doc_points_outside_the_repository():
    """Users have the repository only: help texts, the README and docs/ link nothing above it
    (no `../` path) and no internal design notes."""
    texts = [p.format_help() for p in _all_parsers()]
    assert len(texts) > 20
    texts += [path.read_text(encoding="utf-8") for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]]
    for text in texts:
        escapes = re.findall(r"(?<![.\w])\.\./[\w.]", text)
        assert not escapes, (escapes, text[:200])
        assert "DESIGN.md" not in text, text[:200]


def test_readme_links_the_docs_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for name in ("docs/data-format.md", "docs/resume.md", "docs/sparse-attention.md"):
        assert name in readme and (ROOT / name).is_file()
    fmt = (ROOT / "docs" / "data-format.md").read_text(encoding="utf-8")
    for needle in ("doc.json", "OBELICS", "manifest.json", "PackedBatch", "<|patch|>", "omniloom_tokenizer.json"):
        assert needle in fmt
