"""Wide layers: the isotropic completion of B's null space and the coverage record.

Dense identities on small matrices, the B̃ = B reduction, seeded statistics of the same-batch
bias inside B's null space, and the coverage record / warning of a fit whose factor is wider than
|B| + |B̃|.
"""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.curvature.completion import debiased_factor_mode, isotropic_factor
from laplace_debiased.curvature.linalg import debiased_factor, roundoff_tolerance
from laplace_debiased.two_batch import coverage
from laplace_debiased.two_batch.coverage import numerical_rank, report_coverage
from laplace import KronLaplace

from laplace_debiased.kron.laplace import DebiasedKronLaplace
from laplace_debiased.curvature.completion import extended_spectrum  # after structures (registration)

EPS64 = torch.finfo(torch.float64).eps


def _gram(d: int, m: int, seed: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``mean_n x_n x_nᵀ`` of ``m`` Gaussian samples in ``d`` dims (rank ``min(m, d)``), float64."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(m, d, generator=g, dtype=torch.float64)
    if scales is not None:
        X = X * scales
    return X.T @ X / m


def _tolerance(*Ms: torch.Tensor) -> float:
    """Round-off bound of a float64 eigendecomposition and a few products: d · eps · ‖M‖."""
    return 100 * Ms[0].shape[0] * EPS64 * max(float(torch.linalg.matrix_norm(M)) for M in Ms)


def test_isotropic_factor_dense_identity():
    """U diag(λ) Uᵀ = Σ_i (u_iᵀ C u_i) u_i u_iᵀ on B's range + tr(P C P)/dim P · P on its null space."""
    d, r = 12, 5
    D, C = _gram(d, r, 0), _gram(d, 30, 1)
    U, lam = isotropic_factor(D, C)
    L, V = torch.linalg.eigh(D)
    R, N = V[:, L > _tolerance(D)], V[:, L <= _tolerance(D)]
    assert R.shape[1] == r
    P = N @ N.T
    expected = R @ torch.diag(((C @ R) * R).sum(0)) @ R.T + torch.trace(P @ C @ P) / (d - r) * P
    tol = _tolerance(D, C)
    torch.testing.assert_close(U.T @ U, torch.eye(d, dtype=U.dtype), atol=tol, rtol=0)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, expected, atol=tol, rtol=0)


def test_isotropic_factor_reduces_to_eigendecomposition_for_same_batch():
    """B̃ = B: the null space gets B's own (zero) curvature, the factor is B's factor."""
    D = _gram(10, 4, 2)
    U, lam = isotropic_factor(D, D)
    torch.testing.assert_close(U @ torch.diag(lam) @ U.T, D, atol=_tolerance(D), rtol=0)


def test_full_rank_direction_factor_is_unchanged_by_the_mode():
    """Without degenerate eigenvalues both treatments are the plain two-batch estimator."""
    D, C = _gram(6, 40, 3), _gram(6, 40, 4)
    (U1, l1), (U2, l2) = isotropic_factor(D, C), debiased_factor(D, C)
    tol = _tolerance(D, C)
    torch.testing.assert_close(U1 @ torch.diag(l1) @ U1.T, U2 @ torch.diag(l2) @ U2.T, atol=tol, rtol=0)


def test_zero_counts_aligned_versus_isotropic():
    """d > |B| + |B̃|: the aligned treatment leaves d − rank(B ∪ B̃) exact zeros, isotropic none."""
    d, m, mt = 20, 4, 5
    D, C = _gram(d, m, 5), _gram(d, mt, 6)
    _, lam_aligned = debiased_factor_mode(D, C, "aligned")
    _, lam_iso = debiased_factor_mode(D, C, "isotropic")
    assert numerical_rank(D + C) == m + mt
    tol = _tolerance(C)
    assert int((lam_aligned <= tol).sum()) == d - (m + mt)
    assert int((lam_iso <= tol).sum()) == 0
    with pytest.raises(ValueError, match="null_space"):
        debiased_factor_mode(D, C, "nearest")


