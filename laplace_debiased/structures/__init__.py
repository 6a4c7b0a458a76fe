"""The Laplace classes, registered with laplace-torch's ``Laplace(...)`` factory.

* :mod:`.batches` -- the choice and validation of the direction batch B and the magnitude batch B̃;
* :mod:`.two_batch` -- the two-batch ``fit`` shared by every debiased class, with its bases
  :mod:`.fit_checks` (input checks), :mod:`.chunked` (the predictive over chunks of the
  inputs), :mod:`.token_outputs` (GLM predictive of token outputs, per-example Jacobians) and
  :mod:`.gridsearch` (prior-precision grid search);
* :mod:`.kron` -- ``DebiasedKron(LL)Laplace`` (``hessian_structure="debiased_kron"``);
* :mod:`.lowrank` -- ``DebiasedLowRank(LL)Laplace`` and ``DebiasedFull(LL)Laplace``.
"""

# Importing any submodule defines (and so registers) every debiased class.
from laplace_debiased.structures import ekfac, kron, lowrank  # noqa: E402,F401
