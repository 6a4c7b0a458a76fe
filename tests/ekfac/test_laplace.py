"""Debiased EKFAC against dense explicit matrices on a tiny MLP and a tiny CNN (float64)."""

from __future__ import annotations

import io

import pytest
import torch
from curvlinops import EKFACLinearOperator, FisherType
from hypothesis import given, settings
from hypothesis import strategies as st
from laplace import Laplace
from laplace.curvature import AsdlEF, AsdlGGN, CurvlinopsEF, CurvlinopsGGN, CurvlinopsHessian
from torch import nn
from torch.utils.data import TensorDataset

from _models import dense_kfac, exact_ggn, kfac_to_dense, loader, tiny_cnn, tiny_mlp, toy_data
from _projections import parameter_blocks, projection
from laplace_debiased.ekfac.passes import ekfac_to_dense, kron_eigenbasis, measure_ekfac_eigenvalues
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.ekfac.posterior import EKFACDecomposed
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace

MODELS = {"mlp": (tiny_mlp, (4,)), "cnn": (tiny_cnn, (1, 5, 5))}
CLASSES = {"all": DebiasedEKFACLaplace, "last_layer": DebiasedEKFACLLLaplace}


def _basis(H: EKFACDecomposed) -> torch.Tensor:
    """The dense block-diagonal eigenbasis ``Q`` (columns in eigenvalue order)."""
    return torch.block_diag(*[torch.kron(*Qs) if len(Qs) == 2 else Qs[0] for Qs in H.eigenvectors])


def _eigenvalues(H: EKFACDecomposed) -> torch.Tensor:
    return torch.cat([lam.reshape(-1) for lam in H.eigenvalues])


def exact_ef(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Dense empirical Fisher ``Σ_n ∇ℓ_n ∇ℓ_nᵀ`` of the cross-entropy (per-sample gradients)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, t):
        f = torch.func.functional_call(model, p, (x[None],))
        return nn.functional.cross_entropy(f, t[None], reduction="sum")

    g = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, X, y)
    G = torch.cat([v.flatten(1) for v in g.values()], 1)
    return G.T @ G


def _last_block(M: torch.Tensor, model: nn.Module, n_last: int = 2) -> torch.Tensor:
    p = sum(q.numel() for q in list(model.parameters())[-n_last:])
    return M[-p:, -p:]


def test_factory_dispatch():
    m = tiny_mlp()
    assert type(Laplace(m, "classification", hessian_structure="debiased_ekfac")) is DebiasedEKFACLLLaplace
    assert type(Laplace(m, "classification", "all", "debiased_ekfac")) is DebiasedEKFACLaplace


