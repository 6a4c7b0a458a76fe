"""The two-batch curvature computations as plain functions and small records, with no
laplace-torch import: the choice of B and B̃, the per-layer K-FAC factor passes, the debiased and
corrected decompositions, coverage and automatic batch sizing. They take tensors (and a
[`Reducer`][laplace_debiased.parallel.reducer.Reducer] for the cross-rank sums) and return
decompositions; the Laplace classes in [`laplace_debiased.structures`][laplace_debiased.structures] are
adapters over them."""
