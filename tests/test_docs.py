"""The README and the documentation pages: the README fits its budget, and every relative link
and image of the README and of docs/ points at a file of the checkout (so the links work from a
checkout, on a code host and on the built site, where ``mkdocs build --strict`` checks them too)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
GENERATED = ROOT / "docs" / "reference"
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _relative_links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    text = re.sub(r"`[^`\n]*`", "", text)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:|#|/", t)]


def _generated(target: Path) -> bool:
    """The API reference pages are written at build time (docs/hooks/site.py)."""
    return GENERATED in target.resolve().parents


def _anchors(page: Path) -> set[str]:
    """Heading anchors as GitHub and mkdocs' ``toc`` write them (lower case, punctuation dropped)."""
    heads = re.findall(r"^#+ (.+)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.replace("`", "").strip().lower()).replace(" ", "-") for h in heads}


def test_readme_fits_on_a_few_screens():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    missing = [t for t in _relative_links(page)
               if not (page.parent / t.split("#")[0]).exists() and not _generated(page.parent / t)]
    assert not missing, f"{page.relative_to(ROOT)} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_resolve(page):
    bad = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        file = page.parent / path if path else page
        if anchor and file.suffix == ".md" and not _generated(file) and anchor not in _anchors(file):
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)} links to missing headings: {bad}"


@pytest.mark.parametrize("example", sorted(p.stem for p in (ROOT / "examples").glob("*.py")))
def test_every_example_has_a_tutorial_page_with_its_script_and_committed_output(example):
    page = ROOT / "docs" / "tutorials" / f"{example}.md"
    output = ROOT / "docs" / "tutorials" / "output" / f"{example}.txt"
    assert page.exists() and output.exists(), "add the page and a committed run's output"
    text = page.read_text()
    assert f'--8<-- "examples/{example}.py"' in text and f'--8<-- "docs/tutorials/output/{example}.txt"' in text
    assert output.read_text().startswith(f"$ OMP_NUM_THREADS=1 python examples/{example}.py"), "first line: the command"
    assert f"({example}.md)" in (ROOT / "docs" / "tutorials" / "index.md").read_text()
