"""Posterior maths below ``structures/`` and ``evaluation/``: the posterior structures of a
fitted Laplace approximation (their covariances, variances and square roots), the per-example
logit Jacobians of the linearised network, the link approximations and the grid predictive.

Modules: :mod:`.links` (``(f, Σ)`` -> probabilities), :mod:`.jacobians` (``LayerJacobian``,
``logit_jacobians``), :mod:`.grams` (weighted Gram matrices shared by the structures),
:mod:`.kron` (``KronStructure``), :mod:`.eigen` (``EigenStructure``), :mod:`.lowrank`
(float64 functional covariances for laplace-torch's own predictive paths), :mod:`.from_laplace`
(which structure a fitted laplace-torch object has) and :mod:`.grid` (``GridPredictive`` and the
one-pass prior-precision grid search).
"""
