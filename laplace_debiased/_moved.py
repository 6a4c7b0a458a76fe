"""Old flat import paths (``laplace_debiased.kron`` ...) kept working after the layout move.

A meta-path finder answers an import of an old name with the module at its new place, so
``from laplace_debiased.kron import DebiasedKronLaplace`` and pickles that name old paths still
load, and both names refer to one module object.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

MOVED: dict[str, str] = {
    "linalg": "curvature.linalg",
    "operators": "curvature.operators",
    "eigen": "curvature.eigen",
    "batches": "computers.batches",
    "_two_batch": "structures.two_batch",
    "kron": "structures.kron",
    "lowrank": "structures.lowrank",
    "predictive": "evaluation.predictive",
    "metrics": "evaluation.metrics",
    "sweep": "evaluation.sweep",
    "report": "evaluation.report",
    "pipeline": "evaluation.pipeline",
    "models": "evaluation.models",
    "training": "evaluation.training",
    "cg": "optim.cg",
}
_PREFIX = "laplace_debiased."


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolve ``laplace_debiased.<old>`` to ``laplace_debiased.<new>`` (the same module object)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname.startswith(_PREFIX) and fullname[len(_PREFIX) :] in MOVED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(_PREFIX + MOVED[spec.name[len(_PREFIX) :]])

    def exec_module(self, module: ModuleType) -> None:
        """The target module is already executed."""


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
