"""Round-off of a curvature factor summed over many samples in float32 (the full-data fit of a
confident classifier): ``roundoff_tolerance(C, terms=m)`` covers the error of summing ``m`` outer
products, and a real negative eigenvalue is still refused."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.curvature.kfac import loss_hessian_sqrt_columns
from laplace_debiased.curvature.linalg import clamp_roundoff_negatives, remeasure_eigenvalues, roundoff_tolerance
from laplace_debiased.structures.kron import DebiasedKronLaplace

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
    la = DebiasedKronLaplace(model, "classification")
    la.fit(loader, magnitude_loader=loader, n_direction_batches=80, n_magnitude_batches=80)
    values = [v for block in la.H.eigenvalues for v in block]
    assert all(bool((v >= 0).all()) for v in values)
    assert float(la.H.eigenvalues[2][0].min()) == 0.0  # the softmax's null direction, clamped
