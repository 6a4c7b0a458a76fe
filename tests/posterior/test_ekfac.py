"""The debiased EKFAC posterior (:mod:`laplace_debiased.posterior.ekfac`) against dense matrices."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from _models import loader, tiny_mlp, toy_data
from laplace_debiased.posterior.ekfac import EKFACDecomposed
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.structures.ekfac import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace

CLASSES = {"all": DebiasedEKFACLaplace, "last_layer": DebiasedEKFACLLLaplace}


def _basis(H: EKFACDecomposed) -> torch.Tensor:
    """The dense block-diagonal eigenbasis ``Q`` (columns in eigenvalue order)."""
    return torch.block_diag(*[torch.kron(*Qs) if len(Qs) == 2 else Qs[0] for Qs in H.eigenvectors])


def _eigenvalues(H: EKFACDecomposed) -> torch.Tensor:
    return torch.cat([lam.reshape(-1) for lam in H.eigenvalues])


def test_posterior_precision_is_diagonal_plus_prior_in_the_basis():
    model = tiny_mlp()
    la = DebiasedEKFACLaplace(model, "classification", temperature=0.5)
    la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    delta = torch.tensor([0.3, 1.0, 2.0, 5.0], dtype=torch.float64)
    la.prior_precision = delta
    Q, lam = _basis(la.H), _eigenvalues(la.H)
    sizes = [p.numel() for p in model.parameters()]
    prior = torch.repeat_interleave(delta, torch.tensor(sizes))
    dense = Q @ torch.diag(lam / 0.5 + prior) @ Q.T
    P = la.posterior_precision
    torch.testing.assert_close(P.to_matrix(), dense, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(P.to_matrix(-1), torch.linalg.inv(dense), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(P.diag(-1), torch.linalg.inv(dense).diagonal(), atol=1e-12, rtol=1e-8)
    torch.testing.assert_close(la.log_det_posterior_precision, torch.logdet(dense), atol=1e-10, rtol=1e-10)
    W = torch.randn(5, 3, sum(sizes), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(la.functional_variance(W), W @ torch.linalg.inv(dense) @ W.transpose(1, 2))
    v = la.mean + 0.1
    torch.testing.assert_close(la.square_norm(v), (v - la.mean) @ dense @ (v - la.mean))


@pytest.mark.parametrize("cross_fit", [False, True])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_grid_predictive_of_a_float32_model_matches_float64(subset, cross_fit):
    """The grid structure holds the float32 eigenbasis in float64 (it used to mix dtypes)."""
    ds = toy_data(32, (4,), 3, "classification")
    X = toy_data(5, (4,), 3, "classification", seed=7).tensors[0]
    grid = [1e-3, 0.5, 10.0]
    out = {}
    for dtype in (torch.float32, torch.float64):
        data = TensorDataset(ds.tensors[0].to(dtype), ds.tensors[1])
        la = CLASSES[subset](tiny_mlp().to(dtype), "classification")
        la.fit(loader(data, 8), cross_fit=cross_fit)
        out[dtype] = GridPredictive(la, chunk_size=4).grid(X.to(dtype), grid, links=("probit",))["probit"]
    assert torch.isfinite(out[torch.float32]).all()
    torch.testing.assert_close(out[torch.float32].double(), out[torch.float64], atol=1e-4, rtol=1e-4)