@pytest.mark.parametrize("subset", ["all", "last_layer"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("backend", [CurvlinopsGGN, AsdlGGN])
def test_eigenvalues_are_dense_ggn_diagonal_in_b_basis(name, likelihood, subset, backend):
    """Λ = N/|B̃| · diag(Qᵀ GGN_B̃ Q), Q the eigenbasis of B's K-FAC (conv: exact weight sharing)."""
    make, shape = MODELS[name]
    model = make()
    N, m = 72, 24
    ds = toy_data(N, shape, 3, likelihood)
    X = ds.tensors[0]
    la = CLASSES[subset](model, likelihood, backend=backend)
    la.fit(loader(ds, m))  # B = 0..23, B̃ = 24..47
    ggn = exact_ggn(model, X[m : 2 * m], likelihood) * (N / m)
    kfac_B = kfac_to_dense(dense_kfac(model, X[:m], likelihood))
    if subset == "last_layer":
        ggn, kfac_B = _last_block(ggn, model), _last_block(kfac_B, model)
    Q = _basis(la.H)
    torch.testing.assert_close(Q.T @ Q, torch.eye(len(Q), dtype=Q.dtype), atol=1e-10, rtol=0)
    # Q is B's K-FAC eigenbasis: it diagonalises B's K-FAC ...
    D = Q.T @ kfac_B @ Q
    torch.testing.assert_close(D, torch.diag(D.diagonal()), atol=1e-9 * D.abs().max(), rtol=0)
    # ... and the eigenvalues are B̃'s exact curvature along it
    torch.testing.assert_close(_eigenvalues(la.H), torch.diag(Q.T @ ggn @ Q), atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(la.H.to_matrix(), Q @ torch.diag(torch.diag(Q.T @ ggn @ Q)) @ Q.T, atol=1e-10, rtol=1e-8)
    # neither the GGN of B̃ (EKFAC drops the off-diagonal) nor plain EKFAC of B
    assert not torch.allclose(la.H.to_matrix(), ggn, atol=1e-6)


@pytest.mark.parametrize("backend", [CurvlinopsEF, AsdlEF])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_ef_backends_measure_the_empirical_fisher(name, backend):
    make, shape = MODELS[name]
    model = make()
    ds = toy_data(32, shape, 3, "classification")
    X, y = ds.tensors
    la = DebiasedEKFACLaplace(model, "classification", backend=backend)
    la.fit(loader(ds, 8))  # B = 0..7, B̃ = 8..15
    ef = exact_ef(model, X[8:16], y[8:16]) * 32 / 8
    # diag(Qᵀ EF Q) per block; with the rows of curvlinops' shared pass the cnn's Linear(18, 3) input
    # factor (8 rows) keeps its complement implicit, with the mean over it (the Frobenius projection
    # onto B's eigenprojections)
    want = [projection(Qs, C) for Qs, C in zip(la.H.eigenvectors, parameter_blocks(ef, model))]
    implicit = any(Q.shape[1] < Q.shape[0] for Qs in la.H.eigenvectors for Q in Qs)
    assert implicit == (name == "cnn" and backend is CurvlinopsEF)
    torch.testing.assert_close(_eigenvalues(la.H), torch.cat([w.flatten() for w in want]), atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_same_batch_is_curvlinops_ekfac_scaled_to_n_data(name):
    """B̃ = B: plain EKFAC of B (curvlinops' own operator on B), times N/|B|."""
    make, shape = MODELS[name]
    model = make()
    ds = toy_data(40, shape, 3, "classification")
    dl = loader(ds, 8)
    la = DebiasedEKFACLaplace(model, "classification")
    la.fit(dl, magnitude_loader=dl)
    X, y = ds.tensors
    op = EKFACLinearOperator(
        model, nn.CrossEntropyLoss(reduction="sum"), list(model.parameters()), [(X[:8], y[:8])],
        fisher_type=FisherType.TYPE2, separate_weight_and_bias=True, check_deterministic=False,
    )
    P = sum(p.numel() for p in model.parameters())
    ref = (op @ torch.eye(P, dtype=torch.float64)) * 40 / 8
    torch.testing.assert_close(la.H.to_matrix(), ref, atol=1e-10, rtol=1e-8)
    # and it is not plain K-FAC
    kfac = kfac_to_dense(dense_kfac(model, X[:8], "classification")) * 40 / 8
    assert not torch.allclose(la.H.to_matrix(), kfac, atol=1e-6)




@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_predictives_normalised_and_grid_matches_laplace_torch(subset):
    la = CLASSES[subset](tiny_cnn(), "classification", prior_precision=0.5)
    ds = toy_data(48, (1, 5, 5), 3, "classification")
    la.fit(loader(ds, 16))
    X = toy_data(6, (1, 5, 5), 3, "classification", seed=9).tensors[0]
    for link in ("probit", "mc", "bridge", "bridge_norm"):
        p = la(X, pred_type="glm", link_approx=link, n_samples=50)
        assert torch.isfinite(p).all() and (p >= 0).all()
        torch.testing.assert_close(p.sum(-1), torch.ones(6, dtype=p.dtype))
    p = la(X, pred_type="nn", link_approx="mc", n_samples=20)
    torch.testing.assert_close(p.sum(-1), torch.ones(6, dtype=p.dtype))
    grid = [1e-3, 0.5, 10.0]
    ours = GridPredictive(la, chunk_size=4).grid(X, grid, links=("probit",))["probit"]
    for g, delta in enumerate(grid):
        la.prior_precision = delta
        torch.testing.assert_close(ours[g], la(X, pred_type="glm", link_approx="probit"), rtol=1e-10, atol=1e-12)
    assert (ours[0] - ours[-1]).abs().max() > 1e-3


def test_sample_covariance_is_inverse_posterior_precision():
    la = DebiasedEKFACLaplace(tiny_mlp(), "classification", prior_precision=3.0)
    la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    s = la.sample(n_samples=20000, generator=torch.Generator().manual_seed(0))
    ref = la.posterior_precision.to_matrix(-1)
    assert torch.allclose(torch.cov((s - la.mean).T), ref, atol=0.05 * ref.diag().max())


@pytest.mark.parametrize("cross_fit", [False, True])
@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_state_dict_round_trip_weights_only(subset, cross_fit):
    cls = CLASSES[subset]
    la = cls(tiny_mlp(), "classification", prior_precision=0.5, cross_fit=cross_fit)
    la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    buf = io.BytesIO()
    torch.save(la.state_dict(), buf)
    buf.seek(0)
    new = cls(tiny_mlp(), "classification")
    new.load_state_dict(torch.load(buf, weights_only=True))
    assert type(new.H) is type(la.H)
    assert torch.equal(new.posterior_precision.to_matrix(-1), la.posterior_precision.to_matrix(-1))
    X = toy_data(4, (4,), 3, "classification", seed=5).tensors[0]
    assert torch.equal(new(X), la(X))
    assert torch.equal(new.log_marginal_likelihood(), la.log_marginal_likelihood())


def test_float32_model():
    ds = toy_data(32, (4,), 3, "classification")
    ds = TensorDataset(ds.tensors[0].float(), ds.tensors[1])
    for cls in CLASSES.values():
        la = cls(tiny_mlp().float(), "classification")
        la.fit(loader(ds, 8))
        assert la.H.eigenvalues[0].dtype == torch.float32
        p = la(ds.tensors[0][:3])
        assert p.dtype == torch.float32 and torch.isfinite(p).all()




@settings(max_examples=8, deadline=None)
@given(st.permutations(list(range(8))))
def test_invariant_to_sample_order_within_magnitude_batch(perm):
    ds = toy_data(16, (4,), 3, "classification")
    X, y = ds.tensors
    order = torch.tensor(list(range(8)) + [8 + i for i in perm])
    ref = DebiasedEKFACLaplace(tiny_mlp(), "classification")
    ref.fit(loader(ds, 8))
    la = DebiasedEKFACLaplace(tiny_mlp(), "classification")
    la.fit(loader(TensorDataset(X[order], y[order]), 8))
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)


def test_bad_inputs_get_clear_errors():
    dl = loader(toy_data(32, (4,), 3, "classification"), 8)
    with pytest.raises(ValueError, match="damping"):
        DebiasedEKFACLaplace(tiny_mlp(), "classification", damping=True)
    la = DebiasedEKFACLaplace(tiny_mlp(), "classification")
    with pytest.raises(ValueError, match="override=False"):
        la.fit(dl, override=False)
    with pytest.raises(TypeError, match="cross_fit"):
        DebiasedEKFACLaplace(tiny_mlp(), "classification", cross_fit="yes")
    with pytest.raises(ValueError, match="GGN/Fisher/EF"):
        DebiasedEKFACLaplace(tiny_mlp(), "classification", backend=CurvlinopsHessian).fit(dl)
    model = nn.Sequential(nn.Linear(4, 3), nn.PReLU(), nn.Linear(3, 3)).double()
    with pytest.raises(ValueError, match="PReLU"):
        DebiasedEKFACLaplace(model, "classification").fit(dl)
    X, y = dl.dataset.tensors
    X = X.clone()
    X[9, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        la.fit(loader(TensorDataset(X, y), 8))
    with pytest.raises(ValueError, match="scalar or one value per parameter block"):
        la.fit(dl)
        la.H + torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="reduction='sum'"):
        measure_ekfac_eigenvalues(
            la.model, nn.CrossEntropyLoss(), list(la.model.parameters()), [(X[:8], y[:8])],
            kron_eigenbasis(la.H_facs.kfacs),
        )


# cross-fitting (shared with debiased_kron): tests/test_cross_fit.py


def test_ekfac_to_dense_matches_block_formula():
    g = torch.Generator().manual_seed(0)
    Q1 = torch.linalg.qr(torch.randn(3, 3, generator=g, dtype=torch.float64))[0]
    Q2 = torch.linalg.qr(torch.randn(2, 2, generator=g, dtype=torch.float64))[0]
    lam = torch.rand(3, 2, generator=g, dtype=torch.float64)
    Q = torch.kron(Q1, Q2)
    torch.testing.assert_close(ekfac_to_dense([[Q1, Q2]], [lam]), Q @ torch.diag(lam.flatten()) @ Q.T)


@pytest.mark.parametrize("cross_fit", [False, True])
def test_marglik_prior_optimisation_increases_evidence(cross_fit):
    la = DebiasedEKFACLaplace(tiny_mlp(), "classification", cross_fit=cross_fit)
    la.fit(loader(toy_data(32, (4,), 3, "classification"), 8))
    before = la.log_marginal_likelihood(torch.tensor([1.0], dtype=torch.float64)).item()
    la.optimize_prior_precision(method="marglik", n_steps=50)
    assert la.log_marginal_likelihood().item() > before
