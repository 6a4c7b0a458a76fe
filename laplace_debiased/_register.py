"""Register the debiased structures with laplace-torch's factory, importing torch only when needed.

``Laplace(model, ..., hessian_structure="debiased_kron")`` finds its class among the subclasses of
``laplace.BaseLaplace`` by ``_key``, so the debiased classes must be defined before the first
factory call, and any such call is preceded by ``import laplace``.  ``import laplace_debiased``
therefore defines them at once if ``laplace`` is already imported, and otherwise right after
``laplace`` finishes importing (a one-shot meta-path hook).  The CLI's ``--help`` thus never
imports torch (about 2 s) or laplace-torch.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType


def register() -> None:
    """Define (and so register) every debiased Laplace class."""
    importlib.import_module("laplace_debiased.structures.kron")  # "debiased_kron"
    importlib.import_module("laplace_debiased.structures.lowrank")  # "debiased_lowrank", "debiased_full"
    importlib.import_module("laplace_debiased.structures.ekfac")  # "debiased_ekfac"


def _structures_initialising() -> bool:
    """Whether ``laplace`` is being imported by a submodule of :mod:`laplace_debiased` that is
    still executing (defining the classes now would meet that partly executed module, e.g.
    ``posterior.implicit_kron``, the base of the K-FAC posterior). The classes are then defined
    when :mod:`laplace_debiased.structures` is imported: its ``__init__`` imports them all."""
    for name, module in list(sys.modules.items()):
        if name.startswith("laplace_debiased."):
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                return True
    return False


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Find ``laplace`` with the remaining finders and register once its module has executed."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname != "laplace":
            return None
        sys.meta_path.remove(self)  # one shot; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            if not _structures_initialising():  # else the structures package registers them itself
                register()

        spec.loader.exec_module = exec_then_register  # the loader object belongs to this spec alone
        return spec


def when_laplace_is_imported() -> None:
    """Register now if ``laplace`` is imported, else right after its import."""
    if "laplace" in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
