"""Debiased EKFAC (``hessian_structure="debiased_ekfac"``), standing on debiased K-FAC: B's K-FAC
eigenbasis, B̃'s exact curvature diagonal in it, the posterior and the Laplace class."""
