"""The README's commands are ones a user can paste (issue 15.11) and it points nowhere outside
the repository (issue 15.4)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _literal_escapes(line: str) -> list[str]:
    """The words of a bash command line that pass a backslash and `n` or `t` to the program where
    a reader expects a newline or tab: inside "..." or '...' (bash keeps the backslash there) or
    unquoted (bash drops it). Only $'...' turns \\n and \\t into the real characters. A comment
    (an unquoted # starting a word) ends the command."""
    found, i, n = [], 0, len(line)
    while i < n:
        c = line[i]
        if c == "#" and (i == 0 or line[i - 1].isspace()):
            break
        if c == "$" and line.startswith("$'", i):  # ANSI-C quoting: escapes are real characters
            i += 2
            while i < n and line[i] != "'":
                i += 2 if line[i] == "\\" else 1
            i += 1
        elif c in "'\"":
            end = line.find(c, i + 1)
            while c == '"' and end > 0 and line[end - 1] == "\\":  # \" inside "..."
                end = line.find(c, end + 1)
            end = n if end < 0 else end
            word = line[i:end + 1]
            if re.search(r"\\[nt]", word):
                found.append(word)
            i = end + 1
        elif c == "\\":
            if line[i + 1:i + 2] in ("n", "t"):
                found.append(line[i:i + 2])
            i += 2
        else:
            i += 1
    return found


def test_the_escape_check_tells_bash_quoting_apart():
    assert _literal_escapes('encode "a\\nb"') == ['"a\\nb"']
    assert _literal_escapes("encode 'def f(x):\\n\\treturn x'") == ["'def f(x):\\n\\treturn x'"]
    assert _literal_escapes("encode a\\nb") == ["\\n"]
    assert _literal_escapes("encode $'def f(x):\\n\\treturn x'   # bash $'...': a real newline, not '\\n'") == []
    assert _literal_escapes("encode $'it\\'s\\n' 'plain' \"x\\\"y\"") == []
    assert _literal_escapes("encode 'a' \"b\\tc\" $'\\n'") == ['"b\\tc"']


def test_tokenizer_encode_examples_pass_real_newlines():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = [ln for ln in readme.splitlines() if "tokenizer encode" in ln or "--prompt" in ln]
    assert any("tokenizer encode" in ln for ln in lines)
    for ln in lines:
        # "a\nb" and 'a\nb' reach the program as a backslash and a letter; $'a\nb' as a newline
        assert not _literal_escapes(ln), ln


def _all_parsers():
    import argparse

    from omniloom.pretrain.cli import build_parser
    from omniloom.pretrain.train.main import build_arg_parser

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
    for name in ("docs/data-format.md", "docs/resume.md", "docs/sparse-attention.md", "docs/positions.md",
                 "docs/huggingface.md"):
        assert name in readme
    # every docs/ file the README, the docs or a help text names exists (a link to an uncommitted draft would not)
    texts = [readme, *(p.read_text(encoding="utf-8") for p in (ROOT / "docs").glob("*.md")),
             *(p.format_help() for p in _all_parsers())]
    named = {m for text in texts for m in re.findall(r"docs/[\w.-]+\.md", text)}
    assert named and not [n for n in named if not (ROOT / n).is_file()], named
    fmt = (ROOT / "docs" / "data-format.md").read_text(encoding="utf-8")
    for needle in ("doc.json", "OBELICS", "manifest.json", "PackedBatch", "<|patch|>", "omniloom_tokenizer.json"):
        assert needle in fmt


def test_quick_start_says_where_the_demo_writes_and_how_long_make_test_takes():
    """Issue 28.10: the Quick start said neither where `make demo` leaves its output nor how long
    `make test` runs."""
    from omniloom.pretrain.cli import build_parser

    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    out = next(a.default for a in demo._actions if "--out" in a.option_strings)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    assert f"`./{out}/`" in quick and "run/report/index.html" in quick
    assert re.search(r"`make test` takes about \d+ minutes", quick), quick
