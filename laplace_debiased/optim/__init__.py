"""Optimisation with mini-batch quadratics: CG, debiased CG ([`cg`][laplace_debiased.optim.cg]) and the
``NewtonCG`` optimizer ([`newton_cg`][laplace_debiased.optim.newton_cg])."""
