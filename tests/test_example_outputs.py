"""Pages that quote an example's committed output verbatim quote it as committed.

The example pages include ``docs/tutorials/output/NAME.txt`` (``make outputs`` regenerates every
committed output); a page that cannot include a file (the quick start, read on a code host too)
quotes it after a ``<!-- output: docs/tutorials/output/NAME.txt -->`` line, and this test fails
when the quote and the file differ, so those numbers cannot go stale silently. Prose that names
an output file may quote only numbers that file holds.
"""

from __future__ import annotations

import ast
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


#: a committed output file named in prose: ``output/NAME.txt``, relative to the page or from the root
_CITED = re.compile(r"((?:[\w.-]+/)*output/[\w/.-]+\.(?:txt|md))")
#: a decimal number as prose quotes it (``0.95``, ``-1.2``); integers and ``1e3`` name grid points,
#: sizes and counts, and are not checked
_DECIMAL = re.compile(r"(?<![\w.])[-−]?\d+\.\d+(?![\w.]*\d)")
_FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def _prose() -> list[tuple[Path, str]]:
    """The pages under docs/ (not the committed outputs, which are what is quoted) without their
    code blocks, and the examples' docstrings, which the example pages show."""
    out = [(p, _FENCED.sub("", p.read_text())) for p in sorted((ROOT / "docs").rglob("*.md"))
           if "output" not in p.relative_to(ROOT / "docs").parts]
    return out + [(p, ast.get_docstring(ast.parse(p.read_text())) or "") for p in sorted((ROOT / "examples").glob("*.py"))]


def _cited_file(page: Path, cited: str) -> Path:
    return ROOT / cited if cited.startswith("docs/") else page.parent / cited


def _citing_paragraphs() -> list[tuple[Path, str, str]]:
    """``(page, cited file, paragraph)`` for every paragraph or list item that names an output file."""
    found = []
    for page, text in _prose():
        for para in re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", text):
            for cited in dict.fromkeys(_CITED.findall(para)):
                found.append((page, cited, para))
    return found


def _quoted_in(quoted: str, values: list[float]) -> bool:
    decimals = len(quoted.partition(".")[2])
    return any(round(v, decimals) == float(quoted) for v in values)


def test_the_number_scan_tells_a_quoted_number_from_a_stale_one():
    values = [float(n) for n in _numbers("ECE 0.9512 and δ 0.676, draws 3")]
    assert _quoted_in("0.95", values) and _quoted_in("0.676", values) and _quoted_in("0.7", values)
    assert not _quoted_in("1.30", values) and not _quoted_in("0.705", values)
    assert _DECIMAL.findall("ECE 1.30 at δ = 1e3, 300 images, v0.3.1, 0.95.") == ["1.30", "0.95"]


def test_the_examples_and_the_tutorials_cite_their_outputs():
    cited = {str(_cited_file(page, c).resolve().relative_to(ROOT)) for page, c, _ in _citing_paragraphs()}
    assert {f"docs/tutorials/output/{p.stem}.txt" for p in (ROOT / "examples").glob("*.py")} <= cited


@pytest.mark.parametrize("cite", _citing_paragraphs(),
                         ids=lambda c: f"{c[0].relative_to(ROOT)}:{c[1]}:{c[2][:30]}")
def test_numbers_next_to_a_cited_output_are_in_it(cite):
    """A paragraph (or list item) of a page or an example's docstring that names a committed output
    file quotes only decimal numbers that file holds, to the digits shown, so regenerating the
    outputs (``make outputs``) and forgetting the prose fails here."""
    page, cited, para = cite
    path = _cited_file(page, cited)
    assert path.is_file(), f"{page.relative_to(ROOT)} cites {cited}, which does not exist"
    values = [float(n) for n in _numbers(path.read_text())]
    stale = [q for q in (n.replace("−", "-") for n in _DECIMAL.findall(para)) if not _quoted_in(q, values)]
    assert not stale, f"{page.relative_to(ROOT)} quotes {stale} next to {cited}, which does not hold them"
