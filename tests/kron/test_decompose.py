"""The two-batch K-FAC decomposition as plain functions of the factors, against dense formulas."""

import pytest
import torch

from laplace_debiased.kron.decompose import combine_kfacs, decompose_two_batch, paired_rows
from laplace_debiased.parallel.reducer import Reducer

EPS64 = torch.finfo(torch.float64).eps


def _spd(d: int, rows: int, seed: int) -> torch.Tensor:
    X = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X.T @ X / rows


def _factors(seed: int) -> list[list[torch.Tensor]]:
    """A weight block [G (3 x 3), A (4 x 4)] and a bias block [G], full rank."""
    return [[_spd(3, 20, seed), _spd(4, 20, seed + 1)], [_spd(3, 20, seed + 2)]]


def _decompose(direction, magnitude, **kw):
    args = dict(null_space="isotropic", estimator="paper", cross_fit=False, sizes=(20, 20),
                n_data=1000, names=[("fc", "weight"), ("fc", "bias")], reducer=Reducer())
    return decompose_two_batch(direction, magnitude, **{**args, **kw})


def test_same_batches_give_each_factors_eigendecomposition():
    """B̃ = B (one list object): stock K-FAC, ``Q diag(λ) Qᵀ = F`` per factor."""
    F = _factors(0)
    out = _decompose(F, F)
    for Fs, Qs, lams in zip(F, out.eigenvectors, out.eigenvalues):
        for Fi, Q, lam in zip(Fs, Qs, lams):
            assert torch.allclose(Q.T @ Q, torch.eye(len(Q), dtype=Q.dtype), atol=100 * EPS64)
            tol = 100 * EPS64 * torch.linalg.matrix_norm(Fi, 2)
            assert torch.allclose(Q @ torch.diag(lam) @ Q.T, Fi, atol=float(tol))
    assert out.swapped is None and out.correction is None


def test_paper_estimate_is_B_basis_with_B_tilde_rayleigh_quotients():
    B, Bt = _factors(0), _factors(10)
    out = _decompose(B, Bt)
    for Fb, Fm, Qs, lams in zip(B, Bt, out.eigenvectors, out.eigenvalues):
        for Fd, M, Q, lam in zip(Fb, Fm, Qs, lams):
            _, U = torch.linalg.eigh(Fd)
            # the same eigenspaces as B's factor (columns up to sign)
            assert torch.allclose((Q.T @ U).abs().max(0).values, torch.ones(len(Q), dtype=Q.dtype), atol=1e-10)
            assert torch.allclose(lam, torch.diagonal(Q.T @ M @ Q), atol=100 * EPS64 * float(M.norm()))


def test_cross_fit_adds_the_role_swapped_decomposition():
    B, Bt = _factors(0), _factors(10)
    out = _decompose(B, Bt, cross_fit=True)
    swapped = _decompose(Bt, B)
    for got, want in zip(out.swapped, (swapped.eigenvectors, swapped.eigenvalues)):
        for g_block, w_block in zip(got, want):
            for g, w in zip(g_block, w_block):
                assert torch.equal(g, w)


def test_corrected_estimate_records_its_change_and_reduces_at_same_batches():
    B, Bt = _factors(0), _factors(10)
    out = _decompose(B, Bt, estimator="corrected")
    assert out.correction is not None and len(out.correction.factors) == 2
    same = _decompose(B, B, estimator="corrected")
    stock = _decompose(B, B)
    assert same.correction is None
    for a, b in zip(same.eigenvalues, stock.eigenvalues):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_coverage_counts_full_rank_factors_as_covered():
    out = _decompose(_factors(0), _factors(10))
    assert all(b.prior_only_share == 0 for b in out.coverage.blocks)
    assert [b.parameter for b in out.coverage.blocks] == ["weight", "bias"]


def test_combined_factors_add_output_sides_and_average_input_sides():
    old, new = _factors(0), _factors(10)
    both = combine_kfacs(old, new, 30, 10)
    assert torch.equal(both[0][0], old[0][0] + new[0][0])
    assert torch.allclose(both[0][1], (30 * old[0][1] + 10 * new[0][1]) / 40, atol=10 * EPS64)
    assert len(both[1]) == 1 and torch.equal(both[1][0], old[1][0] + new[1][0])


def test_rows_pair_up_only_where_both_batches_have_them():
    X, Y = torch.ones(2, 3), torch.zeros(2, 3)
    assert paired_rows(None, [[X]]) is None
    assert paired_rows([[None, X]], [[None, Y]]) == [[None, (X, Y)]]
    assert paired_rows([[X]], [[None]]) == [[None]]


@pytest.mark.parametrize("estimator", ["paper", "corrected"])
def test_rank_zero_result_reaches_every_rank_through_the_reducer(estimator):
    """A non-zero rank receives rank 0's broadcast instead of computing: here, a reducer that
    plays rank 1 and fills the received tensors with a marker."""

    class Rank1(Reducer):
        rank = 1

        def broadcast_(self, tensors, src=0):
            for t in tensors:
                t.fill_(7.0)

    out = _decompose(_factors(0), _factors(10), estimator=estimator, reducer=Rank1())
    assert all(bool((t == 7.0).all()) for blocks in (out.eigenvectors, out.eigenvalues) for b in blocks for t in b)


@pytest.mark.parametrize("estimator, cross_fit", [("paper", False), ("paper", True), ("corrected", False), ("shrunk", False)])
def test_a_bias_proportional_to_its_weight_takes_the_weight_decomposition_scaled(estimator, cross_fit):
    """A bias factor ``s G`` in B and B̃ (``s = √c``, the loss factor's split): its decomposition,
    correction record and coverage equal those computed from the bias factor itself (the weight's
    decomposition is not repeated); a bias that is not proportional is decomposed on its own."""
    s = 0.5**0.5
    D, M = _factors(0), _factors(10)
    D[1], M[1] = [s * D[0][0]], [s * M[0][0]]
    kw = dict(estimator=estimator, cross_fit=cross_fit)
    out = _decompose(D, M, **kw)
    alone = _decompose([D[1]], [M[1]], names=[("fc", "bias")], **kw)
    dense = lambda Q, lam: (Q * lam) @ Q.T  # noqa: E731
    torch.testing.assert_close(dense(out.eigenvectors[1][0], out.eigenvalues[1][0]),
                               dense(alone.eigenvectors[0][0], alone.eigenvalues[0][0]), rtol=1e-12, atol=1e-12)
    if cross_fit:
        torch.testing.assert_close(dense(out.swapped[0][1][0], out.swapped[1][1][0]),
                                   dense(alone.swapped[0][0][0], alone.swapped[1][0][0]), rtol=1e-12, atol=1e-12)
    if out.correction is not None:
        ours, theirs = out.correction.rows()[2], alone.correction.rows()[0]
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-12) and ours["factor"] == "factor"
    assert out.coverage.blocks[1] == alone.coverage.blocks[0]
    D[1] = [D[1][0] + 1e-3 * _spd(3, 20, 7)]  # no longer proportional: decomposed on its own
    out = _decompose(D, M, **kw)
    alone = _decompose([D[1]], [M[1]], names=[("fc", "bias")], **kw)
    torch.testing.assert_close(dense(out.eigenvectors[1][0], out.eigenvalues[1][0]),
                               dense(alone.eigenvectors[0][0], alone.eigenvalues[0][0]), rtol=1e-12, atol=1e-12)
