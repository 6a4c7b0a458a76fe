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


_NUMBER = re.compile(r"[-−+]?\d+(?:\.\d+)?(?:e[-−+]?\d+)?")


def _numbers(text: str) -> list[str]:
    return [n.replace("−", "-") for n in _NUMBER.findall(text)]


def test_the_diagnostics_table_quotes_the_committed_report():
    """Each number in the guide's table of the default diagnosis is one of the committed report's
    (``make diagnose-doc``), to the digits the table shows; "Eq. 5", "Eq. 7" and "top-20" name
    things and are skipped."""
    page = (ROOT / "docs/guide/diagnostics.md").read_text()
    report = (ROOT / "docs/guide/output/diagnose/README.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ") and "what" not in line]
    assert len(rows) >= 8, "the table of the default run is gone from docs/guide/diagnostics.md"
    values = [float(n) for n in _numbers(report)]
    for row in rows:
        cell = re.sub(r"Eq\. \d|top-\d+|u₁", "", row.split("|")[2])
        for quoted in _numbers(cell):
            decimals = len(quoted.split("e")[0].partition(".")[2])
            scale = 10 ** int(quoted.split("e")[1]) if "e" in quoted else 1
            assert any(round(v / scale, decimals) == float(quoted.split("e")[0]) for v in values), (
                f"docs/guide/diagnostics.md quotes {quoted} ({row.strip()}), which the report does not hold")
