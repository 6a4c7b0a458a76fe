"""2D slices of a quadratic (:mod:`laplace_debiased.diagnostics.slices`) against the dense
quadratic evaluated in the plane of two directions, and the in-plane Newton step."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.diagnostics.measure import Restriction
from laplace_debiased.diagnostics.slices import plane_minimizer, plane_quadratic

pytestmark = pytest.mark.usefixtures("float64")


def _quadratic(P: int = 6, K: int = 3, seed: int = 0):
    """``q(x) = q₀ + gᵀx + ½ xᵀHx`` (H positive definite), K orthonormal directions D, and the
    restriction of q to span D at x = 0."""
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(P, P, generator=g)
    H = A @ A.T + 0.5 * torch.eye(P)
    grad = torch.randn(P, generator=g)
    D = torch.linalg.qr(torch.randn(P, K, generator=g)).Q
    q0 = torch.tensor(1.5)
    restriction = Restriction(value=q0, slopes=D.T @ grad, gram=D.T @ H @ D, n_data=10)
    return (lambda x: q0 + grad @ x + 0.5 * x @ H @ x), D, restriction


@pytest.mark.parametrize("dims", [(0, 1), (2, 0)])
def test_plane_values_equal_the_dense_quadratic_on_the_plane(dims):
    q, D, restriction = _quadratic()
    a, b = torch.meshgrid(torch.linspace(-2, 2, 5), torch.linspace(-1, 3, 4), indexing="ij")
    values = plane_quadratic(restriction, a, b, dims)
    i, j = dims
    expected = torch.stack([q(x * D[:, i] + y * D[:, j]) for x, y in zip(a.flatten(), b.flatten())]).reshape(a.shape)
    assert values.shape == a.shape
    torch.testing.assert_close(values, expected)


def test_the_minimiser_zeroes_the_in_plane_gradient_and_is_the_lowest_point():
    q, D, restriction = _quadratic(seed=1)
    a, b = plane_minimizer(restriction, (1, 2))
    x = a * D[:, 1] + b * D[:, 2]
    x.requires_grad_(True)
    (grad,) = torch.autograd.grad(q(x), x)
    torch.testing.assert_close(D[:, [1, 2]].T @ grad, torch.zeros(2), atol=1e-12, rtol=0)
    best = plane_quadratic(restriction, a, b, (1, 2))
    around = plane_quadratic(restriction, a + torch.tensor([0.1, -0.1, 0.0, 0.0]),
                             b + torch.tensor([0.0, 0.0, 0.1, -0.1]), (1, 2))
    assert bool((around > best).all())
