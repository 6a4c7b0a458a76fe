"""One version number and one licence: the installed metadata, ``laplace_debiased.__version__``,
``pyproject.toml``, CITATION.cff and LICENSE agree."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

import yaml

import laplace_debiased

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_version_is_the_installed_metadata_of_pyproject():
    """``__version__`` is read from the installed metadata, which is pyproject.toml's (a stale
    install of another version fails here: reinstall with ``make install``)."""
    assert laplace_debiased.__version__ == version("laplace-debiased") == PROJECT["version"]


def test_an_uninstalled_source_tree_says_its_version_is_unknown():
    """Without installed metadata the import still works, and the version says it is unknown."""
    code = (
        "import importlib.metadata as m\n"
        "def missing(name):\n"
        "    raise m.PackageNotFoundError(name)\n"
        "m.version = missing\n"
        "import laplace_debiased\n"
        "print(laplace_debiased.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0+unknown"


def test_citation_names_this_version_licence_and_the_paper():
    """CITATION.cff carries pyproject.toml's version and licence and cites Tatzel et al. (2025)."""
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text(encoding="utf-8"))
    assert cff["cff-version"] == "1.2.0"
    assert str(cff["version"]) == PROJECT["version"]
    assert cff["license"] == PROJECT["license"] == "MIT"
    paper = cff["preferred-citation"]
    assert paper["title"] == "Debiasing Mini-Batch Quadratics for Applications in Deep Learning"
    assert [a["family-names"] for a in paper["authors"]] == ["Tatzel", "Mucsányi", "Hackel", "Hennig"]
    assert paper["year"] == 2025 and "2410.14325" in paper["url"]


def test_licence_file_is_the_mit_licence_that_pyproject_names():
    """LICENSE is the MIT text and pyproject.toml ships it (PEP 639 ``license-files``)."""
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License") and "the laplace-debiased authors" in text
    assert PROJECT["license-files"] == ["LICENSE"]
