"""Pages that quote an example's committed output verbatim quote it as committed.

The example pages include ``docs/tutorials/output/NAME.txt`` (``make examples`` regenerates
them); a page that cannot include a file (the quick start, read on a code host too) quotes it
after a ``<!-- output: docs/tutorials/output/NAME.txt -->`` line, and this test fails when the
quote and the file differ, so those numbers cannot go stale silently.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
QUOTE = re.compile(r"<!-- output: (\S+) -->\n```\w*\n(.*?)```", re.S)


def _quotes() -> list[tuple[Path, str, str]]:
    return [(page, path, block) for page in PAGES for path, block in QUOTE.findall(page.read_text())]


def test_the_quick_start_page_quotes_its_output():
    assert any(page.name == "quickstart.md" and "getting-started" in str(page) for page, _, _ in _quotes())


@pytest.mark.parametrize("quote", _quotes(), ids=lambda q: f"{q[0].relative_to(ROOT)}:{q[1]}")
def test_quoted_output_matches_the_committed_file(quote):
    page, path, block = quote
    assert block.strip() == (ROOT / path).read_text().strip(), f"{page.relative_to(ROOT)} quotes a stale {path}"