def test_same_batch_bias_in_null_space_and_its_removal():
    """Seeded statistics, anisotropic truth Σ, B's null space P (chosen by B only).

    Aligned: B̃ picks the directions in P and measures them, so the smallest measured curvature
    underestimates the truth along its own direction (same-batch bias; here it is exactly 0
    because dim P > |B̃|). Isotropic: the measured c_P = tr(Pᵀ C P)/k is unbiased for
    tr(Pᵀ Σ P)/k, the mean relative error is within 4 standard errors of 0.
    """
    d, m, mt, draws = 16, 4, 8, 400
    scales = torch.logspace(0, -1.5, d, dtype=torch.float64)
    Sigma = torch.diag(scales**2)
    rel_iso, gap_aligned = [], []
    for s in range(draws):
        D, C = _gram(d, m, 2 * s, scales), _gram(d, mt, 2 * s + 1, scales)
        L, V = torch.linalg.eigh(D)
        N = V[:, L <= _tolerance(D)]
        truth = torch.trace(N.T @ Sigma @ N) / N.shape[1]
        U, lam = isotropic_factor(D, C)
        rel_iso.append(float((lam[0] - truth) / truth))  # lam[0]: a null-space eigenvalue
        Ua, lam_a = debiased_factor(D, C)
        j = int(torch.argmin(lam_a))
        gap_aligned.append(float((lam_a[j] - Ua[:, j] @ Sigma @ Ua[:, j]) / (Ua[:, j] @ Sigma @ Ua[:, j])))
    rel = torch.tensor(rel_iso)
    assert abs(float(rel.mean())) < 4 * float(rel.std()) / math.sqrt(draws)
    assert max(gap_aligned) == pytest.approx(-1.0)  # every draw: measured 0, truth > 0


