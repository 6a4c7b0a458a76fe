"""Debiased EKFAC through the rows of factors narrower than their width: eigenvectors ``(d, r)``,
the complement implicit with one value per block row / column, against dense matrices (float64)."""

from __future__ import annotations

import pytest
import torch
from curvlinops import FisherType
from laplace.curvature import CurvlinopsEF, CurvlinopsGGN
from torch import nn

import laplace_debiased.ekfac.passes as passes
from _models import exact_ggn, loader, tiny_mlp, toy_data
from _projections import block_from_projectors, parameter_blocks, projection
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
from laplace_debiased.ekfac.passes import complement_values, kron_eigenbasis, measure_ekfac_eigenvalues
from laplace_debiased.ekfac.posterior import EKFACDecomposed, ImplicitEKFACStructure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import LayerJacobian

N, M = 40, 4  # B = samples 0..3, B̃ = 4..7


def _wide_mlp() -> nn.Module:
    """Linear(6, 16) - Tanh - Linear(16, 3), float64: with 4 samples per batch the input factors
    (4 rows) and the first output factor (4 samples × at most 3 columns = 12 rows) are narrower
    than their widths 6, 16 and 16."""
    return tiny_mlp(n_in=6, hidden=16, n_out=3)


def _exact_ef(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p, x, t):
        return nn.functional.cross_entropy(torch.func.functional_call(model, p, (x[None],)), t[None], reduction="sum")

    g = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(params, X, y)
    G = torch.cat([v.flatten(1) for v in g.values()], 1)
    return G.T @ G


def _fit(likelihood: str = "classification", backend=CurvlinopsGGN, same: bool = False) -> tuple:
    model = _wide_mlp()
    ds = toy_data(N, (6,), 3, likelihood)
    la = DebiasedEKFACLaplace(model, likelihood, backend=backend)
    dl = loader(ds, M)
    la.fit(dl, magnitude_loader=dl) if same else la.fit(dl)
    return la, model, ds.tensors


def test_a_factor_narrower_than_its_width_is_decomposed_through_its_rows(monkeypatch):
    """Eigenvectors ``(d, r)`` spanning the range of B's factor, the nonzero eigenpairs of the dense
    one; no ``d × d`` eigendecomposition of that factor."""
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.randn(9, 4, generator=g, dtype=torch.float64)
    sizes = []
    eigh = passes.symmetric_eigh64
    monkeypatch.setattr(passes, "symmetric_eigh64", lambda F: sizes.append(F.shape[0]) or eigh(F))
    (Q_1, Q_2), = kron_eigenbasis([[X.T @ X, Y.T @ Y]], [[X, Y]])
    assert sizes == [4]  # only the factor with more rows (9) than its width (4)
    assert Q_1.shape == (7, 3) and Q_2.shape == (4, 4)
    torch.testing.assert_close(Q_1.T @ Q_1, torch.eye(3, dtype=torch.float64), atol=1e-13, rtol=0)
    L, V = torch.linalg.eigh(X.T @ X)
    torch.testing.assert_close(Q_1 @ Q_1.T, V[:, -3:] @ V[:, -3:].T, atol=1e-12, rtol=0)  # the same range
    torch.testing.assert_close(torch.diag(Q_1.T @ X.T @ X @ Q_1), L[-3:], atol=1e-12, rtol=1e-12)
    # without the rows (a process group's ranks hold them), the term count gives the same basis from eigh
    (D_1, D_2), = kron_eigenbasis([[X.T @ X, Y.T @ Y]], None, [[3, 9]])
    assert D_1.shape == (7, 3) and D_2.shape == (4, 4)
    torch.testing.assert_close(D_1 @ D_1.T, Q_1 @ Q_1.T, atol=1e-12, rtol=0)


