"""Register the debiased structures with laplace-torch's factory, importing torch only when needed.

``Laplace(model, ..., hessian_structure="debiased_kron")`` finds its class among the subclasses of
``laplace.BaseLaplace`` by ``_key``, so the debiased classes must be defined before the first
factory call, and any such call is preceded by ``import laplace``.  ``import laplace_debiased``
therefore defines them at once if ``laplace`` is already imported, and otherwise right after
``laplace`` finishes importing (a one-shot meta-path hook).  The CLI's ``--help`` thus never
imports torch (about 2 s) or laplace-torch.

Two more things happen at registration:

* laplace-torch's ``Laplace(...)`` factory is wrapped (``explain_unknown_keys``) so that an
  unknown ``(subset_of_weights, hessian_structure)`` names the valid keys and the closest
  structure name; valid keys build the same classes as the unwrapped factory.
* laplace-torch's import logs through the root logger (``logging.info`` at module level), which
  gives the root logger a WARNING handler (``logging.basicConfig()``) and so turns a later
  ``logging.basicConfig(level=logging.INFO)`` of the user into a no-op.  When
  ``import laplace_debiased`` comes first, the handlers that laplace-torch's import added to the
  root logger are removed again, so the fit's INFO line on the batches it used appears under
  ``logging.basicConfig(level=logging.INFO)``.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.abc
import logging
import importlib.machinery
import importlib.util
import sys
import warnings
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any


#: The structure packages. Each defines (and so registers) its Laplace classes in its ``laplace``
#: module; a new structure is one more line here.
STRUCTURES = (
    "kron",  # "debiased_kron"
    "ekfac",  # "debiased_ekfac"
    "eigen",  # "debiased_lowrank", "debiased_full"
)


def define_structures() -> None:
    """Import every structure's ``laplace`` module, which defines its classes."""
    for name in STRUCTURES:
        importlib.import_module(f"laplace_debiased.{name}.laplace")


def register() -> None:
    """Define (and so register) every debiased Laplace class, and wrap the factory."""
    define_structures()
    wrap_factory()


def unknown_key_message(subset_of_weights: object, hessian_structure: object, keys: Iterable[tuple]) -> str:
    """The error for a ``(subset_of_weights, hessian_structure)`` pair that no Laplace class has:
    the valid structures for that subset (or all keys), and the closest structure name."""
    keys = sorted({(str(s), str(h)) for s, h in keys})
    structures = sorted({h for s, h in keys if s == str(subset_of_weights)}) or sorted({h for _, h in keys})
    subsets = sorted({s for s, _ in keys})
    message = (
        f"Unsupported Laplace combination: subset_of_weights={subset_of_weights!r}, "
        f"hessian_structure={hessian_structure!r}. Valid subset_of_weights: {subsets}; valid "
        f"hessian_structure for subset_of_weights={subset_of_weights!r}: {structures}."
    )
    close = difflib.get_close_matches(str(hessian_structure), structures, n=2, cutoff=0.6)
    if close:
        message += " Did you mean " + " or ".join(f"hessian_structure={c!r}" for c in close) + "?"
    return message


def explain_unknown_keys(factory: Callable[..., Any], keys: Callable[[], Iterable[tuple]]) -> Callable[..., Any]:
    """``factory`` (laplace-torch's ``Laplace``), which first defines the debiased classes
    (``define_structures``) and whose "Unsupported Laplace combination" error is replaced by
    ``unknown_key_message`` over the registered ``keys()``."""

    @functools.wraps(factory)
    def laplace_factory(model, likelihood, subset_of_weights="last_layer", hessian_structure="kron", *args, **kwargs):
        define_structures()
        try:
            return factory(model, likelihood, subset_of_weights, hessian_structure, *args, **kwargs)
        except ValueError as err:
            if not str(err).startswith("Unsupported Laplace combination"):
                raise
            raise ValueError(unknown_key_message(subset_of_weights, hessian_structure, keys())) from err

    laplace_factory.explains_unknown_keys = True
    return laplace_factory


def wrap_factory() -> None:
    """Replace ``laplace.Laplace`` (and ``laplace.laplace.Laplace``) by
    ``explain_unknown_keys`` of it, once."""
    import laplace
    import laplace.laplace as factory_module
    from laplace.baselaplace import BaseLaplace

    if getattr(laplace.Laplace, "explains_unknown_keys", False):
        return

    def keys() -> list[tuple]:
        found, todo = [], [BaseLaplace]
        while todo:
            cls = todo.pop()
            todo.extend(cls.__subclasses__())
            if hasattr(cls, "_key"):
                found.append(cls._key)
        return found

    laplace.Laplace = factory_module.Laplace = explain_unknown_keys(factory_module.Laplace, keys)


def _structures_initialising() -> bool:
    """Whether ``laplace`` is being imported by a submodule of [`laplace_debiased`][laplace_debiased] that is
    still executing (defining the classes now would meet that partly executed module, e.g.
    ``kron.posterior``, the base of the K-FAC posterior). The classes are then defined by the
    factory's first call (``explain_unknown_keys``)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("laplace_debiased."):
            if getattr(getattr(module, "__spec__", None), "_initializing", False):
                return True
    return False


#: Warnings that laplace-torch's own import chain emits under newer torch and that no user can act
#: on: asdl (``asdfghjkl`` 0.1a4, imported by laplace-torch 0.3) decorates with ``torch.jit.script``,
#: which torch 2.15 deprecates with a FutureWarning at import.
DEPENDENCY_IMPORT_WARNINGS = (r"`torch\.jit\.script` is deprecated",)


def exec_quietly(exec_module: Callable[[ModuleType], None], module: ModuleType) -> None:
    """``exec_module(module)`` with the FutureWarnings of
    [`DEPENDENCY_IMPORT_WARNINGS`][laplace_debiased._register.DEPENDENCY_IMPORT_WARNINGS] ignored;
    every other warning passes."""
    with warnings.catch_warnings():
        for message in DEPENDENCY_IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=FutureWarning)
        exec_module(module)


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
            root = logging.getLogger()
            handlers = list(root.handlers)
            exec_quietly(exec_module, module)
            for handler in [h for h in root.handlers if h not in handlers]:  # laplace-torch's basicConfig()
                root.removeHandler(handler)
            if _structures_initialising():  # the factory's first call defines the classes
                wrap_factory()
            else:
                register()

        spec.loader.exec_module = exec_then_register  # the loader object belongs to this spec alone
        return spec


def when_laplace_is_imported() -> None:
    """Register now if ``laplace`` is imported, else right after its import."""
    if "laplace" in sys.modules:
        register()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
