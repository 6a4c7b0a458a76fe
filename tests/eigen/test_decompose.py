"""The debiased low-rank and full decompositions as plain functions, against dense formulas on a
27-parameter network, in one process and over two ranks played by fake reducers."""

import pytest
import torch

from _models import exact_ggn, tiny_mlp
from _ranks import Rank0, Rank1, over_two_ranks
from laplace_debiased.eigen.decompose import (
    CurvatureSource,
    debiased_full,
    debiased_lowrank,
    decompose_debiased_full,
    direction_eigenpairs,
    remeasured_eigenvalues,
    summed_dense_curvature,
    symmetric_outer,
)
from laplace_debiased.curvature import eigen
from laplace_debiased.curvature.factors import curvature_factor
from laplace_debiased.curvature.thresholds import EigenPairs
from laplace_debiased.parallel.reducer import Reducer

EPS64 = torch.finfo(torch.float64).eps
N_DATA = 1000


def _batches(seed: int, sizes: tuple[int, ...] = (5, 4)) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of ``sizes`` rows: 4 inputs, a class of 3."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(m, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (m,), generator=g))
            for m in sizes]


def _rows(batches, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank ``rank``'s rows of every batch among two ranks."""
    return [(X.tensor_split(2)[rank], y.tensor_split(2)[rank]) for X, y in batches]


def _ggn(model, batches) -> torch.Tensor:
    return sum(exact_ggn(model, X, "classification") for X, _ in batches)


def _source(model) -> CurvatureSource:
    return CurvatureSource(model, "classification", "ggn", 3)


def _rel(A: torch.Tensor, B: torch.Tensor) -> float:
    return float((A - B).abs().max() / B.abs().max())


def test_dense_curvature_summed_over_two_ranks_is_that_of_all_rows():
    model, batches = tiny_mlp(), _batches(0)
    G = over_two_ranks(lambda r, red: summed_dense_curvature(_source(model), _rows(batches, r), red))
    assert _rel(G, _ggn(model, batches)) < 1e-12


@pytest.mark.parametrize("ranks", [1, 2])
def test_remeasured_eigenvalues_are_the_rayleigh_quotients(ranks):
    model, batches = tiny_mlp(), _batches(1)
    U = torch.linalg.qr(torch.randn(27, 5, generator=torch.Generator().manual_seed(2), dtype=torch.float64))[0]
    if ranks == 1:
        lam = remeasured_eigenvalues(_source(model), batches, U, Reducer())
    else:
        lam = over_two_ranks(lambda r, red: remeasured_eigenvalues(_source(model), _rows(batches, r), U, red))
    assert _rel(lam, torch.diagonal(U.T @ _ggn(model, batches) @ U)) < 1e-12


@pytest.mark.parametrize("method", ["gram", "lanczos"])
def test_direction_eigenpairs_over_two_ranks_are_those_of_the_summed_curvature(method):
    """The dense route (rank 0 decomposes the summed ``G_B``) and Lanczos over products summed
    over the ranks give the top eigenpairs of ``G_B`` over all rows."""
    model, batches = tiny_mlp(), _batches(3)
    pairs = over_two_ranks(lambda r, red: direction_eigenpairs(
        _source(model), _rows(batches, r), rank=4, method=method, eigval_rtol=1e-6, reducer=red))
    want_vals, want_vecs = torch.linalg.eigh(_ggn(model, batches))
    want_vals, want_vecs = want_vals.flip(0)[:4], want_vecs.flip(1)[:, :4]
    assert pairs.method == ("dense" if method == "gram" else "lanczos")
    tol = 1e-12 if method == "gram" else 1e-8
    assert _rel(pairs.values, want_vals) < tol
    assert _rel(pairs.vectors @ pairs.vectors.T, want_vecs @ want_vecs.T) < 1e6 * tol


def test_direction_eigenpairs_over_ranks_refuse_a_dense_curvature_over_the_limit():
    wide = torch.nn.Linear(120, 100).double()  # 12 100 parameters: 8 · P² > 1 GiB
    with pytest.raises(ValueError, match="method='lanczos'"):
        direction_eigenpairs(CurvatureSource(wide, "classification", "ggn", 100), [], rank=2, method="gram",
                             eigval_rtol=0.0, reducer=Rank0(Rank1()))


def test_debiased_lowrank_keeps_B_top_eigenvectors_with_B_tilde_rayleigh_quotients():
    model, B, Bt = tiny_mlp(), _batches(4), _batches(5, (5,))
    out = debiased_lowrank(_source(model), B, Bt, sizes=(9, 5), n_data=N_DATA, rank=4, method="gram",
                           eigval_rtol=1e-6, remeasured_rtol=1e-8, reducer=Reducer())
    G_B, G_Bt = _ggn(model, B), _ggn(model, Bt)
    vals, vecs = torch.linalg.eigh(G_B)
    U = vecs.flip(1)[:, :4]
    assert _rel(out.vectors @ out.vectors.T, U @ U.T) < 1e-8
    assert _rel(out.direction_eigenvalues, N_DATA / 9 * vals.flip(0)[:4]) < 1e-12
    assert _rel(out.eigenvalues, N_DATA / 5 * torch.diagonal(out.vectors.T @ G_Bt @ out.vectors)) < 1e-12
    same = debiased_lowrank(_source(model), B, None, sizes=(9, 9), n_data=N_DATA, rank=4, method="gram",
                            eigval_rtol=1e-6, remeasured_rtol=1e-8, reducer=Reducer())
    assert torch.equal(same.eigenvalues, same.direction_eigenvalues)


def test_debiased_lowrank_leaves_out_directions_B_tilde_does_not_curve():
    """A direction with ``λ̃ ≤ remeasured_rtol · max λ̃`` goes: here every rank-4 direction of B
    is kept at rtol 0, and at an rtol just above the smallest relative ``λ̃`` one fewer."""
    model, B, Bt = tiny_mlp(), _batches(6), _batches(7, (5,))
    kw = dict(sizes=(9, 5), n_data=N_DATA, rank=4, method="gram", eigval_rtol=1e-6, reducer=Reducer())
    full = debiased_lowrank(_source(model), B, Bt, remeasured_rtol=0.0, **kw)
    lam = full.eigenvalues
    rtol = float(lam.min() / lam.max()) * 1.001
    fewer = debiased_lowrank(_source(model), B, Bt, remeasured_rtol=rtol, **kw)
    assert full.vectors.shape[1] == 4 and fewer.vectors.shape[1] == 3
    assert torch.equal(fewer.eigenvalues, lam[lam > rtol * lam.max()])


def test_debiased_lowrank_corrected_is_pooled_top_k_and_refuses_unknown_estimators():
    """``estimator="corrected"``: B ∪ B̃'s top eigenvectors (unequal halves 9 + 5 here, order weights
    ``(m/n)(1 - n/N)/2``); B̃ = B (``None``): the single batch, as for ``"paper"``."""
    model, B, Bt = tiny_mlp(), _batches(8), _batches(9, (5,))
    kw = dict(sizes=(9, 5), n_data=N_DATA, rank=4, method="gram", eigval_rtol=1e-6, remeasured_rtol=1e-8,
              reducer=Reducer())
    out = debiased_lowrank(_source(model), B, Bt, estimator="corrected", **kw)
    G_B, G_Bt = _ggn(model, B) * N_DATA / 9, _ggn(model, Bt) * N_DATA / 5
    vals, vecs = torch.linalg.eigh((9 * G_B + 5 * G_Bt) / 14)
    U_P = vecs.flip(1)[:, :4]
    gaps = []
    for D, M in ((G_B, G_Bt), (G_Bt, G_B)):
        lam, U = torch.linalg.eigh(D)
        U = U.flip(1)[:, :4]
        gaps.append(lam.flip(0)[:4] - torch.diagonal(U.T @ M @ U))
    k_B, k_Bt = 9 / 14 * (1 - 14 / N_DATA) / 2, 5 / 14 * (1 - 14 / N_DATA) / 2
    assert _rel(out.eigenvalues, (vals.flip(0)[:4] - k_B * gaps[0] - k_Bt * gaps[1]).clamp(min=0)) < 1e-10
    assert _rel(out.vectors @ out.vectors.T, U_P @ U_P.T) < 1e-8
    same = [debiased_lowrank(_source(model), B, None, estimator=e, **kw) for e in ("paper", "corrected")]
    assert torch.equal(same[0].eigenvalues, same[1].eigenvalues)
    with pytest.raises(ValueError, match="estimator"):
        debiased_lowrank(_source(model), B, Bt, estimator="stein", **kw)


def _range(G: torch.Tensor) -> EigenPairs:
    return eigen.dense_range_eigenpairs(G)


def test_debiased_full_is_remeasured_eigenbasis_plus_null_space_compression():
    """``H = U diag(diag(Uᵀ G̃ U)) Uᵀ + Π G̃ Π`` for dense ``G̃``; a factor ``V`` of ``G̃ = V Vᵀ``
    gives the same ``H`` as eigenpairs; ``G̃ = None`` (B̃ = B) gives ``G_B`` itself."""
    model, B, Bt = tiny_mlp(), _batches(8, (4,)), _batches(9, (3,))
    G_B, scale_B = _ggn(model, B), N_DATA / 4
    pairs = _range(G_B)
    U = pairs.vectors
    assert 0 < U.shape[1] < 27  # B has a null space
    V = curvature_factor(model, Bt, "classification", "ggn") * (N_DATA / 3) ** 0.5
    G_Bt = V @ V.T
    Pi = torch.eye(27, dtype=torch.float64) - U @ U.T
    lam = torch.diagonal(U.T @ G_Bt @ U)
    want = U @ torch.diag(lam) @ U.T + Pi @ G_Bt @ Pi

    dense = decompose_debiased_full(pairs, G_Bt, scale_B)
    assert dense.eigenpairs is None and _rel(dense.dense, want) < 1e-10
    assert _rel(dense.eigenvalues, lam) < 1e-12 and _rel(dense.direction_eigenvalues, scale_B * pairs.values) < 1e-15
    factored = decompose_debiased_full(pairs, V, scale_B)
    Q, h = factored.eigenpairs
    assert factored.dense is None and _rel(Q @ torch.diag(h) @ Q.T, want) < 1e-10
    assert _rel(Q.T @ Q, torch.eye(Q.shape[1], dtype=Q.dtype)) < 1e-10
    Q, h = decompose_debiased_full(pairs, None, scale_B).eigenpairs
    assert _rel(Q @ torch.diag(h) @ Q.T, scale_B * G_B) < 1e-10


@pytest.mark.parametrize("same", [False, True])
def test_debiased_full_over_two_ranks_is_that_of_one_process(same):
    """Rank 0 of two decomposes the summed ``G_B`` (and ``G_B̃``) into the dense ``H`` one process
    gets from its factors, with the same eigenvalues."""
    model, B, Bt = tiny_mlp(), _batches(10), _batches(11, (5,))
    Bt_or_none = None if same else Bt
    kw = dict(sizes=(9, 9 if same else 5), n_data=N_DATA)
    one = debiased_full(_source(model), B, Bt_or_none, reducer=Reducer(), **kw)
    two = over_two_ranks(lambda r, red: debiased_full(
        _source(model), _rows(B, r), None if same else _rows(Bt, r), reducer=red, **kw))
    Q, h = one.eigenpairs
    assert two.eigenpairs is None and _rel(two.dense, Q @ torch.diag(h) @ Q.T) < 1e-10
    assert _rel(two.eigenvalues, one.eigenvalues) < 1e-10
    assert _rel(two.direction_eigenvalues, one.direction_eigenvalues) < 1e-10


def test_symmetric_outer_is_the_weighted_outer_product_exactly_symmetric():
    g = torch.Generator().manual_seed(4)
    Q = torch.randn(7, 3, generator=g, dtype=torch.float64)  # not orthonormal: the formula, not an eigh
    h = torch.tensor([2.0, -0.5, 3.0], dtype=torch.float64)
    H = symmetric_outer(Q, h)
    assert torch.equal(H, H.T)
    torch.testing.assert_close(H, sum(h[i] * torch.outer(Q[:, i], Q[:, i]) for i in range(3)), rtol=1e-14, atol=1e-14)
    assert symmetric_outer(Q.float(), h.float()).dtype == torch.float32
