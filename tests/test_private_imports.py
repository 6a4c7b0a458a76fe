"""No module of the package imports another module's private name.

A name with one leading underscore is internal to the module that defines it: a helper that a
second module needs is public (no underscore, documented). The check reads the source (``ast``),
so it sees every import, at module level or inside a function, on one line or several:

* ``from laplace_debiased.X import _name`` (absolute or relative);
* ``laplace_debiased._module`` on an import path (``import``, ``from ... import``);
* ``module._name`` where ``module`` was imported from the package.

The private modules :data:`PRIVATE_BY_DESIGN` are the exception: package-internal plumbing with
no user-facing API (progress bars, thread counts, the laplace-torch registration), imported by
the modules that need them. Their own private names stay private.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "laplace_debiased"

#: Private modules (``laplace_debiased._<name>``) that any module of the package may import.
PRIVATE_BY_DESIGN = frozenset({"_progress", "_threads", "_register"})

#: ``(importing module, private name)`` pairs that are still to be removed. The test fails on any
#: pair not listed here and on a listed pair that no longer occurs, so this set only shrinks.
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _module_name(path: Path) -> tuple[str, str]:
    """``(module, package)`` dotted names of a source file of the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
        return ".".join(parts), ".".join(parts)
    return ".".join(parts), ".".join(parts[:-1])


def _source_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute dotted name ``node`` imports from (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_module(dotted: str) -> bool:
    """Whether ``dotted`` names a module or package of the source tree (nothing is imported)."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _private_parts(dotted: str) -> list[str]:
    """The private components of a package path, other than :data:`PRIVATE_BY_DESIGN`."""
    return [p for p in dotted.split(".")[1:] if _is_private(p) and p not in PRIVATE_BY_DESIGN]


def _violations(source: str, path: Path) -> Iterator[tuple[str, str, int]]:
    """``(module, private name, line)`` for each private import in ``source``, the text of the
    package's file ``path``."""
    module, package = _module_name(path)
    tree = ast.parse(source, str(path))
    modules: set[str] = set()  # local names bound to modules of the package
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "laplace_debiased":
                    for part in _private_parts(alias.name):
                        yield module, part, node.lineno
                    modules.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            source = _source_module(node, package)
            if source.split(".")[0] != "laplace_debiased":
                continue
            for part in _private_parts(source):
                yield module, part, node.lineno
            for alias in node.names:
                if _is_private(alias.name) and alias.name not in PRIVATE_BY_DESIGN:
                    yield module, alias.name, node.lineno
                elif _is_module(f"{source}.{alias.name}"):
                    modules.add(alias.asname or alias.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and _is_private(node.attr)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            yield module, node.attr, node.lineno


def _all_violations() -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for module, name, line in _violations(path.read_text(), path):
            found.setdefault((module, name), []).append(f"{path.relative_to(ROOT)}:{line}")
    return found


def test_no_module_imports_a_private_name_of_another():
    found = _all_violations()
    new = {pair: where for pair, where in found.items() if pair not in ALLOWED}
    assert not new, "make these names public (or keep them in one module):\n" + "\n".join(
        f"{', '.join(where)}: {name}" for (_, name), where in sorted(new.items())
    )


def test_the_allowlist_names_only_imports_that_remain():
    stale = sorted(ALLOWED - set(_all_violations()))
    assert not stale, f"remove these pairs from ALLOWED, they no longer occur: {stale}"


def _violations_of(source: str) -> list[tuple[str, str]]:
    """The violations of ``source`` as if it were ``laplace_debiased/curvature/example.py``."""
    return [(m, n) for m, n, _ in _violations(source, PACKAGE / "curvature" / "example.py")]


def test_the_scan_sees_every_form_of_private_import():
    source = (
        "from laplace_debiased.curvature.linalg import (\n    debiased_kron,\n    _tolerance,\n)\n"
        "from .linalg import _ritz\n"
        "from ..posterior import grams\n"
        "import laplace_debiased.curvature.lanczos as lz\n"
        "from laplace_debiased import _moved\n"
        "import laplace_debiased._moved\n"
        "def f():\n    from laplace_debiased.posterior.grams import PAIR_BUFFER, _hidden\n"
        "    return grams._secret, lz._inner, lz.lanczos_top_k\n"
    )
    module = "laplace_debiased.curvature.example"
    assert sorted(_violations_of(source)) == sorted(
        [(module, n) for n in ("_tolerance", "_ritz", "_moved", "_moved", "_hidden", "_secret", "_inner")]
    )


def test_the_private_modules_by_design_and_public_names_pass():
    source = (
        "from laplace_debiased import _progress, _threads\n"
        "from laplace_debiased._progress import progress\n"
        "import laplace_debiased._register\n"
        "from laplace_debiased.curvature.linalg import __doc__, debiased_kron\n"
        "from torch import _C\n"
        "from laplace_debiased.posterior.kron_structure import KronStructure\n"
        "x = KronStructure._private_is_not_a_module_name\n"
    )
    assert _violations_of(source) == []
