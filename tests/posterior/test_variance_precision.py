"""Variances at extreme prior precisions across the structures: float32 models agree with their
float64 copies, the low-rank regression variance marginal and joint, the diagonal links without
the (n, C, C) covariance, normal samples of an ill-conditioned covariance."""

from __future__ import annotations

import copy

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  registers the structures
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.links import normal_samples

DELTAS = [1e-8, 1e-5, 1e-2, 1.0, 1e4, 1e8]
SUBSETS = ["all", "last_layer"]


def overfit_mlp(seed: int = 0, n: int = 40, d: int = 4, hidden: int = 6, C: int = 3):
    """A float64 MLP trained to near-zero training loss (large logits), and its data."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, C, (n,), generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(d, hidden), nn.Tanh(), nn.Linear(hidden, C)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model, X, y


def fit_pair(structure: str, subset: str, likelihood: str = "classification", **kw):
    """The same fitted structure for the float64 model and its float32 copy, and held-out
    float64 inputs.  (At the training inputs of an overfit model the logit-difference variance
    at δ ≲ 1e-5 lives on curvature eigenvalues below float32's resolution of ``H``, ~1e-7‖H‖,
    which no float32 fit can measure; the float32/float64 comparisons below therefore also use a
    float64 model carrying the float32 fit's curvature.)"""
    model, X, y = overfit_mlp()
    out = {}
    for dtype in (torch.float64, torch.float32):
        m = copy.deepcopy(model).to(dtype)
        la = Laplace(m, likelihood, subset_of_weights=subset, hessian_structure=structure, **kw)
        la.fit(DataLoader(TensorDataset(X.to(dtype), y), batch_size=20))
        out[dtype] = la
    X_test = torch.randn(30, X.shape[1], generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    return out, X_test


def _la_kw(structure: str) -> dict:
    return {"rank": 5} if structure == "debiased_lowrank" else {}


def _cast_curvature(H):
    if isinstance(H, torch.Tensor):
        return H.double()
    if isinstance(H, tuple):
        return tuple(h.double() for h in H)
    return type(H)([[q.double() for q in qs] for qs in H.eigenvectors],
                   [[l.double() for l in ls] for ls in H.eigenvalues], damping=H.damping)


def _pairs(structure: str, subset: str):
    """(float32 fit, float64 model with the float32 fit's curvature) -- isolates the
    predictive's own precision -- and (float32 fit, independent float64 fit)."""
    las, X = fit_pair(structure, subset, **_la_kw(structure))
    copy64, _ = fit_pair(structure, subset, **_la_kw(structure))
    copy64 = copy64[torch.float64]
    copy64.H = _cast_curvature(las[torch.float32].H)  # the float32 fit's curvature, in float64
    return {"same curvature": {torch.float32: las[torch.float32], torch.float64: copy64},
            "independent fits": las}, X


def _dense_curvature(la) -> torch.Tensor:
    """The fitted curvature (without the prior) as a dense float64 (P, P) matrix."""
    H = la.H
    if isinstance(H, tuple):  # low rank: (U, λ)
        U, lam = (h.double() for h in H)
        return (U * lam) @ U.T
    if isinstance(H, torch.Tensor):
        return H.double()
    return _cast_curvature(H).to_matrix()


def _max_logit(la, X: torch.Tensor) -> float:
    with torch.no_grad():
        return float(la.model(X.to(next(la.model.parameters()).dtype)).abs().max())


#: longest chain of float32 multiply-adds behind one logit or Jacobian entry of the test MLP
#: (inputs d = 4, hidden 6, classes 3): its forward error is at most this many float32 epsilons
#: relative to the magnitudes involved (Higham, *Accuracy and Stability*, Sec. 3.1, γ_k ≈ k·eps).
CHAIN = 4 + 6 + 3
EPS32 = torch.finfo(torch.float32).eps


def same_curvature_tolerance(max_logit: float) -> float:
    """Bound on ``|p32 − p64|`` when both predictives use the same curvature.

    The probit links give ``p = softmax(z)`` with ``z = f / sqrt(1 + π/8 · σ²)`` (``σ²``
    computed in float64 from the float32 Jacobians).  The float32 forward pass perturbs ``f``
    and the Jacobians by at most ``CHAIN · eps32`` relatively, so ``|Δz| ≤ 2 · CHAIN · eps32 ·
    max|f|``; softmax is 1/2-Lipschitz in the max-norm, and the result is rounded to float32
    (one more eps32 per probability).
    """
    return CHAIN * EPS32 * max_logit + 2 * EPS32


def curvature_tolerance(max_logit: float, dH: float, delta: float) -> float:
    """Bound on the extra ``|p32 − p64|`` caused by a curvature discrepancy ``‖ΔH‖₂ = dH``.

    With ``P = H + δ·I``, ``|Δσ²| = |jᵀ(P⁻¹ΔH P⁻¹)j| ≤ σ² · dH / δ``, and
    ``|∂z/∂σ²| · σ² ≤ |z| / 2 ≤ |f| / 2``, so ``|Δp| ≤ (1/2) · (|f| / 2) · dH / δ`` to first
    order; a factor 2 covers the second-order term while ``dH / δ ≤ 1/2``.
    """
    return 0.5 * max_logit * dH / delta


def _check_agreement(probs: dict, name: str, deltas: list[float], tolerance) -> None:
    """``tolerance(δ)``: the largest ``max |p32 - p64|`` the maths allows at ``δ`` (None: skip)."""
    p32, p64 = probs[torch.float32], probs[torch.float64]
    assert p32.dtype == torch.float32
    assert torch.isfinite(p32).all() and torch.isfinite(p64).all(), name
    torch.testing.assert_close(p32.sum(-1), torch.ones_like(p32.sum(-1)))
    err = (p32.double() - p64).abs().amax(dim=tuple(range(1, p32.ndim)))
    bad = [(d, e, tolerance(d)) for d, e in zip(deltas, err.tolist())
           if tolerance(d) is not None and e > tolerance(d)]
    assert not bad, f"{name}: (δ, max |p32 - p64|, bound) {bad}"


def _tolerances(las: dict, X: torch.Tensor, name: str):
    """The per-δ bound for one pair of fits: the predictive's own float32 error, plus, for
    independent fits, the effect of their curvature discrepancy where first-order
    perturbation theory holds (``‖ΔH‖₂ / δ ≤ 1/2``).  Below that δ the two fits are
    different posteriors (the float32 fit cannot resolve B's curvature below ~1e-7·‖H‖), and
    their curvatures are compared through the basis-invariant trace instead."""
    f_max = _max_logit(las[torch.float64], X)
    same = same_curvature_tolerance(f_max)
    if name == "same curvature":
        return lambda delta: same
    dH = float(torch.linalg.matrix_norm(
        _dense_curvature(las[torch.float32]) - _dense_curvature(las[torch.float64]), ord=2))
    return lambda delta: same + curvature_tolerance(f_max, dH, delta) if dH <= delta / 2 else None


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_kron", "debiased_lowrank"])
def test_grid_predictive_float32_equals_float64(structure, subset):
    pairs, X = _pairs(structure, subset)
    links = ("probit", "probit_projected")
    for name, las in pairs.items():
        out = {dt: GridPredictive(la).grid(X.to(dt), DELTAS, links=links) for dt, la in las.items()}
        for link in links:
            _check_agreement({dt: o[link] for dt, o in out.items()}, f"{name}, {link}", DELTAS,
                             _tolerances(las, X, name))


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_laplace_torch_probit_float32_equals_float64(structure, subset):
    """laplace-torch's ``la(x)`` on the eigen classes (their functional_variance is ours)."""
    pairs, X = _pairs(structure, subset)
    for name, las in pairs.items():
        probs = {}
        for dt, la in las.items():
            out = []
            for delta in DELTAS:
                la.prior_precision = delta
                out.append(la(X.to(dt), pred_type="glm", link_approx="probit"))
            probs[dt] = torch.stack(out)
        _check_agreement(probs, name, DELTAS, _tolerances(las, X, name))


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_kron"])
def test_float32_and_float64_fits_have_the_same_curvature_trace(structure, subset):
    """Re-measured eigenvalues sum to the magnitude batch's trace in any eigenbasis, so the
    trace of the debiased curvature is basis-invariant: the float32 fit, whose basis differs
    from the float64 fit's below float32's resolution, must still agree on it to float32
    forward error (``CHAIN · eps32`` relative, per summed term)."""
    las, _ = fit_pair(structure, subset)
    t32, t64 = (float(torch.trace(_dense_curvature(las[dt]))) for dt in (torch.float32, torch.float64))
    assert abs(t32 - t64) <= 4 * CHAIN * EPS32 * t64, (t32, t64)


def _regression_1d(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    X = torch.linspace(-3, 3, 150, dtype=torch.float64).unsqueeze(-1)
    y = torch.sin(X) + 0.1 * torch.randn(X.shape, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 20), nn.Tanh(), nn.Linear(20, 1)).double()
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.mse_loss(model(X), y).backward()
        opt.step()
    model = model.to(dtype)
    la = Laplace(model, "regression", subset_of_weights="all", hessian_structure="debiased_lowrank", rank=10)
    la.fit(DataLoader(TensorDataset(X.to(dtype), y.to(dtype)), batch_size=75))
    la.prior_precision = 0.1
    return la, X.to(dtype)


def test_lowrank_regression_variance_marginal_equals_joint_and_float64():
    la32, X32 = _regression_1d(torch.float32)
    la64, X64 = _regression_1d(torch.float64)
    for la, X in ((la32, X32), (la64, X64)):
        _, var = la(X, pred_type="glm")
        _, cov = la(X, pred_type="glm", joint=True)
        assert (var.squeeze() > 0).all()
        torch.testing.assert_close(var.squeeze(), cov.diagonal(), rtol=1e-6, atol=0)
    _, var32 = la32(X32, pred_type="glm")
    _, var64 = la64(X64, pred_type="glm")
    # not quantised to multiples of 2^-12: float32 agrees with float64 everywhere
    rel = (var32.double() / var64 - 1).abs().max()
    assert rel < 1e-3, f"max relative difference {rel:.3g}"


def test_grid_predictive_diagonal_links_never_form_the_covariance(monkeypatch):
    """probit / probit_projected take the variance route; only mc needs Σ."""
    las, X = fit_pair("debiased_kron", "last_layer")
    la = las[torch.float64]
    pred = GridPredictive(la)
    ref = pred.grid(X, DELTAS, links=("probit", "probit_projected", "mc"), generator=torch.Generator().manual_seed(0))

    def boom(*a, **k):
        raise AssertionError("covariances() called for a diagonal link")

    monkeypatch.setattr(pred.structure, "covariances", boom)
    out = pred.grid(X, DELTAS, links=("probit", "probit_projected"))
    for link in ("probit", "probit_projected"):
        torch.testing.assert_close(out[link], ref[link], rtol=1e-10, atol=1e-12)


def test_normal_samples_moments_and_ill_conditioned_covariance():
    g = torch.Generator().manual_seed(2)
    L = torch.randn(3, 4, 4, generator=g, dtype=torch.float64)
    var = L @ L.transpose(1, 2)
    mean = torch.randn(3, 4, generator=g, dtype=torch.float64)
    s = normal_samples(mean, var, 40_000, torch.Generator().manual_seed(0))
    assert s.shape == (40_000, 3, 4)
    centred = s - mean
    emp = torch.einsum("snc,snd->ncd", centred, centred) / len(s)
    torch.testing.assert_close(emp, var, rtol=0, atol=0.05 * var.abs().max())
    diag = normal_samples(mean, var.diagonal(dim1=1, dim2=2), 40_000, torch.Generator().manual_seed(0))
    torch.testing.assert_close(diag.var(0), var.diagonal(dim1=1, dim2=2), rtol=0.05, atol=0)
    # float32 Σ dominated by the all-ones direction (small prior precision): Cholesky fails here
    bad = (var + 1e12 * torch.ones(4, 4, dtype=torch.float64)).float()
    with pytest.raises(torch.linalg.LinAlgError):
        torch.linalg.cholesky(bad)
    out = normal_samples(mean.float(), bad, 100, torch.Generator().manual_seed(0))
    assert out.dtype == torch.float32 and torch.isfinite(out).all()


@pytest.mark.parametrize("subset", SUBSETS)
@pytest.mark.parametrize("structure", ["debiased_full", "debiased_kron", "debiased_lowrank"])
def test_laplace_torch_mc_finite_at_small_prior_precision(structure, subset):
    las, X = fit_pair(structure, subset, **_la_kw(structure))
    la = las[torch.float32]
    la.prior_precision = 1e-8
    p = la(X.float(), pred_type="glm", link_approx="mc", n_samples=20)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(-1), torch.ones(len(p)))
