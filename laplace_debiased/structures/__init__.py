"""The Laplace classes, registered with laplace-torch's ``Laplace(...)`` factory.

* :mod:`.two_batch` -- ``TwoBatchLaplace``, the one adapter base listed before laplace-torch's
  class: the two-batch ``fit`` shared by every debiased class and thin overrides calling the
  functions of :mod:`.fit_checks` (input checks), :mod:`.chunked` (the predictive over chunks of
  the inputs), :mod:`.token_outputs` (GLM predictive of token outputs, per-example Jacobians),
  :mod:`.gridsearch` (prior-precision grid search) and :mod:`.block_priors` (per-block marglik);
* :mod:`.kron` -- ``DebiasedKron(LL)Laplace`` (``hessian_structure="debiased_kron"``);
* :mod:`.ekfac` -- ``DebiasedEKFAC(LL)Laplace`` (``hessian_structure="debiased_ekfac"``);
* :mod:`.lowrank` -- ``DebiasedLowRank(LL)Laplace`` and ``DebiasedFull(LL)Laplace``.

The choice of B and B̃ and the K-FAC computations are in :mod:`laplace_debiased.computers`.
"""

# Importing any submodule defines (and so registers) every debiased class.
from laplace_debiased.structures import ekfac, kron, lowrank  # noqa: E402,F401
