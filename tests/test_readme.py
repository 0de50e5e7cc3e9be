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
