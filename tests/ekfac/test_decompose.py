"""The two-batch EKFAC decomposition as plain functions, against the dense GGN of a small network,
in one process and over two ranks played by fake reducers."""

import torch
from curvlinops import FisherType
from torch import nn

from _models import exact_ggn
from _ranks import over_two_ranks
from laplace_debiased.ekfac.decompose import EKFACMeasurement, decompose_ekfac, kron_basis_on_rank0
from laplace_debiased.parallel.reducer import Reducer

N_DATA, ROWS = 500, 7


def _model() -> nn.Module:
    """Linear(3, 4) - Tanh - Linear(4, 2), float64: blocks W1 (4, 3), b1 (4,), W2 (2, 4), b2 (2,)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()


def _spd(d: int, seed: int) -> torch.Tensor:
    X = torch.randn(2 * d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return X.T @ X


def _kfacs(seed: int) -> list[list[torch.Tensor]]:
    return [[_spd(4, seed), _spd(3, seed + 1)], [_spd(4, seed + 2)], [_spd(2, seed + 3), _spd(4, seed + 4)],
            [_spd(2, seed + 5)]]


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(ROWS, 3, generator=g, dtype=torch.float64), torch.randint(0, 2, (ROWS,), generator=g)


def _measurement(model: nn.Module, batches) -> EKFACMeasurement:
    return EKFACMeasurement(
        model=model, loss_func=nn.CrossEntropyLoss(reduction="sum"), params=list(model.parameters()),
        batches=batches, fisher_type=FisherType.TYPE2, batch_size_fn=None, scale=N_DATA / ROWS,
        dtype=torch.float64,
    )


def _dense_blocks(model: nn.Module, X: torch.Tensor) -> list[torch.Tensor]:
    """The diagonal blocks of B̃'s GGN, one per parameter tensor."""
    C = exact_ggn(model, X, "classification")
    bounds = torch.tensor([0] + [p.numel() for p in model.parameters()]).cumsum(0).tolist()
    return [C[a:b, a:b] for a, b in zip(bounds, bounds[1:])]


def _kron(Qs: list[torch.Tensor]) -> torch.Tensor:
    return torch.kron(*Qs) if len(Qs) == 2 else Qs[0]


def test_eigenvalues_are_B_tilde_curvature_diagonal_in_B_kfac_basis():
    """``Λ = N/|B̃| · diag(Qᵀ C_B̃ Q)`` per block with ``Q = Q_G ⊗ Q_A`` eigenvectors of B's
    factors; a bias block is measured in its layer's weight ``Q_G``."""
    model, (X, y) = _model(), _data()
    kfacs = _kfacs(0)
    out = decompose_ekfac(kfacs, _kfacs(10), [False] * 4, _measurement(model, [(X, y)]), Reducer())
    for F, Qs in zip(kfacs[0] + kfacs[2], out.eigenvectors[0] + out.eigenvectors[2]):
        D = Qs.T @ F @ Qs  # B's factor is diagonal in its basis
        assert float((D - torch.diag(torch.diagonal(D))).abs().max()) < 1e-12 * float(F.norm())
    assert torch.equal(out.eigenvectors[1][0], out.eigenvectors[0][0])  # bias: the weight's Q_G
    assert torch.equal(out.eigenvectors[3][0], out.eigenvectors[2][0])
    for C, Qs, lam in zip(_dense_blocks(model, X), out.eigenvectors, out.eigenvalues):
        Q = _kron(Qs)
        want = N_DATA / ROWS * torch.diagonal(Q.T @ C @ Q)
        assert torch.allclose(lam.flatten(), want, rtol=1e-10, atol=1e-12 * float(want.abs().max()))


def test_extra_blocks_get_the_debiased_kron_blocks():
    """An embedding or normalisation block is not measured: B's factor eigenvectors ``U`` and
    ``diag(Uᵀ M U)`` of B̃'s factors (their outer product for two factors)."""
    model, (X, y) = _model(), _data()
    B, Bt = _kfacs(0) + [[_spd(3, 20), _spd(2, 21)], [_spd(5, 22)]], _kfacs(10) + [[_spd(3, 30), _spd(2, 31)], [_spd(5, 32)]]
    out = decompose_ekfac(B, Bt, [False] * 4 + [True, True], _measurement(model, [(X, y)]), Reducer())
    measured = decompose_ekfac(B[:4], Bt[:4], [False] * 4, _measurement(model, [(X, y)]), Reducer())
    assert all(torch.equal(a, b) for a, b in zip(out.eigenvalues[:4], measured.eigenvalues))
    quotients = [torch.diagonal(U.T @ M @ U) for U, M in zip(out.eigenvectors[4] + out.eigenvectors[5], Bt[4] + Bt[5])]
    assert torch.allclose(out.eigenvalues[4], torch.outer(*quotients[:2]), rtol=1e-12)
    assert torch.allclose(out.eigenvalues[5], quotients[2], rtol=1e-12)
    for U, F in zip(out.eigenvectors[4] + out.eigenvectors[5], B[4] + B[5]):
        D = U.T @ F @ U
        assert float((D - torch.diag(torch.diagonal(D))).abs().max()) < 1e-12 * float(F.norm())


def test_two_ranks_measure_their_rows_and_add_the_sums():
    """Each of two ranks measures its rows of B̃ in rank 0's basis; the sums equal one process
    measuring all rows. A rank without rows adds zeros."""
    model, (X, y) = _model(), _data()
    kfacs = _kfacs(0)
    one = decompose_ekfac(kfacs, kfacs, [False] * 4, _measurement(model, [(X, y)]), Reducer())

    def rank_rows(rank: int, reducer: Reducer):
        rows = [(X.tensor_split(2)[rank], y.tensor_split(2)[rank])]
        return decompose_ekfac(kfacs, kfacs, [False] * 4, _measurement(model, rows), reducer)

    two = over_two_ranks(rank_rows)
    for a, b in zip(two.eigenvalues, one.eigenvalues):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14 * float(b.abs().max()))
    alone = over_two_ranks(lambda rank, reducer: decompose_ekfac(
        kfacs, kfacs, [False] * 4, _measurement(model, [(X, y)] if rank == 0 else []), reducer))
    assert all(torch.equal(a, b) for a, b in zip(alone.eigenvalues, one.eigenvalues))


def test_rank_zero_basis_reaches_every_rank_through_the_reducer():
    """A non-zero rank receives rank 0's basis: here a reducer that plays rank 1 and hands out a
    marker instead of computing."""

    class Rank1(Reducer):
        rank, world = 1, 2

        def computed_on_rank0(self, compute, device):
            return [torch.full((d, d), 7.0, dtype=torch.float64) for d in (4, 3, 4, 2, 4, 2)]

    basis = kron_basis_on_rank0(_kfacs(0), Rank1())
    assert [[Q.shape[0] for Q in Qs] for Qs in basis] == [[4, 3], [4], [2, 4], [2]]
    assert all(bool((Q == 7.0).all()) for Qs in basis for Q in Qs)
