"""Cross-fitting (``cross_fit=True``) of debiased K-FAC and debiased EKFAC: the
equal-weight mixture of the two role-swapped approximations, against the two separate fits."""

from __future__ import annotations

import io

import pytest
import torch

from _models import loader, tiny_mlp, toy_data
from laplace_debiased.posterior.from_laplace import laplace_params, posterior_structure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import logit_jacobians
from laplace_debiased.two_batch.cross_fit import CrossFitDecomposed
from laplace_debiased.ekfac.posterior import EKFACDecomposed
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace
from laplace_debiased.kron.laplace import DebiasedKronDecomposed, DebiasedKronLaplace, DebiasedKronLLLaplace

CLASSES = {
    ("kron", "all"): DebiasedKronLaplace,
    ("kron", "last_layer"): DebiasedKronLLLaplace,
    ("ekfac", "all"): DebiasedEKFACLaplace,
    ("ekfac", "last_layer"): DebiasedEKFACLLLaplace,
}
PLAIN = {"kron": DebiasedKronDecomposed, "ekfac": EKFACDecomposed}
CASES = pytest.mark.parametrize("structure,subset", list(CLASSES))


def _two_loaders():
    ds1 = toy_data(16, (4,), 3, "classification", seed=1)
    ds2 = toy_data(16, (4,), 3, "classification", seed=2)
    return loader(ds1, 16), loader(ds2, 16)


def _inputs():
    return toy_data(5, (4,), 3, "classification", seed=7).tensors[0]


def _fit(structure, subset, direction, magnitude, cross_fit=False, **kwargs):
    la = CLASSES[structure, subset](
        tiny_mlp(), "classification", prior_precision=0.5, cross_fit=cross_fit, estimator="paper", **kwargs
    )
    la.fit(direction, magnitude_loader=magnitude)
    return la


