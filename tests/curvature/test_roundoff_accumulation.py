"""Round-off of a curvature factor summed over many samples in float32 (the full-data fit of a
confident classifier): ``roundoff_tolerance(C, terms=m)`` covers the error of summing ``m`` outer
products, and a real negative eigenvalue is still refused."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.curvature.kfac import loss_hessian_sqrt_columns
from laplace_debiased.curvature.linalg import clamp_roundoff_negatives, remeasure_eigenvalues, roundoff_tolerance
from laplace_debiased.kron.laplace import DebiasedKronLaplace

EPS32 = torch.finfo(torch.float32).eps


def _softmax_factor(m: int, C: int = 10, batch: int = 250, seed: int = 0) -> torch.Tensor:
    """Σ_n S_n S_nᵀ over ``m`` confident softmax outputs, summed batch by batch in float32 as the
    K-FAC pass does (``addmm_``); exactly singular along the all-ones direction."""
    gen = torch.Generator().manual_seed(seed)
    G = torch.zeros(C, C)
    for start in range(0, m, batch):
        f = 8.0 * torch.randn(min(batch, m - start), C, generator=gen)
        rows = torch.cat(list(loss_hessian_sqrt_columns(f, "classification")))
        G.addmm_(rows.T, rows)
    return G


@pytest.mark.parametrize("m", [2_000, 20_000, 80_000])
def test_the_null_direction_of_a_float32_sum_stays_within_the_accumulation_tolerance(m):
    G = _softmax_factor(m)
    u = torch.ones(G.shape[0], dtype=torch.float64) / G.shape[0] ** 0.5
    along_null = float(u @ G.double() @ u)  # exactly 0 in exact arithmetic
    assert abs(along_null) <= roundoff_tolerance(G, terms=m)
    values = remeasure_eigenvalues(torch.linalg.eigh(G.double()).eigenvectors, G, terms=m)
    assert values.min() >= 0


def test_the_rigorous_bound_holds_entrywise():
    """|E_ij| ≤ γ_m √(C_ii C_jj) for the float32 sum against the float64 one (the docstring's
    derivation of the ``terms`` part)."""
    m, batch, C = 20_000, 250, 10
    gen = torch.Generator().manual_seed(1)
    G32, G64 = torch.zeros(C, C), torch.zeros(C, C, dtype=torch.float64)
    for _ in range(m // batch):
        rows = torch.cat(list(loss_hessian_sqrt_columns(8.0 * torch.randn(batch, C, generator=gen), "classification")))
        G32.addmm_(rows.T, rows)
        G64.addmm_(rows.T.double(), rows.double())
    d = G64.diagonal()
    gamma = m * C * EPS32 / (1 - m * C * EPS32)  # m·C rank-one terms (C columns per sample)
    assert ((G32.double() - G64).abs() <= gamma * (d[:, None] * d[None, :]).sqrt()).all()


def test_a_real_negative_eigenvalue_is_still_refused():
    C = torch.diag(torch.tensor([1.0, 1.0, -0.05]))  # an indefinite "curvature" (a Hessian)
    tol = roundoff_tolerance(C, terms=10_000)
    assert tol < 0.05
    with pytest.raises(ValueError, match="not positive semi-definite"):
        clamp_roundoff_negatives(torch.tensor([1.0, 1.0, -0.05]), tol)


def test_a_full_data_fit_over_many_samples_is_not_refused():
    """B̃ = B over 20,000 samples of a confident MLP: the output factor of the last layer is
    singular (softmax), and its float32 sum is negative along that direction by about
    0.04 · m · eps · ‖G‖_F, beyond the eigensolver's tolerance (the fit used to raise)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    X = torch.randn(20_000, 20)
    loader = DataLoader(TensorDataset(X, model(X).argmax(-1).detach()), batch_size=250)
    la = DebiasedKronLaplace(model, "classification", n_direction_batches=80, n_magnitude_batches=80)
    la.fit(loader, magnitude_loader=loader)
    values = [v for block in la.H.eigenvalues for v in block]
    assert all(bool((v >= 0).all()) for v in values)
    assert float(la.H.eigenvalues[2][0].min()) == 0.0  # the softmax's null direction, clamped


def _conv_gap_classifier() -> torch.nn.Module:
    """A 1×1 convolution to 10 classes over 32×32 positions, then global average pooling: the
    ALL-CNN-C head. Its K-FAC output factor sums 1,024 positions × 10 loss-Hessian columns per
    sample, and is exactly singular along the all-ones direction (softmax)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 10, 1), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    with torch.no_grad():
        model[0].weight.mul_(20.0)
    return model


def test_a_factor_summed_over_many_positions_counts_every_rank_one_term():
    """The K-FAC sums count the rank-one terms summed into each factor: samples × positions ×
    loss-Hessian columns (C - 1 = 9 for cross-entropy over 10 classes) on the output side, samples ×
    positions on the input side."""
    from laplace_debiased.curvature.kfac import group_kfac_sums

    model = _conv_gap_classifier()
    X = torch.randn(6, 3, 32, 32)
    y = torch.randint(0, 10, (6,))
    sums = group_kfac_sums(model, [model[0]], X, y, [(0, 2, 0), (2, 6, 1)], 2, likelihood="classification",
                           lossfunc=torch.nn.CrossEntropyLoss(reduction="sum"), factor=1.0)
    assert sums.terms[0].tolist() == [[2 * 1024 * 9, 2 * 1024], [4 * 1024 * 9, 4 * 1024]]


def test_a_stock_equivalent_fit_over_many_positions_is_not_refused():
    """B̃ = B over 256 samples of the 1×1-conv head: its float32 output factor, summed over
    256 × 1,024 × 9 rank-one terms, is negative along the softmax's null direction by more than a
    tolerance that counts only the samples (the fit used to raise); with every summed term counted
    it is round-off, clamped to 0."""
    model = _conv_gap_classifier()
    X = torch.randn(256, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(X, model(X).argmax(-1).detach()), batch_size=256)
    G = DebiasedKronLaplace(model, "classification")
    G.fit(loader, magnitude_loader=loader)
    assert all(bool((v >= 0).all()) for block in G.H.eigenvalues for v in block)
    factor = G.H_facs.kfacs[0][0]
    u = torch.ones(10, dtype=torch.float64) / 10**0.5
    along_null = float(u @ factor.double() @ u)  # 0 in exact arithmetic
    assert along_null < -roundoff_tolerance(factor, terms=256)  # what the samples alone allow
    assert abs(along_null) <= roundoff_tolerance(factor, terms=256 * 1024 * 9)


@pytest.mark.parametrize("estimator", ["paper", "corrected", "shrunk"])
def test_a_two_batch_fit_over_many_positions_is_not_refused(estimator):
    """B ≠ B̃ (256 samples each) of the same head: every estimate remeasures B̃'s float32 output
    factor along B's eigenvectors, the softmax's null direction among them."""
    model = _conv_gap_classifier()
    X = torch.randn(512, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    loader = DataLoader(TensorDataset(X, model(X).argmax(-1).detach()), batch_size=256)
    la = DebiasedKronLaplace(model, "classification", estimator=estimator)
    la.fit(loader)
    assert all(bool((v >= 0).all()) for block in la.H.eigenvalues for v in block)
