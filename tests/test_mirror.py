"""tests/ mirrors the package module by module: every ``laplace_debiased/<sub>/<module>.py`` has
its test module ``tests/<sub>/test_<module>.py``, and every top-level ``laplace_debiased/<module>.py``
has ``tests/test_<module>.py`` (a leading underscore dropped: ``_threads.py`` → ``test_threads.py``).
The modules in :data:`UNMIRRORED` are exempt; a new module without a test module fails."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "laplace_debiased"
TESTS = ROOT / "tests"

# Package modules without a test module of their own: the entry point.
UNMIRRORED = frozenset({
    "__main__.py",
})


def package_modules() -> list[str]:
    """Every module of the package as a path relative to it (``"posterior/grid.py"``), without the
    ``__init__.py`` package markers."""
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if p.name != "__init__.py")


def mirror_of(module: str) -> str:
    """The test module of a package module, relative to tests/: ``"posterior/grid.py"`` →
    ``"posterior/test_grid.py"``, ``"_threads.py"`` → ``"test_threads.py"``."""
    path = Path(module)
    return (path.parent / f"test_{path.name.lstrip('_')}").as_posix()


def test_mirror_of_maps_a_module_to_its_test_module():
    assert mirror_of("posterior/grid.py") == "posterior/test_grid.py"
    assert mirror_of("cli.py") == "test_cli.py"
    assert mirror_of("_threads.py") == "test_threads.py"


def test_the_scan_sees_every_layer():
    modules = package_modules()
    assert {m.split("/")[0] for m in modules if "/" in m} >= {
        "commands", "curvature", "data", "diagnostics", "evaluation", "optim", "posterior",
        "kron", "ekfac", "eigen", "two_batch"}
    assert "cli.py" in modules and not any(m.endswith("__init__.py") for m in modules)


def test_every_module_has_its_test_module():
    missing = [f"laplace_debiased/{m} -> tests/{mirror_of(m)}" for m in package_modules()
               if m not in UNMIRRORED and not (TESTS / mirror_of(m)).is_file()]
    assert not missing, "add a test module for each of:\n" + "\n".join(missing)


def test_two_modules_never_share_a_test_module():
    seen: dict[str, str] = {}
    for m in package_modules():
        other = seen.setdefault(mirror_of(m), m)
        assert other == m, f"{other} and {m} both map to tests/{mirror_of(m)}"


def test_the_exemptions_name_existing_modules_only():
    """An exempt module that is deleted or gains its test module leaves the list."""
    modules = set(package_modules())
    stale = sorted(m for m in UNMIRRORED if m not in modules or (TESTS / mirror_of(m)).is_file())
    assert not stale, f"remove from UNMIRRORED: {stale}"
