"""Posterior maths shared by the structure packages and ``evaluation/``: the grid structures of a
fitted Laplace approximation (their covariances, variances and square roots), the per-example
logit Jacobians of the linearised network, the link approximations and the grid predictive.

Modules: [`links`][laplace_debiased.posterior.links] (``(f, Σ)`` -> probabilities),
[`jacobians`][laplace_debiased.posterior.jacobians] (``LayerJacobian``, ``logit_jacobians``),
[`grams`][laplace_debiased.posterior.grams] (weighted Gram matrices shared by the structures),
[`kron_structure`][laplace_debiased.posterior.kron_structure] (``KronStructure``),
[`eigen_structure`][laplace_debiased.posterior.eigen_structure] (``EigenStructure``), [`from_laplace`][laplace_debiased.posterior.from_laplace] (which
structure a fitted laplace-torch object has) and [`grid`][laplace_debiased.posterior.grid] (``GridPredictive``
and the one-pass prior-precision grid search).
"""
