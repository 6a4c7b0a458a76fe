"""Optimisation with mini-batch quadratics: CG, debiased CG (:mod:`.cg`) and the ``NewtonCG``
optimizer (:mod:`.newton_cg`)."""
