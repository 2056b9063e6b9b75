"""The house rule on module size: a module of nxdi past 400 lines says why at its top (its
docstring), so that growth is a decision, not a drift."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nxdi

LIMIT = 400
REASON = re.compile(r"(over|past) 400 lines|Length: ~\d+ lines", re.IGNORECASE)


def test_every_module_past_the_limit_says_why_at_its_top() -> None:
    root = Path(nxdi.__file__).parent
    silent = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > LIMIT and not REASON.search(ast.get_docstring(ast.parse(text)) or ""):
            silent.append(f"{path.relative_to(root.parent)} ({text.count(chr(10))} lines)")
    assert not silent, "modules past 400 lines with no reason in their docstring: " + ", ".join(silent)
