"""The documentation's pages and their Python snippets, for the tests that check or run them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _snippets() -> list[tuple[str, str]]:
    """``(places, code)`` of every distinct python block, ``places`` like ``README.md:14#0``."""
    found: dict[str, list[str]] = {}
    for path in DOC_FILES:
        text = path.read_text()
        for i, match in enumerate(_BLOCK.finditer(text)):
            line = text[: match.start()].count("\n") + 1
            found.setdefault(match.group(1), []).append(f"{path.relative_to(ROOT)}:{line}#{i}")
    return [("+".join(places), code) for code, places in found.items()]


SNIPPETS = _snippets()