@pytest.mark.parametrize("S", [1, 3])
def test_complement_values_are_the_mean_over_any_basis_of_the_complement(S):
    """``Λ`` of a complement block is the mean of the dense per-direction ``Σ_n ((Q_Gᵀ G_n Q_A)_ij)²``
    over that block, for any orthonormal completion of ``Q`` (here two random ones), ``G_n = Σ_s g_ns a_nsᵀ``
    (``S`` weight-sharing positions summed before squaring); bias blocks ``G_n = Σ_s g_ns``."""
    g = torch.Generator().manual_seed(1)
    n, o, k = 5, 6, 4
    gs, a = torch.randn(n, S, o, generator=g, dtype=torch.float64), torch.randn(n, S, k, generator=g, dtype=torch.float64)
    Q_G = torch.linalg.qr(torch.randn(o, 2, generator=g, dtype=torch.float64)).Q
    Q_A = torch.linalg.qr(torch.randn(k, 3, generator=g, dtype=torch.float64)).Q
    G = torch.einsum("nso,nsk->nok", gs, a)
    weight, bias = complement_values(gs, Q_G, a, Q_A), complement_values(gs, Q_G, None, None)
    assert weight.shape == (3, 4) and bias.shape == (3,)
    assert complement_values(gs, torch.eye(o, dtype=torch.float64), a, torch.eye(k, dtype=torch.float64)) is None
    for seed in (2, 3):
        gen = torch.Generator().manual_seed(seed)
        R = [torch.randn(len(Q), len(Q) - Q.shape[1], generator=gen, dtype=torch.float64) for Q in (Q_G, Q_A)]
        full = [torch.cat([Q, torch.linalg.qr(Rk - Q @ (Q.T @ Rk)).Q], 1) for Q, Rk in zip((Q_G, Q_A), R)]
        dense = (full[0].T @ G @ full[1]).square().sum(0)  # the dense route's Λ in this completion
        dense_bias = (gs.sum(1) @ full[0]).square().sum(0)
        torch.testing.assert_close(weight[:2, 3], dense[:2, 3:].mean(1), rtol=1e-12, atol=0)
        torch.testing.assert_close(weight[2, :3], dense[2:, :3].mean(0), rtol=1e-12, atol=0)
        torch.testing.assert_close(weight[2, 3], dense[2:, 3:].mean(), rtol=1e-12, atol=0)
        torch.testing.assert_close(bias[2], dense_bias[2:].mean(), rtol=1e-12, atol=0)
    assert torch.equal(weight[:2, :3], torch.zeros(2, 3, dtype=torch.float64))  # the range block is curvlinops'


@pytest.mark.parametrize(("likelihood", "backend"), [("classification", CurvlinopsGGN), ("regression", CurvlinopsGGN),
                                                      ("classification", CurvlinopsEF)])
