"""laplace-debiased: two-batch debiased mini-batch quadratics for laplace-torch.

Importing this package registers the debiased Hessian structures with laplace-torch's
``Laplace(...)`` factory (it finds subclasses of ``BaseLaplace`` by their ``_key``).

Layout: :mod:`.curvature` (the maths), :mod:`.structures` (the Laplace classes),
:mod:`.evaluation` (predictive, metrics, sweeps, reports, main job), :mod:`.optim` (CG,
Newton-CG), :mod:`.data`, :mod:`.diagnostics`, and the CLI (:mod:`.cli`, :mod:`.commands`).
"""

__version__ = "0.1.0"
from laplace_debiased import _moved  # noqa: E402

_moved.install()
from laplace_debiased.structures import kron as _kron  # noqa: E402,F401  registers "debiased_kron"
from laplace_debiased.structures import lowrank as _lowrank  # noqa: E402,F401  registers "debiased_lowrank", "debiased_full"
from laplace_debiased.structures import ekfac as _ekfac  # noqa: E402,F401  registers "debiased_ekfac"
