"""The package's docstring style: Google sections (``Args:``, ``Returns:``, ``Raises:``,
``Attributes:``), as mkdocstrings renders them (``docstring_style: google`` in mkdocs.yml), and no
issue numbers. ruff's pydocstyle rules with the Google convention (``[tool.ruff.lint]`` in
pyproject.toml) check the sections, and its W605 the escapes (a ``\\b`` in a maths docstring is a
backspace); a scan of every docstring checks what they do not see."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "laplace_debiased"

#: a NumPy/reST section underline: a line of dashes under a title line
UNDERLINE = re.compile(r"^[^\S\n]*\S[^\n]*\n[^\S\n]*-{3,}[^\S\n]*$", re.M)
#: "issue 31", "issues 23 and 24", "#31"
ISSUE_NUMBER = re.compile(r"\bissues?\s+#?\d+|(?<![\w&#])#\d+\b", re.I)
#: one entry for several parameters, "a, b: ...", which mkdocstrings cannot parse
COMBINED_ENTRY = re.compile(r"^\s+\w+(\s*,\s*\w+)+\s*(\([^)]*\))?\s*:", re.M)
#: a Sphinx role, ``:func:`x```, which mkdocstrings shows as plain text (a cross-reference there is
#: ``[`x`][laplace_debiased.module.x]``)
SPHINX_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj|const):`")
SECTION = re.compile(r"^(\s*)(Args|Arguments|Attributes|Parameters|Keyword Args):\s*$", re.M)


def docstrings(path: Path) -> list[tuple[int, str]]:
    """``(line, docstring)`` of the module and of every class and function in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text is not None:
                found.append((getattr(node, "lineno", 1), text))
    return found


def parameter_sections(text: str) -> list[str]:
    """The bodies of the parameter-like sections of a Google docstring (the lines indented
    deeper than the section title, up to the first line that is not)."""
    bodies = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = SECTION.match(line)
        if not m:
            continue
        indent, body = len(m.group(1)), []
        for nxt in lines[i + 1:]:
            if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                break
            body.append(nxt)
        bodies.append("\n".join(body))
    return bodies


def violations(path: Path, root: Path = ROOT) -> list[str]:
    """What the scan finds in the docstrings of ``path``, one line each, named relative to ``root``."""
    out = []
    for line, text in docstrings(path):
        where = f"{path.relative_to(root)}:{line}"
        out += [f"{where}: underlined section {m.group(0).strip().splitlines()[0]!r}" for m in UNDERLINE.finditer(text)]
        out += [f"{where}: issue number {m.group(0)!r}" for m in ISSUE_NUMBER.finditer(text)]
        out += [f"{where}: Sphinx role {m.group(0)!r}" for m in SPHINX_ROLE.finditer(text)]
        for body in parameter_sections(text):
            out += [f"{where}: combined entry {m.group(0).strip()!r}" for m in COMBINED_ENTRY.finditer(body)]
    return out


def test_the_scan_finds_each_kind_of_violation(tmp_path):
    """A module with a NumPy section, an issue number, a Sphinx role and a combined entry gives
    four findings; its Google-style twin with a Markdown cross-reference gives none."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        'def f(a, b):\n'
        '    """Sum (issue 31), see :func:`g`.\n\n'
        '    Parameters\n'
        '    ----------\n'
        '    a : int\n'
        '        first.\n\n'
        '    Args:\n'
        '        a, b: summands.\n'
        '    """\n'
    )
    good = tmp_path / "good.py"
    good.write_text(
        'def f(a, b):\n'
        '    """Sum of two numbers; ``a - b`` is not it, see [`g`][m.g].\n\n'
        '    Args:\n'
        '        a: The first summand, e.g. 1, 2.\n'
        '        b: The second summand.\n\n'
        '    Returns:\n'
        '        ``a + b``.\n'
        '    """\n'
    )
    found = [v.split(": ", 2)[1] for v in violations(bad, tmp_path)]
    assert [v.split(" ", 1)[0] for v in found] == ["underlined", "issue", "Sphinx", "combined"], found
    assert violations(good, tmp_path) == []


def test_package_docstrings_have_no_numpy_sections_issue_numbers_sphinx_roles_or_combined_entries():
    found = [v for path in sorted(PACKAGE.rglob("*.py")) for v in violations(path)]
    assert not found, "\n".join(found)


def test_ruff_pydocstyle_google_convention():
    """``ruff check laplace_debiased`` with pyproject.toml's rules (pydocstyle, Google convention;
    no invalid escape sequences)."""
    pytest.importorskip("ruff", reason="ruff is pinned in requirements-cpu.lock")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "laplace_debiased"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
