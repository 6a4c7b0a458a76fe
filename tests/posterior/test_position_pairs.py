"""Sums over positions (``Conv2d``, a ``Linear`` on every token) in the K-FAC eigenbasis without
the per-input Jacobian: the pairs-of-positions covariance, the rotated factors summed, the dead
positions dropped, and the grid predictive on conv, token and last-layer models against the
Jacobian route (laplace-torch's ``functional_variance`` of the dense Jacobians), float64.

Identities in exact arithmetic; 1e-10 relative sits four orders above the round-off of these
tiny problems (as in ``tests/kron/test_posterior.py``).
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import TensorDataset

import laplace_debiased  # noqa: F401  registers the debiased structures
from _models import loader, tiny_cnn, tiny_mlp
from laplace_debiased.kron.posterior import ImplicitKronDecomposed, ImplicitKronStructure
from laplace_debiased.posterior import kron_structure
from laplace_debiased.posterior.from_laplace import laplace_params, posterior_structure
from laplace_debiased.posterior.grams import jacobian_float64, weighted_grams
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import LayerJacobian, logit_jacobians, logit_rows
from laplace_debiased.posterior.kron_structure import (
    KronStructure,
    live_positions,
    positions_cheaper,
    pair_covariances,
    positions_sum,
    rotated_factors,
)
from laplace_debiased.posterior.links import project_classes

GRID = [1e-3, 0.1, 1.0, 30.0]


def _r(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-10) -> None:
    torch.testing.assert_close(a, b, rtol=rtol, atol=rtol * float(b.abs().max()))


# ---------------------------------------------------------------- the pieces (pure maths)
def test_rotated_factors_summed_are_the_rotated_dense_jacobian():
    G, u = _r(4, 3, 5, 7, seed=1), _r(4, 6, 7, seed=2)
    Q_G, Q_A = torch.linalg.qr(_r(5, 5, seed=3))[0], torch.linalg.qr(_r(6, 4, seed=4))[0]
    J = torch.einsum("ncot,nkt->ncok", G, u)
    _close(positions_sum(*rotated_factors(G, u, Q_G, Q_A)), (Q_G.T @ J @ Q_A).flatten(2), rtol=1e-13)


@pytest.mark.parametrize("grid", [1, 4])
def test_pair_covariances_equal_the_weighted_grams_of_the_summed_jacobian(grid):
    G, A, W = _r(3, 4, 5, 6, seed=5), _r(3, 5, 7, seed=6), _r(grid, 6 * 7, seed=7).exp()
    ref = weighted_grams(positions_sum(G, A), W)
    _close(pair_covariances(G, A, W), ref, rtol=1e-12)
    _close(pair_covariances(G, A, W, diagonal=True), torch.diagonal(ref, dim1=-2, dim2=-1), rtol=1e-12)


def test_live_positions_drop_only_zero_terms():
    """Rows with 1 or 3 of 5 positions alive: cut to 3 (the summed Jacobian unchanged); one per
    row: the factored ``g ⊗ a``; all alive: unchanged."""
    g, u = _r(4, 3, 2, 5, seed=8), _r(4, 6, 5, seed=9)
    alive = torch.tensor([[1, 0, 0, 0, 0], [0, 1, 1, 0, 1], [0, 0, 0, 1, 0], [1, 0, 1, 0, 0]], dtype=torch.float64)
    jac = LayerJacobian(positions=(g * alive[:, None, None], u))
    cut = live_positions(jac)
    assert cut.positions[0].shape[-1] == 3
    _close(cut.full(), jac.full(), rtol=0)
    one = LayerJacobian(positions=(g * torch.eye(5, dtype=torch.float64)[[2, 0, 4, 4], None, None], u))
    factored = live_positions(one)
    assert factored.positions is None and factored.g.shape == (4, 3, 2) and factored.a.shape == (4, 6)
    _close(factored.full(), one.full(), rtol=0)
    assert live_positions(LayerJacobian(positions=(g, u))).positions[0].shape[-1] == 5
    single = live_positions(LayerJacobian(positions=(g[..., :1], u[..., :1])))
    assert single.g is not None and torch.equal(single.full(), LayerJacobian(positions=(g[..., :1], u[..., :1])).full())


def test_float64_jacobian_of_float32_positions_is_summed_in_float64():
    """Two positions that nearly cancel (``g_1 = -(1 - 1e-4) g_0``, same input): float32 factors
    summed in float32 lose ``u / 1e-4 ≈ 6e-4`` of the sum; widened first, the float64 Jacobian is
    exact to float64 round-off."""
    g0, u0 = _r(3, 2, 4, 1, seed=10).float(), _r(3, 5, 1, seed=11).float()
    g, u = torch.cat([g0, -(1 - 1e-4) * g0], -1), torch.cat([u0, u0], -1)
    exact = torch.einsum("ncot,nkt->ncok", g.double(), u.double()).flatten(2)
    _close(jacobian_float64(LayerJacobian(positions=(g, u))).dense, exact, rtol=1e-12)


# ---------------------------------------------------------------- models against the Jacobian route
class TokenMixer(nn.Module):
    """Per-token Linear(32, 12), a Linear across the token axis (tokens interact: every position of
    the first layer alive for every output row), Tanh, per-token output Linear."""

    def __init__(self, T: int = 4, C: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.mix, self.out = nn.Linear(32, 12), nn.Linear(T, T), nn.Linear(12, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.mix(self.embed(x).transpose(1, 2)).transpose(1, 2)
        return self.out(torch.tanh(h))


def _conv() -> nn.Module:
    """Conv2d(8, 16, 3) on 8x4x4: 4 positions, 72 unfolded inputs (its factors wider than a batch)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3), nn.Tanh(), nn.Flatten(), nn.Linear(64, 3)).double()


