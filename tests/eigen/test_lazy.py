"""The dense ``la.H`` of ``debiased_full`` formed on first read
(:mod:`laplace_debiased.eigen.lazy`)."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.eigen.lazy import PendingCurvature, formed_curvature
from tests.eigen.test_laplace import data_loader, make_la, reference_parts
from tests.curvature.test_eigen import explicit_curvature, tiny_mlp


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_debiased_full_forms_H_only_when_read(subset, monkeypatch):
    """fit + marglik tuning + GLM probit predictive never form the dense ``la.H``; reading it
    forms it once, as the dense formula, without invalidating the fitted eigenpairs."""
    from laplace_debiased.eigen import lazy as lazy_curvature

    formed = []
    original = lazy_curvature.symmetric_outer
    monkeypatch.setattr(lazy_curvature, "symmetric_outer", lambda Q, h: formed.append(1) or original(Q, h))
    model = tiny_mlp()
    loader = data_loader("classification", n=8, batch_size=4)  # rank G_B ≤ 8 < P: factored route
    la = make_la(model, "classification", subset, "debiased_full")
    la.fit(loader)
    la.optimize_prior_precision(method="marglik", n_steps=5, lr=0.1)
    la(loader.dataset.tensors[0], pred_type="glm", link_approx="probit")
    pairs = la.curvature_eigenpairs()
    assert formed == []
    module, B, Bt, _ = reference_parts(model, subset, loader, "classification")
    G_B = explicit_curvature(module, B, "classification") * 2
    G_Bt = explicit_curvature(module, Bt, "classification") * 2
    values, vectors = torch.linalg.eigh(G_B)
    U = vectors[:, values > 1e-10 * values.max()]
    Pi = torch.eye(len(G_B), dtype=torch.float64) - U @ U.T
    expected = U @ torch.diag(torch.diag(U.T @ G_Bt @ U)) @ U.T + Pi @ G_Bt @ Pi
    torch.testing.assert_close(la.H, expected, atol=1e-9, rtol=1e-9)
    assert la.H is la.H and formed == [1]
    assert la.curvature_eigenpairs()[0] is pairs[0]  # forming H is not a new curvature
    la.H = 2 * la.H  # assigning one is
    Q, h = la.curvature_eigenpairs()
    assert Q is not pairs[0]
    torch.testing.assert_close((Q * h) @ Q.T, 2 * expected, atol=1e-9, rtol=1e-9)


def test_debiased_full_refit_without_override_adds_to_lazy_H():
    """``override=False`` adds the second fit's curvature to the (lazily formed) first one."""
    model = tiny_mlp()
    loader = data_loader("classification", n=8, batch_size=4)
    once = make_la(model, "classification", "all", "debiased_full")
    once.fit(loader)
    twice = make_la(model, "classification", "all", "debiased_full")
    twice.fit(loader)
    twice.fit(loader, override=False)
    torch.testing.assert_close(twice.H, 2 * once.H, atol=1e-12, rtol=1e-12)


def test_formed_curvature_forms_a_pending_one_and_passes_the_rest_through():
    g = torch.Generator().manual_seed(0)
    Q = torch.linalg.qr(torch.randn(6, 3, generator=g, dtype=torch.float64))[0]
    h = torch.tensor([3.0, 1.0, 0.25], dtype=torch.float64)
    H = formed_curvature(PendingCurvature(Q, h), torch.device("cpu"), torch.float32)
    assert H.dtype == torch.float32 and H.shape == (6, 6) and torch.equal(H, H.T)
    torch.testing.assert_close(H, (Q @ torch.diag(h) @ Q.T).float(), rtol=1e-6, atol=1e-6)
    dense = torch.eye(6, dtype=torch.float64)
    assert formed_curvature(dense, torch.device("cpu"), torch.float32) is dense  # stored as it is
    assert formed_curvature(None, torch.device("cpu"), torch.float64) is None