def _wide_fit(null_space: str, route: str = "rows"):
    """Linear(24, 4) -> ReLU -> Linear(4, 3) fitted on B = 4, B̃ = 4 samples (24 > 8).

    ``route="rows"``: the fit as it is (the 24-dimensional input factor through its rows' Gram
    matrices, null space implicit); ``"dense"``: decomposed and recorded again without the rows
    (square eigenvector matrices, ranks by ``eigvalsh``), the warnings of that record."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 4), nn.ReLU(), nn.Linear(4, 3))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(16, 24, generator=g), torch.randint(0, 3, (16,), generator=g))
    la = DebiasedKronLaplace(model, "classification", null_space=null_space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la.fit(DataLoader(data, batch_size=4))
        if route == "dense":
            caught.clear()
            la._factor_rows = None
            la._decompose()
            report_coverage(la.coverage)
    square = [Q.shape[0] == Q.shape[1] for Q in la.H.eigenvectors[0]]
    assert square == ([True, False] if route == "rows" else [True, True])
    return la, [w for w in caught if issubclass(w.category, UserWarning) and "prior" in str(w.message)]


@pytest.mark.parametrize("route", ["rows", "dense"])
def test_coverage_record_counts_and_warning_aligned(route):
    la, warned = _wide_fit("aligned", route)
    cov = la.coverage
    first = cov.blocks[0]
    assert (first.layer, first.parameter) == ("0", "weight")
    A = first.factors[1]
    assert (A.factor, A.dimension, A.rank_direction, A.rank_magnitude, A.rank_union) == ("input", 24, 4, 4, 8)
    assert A.zero_eigenvalues == A.dimension - A.rank_union
    C = la.H_facs_magnitude.kfacs[0]
    tol = max(roundoff_tolerance(C[0]), roundoff_tolerance(C[1])) ** 2
    (lam_G, n_G), (lam_A, n_A) = (extended_spectrum(Q, lam) for Q, lam in zip(la.H.eigenvectors[0], la.H.eigenvalues[0]))
    zero_share = float(((torch.outer(lam_G, lam_A) <= tol) * torch.outer(n_G, n_A)).sum()) / (4 * 24)
    assert first.prior_only_share == pytest.approx(zero_share)
    assert first.prior_only_share >= 16 / 24 - 1e-12
    assert len(warned) == 1 and "'0' weight" in str(warned[0].message)
    assert "'2'" not in str(warned[0].message)  # the narrow layer is covered
    assert cov.direction_size == cov.magnitude_size == 4


@pytest.mark.parametrize("route", ["rows", "dense"])
def test_coverage_record_isotropic_has_no_prior_only_weights(route):
    la, warned = _wide_fit("isotropic", route)
    A = la.coverage.blocks[0].factors[1]
    assert (A.zero_eigenvalues, A.completed) == (0, A.dimension - A.rank_direction)
    assert la.coverage.blocks[0].prior_only_share == 0 and not warned
    # the output layer keeps the softmax-invariant direction of its output factor (every batch
    # shares it, so it is recorded but not warned about): 1/3 of its 12 + 3 weights
    assert round(sum(b.prior_only_share * b.n_weights for b in la.coverage.blocks)) == 5
    assert "| 0 | weight | input | 24 | 4 | 4 | 8 | 0 | 20 |" in la.coverage.markdown()


def test_coverage_of_the_rows_route_decomposes_no_wide_factor(monkeypatch):
    """The coverage of a factor on the Gram route costs no ``d × d`` eigvalsh: ``numerical_rank``
    (dense) only sees the factors without rows (the 4- and 3-dimensional ones), and the ranks from
    the rows equal the dense ones."""
    seen = []

    def spy(F, tolerance=None):
        seen.append(F.shape[0])
        return numerical_rank(F, tolerance)

    monkeypatch.setattr(coverage, "numerical_rank", spy)
    la, _ = _wide_fit("aligned")
    assert seen and 24 not in seen
    A = la.coverage.blocks[0].factors[1]
    Fd, Fm = la.H_facs.kfacs[0][1], la.H_facs_magnitude.kfacs[0][1]
    tol = roundoff_tolerance(Fd + Fm)  # every rank of the record at the union's tolerance
    assert (A.rank_direction, A.rank_magnitude, A.rank_union) == (
        numerical_rank(Fd, tol), numerical_rank(Fm, tol), numerical_rank(Fd + Fm, tol))


def test_null_space_refuses_unknown_mode():
    with pytest.raises(ValueError, match="null_space"):
        DebiasedKronLaplace(nn.Sequential(nn.Linear(3, 2)), "classification", null_space="zero")


def test_report_shows_the_coverage_of_a_fit(tmp_path):
    """The main job's report renders the coverage rows a sweep stored with a fit."""
    from laplace_debiased.evaluation.report_page import write_report

    la, _ = _wide_fit("isotropic")
    rel = {"edges": [i / 15 for i in range(16)], "confidence": [None] * 15, "accuracy": [0.5] * 15,
           "count": [1.0] * 15}
    metrics = {"accuracy": 0.9, "nll": 0.4, "ece": 0.05, "brier": 0.2, "reliability": rel}
    rows = [{"method": "map", "repeat": 0, "prior_precision": None, "eval_set": "test", "kind": "test",
             "severity": None, "link": "map", "full_batch": False, **metrics}]
    for d in (0.1, 1.0):
        rows.append({"method": "kron_debiased", "repeat": 0, "prior_precision": d, "eval_set": "test",
                     "kind": "test", "severity": None, "link": "probit_projected", "full_batch": False,
                     **metrics, **({"coverage": la.coverage.rows()} if d == 0.1 else {})})
    text = write_report(rows, tmp_path / "rep").read_text()
    assert "## Curvature coverage" in text
    assert "| 0 | weight | input | 24 | 4 | 4 | 8 | 0 | 20 | 0.0 |" in text