def test_fit_is_the_frobenius_projection_of_the_measured_curvature(likelihood, backend):
    """Per block ``Λ_ab = N/|B̃| · ⟨C_B̃, P_a ⊗ P_b⟩ / ⟨P_a ⊗ P_b, P_a ⊗ P_b⟩`` over B's eigenprojections
    (``q q ᵀ`` and the complement); on the range block that is the dense route's ``diag(Qᵀ C_B̃ Q)``,
    and the complement entries are the dense route's (B's basis completed, square bases measured as
    before) averaged over the complement."""
    la, model, (X, y) = _fit(likelihood, backend)
    shapes = [[tuple(Q.shape) for Q in Qs] for Qs in la.H.eigenvectors]
    r = shapes[0][0][1]  # B's rank on the output side: 4 samples × (2 softmax, 1 EF, 3 MSE) directions
    assert r == 4 * {CurvlinopsEF: 1, CurvlinopsGGN: 2 if likelihood == "classification" else 3}[backend]
    assert shapes[0] == [(16, r), (6, 4)] and shapes[1] == [(16, r)] and shapes[2] == [(3, 3), (16, 4)]
    C = (_exact_ef(model, X[M:2 * M], y[M:2 * M]) if backend is CurvlinopsEF
         else exact_ggn(model, X[M:2 * M], likelihood)) * (N / M)
    for Qs, lam, Ck in zip(la.H.eigenvectors, la.H.eigenvalues, parameter_blocks(C, model)):
        torch.testing.assert_close(lam, projection(Qs, Ck), rtol=1e-9, atol=1e-12 * float(Ck.norm()))
    torch.testing.assert_close(la.H.to_matrix(), torch.block_diag(*[block_from_projectors(Qs, lam) for Qs, lam in
                                                                   zip(la.H.eigenvectors, la.H.eigenvalues)]))
    # the dense route on B's basis completed to square matrices
    full = [[torch.linalg.qr(Q, mode="complete").Q if Q.shape[1] < Q.shape[0] else Q for Q in Qs]
            for Qs in la.H.eigenvectors]
    full = [[torch.cat([Q, F[:, Q.shape[1]:]], 1) for Q, F in zip(Qs, Fs)] for Qs, Fs in zip(la.H.eigenvectors, full)]
    loss = nn.CrossEntropyLoss(reduction="sum") if likelihood == "classification" else nn.MSELoss(reduction="sum")
    factor = 1.0 if likelihood == "classification" else 0.5
    fisher = FisherType.EMPIRICAL if backend is CurvlinopsEF else FisherType.TYPE2
    _, dense = measure_ekfac_eigenvalues(model, loss, list(model.parameters()), [(X[M:2 * M], y[M:2 * M])], full,
                                         fisher_type=fisher)
    W1 = dense[0] * (N / M) * factor
    torch.testing.assert_close(la.H.eigenvalues[0][:r, :4], W1[:r, :4], rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(la.H.eigenvalues[0][:r, 4], W1[:r, 4:].mean(1), rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(la.H.eigenvalues[0][r, :4], W1[r:, :4].mean(0), rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(la.H.eigenvalues[0][r, 4], W1[r:, 4:].mean(), rtol=1e-9, atol=1e-14)


def test_same_batch_leaves_nothing_on_the_complement():
    """B̃ = B: the samples' vectors lie in the range of B's factors, so the complement entries are 0 up
    to round-off (as the dense route's are) and the range block is plain EKFAC of B."""
    la, model, (X, y) = _fit(same=True)
    C = exact_ggn(model, X[:M], "classification") * (N / M)
    scale = float(C.norm())
    for Qs, lam in zip(la.H.eigenvectors, la.H.eigenvalues):
        rG = Qs[0].shape[1]
        if Qs[0].shape[1] < Qs[0].shape[0]:
            assert float(lam[rG].abs().max()) < 1e-12 * scale
        if len(Qs) == 2 and Qs[1].shape[1] < Qs[1].shape[0]:
            assert float(lam[..., Qs[1].shape[1]].abs().max()) < 1e-12 * scale
    # EKFAC of B keeps the curvature of B along its own range: tr(C) is preserved blockwise
    for lam, Qs, Ck in zip(la.H.eigenvalues, la.H.eigenvectors, parameter_blocks(C, model)):
        torch.testing.assert_close(block_from_projectors(Qs, lam).trace(), Ck.trace(), rtol=1e-10, atol=0)


def _random_implicit() -> tuple[list, list]:
    g = torch.Generator().manual_seed(4)
    orth = lambda d, r: torch.linalg.qr(torch.randn(d, r, generator=g, dtype=torch.float64)).Q  # noqa: E731
    Q_G, Q_A, Q_B = orth(5, 2), orth(4, 4), orth(3, 1)
    vectors = [[Q_G, Q_A], [Q_G], [Q_B, orth(4, 3)]]
    values = [torch.rand(3, 4, generator=g, dtype=torch.float64) + 0.1, torch.rand(3, generator=g, dtype=torch.float64),
              torch.rand(2, 4, generator=g, dtype=torch.float64) + 0.1]
    return vectors, values


def test_operations_of_implicit_blocks_equal_the_dense_matrix():
    """``logdet``, ``bmm``, ``inv_square_form``, ``diag`` and ``to_matrix`` of blocks with implicit
    complements equal those of ``Σ_ab (s Λ_ab + δ) P_a ⊗ P_b`` formed densely."""
    vectors, values = _random_implicit()
    deltas = torch.tensor([0.3, 2.0, 0.7], dtype=torch.float64)
    H = EKFACDecomposed(vectors, values) * 0.5 + deltas
    dense = torch.block_diag(*[block_from_projectors(Qs, 0.5 * lam, float(d)) for Qs, lam, d in zip(vectors, values, deltas)])
    inverse = torch.linalg.inv(dense)
    torch.testing.assert_close(H.to_matrix(), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H.to_matrix(-1), inverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(H.logdet(), torch.logdet(dense), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H.diag(), dense.diagonal(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(H.diag(-1), inverse.diagonal(), rtol=1e-10, atol=1e-12)
    W = torch.randn(5, 2, len(dense), dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(H.bmm(W), W @ inverse, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(H.bmm(W[:, 0], exponent=1), W[:, 0] @ dense, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(H.inv_square_form(W), W @ inverse @ W.transpose(1, 2), rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match="block 0: eigenvalues of shape"):
        EKFACDecomposed(vectors, [values[0][:2, :4], *values[1:]])


def test_grid_structure_of_implicit_blocks_equals_the_dense_inverse():
    """``Σ(δ) = J (s·H + δ)⁻¹ Jᵀ`` for factored (``g ⊗ a``), dense two-factor and one-factor
    Jacobians, over a grid of prior precisions, without a ``d × d`` basis."""
    vectors, values = _random_implicit()
    H = EKFACDecomposed(vectors, values)
    s = 0.7
    struct = H.grid_structure(s, [20, 5, 12])
    assert type(struct) is ImplicitEKFACStructure
    g = torch.Generator().manual_seed(6)
    gw = torch.randn(4, 2, 5, generator=g, dtype=torch.float64)
    jacs = [LayerJacobian(g=gw, a=torch.randn(4, 4, generator=g, dtype=torch.float64)), LayerJacobian(dense=gw),
            LayerJacobian(dense=torch.randn(4, 2, 12, generator=g, dtype=torch.float64))]
    J = torch.cat([j.full() for j in jacs], -1)
    grid = [1e-3, 0.5, torch.tensor([2.0, 0.1, 0.4], dtype=torch.float64)]
    rotated = struct.rotate(jacs)
    cov, var = struct.covariances(rotated, grid), struct.variances(rotated, grid)
    for k, delta in enumerate(grid):
        d = torch.as_tensor(delta, dtype=torch.float64).expand(3)
        P = torch.block_diag(*[block_from_projectors(Qs, s * lam, float(dk)) for Qs, lam, dk in zip(vectors, values, d)])
        want = J @ torch.linalg.inv(P) @ J.transpose(1, 2)
        torch.testing.assert_close(cov[k], want, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(var[k], want.diagonal(dim1=-2, dim2=-1), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm", [False, True])
def test_predictive_of_a_fit_equals_the_jacobian_route(norm):
    """``la(x)``'s GLM covariance and the grid predictive on a fit with implicit complements equal
    ``J P⁻¹ Jᵀ`` with the per-example Jacobians ``J`` and the dense posterior precision ``P``; with a
    ``LayerNorm`` (a dense block spanning its weight and bias) beside the implicit Linear blocks."""
    if norm:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, 3)).double()
        ds = toy_data(N, (6,), 3, "classification")
        la = DebiasedEKFACLaplace(model, "classification")
        la.fit(loader(ds, M))
        X = ds.tensors[0]
    else:
        la, model, (X, y) = _fit()
    assert la.H.eigenvectors[0][1].shape == (6, 4)
    la.prior_precision = 0.4
    x = X[20:26]
    params = dict(model.named_parameters())
    jac = torch.func.jacrev(lambda p: torch.func.functional_call(model, p, (x,)))(params)
    J = torch.cat([j.flatten(2) for j in jac.values()], -1)  # (n, C, P)
    want = J @ torch.linalg.inv(la.posterior_precision.to_matrix()) @ J.transpose(1, 2)
    pred = GridPredictive(la)
    assert isinstance(pred.structure, ImplicitEKFACStructure)
    _, cov = pred.covariance(x, 0.4)
    torch.testing.assert_close(cov, want, rtol=1e-10, atol=1e-12)
    _, f_var = la._glm_predictive_distribution(x)
    torch.testing.assert_close(f_var, want, rtol=1e-10, atol=1e-12)


def test_token_outputs_equal_the_tokens_as_samples():
    """A model acting on each token separately, every token an output: the fit on ``(n, T, C)``
    outputs (the complement measured per token position, positions summed) equals the fit on the
    ``n·T`` tokens as samples, both through the rows (2 sequences × 2 tokens = 4 rows < 6)."""
    g = torch.Generator().manual_seed(7)
    X, y = torch.randn(8, 2, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8, 2), generator=g)
    fits = []
    for data, bs in (((X, y), 2), ((X.flatten(0, 1), y.flatten(0, 1)), 4)):
        la = DebiasedEKFACLaplace(_wide_mlp(), "classification")
        la.fit(loader(torch.utils.data.TensorDataset(*data), bs))
        fits.append(la)
    seq, flat = fits
    assert [[Q.shape for Q in Qs] for Qs in seq.H.eigenvectors] == [[Q.shape for Q in Qs] for Qs in flat.H.eigenvectors]
    assert seq.H.eigenvectors[0][1].shape == (6, 4)
    for a, b in zip(seq.H.eigenvalues, flat.H.eigenvalues, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(seq.H.to_matrix(), flat.H.to_matrix(), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("cross_fit", [False, True])
def test_cross_fit_and_saved_state_keep_the_implicit_blocks(cross_fit):
    """Cross-fitted, both components (B's basis with B̃'s curvature and the swap, each through its own
    rows) keep their complements implicit; the ``state_dict`` restores the same posterior and predictive."""
    import io

    from laplace_debiased.two_batch.cross_fit import CrossFitDecomposed

    ds = toy_data(N, (6,), 3, "classification")
    la = DebiasedEKFACLaplace(_wide_mlp(), "classification", prior_precision=0.5, cross_fit=cross_fit)
    la.fit(loader(ds, M))
    comps = la.H.components if cross_fit else (la.H,)
    assert type(la.H) is (CrossFitDecomposed if cross_fit else EKFACDecomposed)
    assert all(c.eigenvectors[0][1].shape == (6, 4) for c in comps)
    buf = io.BytesIO()
    torch.save(la.state_dict(), buf)
    buf.seek(0)
    new = DebiasedEKFACLaplace(_wide_mlp(), "classification")
    new.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(new.posterior_precision.to_matrix(-1), la.posterior_precision.to_matrix(-1))
    x = ds.tensors[0][:3]
    torch.testing.assert_close(new(x), la(x), rtol=1e-12, atol=0)
