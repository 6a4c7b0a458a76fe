"""laplace-debiased: two-batch debiased mini-batch quadratics for laplace-torch.

Importing this package registers the debiased Hessian structures with laplace-torch's
``Laplace(...)`` factory (it finds subclasses of ``BaseLaplace`` by their ``_key``).

The public API is at the top, ``import laplace_debiased as ld``: the Laplace classes
(``ld.DebiasedKronLaplace``, ...), ``ld.GridPredictive``, the main job, sweep and report
(``ld.run_pipeline``, ``ld.run_sweep``, ``ld.write_report``) and the bias diagnosis
(``ld.diagnose_bias``). Each is imported on first use, so that importing the package (and
``python -m laplace_debiased --help``) does not import torch. Deeper paths are for internals.

Layers, top to bottom (docs/architecture.md): the CLI ([`cli`][laplace_debiased.cli],
[`commands`][laplace_debiased.commands]), [`evaluation`][laplace_debiased.evaluation] and
[`diagnostics`][laplace_debiased.diagnostics], one package per structure
([`ekfac`][laplace_debiased.ekfac] on [`kron`][laplace_debiased.kron], and
[`eigen`][laplace_debiased.eigen]), the base they share ([`two_batch`][laplace_debiased.two_batch]),
[`posterior`][laplace_debiased.posterior] and [`optim`][laplace_debiased.optim],
[`curvature`][laplace_debiased.curvature] (the maths), [`parallel`][laplace_debiased.parallel]
(collectives), [`data`][laplace_debiased.data], and [`prior_grid`][laplace_debiased.prior_grid] with the
path, progress and thread helpers.
"""

from __future__ import annotations

import importlib
from typing import Any

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("laplace-debiased")  # pyproject.toml's, as installed
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

#: public name -> the module that defines it
_PUBLIC = {
    "DebiasedKronLaplace": "laplace_debiased.kron.laplace",
    "DebiasedKronLLLaplace": "laplace_debiased.kron.laplace",
    "DebiasedEKFACLaplace": "laplace_debiased.ekfac.laplace",
    "DebiasedEKFACLLLaplace": "laplace_debiased.ekfac.laplace",
    "DebiasedLowRankLaplace": "laplace_debiased.eigen.laplace",
    "DebiasedLowRankLLLaplace": "laplace_debiased.eigen.laplace",
    "DebiasedFullLaplace": "laplace_debiased.eigen.laplace",
    "DebiasedFullLLLaplace": "laplace_debiased.eigen.laplace",
    "GridPredictive": "laplace_debiased.posterior.grid",
    "run_pipeline": "laplace_debiased.evaluation.pipeline",
    "run_sweep": "laplace_debiased.evaluation.sweep",
    "EvalSet": "laplace_debiased.evaluation.sweep",
    "Method": "laplace_debiased.evaluation.methods",
    "write_report": "laplace_debiased.evaluation.report_page",
    "diagnose_bias": "laplace_debiased.diagnostics.bias",
}
__all__ = [
    "DebiasedEKFACLLLaplace", "DebiasedEKFACLaplace", "DebiasedFullLLLaplace", "DebiasedFullLaplace",
    "DebiasedKronLLLaplace", "DebiasedKronLaplace", "DebiasedLowRankLLLaplace", "DebiasedLowRankLaplace",
    "EvalSet", "GridPredictive", "Method", "diagnose_bias", "run_pipeline", "run_sweep", "write_report",
]


def __getattr__(name: str) -> Any:
    """The public name ``name``, imported from its module on first use (PEP 562)."""
    if name not in _PUBLIC:
        raise AttributeError(f"module 'laplace_debiased' has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


from laplace_debiased import _register  # noqa: E402

# Registers the debiased structures now if laplace-torch is already imported, else right after
# its import, so that ``python -m laplace_debiased --help`` does not import torch.
_register.when_laplace_is_imported()
