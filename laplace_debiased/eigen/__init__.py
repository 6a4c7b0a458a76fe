"""Debiased low-rank and full Laplace (``"debiased_lowrank"``, ``"debiased_full"``): the
eigenpairs of B re-measured on B̃, the posterior, the marginal likelihood from the eigenpairs, the
lazily formed dense curvature and the Laplace classes."""
