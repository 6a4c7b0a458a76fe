"""Optimisation with mini-batch quadratics: CG, debiased CG (:mod:`.cg`) and the ``NewtonCG``
optimizer (:mod:`.newton_cg`)."""

from laplace_debiased.optim.newton_cg import NewtonCG, StepInfo

__all__ = ["NewtonCG", "StepInfo"]
