"""Debiased K-FAC (``hessian_structure="debiased_kron"``): the factor passes over B ∪ B̃, the
estimates and decompositions, the corrected estimates, the posterior and the Laplace class."""