MODELS = {  # model, input shape, label shape, the kind of the first block's rotation
    "conv": (_conv, (8, 4, 4), (), "positions"),
    "token_mixer": (lambda: TokenMixer().double(), (4, 32), (4,), "positions"),
    "token_mlp": (lambda: tiny_mlp(n_in=32, hidden=12), (4, 32), (4,), "factored"),
    "small_conv": (tiny_cnn, (1, 5, 5), (), "dense"),  # 9 positions of a 2 × 9 weight: rotated densely
}
#: (model, structure, batch size): stock kron (laplace-torch fits no token outputs), debiased_kron
#: with square bases (tokens) and implicit ones (the conv: 72 inputs against 2 × 3 × 4 rows).
CASES = [("conv", "kron", 6), ("conv", "debiased_kron", 3),
         ("token_mixer", "debiased_kron", 6), ("token_mlp", "debiased_kron", 6), ("small_conv", "debiased_kron", 6)]

def _fit(name: str, structure: str, batch: int, subset: str = "all", dtype=torch.float64):
    """The model fitted on 4 batches, and 3 test inputs."""
    make, shape, label_shape, _ = MODELS[name]
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4 * batch, *shape, generator=g, dtype=dtype)
    y = torch.randint(0, 3, (4 * batch, *label_shape), generator=g)
    kw = {"n_direction_batches": 2} if structure != "kron" else {}
    la = Laplace(make().to(dtype), "classification", subset_of_weights=subset, hessian_structure=structure, **kw)
    la.fit(loader(TensorDataset(X, y), batch))
    return la, torch.randn(3, *shape, generator=g, dtype=dtype)


def _jacobian_route(la, x: torch.Tensor, deltas) -> torch.Tensor:
    """laplace-torch's ``functional_variance`` of the dense ``(rows, C, P)`` Jacobian, per δ."""
    f, jacs = logit_jacobians(la.model, laplace_params(la), x)
    rows, C = logit_rows(f).shape
    J = torch.cat([j.full().expand(rows, C, -1) for j in jacs], dim=-1)
    out = []
    for d in deltas:
        la.prior_precision = d
        out.append(la.functional_variance(J))
    return torch.stack(out)


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("name, structure, batch", CASES)
def test_grid_covariances_equal_the_jacobian_route(name, structure, batch, pairs, monkeypatch):
    """Covariances and (projected) variances over a grid of 4 prior precisions, summed over pairs
    of positions (``pairs``) or formed densely from the rotated factors, equal laplace-torch's
    route on the dense Jacobians; the conv and mixer blocks take the positions route, the
    per-token MLP's first layer keeps one position per row (factored)."""
    monkeypatch.setattr(kron_structure, "pairs_cheaper", lambda *a, **k: pairs)
    la, x = _fit(name, structure, batch)
    structure_ = posterior_structure(la)
    assert isinstance(structure_, ImplicitKronStructure) == (name == "conv" and structure != "kron")
    _, jacs = logit_jacobians(la.model, laplace_params(la), x)
    rotated = structure_.rotate(jacs)
    assert rotated[0][0] == MODELS[name][3]
    ref = _jacobian_route(la, x, GRID)
    _close(structure_.covariances(rotated, GRID), ref)
    proj = project_classes(project_classes(ref, -1), -2)
    _close(structure_.variances(rotated, GRID, project=True), torch.diagonal(proj, dim1=-2, dim2=-1))
    _close(structure_.variances(rotated, GRID), torch.diagonal(ref, dim1=-2, dim2=-1))


