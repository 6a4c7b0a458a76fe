"""The package's layout rules: every import points down the layers of docs/architecture.md and
nothing in computers/ imports laplace-torch (import-linter's contracts in pyproject.toml)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "laplace_debiased"


def test_imports_point_down_the_layers():
    """``lint-imports`` with the contract of pyproject.toml (function-level imports count too)."""
    pytest.importorskip("importlinter", reason="import-linter is pinned in requirements-cpu.lock")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_merge_conflict_markers_are_committed():
    """A merge resolved by hand must not leave ``<<<<<<<``/``>>>>>>>`` lines in tracked text."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=False)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    suffixes = {".md", ".py", ".toml", ".yml", ".txt", ".lock", ".cfg"}
    hits = [name for name in tracked.stdout.split()
            if Path(name).suffix in suffixes and (ROOT / name).is_file()
            and marker.search((ROOT / name).read_text(errors="replace"))]
    assert not hits, f"conflict markers in {hits}"


@pytest.mark.slow
def test_a_posterior_module_imported_first_does_not_meet_a_partly_imported_one():
    """``kron.posterior`` imports laplace-torch, whose import registers the structures,
    which subclass its class: the registration must wait for the factory's first call."""
    code = ("import laplace_debiased.kron.posterior\n"
            "import torch\nfrom laplace import Laplace\n"
            "la = Laplace(torch.nn.Linear(3, 2), 'classification', subset_of_weights='all',\n"
            "             hessian_structure='debiased_kron')\n"
            "print(type(la).__name__)\n"
            "print(type(Laplace(torch.nn.Linear(3, 2), 'classification', subset_of_weights='all',\n"
            "                   hessian_structure='debiased_ekfac')).__name__)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert res.returncode == 0 and res.stdout.split() == ["DebiasedKronLaplace", "DebiasedEKFACLaplace"], res.stderr