@CASES
def test_cross_fit_is_symmetric_in_the_two_batches(structure, subset):
    L1, L2 = _two_loaders()
    X = _inputs()
    one, two = (_fit(structure, subset, a, b, cross_fit=True) for a, b in ((L1, L2), (L2, L1)))
    assert isinstance(one.H, CrossFitDecomposed)
    assert all(type(c) is PLAIN[structure] for c in one.H.components)
    torch.testing.assert_close(one.H.to_matrix(), two.H.to_matrix(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(one.posterior_precision.to_matrix(-1), two.posterior_precision.to_matrix(-1))
    torch.testing.assert_close(one.log_marginal_likelihood(), two.log_marginal_likelihood())
    torch.testing.assert_close(one(X, link_approx="probit"), two(X, link_approx="probit"))
    torch.testing.assert_close(one.loss, two.loss)


@CASES
def test_cross_fit_is_the_mixture_of_the_two_role_swapped_fits(structure, subset):
    L1, L2 = _two_loaders()
    X = _inputs()
    cross = _fit(structure, subset, L1, L2, cross_fit=True)
    parts = [_fit(structure, subset, a, b) for a, b in ((L1, L2), (L2, L1))]
    P1, P2 = (p.posterior_precision for p in parts)
    cov = 0.5 * (P1.to_matrix(-1) + P2.to_matrix(-1))
    torch.testing.assert_close(cross.posterior_precision.to_matrix(-1), cov, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(cross.posterior_precision.diag(-1), cov.diagonal(), atol=1e-12, rtol=1e-10)
    # the two components differ, so the mixture is new
    assert not torch.allclose(P1.to_matrix(-1), P2.to_matrix(-1), atol=1e-6)
    # function space: the mixture's covariance ½ J (P₁⁻¹ + P₂⁻¹) Jᵀ
    J = torch.randn(5, 3, cross.n_params, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(cross.functional_variance(J), J @ cov @ J.transpose(1, 2))
    # averaged log evidence
    lml = 0.5 * (parts[0].log_marginal_likelihood() + parts[1].log_marginal_likelihood())
    torch.testing.assert_close(cross.log_marginal_likelihood(), lml)
    # the grid predictive agrees with laplace-torch's on the mixture, and at every δ with the
    # average of the two fits' function-space covariances
    grid = [1e-2, 0.5, 10.0]
    ours = GridPredictive(cross).grid(X, grid, links=("probit",))["probit"]
    torch.testing.assert_close(ours[1], cross(X, pred_type="glm", link_approx="probit"), rtol=1e-10, atol=1e-12)
    _, jacs = logit_jacobians(cross.model, laplace_params(cross), X)
    structures = [posterior_structure(la) for la in (cross, *parts)]
    covs = [st.covariances(st.rotate(jacs), grid) for st in structures]  # (G, n, C, C) each
    torch.testing.assert_close(covs[0], 0.5 * (covs[1] + covs[2]), atol=1e-12, rtol=1e-10)
    variances = [st.variances(st.rotate(jacs), grid, project=True) for st in structures]
    torch.testing.assert_close(variances[0], 0.5 * (variances[1] + variances[2]), atol=1e-12, rtol=1e-10)
    # exact mixture samples: their covariance is the mixture's
    s = cross.sample(20000, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(torch.cov((s - cross.mean).T), cov, atol=0.05 * cov.diag().max())
    with pytest.raises(ValueError, match="exponent"):
        cross.posterior_precision.bmm(J, exponent=-0.5)


@CASES
def test_cross_fit_reduces_to_plain_structure_when_batches_coincide(structure, subset):
    dl = loader(toy_data(32, (4,), 3, "classification"), 8)
    plain = _fit(structure, subset, dl, dl)
    cross = _fit(structure, subset, dl, dl, cross_fit=True)
    assert type(cross.H) is PLAIN[structure]
    assert torch.equal(cross.H.to_matrix(), plain.H.to_matrix())
    # and the mixture of two equal components is that component
    delta = torch.tensor(0.7, dtype=torch.float64)
    mix = CrossFitDecomposed(plain.H, plain.H) + delta
    torch.testing.assert_close(mix.to_matrix(-1), (plain.H + delta).to_matrix(-1))
    torch.testing.assert_close(mix.logdet(), (plain.H + delta).logdet())


@pytest.mark.parametrize("subset", ["all", "last_layer"])
def test_kron_cross_fit_state_dict_round_trip_weights_only(subset):
    L1, L2 = _two_loaders()
    la = _fit("kron", subset, L1, L2, cross_fit=True)
    buf = io.BytesIO()
    torch.save(la.state_dict(), buf)
    buf.seek(0)
    new = CLASSES["kron", subset](tiny_mlp(), "classification", estimator="paper", cross_fit=True)
    new.load_state_dict(torch.load(buf, weights_only=True))
    assert isinstance(new.H, CrossFitDecomposed)
    assert torch.equal(new.posterior_precision.to_matrix(-1), la.posterior_precision.to_matrix(-1))
    assert torch.equal(new(_inputs()), la(_inputs()))


def test_kron_cross_fit_keeps_damping_and_marglik_increases_evidence():
    L1, L2 = _two_loaders()
    la = _fit("kron", "all", L1, L2, cross_fit=True, damping=True)
    assert all(c.damping for c in la.posterior_precision.components)
    la = _fit("kron", "all", L1, L2, cross_fit=True)
    before = la.log_marginal_likelihood(torch.tensor([1.0], dtype=torch.float64)).item()
    la.optimize_prior_precision(method="marglik", n_steps=50)
    assert la.log_marginal_likelihood().item() > before


def test_mixture_components_must_match():
    L1, L2 = _two_loaders()
    kron = _fit("kron", "all", L1, L2).H
    ekfac = _fit("ekfac", "all", L1, L2).H
    with pytest.raises(TypeError, match="different types"):
        CrossFitDecomposed(kron, ekfac)
    small = _fit("kron", "last_layer", L1, L2).H
    with pytest.raises(ValueError, match="different blocks"):
        CrossFitDecomposed(kron, small)
    with pytest.raises(TypeError, match="cross_fit must be a bool"):
        DebiasedKronLaplace(tiny_mlp(), "classification", cross_fit=1)


def test_kron_online_cross_fit_swaps_the_combined_factors():
    """``override=False``: both components come from the factors combined over the two fits."""
    L1, L2 = _two_loaders()
    L3, L4 = (loader(toy_data(16, (4,), 3, "classification", seed=s), 16) for s in (3, 4))
    la = _fit("kron", "all", L1, L2, cross_fit=True)
    la.fit(L3, override=False, magnitude_loader=L4)
    first, swapped = la.H.components
    assert la.n_data == 32
    ref = DebiasedKronLaplace(tiny_mlp(), "classification", estimator="paper")
    ref._fit_sizes = la._fit_sizes  # the samples summed into the factors (their round-off tolerance)
    ref.H_facs, ref.H_facs_magnitude = la.H_facs_magnitude, la.H_facs
    ref._decompose()
    torch.testing.assert_close(swapped.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)
    ref.H_facs, ref.H_facs_magnitude = la.H_facs, la.H_facs_magnitude
    ref._decompose()
    torch.testing.assert_close(first.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)



@CASES
def test_cross_fit_log_prob_is_the_mixture_density(structure, subset):
    """``log_prob`` is the log density of the mixture ``sample()`` draws from, ``log(½ N(θ; θ*,
    P₁⁻¹) + ½ N(θ; θ*, P₂⁻¹))`` with the two role-swapped fits' dense precisions, not the mean of
    the components' log densities; ``normalized=False`` drops the constant ``-P/2 log 2π`` and the
    mean of the components' ``½ log det P_k``, so it is stock's ``-½ Δᵀ P Δ`` when they coincide."""
    L1, L2 = _two_loaders()
    cross = _fit(structure, subset, L1, L2, cross_fit=True)
    parts = [_fit(structure, subset, a, b) for a, b in ((L1, L2), (L2, L1))]
    theta = cross.sample(3, generator=torch.Generator().manual_seed(1))
    precisions = [p.posterior_precision.to_matrix() for p in parts]
    comps = torch.stack([torch.distributions.MultivariateNormal(cross.mean, precision_matrix=P).log_prob(theta)
                         for P in precisions])
    mixture = torch.logsumexp(comps, 0) + torch.tensor(0.5, dtype=torch.float64).log()
    assert not torch.allclose(mixture, comps.mean(0), rtol=1e-6)  # the two differ here
    torch.testing.assert_close(torch.stack([cross.log_prob(t) for t in theta]), mixture, rtol=1e-10, atol=0)
    const = -0.5 * cross.n_params * torch.log(torch.tensor(2 * torch.pi, dtype=torch.float64))
    mean_half_logdet = 0.25 * sum(P.logdet() for P in precisions)
    torch.testing.assert_close(torch.stack([cross.log_prob(t, normalized=False) for t in theta]),
                               mixture - const - mean_half_logdet, rtol=1e-10, atol=0)
    dl = loader(toy_data(32, (4,), 3, "classification"), 8)
    same = _fit(structure, subset, dl, dl, cross_fit=True)
    torch.testing.assert_close(same.log_prob(theta[0], normalized=False), -0.5 * same.square_norm(theta[0]))
