"""The two-batch base every debiased Laplace class stands on, and what only it uses: the choice of
B and B̃, input checks, coverage, the chunked and token-output predictives, the grid search,
per-block priors, the automatic size of B̃, saved state and cross-fitting."""
