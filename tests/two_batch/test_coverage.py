"""The ranks of the coverage record: the union B ∪ B̃ reaches at least as far as each batch.

Every rank of a factor's coverage (B, B̃ and their union) is counted at one tolerance, that of the
union: by Weyl's inequality ``λ_i(F_B + F_B̃) ≥ λ_i(F_B)`` for a PSD ``F_B̃``, so the union's count
cannot fall below a part's. Counting each matrix at its own norm-relative tolerance could.
"""

from __future__ import annotations

import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.curvature.linalg import RowFactor, roundoff_tolerance
from laplace_debiased.kron.corrected import corrected_kron
from laplace_debiased.kron.laplace import DebiasedKronLaplace
from laplace_debiased.two_batch.coverage import factor_ranks, numerical_rank


def test_an_eigenvalue_between_the_parts_and_the_unions_own_tolerance_counts_in_both():
    """``F_B = diag(1, t, 0)``, ``F_B̃ = diag(1, 0, 0)`` in float32 with ``t`` above ``F_B``'s own
    tolerance and below that of ``F_B + F_B̃`` (whose norm is twice as large): rank B is 2 at its
    own tolerance, the union 1 at its own; at the common tolerance B has rank 1 as well."""
    tol_b = roundoff_tolerance(torch.diag(torch.tensor([1.0, 0.0, 0.0])))
    t = 1.5 * tol_b
    Fd = torch.diag(torch.tensor([1.0, t, 0.0]))
    Fm = torch.diag(torch.tensor([1.0, 0.0, 0.0]))
    assert numerical_rank(Fd) == 2 and numerical_rank(Fd + Fm) == 1  # the inconsistency
    assert factor_ranks(Fd, Fm) == (1, 1, 1)
    t = 3 * tol_b  # above the union's tolerance too: counted in B and in the union
    Fd = torch.diag(torch.tensor([1.0, t, 0.0]))
    assert factor_ranks(Fd, Fm) == (2, 1, 2)


@st.composite
def two_batches(draw):
    """Rows of two batches in ``d`` dims, float32, ReLU-like: a dominant mean direction plus
    components whose scales fall over up to eight decades (so that eigenvalues lie on both
    sides of every tolerance)."""
    d = draw(st.integers(2, 24))
    n, m = draw(st.integers(1, 2 * d)), draw(st.integers(1, 2 * d))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    decades = draw(st.floats(0.0, 8.0))
    scales = torch.logspace(0.0, -decades, d, dtype=torch.float64)
    mean = draw(st.floats(0.0, 1e3)) * torch.rand(d, generator=g, dtype=torch.float64)

    def rows(k):
        Z = torch.randn(k, d, generator=g, dtype=torch.float64) * scales
        Z[:, draw(st.integers(0, d - 1)):] = 0.0  # a support narrower than d
        return (mean + Z).float()

    return rows(n), rows(m)


@settings(max_examples=100, deadline=None)
@given(two_batches(), st.booleans())
def test_the_union_has_at_least_the_rank_of_each_batch(batches, from_rows):
    Xd, Xm = batches
    Fd, Fm = Xd.T @ Xd, Xm.T @ Xm
    rd, rm, ru = factor_ranks(Fd, Fm, (Xd, Xm) if from_rows else None)
    assert ru >= max(rd, rm)
    assert ru <= min(len(Xd) + len(Xm), Fd.shape[0])


@settings(max_examples=60, deadline=None)
@given(two_batches(), st.sampled_from([0, 1]))
def test_a_part_held_as_rows_beside_a_dense_one_keeps_the_union_above_each_part(batches, held):
    """One part held as rows (``RowFactor``, never formed alone), the other dense, their pair's rows unknown (a
    batch narrower than the factor beside a wider one): the same bounds as the dense counts."""
    Xd, Xm = batches
    parts = [Xd.T @ Xd, Xm.T @ Xm]
    parts[held] = RowFactor((Xd, Xm)[held])
    rd, rm, ru = factor_ranks(*parts)
    assert ru >= max(rd, rm)
    assert ru <= min(len(Xd) + len(Xm), Xd.shape[1])


