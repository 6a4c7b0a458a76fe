"""Debiased K-FAC against dense explicit matrices on a tiny MLP and a tiny CNN (float64)."""

import pytest
import torch
from laplace import KronLaplace
from laplace.curvature import AsdlEF, AsdlGGN, CurvlinopsEF, CurvlinopsGGN

from _models import (
    dense_kfac,
    diagonal_blocks,
    exact_ggn,
    kfac_to_dense,
    loader,
    tiny_cnn,
    tiny_mlp,
    toy_data,
)
from laplace_debiased.kron.laplace import DebiasedKronLaplace

MODELS = {"mlp": (tiny_mlp, (4,)), "cnn": (tiny_cnn, (1, 5, 5))}


def _scaled(blocks, s):
    return [[F[0] * s, *F[1:]] for F in blocks]


def test_reference_kfac_is_exact_ggn_for_single_sample():
    """Anchor of the dense reference: one sample, one output position => exact GGN blocks."""
    for model, shape in [(tiny_mlp(), (4,)), (tiny_cnn(), (1, 3, 3))]:
        if shape == (1, 3, 3):  # conv with a single output position
            model = torch.nn.Sequential(
                model[0], torch.nn.Tanh(), torch.nn.Flatten(), torch.nn.Linear(2, 3)
            ).double()
        X = toy_data(1, shape, 3, "classification").tensors[0]
        ref = dense_kfac(model, X, "classification")
        exact = diagonal_blocks(exact_ggn(model, X, "classification"), model)
        for F, E in zip(ref, exact):
            torch.testing.assert_close(kfac_to_dense([F]), E, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("backend", [CurvlinopsGGN, AsdlGGN])
def test_debiased_block_equals_dense_formula(name, likelihood, backend):
    make, shape = MODELS[name]
    model = make()
    # m = 24 > 18 input features of every layer: B's factors have no degenerate
    # eigenspaces, so their eigenvectors (and the debiased matrix) are unique
    N, m = 72, 24
    ds = toy_data(N, shape, 3, likelihood)
    X, y = ds.tensors
    la = DebiasedKronLaplace(model, likelihood, backend=backend, estimator="paper")
    la.fit(loader(ds, m))  # B = samples 0..23, B̃ = 24..47
    ref_B = _scaled(dense_kfac(model, X[:m], likelihood), N / m)
    ref_Bt = _scaled(dense_kfac(model, X[m : 2 * m], likelihood), N / m)
    # the stored factor sets are the reference K-FAC of B and B̃ (Kronecker products)
    for facs, ref in ((la.H_facs, ref_B), (la.H_facs_magnitude, ref_Bt)):
        for F, R in zip(facs.kfacs, ref):
            torch.testing.assert_close(kfac_to_dense([F]), kfac_to_dense([R]), atol=1e-10, rtol=1e-8)
    expected, start = [], 0
    for FB, FBt in zip(ref_B, ref_Bt):
        Us = [torch.linalg.eigh(F)[1] for F in FB]
        U = torch.kron(Us[0], Us[1]) if len(Us) == 2 else Us[0]
        K_Bt = kfac_to_dense([FBt])
        lam = torch.diag(U.T @ K_Bt @ U)
        K_hat = U @ torch.diag(lam) @ U.T
        expected.append(K_hat)
        # u^T K̂ u = u^T K_B̃ u for every eigenvector u of K_B
        torch.testing.assert_close(torch.diag(U.T @ K_hat @ U), torch.diag(U.T @ K_Bt @ U), atol=1e-10, rtol=1e-8)
    dense = torch.block_diag(*expected)
    torch.testing.assert_close(la.H.to_matrix(), dense, atol=1e-9, rtol=1e-8)
    # and it is neither K-FAC on B nor on B̃ alone
    assert not torch.allclose(la.H.to_matrix(), kfac_to_dense(ref_B), atol=1e-6)
    assert not torch.allclose(la.H.to_matrix(), kfac_to_dense(ref_Bt), atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_ef_backends_agree(name):
    make, shape = MODELS[name]
    ds = toy_data(16, shape, 3, "classification")
    mats = []
    for backend in (CurvlinopsEF, AsdlEF):
        la = DebiasedKronLaplace(make(), "classification", backend=backend)
        la.fit(loader(ds, 8))
        mats.append(la.H.to_matrix())
    torch.testing.assert_close(mats[0], mats[1], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_same_batch_reduces_to_kron_laplace(name, likelihood):
    make, shape = MODELS[name]
    model = make()
    dl = loader(toy_data(8, shape, 3, likelihood), 8)  # one batch B, N = |B|
    la = DebiasedKronLaplace(model, likelihood, prior_precision=0.7)
    la.fit(dl, magnitude_loader=dl)
    ref = KronLaplace(model, likelihood, prior_precision=0.7)
    ref.fit(dl)
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(la.log_marginal_likelihood(), ref.log_marginal_likelihood(), atol=1e-9, rtol=1e-10)
    X = dl.dataset.tensors[0][:3]
    out, ref_out = la(X, pred_type="glm"), ref(X, pred_type="glm")
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref_out if isinstance(ref_out, tuple) else (ref_out,)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_same_batch_scaled_to_n_data():
    """B̃ = B inside a larger data set: the plain K-FAC of B scaled by N/|B|."""
    model = tiny_mlp()
    ds = toy_data(40, (4,), 3, "classification")
    dl = loader(ds, 8)
    la = DebiasedKronLaplace(model, "classification")
    la.fit(dl, magnitude_loader=dl)
    ref = kfac_to_dense(dense_kfac(model, ds.tensors[0][:8], "classification"))
    torch.testing.assert_close(la.H.to_matrix(), ref * 40 / 8, atol=1e-10, rtol=1e-8)


def test_halves_match_full_fit_scale():
    """Debiased full-batch (halves) is on the scale of KronLaplace's full fit (same N)."""
    model = tiny_mlp()
    ds = toy_data(400, (4,), 3, "classification", seed=3)
    dl = loader(ds, 50)
    la = DebiasedKronLaplace(model, "classification", split="halves", estimator="paper")
    la.fit(dl)
    full = KronLaplace(model, "classification")
    full.fit(dl)
    # exact: each debiased block's trace is the trace of B̃'s K-FAC block (scaled to N=400)
    X = ds.tensors[0]
    ref_Bt = _scaled(dense_kfac(model, X[200:], "classification"), 400 / 200)
    deb = la.H.to_matrix()
    for blk, R, F in zip(_split_blocks(deb, model), ref_Bt, full.H_facs.kfacs):
        torch.testing.assert_close(blk.trace(), kfac_to_dense([R]).trace(), rtol=1e-9, atol=1e-12)
        ratio = blk.trace() / kfac_to_dense([F]).trace()
        assert 0.85 < float(ratio) < 1.15, ratio  # statistically: half the data ≈ all data
    # the loss of the halves fit is the exact summed loss over all data
    torch.testing.assert_close(la.loss, full.loss, rtol=1e-12, atol=1e-9)
    assert la.n_data == full.n_data == 400


def _split_blocks(M, model):
    from _models import diagonal_blocks as blocks

    return blocks(M, model)


def test_damping_is_kept_in_posterior_precision():
    model = tiny_mlp()
    la = DebiasedKronLaplace(model, "classification", damping=True, prior_precision=2.0)
    la.fit(loader(toy_data(16, (4,), 3, "classification"), 8))
    P = la.posterior_precision
    assert P.damping
    dense = []
    for Qs, ls in zip(la.H.eigenvectors, la.H.eigenvalues):
        if len(ls) == 2:
            Q = torch.kron(Qs[0], Qs[1])
            lam = torch.outer(ls[0] + 2.0**0.5, ls[1] + 2.0**0.5).flatten()
        else:
            Q, lam = Qs[0], ls[0] + 2.0
        dense.append(Q @ torch.diag(lam) @ Q.T)
    torch.testing.assert_close(P.to_matrix(), torch.block_diag(*dense), atol=1e-10, rtol=1e-10)
