"""laplace-debiased: two-batch debiased mini-batch quadratics for laplace-torch.

Importing this package registers the debiased Hessian structures with laplace-torch's
``Laplace(...)`` factory (it finds subclasses of ``BaseLaplace`` by their ``_key``).

Layers, top to bottom (docs/architecture.md): the CLI ([`cli`][laplace_debiased.cli],
[`commands`][laplace_debiased.commands]), [`evaluation`][laplace_debiased.evaluation] and
[`diagnostics`][laplace_debiased.diagnostics], [`structures`][laplace_debiased.structures] (the Laplace
classes, adapters over the computations), [`posterior`][laplace_debiased.posterior] and
[`optim`][laplace_debiased.optim], [`computers`][laplace_debiased.computers] (the two-batch computations),
[`curvature`][laplace_debiased.curvature] (the maths), [`parallel`][laplace_debiased.parallel] (collectives),
[`data`][laplace_debiased.data], and [`prior_grid`][laplace_debiased.prior_grid] with the path, progress and
thread helpers.
"""

from importlib.metadata import PackageNotFoundError, version

from laplace_debiased import _register

try:
    __version__ = version("laplace-debiased")  # pyproject.toml's, as installed
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

# Registers the debiased structures now if laplace-torch is already imported, else right after
# its import, so that ``python -m laplace_debiased --help`` does not import torch.
_register.when_laplace_is_imported()
