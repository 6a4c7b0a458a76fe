"""The Laplace classes, registered with laplace-torch's ``Laplace(...)`` factory.

* [`two_batch`][laplace_debiased.two_batch.base] -- ``TwoBatchLaplace``, the one adapter base listed
  before laplace-torch's
  class: the two-batch ``fit`` shared by every debiased class and thin overrides calling the
  functions of [`fit_checks`][laplace_debiased.two_batch.checks] (input checks),
  [`chunked`][laplace_debiased.two_batch.chunked] (the predictive over chunks of the inputs),
  [`token_outputs`][laplace_debiased.two_batch.token_outputs] (GLM predictive of token outputs, per-example
  Jacobians), [`gridsearch`][laplace_debiased.two_batch.gridsearch] (prior-precision grid search) and
  [`block_priors`][laplace_debiased.two_batch.block_priors] (per-block marglik);
* [`kron`][laplace_debiased.kron.laplace] -- ``DebiasedKron(LL)Laplace``
  (``hessian_structure="debiased_kron"``);
* [`ekfac`][laplace_debiased.ekfac.laplace] -- ``DebiasedEKFAC(LL)Laplace``
  (``hessian_structure="debiased_ekfac"``);
* [`lowrank`][laplace_debiased.eigen.laplace] -- ``DebiasedLowRank(LL)Laplace`` and
  ``DebiasedFull(LL)Laplace``.

The choice of B and B̃ and the K-FAC computations are in
[`laplace_debiased.computers`][laplace_debiased.computers].
"""

# Importing any submodule defines (and so registers) every debiased class.
import laplace_debiased.kron.laplace  # noqa: E402,F401
import laplace_debiased.ekfac.laplace  # noqa: E402,F401
import laplace_debiased.eigen.laplace  # noqa: E402,F401
