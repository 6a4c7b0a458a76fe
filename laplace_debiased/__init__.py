"""laplace-debiased: two-batch debiased mini-batch quadratics for laplace-torch.

Importing this package registers the debiased Hessian structures with laplace-torch's
``Laplace(...)`` factory (it finds subclasses of ``BaseLaplace`` by their ``_key``).

Layout: :mod:`.curvature` (the maths), :mod:`.structures` (the Laplace classes),
:mod:`.evaluation` (predictive, metrics, sweeps, reports, main job), :mod:`.optim` (CG,
Newton-CG), :mod:`.data`, :mod:`.diagnostics`, and the CLI (:mod:`.cli`, :mod:`.commands`).
"""

__version__ = "0.1.0"
from laplace_debiased import _register  # noqa: E402

# Registers the debiased structures now if laplace-torch is already imported, else right after
# its import, so that ``python -m laplace_debiased --help`` does not import torch.
_register.when_laplace_is_imported()