def test_diagnose_coverage_section():
    from laplace_debiased.commands.diagnose import coverage_section

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 4), nn.ReLU(), nn.Linear(4, 3))
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(32, 24, generator=g), torch.randint(0, 3, (32,), generator=g)
    text = coverage_section(model, X, y, "classification", 8, 0)
    assert "`null_space='isotropic'` (default)" in text and "`null_space='aligned'`" in text
    assert "| 0 | weight | input | 24 | 4 | 4 | 8 | 0 | 20 |" in text  # isotropic: completed, no zeros
    assert "| 0 | weight | input | 24 | 4 | 4 | 8 | 16 | 0 |" in text  # aligned: 24 - 8 zeros
    assert "'0' weight" in text  # the aligned fit's advice names the wide layer


def _dead_input_fit(null_space: str):
    """Linear(24, 4) -> ReLU -> Linear(4, 3) on inputs whose last 18 features are always 0 (a
    structurally dead input subspace, like digits_cnn's never-active pooled features), B = B̃ = 4
    samples: the input factor's support has dimension 6 < |B| + |B̃| = 8, so B ∪ B̃ reaches all of
    it and the 18 directions no batch reaches stay zero whatever the data."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 4), nn.ReLU(), nn.Linear(4, 3))
    g = torch.Generator().manual_seed(1)
    X = torch.cat([torch.randn(16, 6, generator=g), torch.zeros(16, 18)], dim=1)
    data = TensorDataset(X, torch.randint(0, 3, (16,), generator=g))
    la = DebiasedKronLaplace(model, "classification", null_space=null_space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        la.fit(DataLoader(data, batch_size=4))
    return la, [w for w in caught if issubclass(w.category, UserWarning) and "prior" in str(w.message)]


@pytest.mark.parametrize("null_space", ["aligned", "isotropic"])
def test_structural_zeros_are_recorded_but_not_warned(null_space):
    """Zeros outside the span that B ∪ B̃ reaches, when the union is saturated (rank(B ∪ B̃) <
    rank B + rank B̃: the batches' spans overlap, so more samples add no direction), are the
    curvature's own: recorded (raw count and structural split), no warning."""
    la, warned = _dead_input_fit(null_space)
    A = la.coverage.blocks[0].factors[1]
    assert (A.dimension, A.rank_direction, A.rank_magnitude, A.rank_union) == (24, 4, 4, 6)
    assert not A.sample_limited
    assert A.structural_zeros == A.zero_eigenvalues and A.sample_limited_zeros == 0
    if null_space == "aligned":
        assert A.zero_eigenvalues == A.dimension - A.rank_union  # 18: no batch reaches them
        assert la.coverage.blocks[0].prior_only_share >= 18 / 24 - 1e-12
    assert la.coverage.blocks[0].sample_limited_share == 0
    assert not warned and not la.coverage.advice()


def test_sample_limited_zeros_warn_with_the_reachable_rank():
    """d = 24 > |B| + |B̃| = 8 (aligned): rank(B ∪ B̃) = rank B + rank B̃, every zero is
    sample-limited, and the warning states zero count = dimension − reachable rank and advises
    the isotropic completion or more samples."""
    la, warned = _wide_fit("aligned")
    A = la.coverage.blocks[0].factors[1]
    assert A.sample_limited and A.sample_limited_zeros == A.zero_eigenvalues == 24 - 8
    assert la.coverage.blocks[0].sample_limited_share == pytest.approx(la.coverage.blocks[0].prior_only_share)
    (w,) = warned
    text = str(w.message)
    assert "input factor: 16 of 24 eigenvalues zero = dimension 24 − rank 8 reached by B ∪ B̃" in text
    assert "null_space='isotropic'" in text and "n_magnitude_batches" in text


@pytest.mark.parametrize(
    ("zeros", "text"),
    [(20, "input factor: 20 of 24 eigenvalues zero = dimension 24 − rank 4 reached by B ∪ B̃"),
     (23, "input factor: 23 of 24 eigenvalues zero; dimension 24 − rank 4 reached by B ∪ B̃ = 20 unreached")],
    ids=["equal", "more zeros than unreached"],
)
def test_a_factor_describes_its_zeros_against_the_reachable_rank(zeros, text):
    """The two counts are compared in one phrase: ``=`` where every zero is outside the reach of
    B ∪ B̃, and otherwise the unreached count stated beside the zero count."""
    assert coverage.FactorCoverage("input", 24, 1, 3, 4, zeros, 0).describe() == text


def test_advice_never_names_the_treatment_in_use():
    """Sample-limited zeros under the isotropic completion (B̃ without curvature above round-off on
    B's null space): the advice is more samples, not the option already active."""
    A = coverage.FactorCoverage("input", 24, 4, 4, 8, 20, 20)
    G = coverage.FactorCoverage("output", 4, 4, 4, 4, 0, 0)
    block = coverage.BlockCoverage("0", "weight", (G, A), 96, 1 - 4 / 24)
    text = coverage.Coverage((block,), "isotropic", 4, 4).advice()
    assert "'0' weight" in text and "n_magnitude_batches" in text
    assert text.count("null_space='isotropic'") == 1  # only where it names the fit's setting


def _chained_inputs(n: int, d: int = 24) -> torch.Tensor:
    """``n`` float32 inputs in ``d`` dims whose second moment has one dominant eigenvalue ``1e4``
    and ``min(n, d) - 1`` small ones ``0.25, 0.5, ...``: the round-off tolerance
    ``10 d eps₃₂ ‖A‖_F ≈ 0.29`` exceeds their gaps, so the isotropic rule groups them (chained by
    :func:`degenerate_groups`, or in tied runs by :func:`tied_groups`; with the zeros when
    ``n < d``), as on digits_cnn's ``Linear(256, 32)``."""
    k = min(n, d)
    lam = torch.cat([torch.tensor([1e4]), 0.25 * torch.arange(1, k, dtype=torch.float64)])
    X = torch.zeros(n, d, dtype=torch.float64)
    X[torch.arange(k), torch.arange(k)] = (n * lam).sqrt()  # XᵀX / n = diag(lam, 0)
    return X.float()


@pytest.mark.parametrize("n", [24, 12], ids=["dense", "rows"])
def test_same_batch_is_stock_kron_when_small_eigenvalues_chain(n):
    """B̃ = B reduces to laplace-torch's KronLaplace (same factors, eigendecomposed) also when
    B's small eigenvalues lie within the degeneracy tolerance of each other: the isotropic
    completion, whose mean over such a group would flatten B's own spectrum, is not applied when
    B̃ is B. Tolerance: the float32 cast of eigenvalues and eigenvectors, a few eps₃₂ ‖H‖_F."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 3, bias=False))
    X = _chained_inputs(n)
    dl = DataLoader(TensorDataset(X, torch.arange(n) % 3), batch_size=n)
    la = DebiasedKronLaplace(model, "classification")
    la.fit(dl, magnitude_loader=dl)
    ref = KronLaplace(model, "classification")
    ref.fit(dl)
    A = la.H_facs.kfacs[0][1].double()
    ext, mult = extended_spectrum(la.H.eigenvectors[0][1], la.H.eigenvalues[0][1])
    ours = torch.repeat_interleave(ext.double(), mult.long()).sort().values
    eps32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(ours, torch.linalg.eigvalsh(A), atol=8 * eps32 * float(torch.linalg.matrix_norm(A)), rtol=0)
    H, H_ref = la.H.to_matrix().double(), ref.H.to_matrix().double()
    torch.testing.assert_close(H, H_ref, atol=8 * eps32 * float(torch.linalg.matrix_norm(H_ref)), rtol=0)