@pytest.mark.parametrize("name, structure, batch", CASES)
def test_la_call_and_grid_predictive_equal_the_jacobian_route(name, structure, batch):
    """``la(x)``'s GLM covariance and the grid predictive's probit at each grid point equal the
    Jacobian route (the default choice between pairs and dense)."""
    la, x = _fit(name, structure, batch)
    ref = _jacobian_route(la, x, GRID)
    la.prior_precision = GRID[1]
    _, cov = la._glm_predictive_distribution(x)
    _close(cov, ref[1])
    probs = GridPredictive(la, chunk_size=2).grid(x, GRID, links=("probit",))["probit"]
    f = logit_rows(la.model(x)).detach()
    for p, r in zip(probs, ref):
        expected = torch.softmax(f / (1 + torch.pi / 8 * torch.diagonal(r, dim1=-2, dim2=-1)).sqrt(), -1)
        _close(p.reshape(expected.shape), expected)


@pytest.mark.parametrize("batch", [3, 6])
def test_last_layer_token_grid_equals_the_jacobian_route(batch):
    """Last layer on token outputs: the output ``Linear`` on every token is one position per row
    (factored), covariances over the grid equal the Jacobian route."""
    la, x = _fit("token_mlp", "debiased_kron", batch, subset="last_layer")
    structure_ = posterior_structure(la)
    _, jacs = logit_jacobians(la.model, laplace_params(la), x)
    _close(structure_.covariances(structure_.rotate(jacs), GRID), _jacobian_route(la, x, GRID))


@pytest.mark.parametrize("pairs", [True, False])
@pytest.mark.parametrize("alive", [2, 1, 7])
def test_implicit_positions_equal_the_completed_bases(alive, pairs, monkeypatch):
    """Both factors ``(d, r)`` with a completion value: a sum over 7 positions with ``alive`` of
    them nonzero per row (compressed residual columns over ``(c, t)`` and ``t``) has the
    covariances and (projected) variances of the dense Jacobian on the completed bases."""
    monkeypatch.setattr(kron_structure, "pairs_cheaper", lambda *a, **k: pairs)
    n, C, T = 5, 4, 7
    g = torch.Generator().manual_seed(4)

    def eig(d, r):
        Q = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64)).Q[:, :r]
        return Q, torch.rand(r + 1, generator=g, dtype=torch.float64) * 3

    blocks = [(eig(6, 2), eig(9, 4))]
    H = ImplicitKronDecomposed([[b[0] for b in bl] for bl in blocks], [[b[1] for b in bl] for bl in blocks])
    mask = torch.zeros(n, T, dtype=torch.float64)
    for i in range(n):
        mask[i, torch.randperm(T, generator=g)[:alive]] = 1
    G = torch.randn(n, C, 6, T, generator=g, dtype=torch.float64) * mask[:, None, None]
    jac = LayerJacobian(positions=(G, torch.randn(n, 9, T, generator=g, dtype=torch.float64)))
    implicit, ref = H.grid_structure(0.8, [54]), KronStructure(H.completed(), 0.8, [54])
    assert isinstance(implicit, ImplicitKronStructure)
    a, b = implicit.rotate([jac]), ref.rotate([LayerJacobian(dense=jac.full())])
    assert a[0][0] == ("factored" if alive == 1 else "positions")
    grid = [1e-4, 1.0, 30.0]
    _close(implicit.covariances(a, grid), ref.covariances(b, grid))
    _close(implicit.variances(a, grid), ref.variances(b, grid))
    _close(implicit.variances(a, grid, project=True), ref.variances(b, grid, project=True))


@pytest.mark.parametrize("name", ["token_mixer", "token_mlp"])
def test_sweep_forms_no_jacobian_and_equals_the_jacobian_route(name, tmp_path, monkeypatch):
    """``run_sweep`` on debiased_kron takes the factored route (no ``LayerJacobian.full`` of a
    factored Jacobian, nor of a sum over positions unless that is the cheaper rotation: the mixer's
    4 × 4 layer over 12 positions) and its NLL at each prior precision is that of the probit on
    the Jacobian route's variances."""
    from laplace_debiased.evaluation.sweep import EvalSet, SweepJob, run_sweep

    la, x = _fit(name, "debiased_kron", 6)
    y = torch.randint(0, 3, (3, 4), generator=torch.Generator().manual_seed(2))
    ref = _jacobian_route(la, x, GRID)
    f = logit_rows(la.model(x)).detach()
    formed, full = [], LayerJacobian.full
    def counted(self: LayerJacobian) -> torch.Tensor:
        formed.append(self.g is not None or (self.positions is not None and positions_cheaper(self.positions)))
        return full(self)

    monkeypatch.setattr(LayerJacobian, "full", counted)
    rows = run_sweep([SweepJob("debiased_kron", lambda repeat: la, links=["probit"])], [EvalSet("test", x, y)],
                     tmp_path / "r.jsonl", prior_precisions=GRID, links=["probit"], progress=False, map_model=la.model)
    assert not any(formed)
    nll = {r["prior_precision"]: r["nll"] for r in rows if r["method"] == "debiased_kron"}
    for d, r in zip(GRID, ref):
        p = torch.softmax(f / (1 + torch.pi / 8 * torch.diagonal(r, dim1=-2, dim2=-1)).sqrt(), -1)
        expected = -p.gather(1, y.reshape(-1, 1)).log().mean()
        assert nll[d] == pytest.approx(float(expected), rel=1e-10)


