"""The eigenvalue oracles of ``benchmarks/eigenvalue_oracles.py`` against their definitions on
small dense factors: the true curvature along a batch's eigenvectors, its null-run mean, the
mean bias's sign pattern (regression to the mean), the reductions between the two oracles, and
the oracle posterior of a batch measured against itself (the single batch, BatchNorm block too),
and the cross-validated eigenvalues against the paper's two-batch quotients."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import pytest

from benchmarks.eigenvalue_oracles import (cross_validated_eigenpairs, kronecker_eigenvalues, mean_bias,
                                           oracle_eigenpairs, true_curvature, with_eigenpairs)
from laplace_debiased.kron.corrected import same_minus_cross
from benchmarks.normalisation import kron_fit
from laplace_debiased.posterior.from_laplace import posterior_structure
from laplace_debiased.posterior.jacobians import logit_jacobians
from tests._models import loader, toy_data

EPS64 = torch.finfo(torch.float64).eps


def _factor(seed: int, d: int, rows: int, scales: torch.Tensor | None = None) -> torch.Tensor:
    """``XᵀX / rows`` of ``rows`` Gaussian rows in ``d`` dimensions (standard deviations ``scales``)."""
    X = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if scales is not None:
        X = X * scales
    return X.T @ X / rows


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), d=st.integers(2, 7), rows=st.integers(1, 10))
def test_true_curvature_is_the_quotient_along_the_eigenvectors(seed, d, rows):
    D, F = _factor(seed, d, rows), _factor(seed + 1, d, 3 * d)
    L, U, c = true_curvature(D, F)
    torch.testing.assert_close(U.T @ U, torch.eye(d, dtype=torch.float64), atol=50 * d * EPS64, rtol=0)
    assert (L >= 0).all() and (L[1:] >= L[:-1]).all()
    quotients = torch.diagonal(U.T @ F @ U)
    null = d - min(rows, d)  # Gaussian rows: rank min(rows, d) almost surely
    tol = 100 * d * EPS64 * float(torch.linalg.matrix_norm(F))
    torch.testing.assert_close(c[null:], quotients[null:], atol=tol, rtol=0)
    if null:
        # the null run's mean, tr(Pᵀ F P) / dim P with P the complement of D's range: basis-free
        Q = U[:, null:]
        complement = (torch.trace(F) - torch.trace(Q.T @ F @ Q)) / null
        torch.testing.assert_close(c[:null], complement.expand(null), atol=tol, rtol=0)


def test_truth_equal_to_the_batch_has_no_bias():
    D = _factor(3, 5, 8)
    L, _, c = true_curvature(D, D)
    torch.testing.assert_close(c, L, atol=100 * EPS64 * float(L.max()), rtol=0)
    for beta in mean_bias([[[D]]] * 3, [[D]])[0]:
        assert beta.abs().max() <= 100 * EPS64 * float(L.max())


def test_bias_oracle_of_its_own_draw_is_the_eigenvalue_oracle():
    """With β measured on the very draw it corrects, ``(λ̂ - (λ̂ - c))⁺ = c``: the bias oracle
    becomes the eigenvalue oracle, and both keep the draw's eigenvectors."""
    direction = [[_factor(4, 4, 6), _factor(5, 3, 2)]]
    truth = [[_factor(6, 4, 40), _factor(7, 3, 40)]]
    vec_e, val_e = oracle_eigenpairs(direction, truth, None)
    vec_b, val_b = oracle_eigenpairs(direction, truth, mean_bias([direction], truth))
    for Ue, Ub, le, lb, D in zip(vec_e[0], vec_b[0], val_e[0], val_b[0], direction[0]):
        torch.testing.assert_close(Ub, Ue)
        torch.testing.assert_close(lb, le, atol=100 * EPS64 * float(le.max()), rtol=0)
        torch.testing.assert_close(Ue, true_curvature(D, D)[1])


