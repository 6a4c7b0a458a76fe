"""laplace-debiased: two-batch debiased mini-batch quadratics for laplace-torch.

Importing this package registers the debiased Hessian structures with laplace-torch's
``Laplace(...)`` factory (it finds subclasses of ``BaseLaplace`` by their ``_key``).
"""

__version__ = "0.1.0"
from laplace_debiased import kron as _kron  # noqa: E402,F401  registers "debiased_kron"
from laplace_debiased import lowrank as _lowrank  # noqa: E402,F401  registers "debiased_lowrank", "debiased_full"
