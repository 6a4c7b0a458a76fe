"""docs/architecture.md matches the package module by module and the import contract layer by layer.

Convention checked here: the section "Modules, package layer by package layer" of
docs/architecture.md has one heading (``### ...``) per package layer, whose backticked names are
the layer's members (``computers/`` for a subpackage, ``prior_grid.py`` for a top-level module),
and under it one bullet per module file, ``- `PATH`: one line``, with ``PATH`` relative to
``laplace_debiased/`` (``kron/decompose.py``). Every module file of the package except
``__init__.py`` and ``__main__.py`` has exactly one such bullet, under the heading of its own
member, and every path named in the section is a file of the package. The table under "Package
layers" has one row per layer of the import-linter ``layers`` contract of pyproject.toml,
numbered from the top, naming every member of that layer.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "laplace_debiased"
DOC = ROOT / "docs" / "architecture.md"
TICKED = re.compile(r"`([^`\n]+)`")
BULLET = re.compile(r"^- `([^`]+\.py)`:")


def _section(title: str) -> str:
    text = DOC.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"docs/architecture.md has no section '## {title}'"
    return match.group(1)


def _member(name: str) -> str:
    """``laplace_debiased.x`` -> ``x/`` for a subpackage, ``x.py`` for a module."""
    short = name.removeprefix("laplace_debiased.")
    return f"{short}/" if (PACKAGE / short).is_dir() else f"{short}.py"


def _contract_layers() -> list[list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    return [[_member(m.strip()) for m in layer.split("|")] for layer in layers]


def _package_modules() -> set[str]:
    return {p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py")}


def _module_bullets() -> list[tuple[str, set[str]]]:
    """``(path, backticked names of the heading above it)`` per module bullet."""
    bullets, heading = [], set()
    for line in _section("Modules, package layer by package layer").splitlines():
        if line.startswith("### "):
            heading = set(TICKED.findall(line))
        elif match := BULLET.match(line):
            bullets.append((match.group(1), heading))
    return bullets


def _owner(path: str) -> str:
    """The layer member a module belongs to: ``kron/decompose.py`` -> ``computers/``."""
    head, sep, _ = path.partition("/")
    return f"{head}/" if sep else head


def test_the_parsers_see_the_package_and_the_contract():
    assert len(_package_modules()) > 50 and "kron/decompose.py" in _package_modules()
    assert len(_contract_layers()) >= 8 and ["cli.py"] in _contract_layers()
    assert len(_module_bullets()) > 50


def test_every_module_has_one_line():
    named = [path for path, _ in _module_bullets()]
    missing = sorted(_package_modules() - set(named))
    assert not missing, f"add a '- `PATH`: ...' line to docs/architecture.md for: {missing}"
    repeated = sorted({p for p in named if named.count(p) > 1})
    assert not repeated, f"named more than once: {repeated}"


def test_every_module_named_exists():
    named = set(TICKED.findall(_section("Modules, package layer by package layer")))
    paths = {n for n in named if re.fullmatch(r"[\w/]+\.py", n)}
    absent = sorted(p for p in paths if not (PACKAGE / p).is_file())
    assert not absent, f"docs/architecture.md names modules that do not exist: {absent}"


def test_every_module_sits_under_its_layer_heading():
    misplaced = [path for path, heading in _module_bullets() if _owner(path) not in heading]
    assert not misplaced, f"move these lines under the heading of their package layer: {misplaced}"


def test_the_layer_table_follows_the_contract():
    rows: dict[int, set[str]] = {}
    for line in _section("Package layers").splitlines():
        if match := re.match(r"^\|\s*(\d+)\s*\|([^|]*)\|", line):
            rows.setdefault(int(match.group(1)), set()).update(TICKED.findall(match.group(2)))
    layers = _contract_layers()
    assert sorted(rows) == list(range(1, len(layers) + 1)), "one table row per contract layer, numbered 1.."
    wrong = {i: sorted(set(members) - rows[i]) for i, members in enumerate(layers, 1) if set(members) - rows[i]}
    assert not wrong, f"layer rows missing members of the pyproject contract: {wrong}"