# ---------------------------------------------------------------- float32 models
def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 30), nn.Tanh(), nn.Linear(30, 3))


MODELS["mlp"] = (_wide_mlp, (40,), (), "factored")


def _float64_posterior(P):
    """A float64 copy of a (possibly implicit) ``KronDecomposed`` posterior precision."""
    import copy

    P64 = copy.copy(P)
    P64.eigenvectors = [[q.double() for q in qs] for qs in P.eigenvectors]
    P64.eigenvalues = [[l.double() for l in ls] for ls in P.eigenvalues]
    P64.deltas = P.deltas.double()
    return P64


def _rows_norm(M: torch.Tensor) -> torch.Tensor:
    return M.double().flatten(1).norm(dim=1)


@pytest.mark.parametrize("delta", [1e-3, 1.0])
@pytest.mark.parametrize("name, batch", [("mlp", 6), ("conv", 3), ("small_conv", 6), ("token_mixer", 6), ("token_mlp", 6)])
def test_float32_model_predictive_equals_the_jacobian_route(name, batch, delta):
    """float32 model and inputs, debiased_kron, ``la(x)``'s covariance ``Σ`` (float32) against:

    * the Jacobian route in exact arithmetic on the same model (laplace-torch's
      ``inv_square_form`` in float64 on the float32 model's Jacobians formed in float64 from
      their factors, the posterior's float32 eigenpairs widened): 1e-6 relative per row. The
      factored route differs only by its float64 round-off (``~1e-16 κ``) and the cast of ``Σ``
      to float32 (``u = 2⁻²⁴`` relative per entry);
    * laplace-torch's float32 Jacobian route: its own round-off is not relative to ``Σ``. With
      ``γ_n = n u / (1 - n u)``, rounding the Jacobian (``u``, a sum over ``T`` positions:
      ``γ_T``), the two rotations of a block (``γ_o √o + γ_k √k`` of ``‖J‖``), and the product
      with ``Jᵀ`` over all ``P`` parameters (``γ_P``), each weighted by at most ``1/δ``, give
      ``‖ΔΣ‖_F ≤ (2 η + γ_P) ‖J‖_F² / δ + 2u ‖Σ‖_F`` with ``η = u + γ_T + max(γ_o √o + γ_k √k)``.
      Relative to ``Σ`` that is ``(2η + γ_P) ρ`` with ``ρ = ‖J‖_F² / (δ ‖Σ‖_F) ≤ C κ``,
      ``κ = (s λ_max + δ)/δ``: 1e-6 holds only for inputs with ``ρ ≲ 1e-6 / (2η + γ_P)``
      (about 10 here), so this bound is asserted instead."""
    la, x = _fit(name, "debiased_kron", batch, dtype=torch.float32)
    la.prior_precision = delta
    _, cov = la._glm_predictive_distribution(x)
    assert cov.dtype == torch.float32
    f, jacs = logit_jacobians(la.model, laplace_params(la), x)
    rows, C = logit_rows(f).shape
    J64 = torch.cat([jacobian_float64(j).full().expand(rows, C, -1) for j in jacs], dim=-1)
    exact = _float64_posterior(la.posterior_precision).inv_square_form(J64)
    assert (_rows_norm(cov - exact) <= 1e-6 * _rows_norm(exact)).all()
    J32 = torch.cat([j.full().expand(rows, C, -1) for j in jacs], dim=-1)
    ref32 = la.functional_variance(J32)
    u = torch.finfo(torch.float32).eps / 2

    def gamma(n: int) -> float:
        return n * u / (1 - n * u)

    T = max([j.positions[0].shape[-1] for j in jacs if j.positions is not None], default=1)
    rotations = max(gamma(len(Qs[0])) * len(Qs[0]) ** 0.5 + (gamma(len(Qs[1])) * len(Qs[1]) ** 0.5 if len(Qs) == 2 else 0)
                    for Qs in la.H.eigenvectors)
    eta = u + gamma(T) + rotations
    bound = (2 * eta + gamma(J32.shape[-1])) * _rows_norm(J64).square() / delta + 2 * u * _rows_norm(exact)
    assert (_rows_norm(cov - ref32) <= bound).all()