def test_a_part_held_as_rows_beside_a_dense_one_counts_as_the_dense_pair():
    """Generic float64 rows (every eigenvalue far from the tolerance): 5 rows of B beside 30 of B̃ in 12
    dimensions, the ranks 5, 12, 12 whichever part is held as rows."""
    g = torch.Generator().manual_seed(0)
    Xd, Xm = torch.randn(5, 12, generator=g, dtype=torch.float64), torch.randn(30, 12, generator=g, dtype=torch.float64)
    Fd, Fm = Xd.T @ Xd, Xm.T @ Xm
    assert factor_ranks(Fd, Fm) == (5, 12, 12)
    assert factor_ranks(RowFactor(Xd), Fm) == (5, 12, 12)
    assert factor_ranks(Fm, RowFactor(Xd)) == (12, 5, 12)


@settings(max_examples=30, deadline=None)
@given(two_batches(), st.booleans())
def test_a_batch_united_with_itself_keeps_its_own_rank(batches, from_rows):
    Xd, _ = batches
    Fd = Xd.T @ Xd
    own = numerical_rank(Fd)
    assert factor_ranks(Fd, Fd, (Xd, Xd) if from_rows else None) == (own, own, own)


def test_a_factor_that_underflows_float32_keeps_the_rank_of_its_rows():
    """Found by hypothesis: one float32 row of size ~1e-21 gives a factor of ~1e-42, below float32's
    smallest normal number, whose entries carry absolute round-off (gradual underflow) and whose
    dense eigenvalues then show spurious ~1e-46 values; counted densely or from the rows, the rank
    is 1 (the union of a batch with itself too)."""
    X = torch.tensor([[1.2527e-21, 9.1405e-22, 5.9323e-22, 1.1890e-21]])
    F = X.T @ X
    assert factor_ranks(F, F.clone()) == (1, 1, 1)
    assert factor_ranks(F, F.clone(), (X, X)) == (1, 1, 1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 24), st.integers(0, 2**31 - 1), st.floats(-6.0, -2.0), st.floats(-4.0, 0.0), st.booleans(),
       st.integers(0, 23))
def test_the_rank_counts_the_eigenvalues_above_the_tolerance(d, seed, log_tol, log_margin, above, below):
    """``F = Q diag(λ) Qᵀ`` (float64, ``‖F‖₂ = 1``) with its smallest eigenvalue a relative margin of
    ``10^log_margin`` above or below the tolerance, and ``below`` further eigenvalues well under it:
    the rank, counted by inertia, is the number of eigenvalues above the tolerance. The margin,
    ``≥ 1e-10`` in absolute terms, lies far above the float64 backward error (``d² eps₆₄ ≈ 1e-13``)."""
    g = torch.Generator().manual_seed(seed)
    tol = 10.0**log_tol
    lam = torch.rand(d, generator=g, dtype=torch.float64) * (1 - 2 * tol) + 2 * tol
    lam[0] = 1.0
    lam[-1] = tol * (1 + 10.0**log_margin if above else 1 - 10.0**log_margin)
    k = min(below, d - 1)
    lam[d - 1 - k:d - 1] = 0.5 * tol * torch.rand(k, generator=g, dtype=torch.float64)
    Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q
    F = Q @ torch.diag(lam) @ Q.T
    assert numerical_rank(F, tol) == int((lam > tol).sum())


def test_a_rank_is_counted_without_an_eigendecomposition(monkeypatch):
    """The ranks come from the inertia of ``F - tol I``, not from ``F``'s eigenvalues: a factor of
    full rank and one of rank 5 (5 rows) are counted with ``eigvalsh`` and ``eigh`` refused."""
    X = torch.randn(64, 16, generator=torch.Generator().manual_seed(0))

    def refuse(*args, **kwargs):
        raise AssertionError("an eigendecomposition was called to count a rank")

    monkeypatch.setattr(torch.linalg, "eigvalsh", refuse)
    monkeypatch.setattr(torch.linalg, "eigh", refuse)
    assert numerical_rank(X.T @ X) == 16
    assert numerical_rank(X[:5].T @ X[:5]) == 5