def test_mean_bias_overstates_the_top_and_understates_the_bottom():
    """Regression to the mean (seeded): over 400 draws of 12 samples from a covariance with spread
    eigenvalues, the sorted sample eigenvalues exceed the true curvature along their eigenvectors
    at the top and fall below it at the bottom. Each β_i is a mean of 400 draws; the margin asked
    for is 4 standard errors of that mean, estimated from the same draws."""
    d, m = 5, 12
    scales = torch.tensor([0.3, 0.6, 1.0, 1.5, 2.0], dtype=torch.float64)
    truth = torch.diag(scales**2)
    draws = [[[_factor(100 + k, d, m, scales)]] for k in range(400)]
    beta = mean_bias(draws, [[truth]])[0][0]
    per_draw = torch.stack([true_curvature(D[0][0], truth)[0] - true_curvature(D[0][0], truth)[2] for D in draws])
    se = per_draw.std(0) / len(draws) ** 0.5
    torch.testing.assert_close(beta, per_draw.mean(0))
    assert beta[-1] > 4 * se[-1] and beta[0] < -4 * se[0], (beta, se)


def test_eigenvalue_oracle_against_its_own_batch_is_the_single_batch():
    """With the truth taken to be the batch itself, ``c = λ̂``: the oracle posterior, rebuilt
    through ``state_dict``, has the single batch's predictive covariances, its BatchNorm block's
    too (eigenvectors of the null run may differ; the covariances do not)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Tanh(), nn.Flatten(),
                          nn.Linear(2 * 4 * 4, 3)).double().eval()
    data = toy_data(24, (1, 6, 6), 3, "classification")
    one = loader(data, 12)
    single = kron_fit(model, one, magnitude_loader=one)
    oracle = with_eigenpairs(single, *oracle_eigenpairs(single.H_facs.kfacs, single.H_facs.kfacs, None))
    params = list(model.parameters())
    _, jacs = logit_jacobians(model, params, data.tensors[0][:5].double())
    deltas = torch.tensor([1e-2, 1.0], dtype=torch.float64)
    covs = [s.covariances(s.rotate(jacs), deltas) for s in map(posterior_structure, (single, oracle))]
    torch.testing.assert_close(covs[1], covs[0])


def test_cross_validated_eigenvalues_of_two_folds_are_the_mean_of_both_orders():
    """``K = 2``: ``d_i`` is the mean of the paper's cross-batch quotients of both orders
    (``λ_i(F_1) - g_i``, :func:`same_minus_cross`), on the eigenvectors of the folds' mean."""
    folds = [[[_factor(20, 4, 9)]], [[_factor(21, 4, 9)]]]
    (U,), (d,) = (x[0] for x in cross_validated_eigenpairs(folds))
    F1, F2 = folds[0][0][0], folds[1][0][0]
    cross = [torch.linalg.eigvalsh(A) - same_minus_cross(A, B) for A, B in ((F2, F1), (F1, F2))]
    torch.testing.assert_close(d, (cross[0] + cross[1]) / 2, atol=200 * EPS64 * float(F1.norm()), rtol=0)
    torch.testing.assert_close(U @ torch.diag(torch.linalg.eigvalsh((F1 + F2) / 2)) @ U.T, (F1 + F2) / 2)


def test_cross_validated_eigenvalues_of_equal_folds_are_their_eigenvalues():
    F = _factor(22, 5, 3)  # rank 3 of 5: a null run of 2
    (_,), (d,) = (x[0] for x in cross_validated_eigenpairs([[[F]]] * 4))
    torch.testing.assert_close(d, torch.linalg.eigvalsh(F).clamp(min=0), atol=100 * EPS64 * float(F.norm()), rtol=0)
    with pytest.raises(ValueError, match="at least 2 folds"):
        cross_validated_eigenpairs([[[F]]])


def test_kronecker_eigenvalues_are_those_of_the_dense_blocks():
    A, G, D = _factor(30, 3, 5), _factor(31, 2, 5), _factor(32, 4, 2)
    dense = torch.cat([torch.linalg.eigvalsh(torch.kron(A, G)), torch.linalg.eigvalsh(D)]).clamp(min=0)
    ours = kronecker_eigenvalues([[A, G], [D]])
    torch.testing.assert_close(ours, dense.sort(descending=True).values, atol=100 * EPS64 * float(dense.max()), rtol=0)
