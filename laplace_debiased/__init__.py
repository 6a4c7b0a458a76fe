"""laplace-debiased: two-batch debiased mini-batch quadratics for laplace-torch.

Importing this package registers the debiased Hessian structures with laplace-torch's
``Laplace(...)`` factory (it finds subclasses of ``BaseLaplace`` by their ``_key``).

Layers, top to bottom (docs/architecture.md): the CLI (:mod:`.cli`, :mod:`.commands`),
:mod:`.evaluation` and :mod:`.diagnostics`, :mod:`.structures` (the Laplace classes, adapters
over the computations), :mod:`.posterior` and :mod:`.optim`, :mod:`.computers` (the two-batch
computations), :mod:`.curvature` (the maths), :mod:`.parallel` (collectives), :mod:`.data`, and
:mod:`.prior_grid` with the path, progress and thread helpers.
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