def _corrected_pair(n: int, m: int, d: int, support: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """B's and B̃'s factors from ``n`` and ``m`` float32 samples in ``d`` dims with a support of
    ``support`` dims, and the spectra the shrunk estimate computed decomposing them densely."""
    g = torch.Generator().manual_seed(seed)
    Xd, Xm = torch.randn(n, d, generator=g), torch.randn(m, d, generator=g)
    Xd[:, support:] = 0.0
    Xm[:, support:] = 0.0
    Fd, Fm = Xd.T @ Xd, Xm.T @ Xm
    spectra: dict = {}
    corrected_kron([[Fd]], [[Fm]], n, m, rule="shrunk", spectra=[[spectra]])
    return Fd, Fm, spectra


def test_a_densely_corrected_factor_is_counted_from_the_spectra_its_decomposition_computed(monkeypatch):
    """The corrected estimate of a factor without rows decomposes B's, B̃'s and the pooled factor; the
    coverage counts their ranks from those spectra, with no factorisation of its own, and the counts
    equal the inertia counts of the factors alone (equal batches: the pooled factor is half the
    union, so the union's count is exact)."""
    Fd, Fm, spectra = _corrected_pair(24, 24, 16, 11, 0)
    assert set(spectra) == {0, 1, (0.5, 0.5)}
    expected = factor_ranks(Fd, Fm)
    assert expected == (11, 11, 11)

    def refuse(*args, **kwargs):
        raise AssertionError("a factorisation was called to count a rank the decomposition knows")

    monkeypatch.setattr(torch.linalg, "ldl_factor_ex", refuse)
    assert factor_ranks(Fd, Fm, spectra=spectra) == expected


def test_a_pooled_spectrum_that_does_not_decide_the_unions_rank_leaves_it_to_inertia():
    """Unequal batches (weights 3/4 and 1/4): the pooled factor ``P`` bounds the union ``U`` by
    ``P / (3/4) ≤ U ≤ P / (1/4)``. ``F_B = diag(1, t/2, 0)``, ``F_B̃ = diag(1, 0, 0)`` at the union's
    tolerance ``t``: ``U``'s second eigenvalue ``t/2`` lies between the two bounds' verdicts, so the
    union is counted by inertia: rank 1, as without the spectra. Random unequal batches agree too."""
    tol = roundoff_tolerance(torch.diag(torch.tensor([2.0, 0.0, 0.0])))
    Fd, Fm = torch.diag(torch.tensor([1.0, tol / 2, 0.0])), torch.diag(torch.tensor([1.0, 0.0, 0.0]))
    spectra: dict = {}
    corrected_kron([[Fd]], [[Fm]], 3, 1, rule="shrunk", spectra=[[spectra]])
    assert factor_ranks(Fd, Fm, spectra=spectra) == factor_ranks(Fd, Fm) == (1, 1, 1)
    for seed, (n, m) in enumerate([(20, 40), (40, 20), (17, 33)]):
        Fd, Fm, spectra = _corrected_pair(n, m, 16, 9 + seed, seed)
        assert factor_ranks(Fd, Fm, spectra=spectra) == factor_ranks(Fd, Fm)


def test_a_fit_counts_its_dense_factors_from_their_decompositions(monkeypatch):
    """A fit whose batches have more rows than three factors' widths (the first layer's input, 3, and
    output, 12 (4 samples × 4 classes' rows), and the last layer's output, 5): the coverage factorises
    only the Gram matrices (4 and 8 rows) of the wide input factor of the last layer, and its record
    equals one counted without the decompositions' spectra."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 12), nn.ReLU(), nn.Linear(12, 5))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8, 3, generator=g), torch.randint(0, 5, (8,), generator=g))
    sizes = []
    ldl = torch.linalg.ldl_factor_ex
    monkeypatch.setattr(torch.linalg, "ldl_factor_ex", lambda A, *a, **k: sizes.append(A.shape[-1]) or ldl(A, *a, **k))
    la = DebiasedKronLaplace(model, "classification")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        la.fit(DataLoader(data, batch_size=4))
    assert sorted(set(sizes)) == [4, 8]
    weights = [b for b in la.coverage.blocks if b.parameter == "weight"]
    for block, k in zip(weights, (0, 2)):
        for f, Fd, Fm in zip(block.factors, la.H_facs.kfacs[k], la.H_facs_magnitude.kfacs[k]):
            assert (f.rank_direction, f.rank_magnitude, f.rank_union) == factor_ranks(Fd, Fm)
