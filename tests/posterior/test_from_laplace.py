"""Reading a fitted laplace-torch object (:mod:`laplace_debiased.posterior.from_laplace`): its
parameters (last layer for LL variants) and its curvature as a K-FAC or eigen structure that
holds the same precision."""

from __future__ import annotations

import pytest
import torch
from _models import fit_tiny_conv
from laplace import Laplace
from torch import nn

from laplace_debiased.posterior.eigen_structure import EigenStructure
from laplace_debiased.posterior.from_laplace import laplace_params, posterior_structure
from laplace_debiased.posterior.kron_structure import KronStructure


def test_parameters_are_all_or_the_last_layers():
    la, _ = fit_tiny_conv("kron", "all")
    assert [p.shape for p in laplace_params(la)] == [p.shape for p in la.model.parameters()]
    ll, _ = fit_tiny_conv("kron", "last_layer")
    last = ll.model.last_layer
    assert [id(p) for p in laplace_params(ll)] == [id(p) for p in last.parameters()]


def test_a_dense_curvature_becomes_an_eigen_structure_of_the_same_matrix():
    la, _ = fit_tiny_conv("full", "last_layer")
    struct = posterior_structure(la)
    assert isinstance(struct, EigenStructure)
    H = la.H.double()
    lam, U = torch.linalg.eigh(H)
    rebuilt = (struct.U.double() * struct.lam.double()) @ struct.U.double().T
    scale = float(lam.abs().max())
    torch.testing.assert_close(rebuilt, (U * lam.clamp_min(0)) @ U.T, atol=1e-10 * scale, rtol=0)


def test_a_kron_curvature_becomes_a_kron_structure_and_an_unfitted_one_is_refused():
    la, _ = fit_tiny_conv("kron", "all")
    assert isinstance(posterior_structure(la), KronStructure)
    unfitted = Laplace(nn.Linear(2, 2).double(), "classification", subset_of_weights="all", hessian_structure="diag")
    with pytest.raises(TypeError, match="no eigenbasis for curvature"):
        posterior_structure(unfitted)
