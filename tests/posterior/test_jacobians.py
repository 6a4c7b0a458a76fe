"""Jacobians of the logits (:mod:`laplace_debiased.posterior.jacobians`): the closed forms equal
torch.func's and laplace-torch's."""

from __future__ import annotations

import torch
from _models import fit_tiny_conv

from laplace_debiased.posterior.from_laplace import laplace_params
from laplace_debiased.posterior.jacobians import _func_jacobians, logit_jacobians

def test_closed_form_jacobians_equal_torch_func_and_laplace():
    la, X = fit_tiny_conv("kron", "all")
    f, jacs = logit_jacobians(la.model, laplace_params(la), X[:6])
    _, ref = _func_jacobians(la.model, laplace_params(la), X[:6])
    J = torch.cat([j.full().expand(6, -1, -1) for j in jacs], -1)  # output layer: shared (1, C, ·)
    torch.testing.assert_close(J, torch.cat([j.full() for j in ref], -1))
    J_lap, f_lap = la.backend.jacobians(X[:6])
    torch.testing.assert_close(J, J_lap)
    torch.testing.assert_close(f, f_lap)
