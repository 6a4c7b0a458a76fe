"""Plain and debiased conjugate gradients on dense SPD systems and on tiny-network quadratics."""

import pytest
import torch
from torch import nn

from laplace_debiased.optim.cg import NonPositiveCurvatureError, cg, debiased_cg
from laplace_debiased.curvature.operators import CountingOperator, mini_batch_quadratic

D = 12


def spd(seed, low=0.5, high=20.0, dim=D):
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    eig = torch.linspace(low, high, dim, dtype=torch.float64)
    return Q @ torch.diag(eig) @ Q.T, torch.randn(dim, generator=g, dtype=torch.float64)


def _operator(A: torch.Tensor) -> CountingOperator:
    """The counting operator of a dense symmetric matrix."""
    return CountingOperator(A.__matmul__, A.shape[0], A.dtype)


def test_cg_solves_spd_system_like_linalg_solve():
    A, b = spd(0)
    op = _operator(A)
    res = cg(op, b)
    torch.testing.assert_close(res.x, torch.linalg.solve(A, b), rtol=1e-9, atol=1e-9)
    assert res.n_iter <= D and op.n_products == res.n_iter
    # from a non-zero start too (one more product for r_0 = A x0 − b)
    res0 = cg(A.__matmul__, b, x0=torch.ones(D, dtype=torch.float64))
    torch.testing.assert_close(res0.x, torch.linalg.solve(A, b), rtol=1e-9, atol=1e-9)


def test_cg_directions_are_normalised_and_conjugate_and_iterates_follow_tau():
    A, b = spd(1)
    res = cg(A.__matmul__, b, max_iter=8)
    assert res.reason == "max_iter" and res.n_iter == 8
    dirs = res.directions
    torch.testing.assert_close(dirs.norm(dim=1), torch.ones(8, dtype=torch.float64))
    C = dirs @ A @ dirs.T
    off = C - torch.diag(torch.diag(C))
    assert off.abs().max() < 1e-10 * torch.diag(C).min()
    torch.testing.assert_close(torch.diag(C), res.curvatures)
    steps = res.iterates[1:] - res.iterates[:-1]
    torch.testing.assert_close(steps, res.step_sizes[:, None] * dirs)
    # the residual is the gradient of ½xᵀAx − bᵀx at the iterate
    torch.testing.assert_close(res.residual_norms[-1], (A @ res.x - b).norm())
    # the first direction is steepest descent on q
    torch.testing.assert_close(dirs[0], b / b.norm())


def test_cg_stops_at_residual_tolerance():
    A, b = spd(2)
    res = cg(A.__matmul__, b, rtol=1e-3)
    assert res.reason == "tol"
    assert res.residual_norms[-1] <= 1e-3 * res.residual_norms[0]
    assert res.residual_norms[-2] > 1e-3 * res.residual_norms[0]
    assert cg(A.__matmul__, torch.zeros(D, dtype=torch.float64)).n_iter == 0


def test_debiased_cg_with_same_batch_reproduces_cg():
    A, b = spd(3)
    plain = cg(A.__matmul__, b, max_iter=10)
    deb = debiased_cg(A.__matmul__, b, A.__matmul__, b, max_iter=10)
    torch.testing.assert_close(deb.cg.iterates, plain.iterates)
    torch.testing.assert_close(deb.iterates, plain.iterates, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(deb.step_sizes, plain.step_sizes, rtol=1e-10, atol=1e-12)


def test_debiased_recursion_equals_direct_gradient_and_steps_are_exact_line_minima():
    A, b = spd(4)
    At, bt = spd(5, low=0.2, high=5.0)
    deb = debiased_cg(A.__matmul__, b, At.__matmul__, bt, max_iter=9)
    # directions come from B: identical to plain CG on (A, b)
    torch.testing.assert_close(deb.directions, cg(A.__matmul__, b, max_iter=9).directions)
    for p in range(deb.n_iter):
        d, x = deb.directions[p], deb.iterates[p]
        direct = At @ x - bt  # ∇q(x̃_p; B̃) computed directly
        torch.testing.assert_close(deb.slopes[p], d.dot(direct))
        torch.testing.assert_close(deb.residual_norms[p], direct.norm())
        torch.testing.assert_close(deb.step_sizes[p], -d.dot(direct) / d.dot(At @ d))
        # τ̃_p minimises q(·; B̃) along d_p: zero slope after the step
        assert abs(d.dot(At @ deb.iterates[p + 1] - bt)) < 1e-10 * direct.norm()
    # a different B̃ gives different step sizes (the test can tell the processes apart)
    assert not torch.allclose(deb.step_sizes, deb.cg.step_sizes)


def test_exactly_one_extra_curvature_product_per_iteration():
    A, b = spd(6)
    At, bt = spd(7)
    for K in (1, 5, 9):
        op, op_t = _operator(A), _operator(At)
        deb = debiased_cg(op, b, op_t, bt, max_iter=K)
        assert deb.n_iter == K
        assert op.n_products == K and op_t.n_products == K


def test_non_positive_curvature_stops_or_raises():
    A = torch.diag(torch.tensor([3.0, 1.0, -2.0], dtype=torch.float64))
    b = torch.ones(3, dtype=torch.float64)
    res = cg(A.__matmul__, b)
    assert res.reason == "nonpositive_curvature" and res.n_iter < 3
    assert (res.curvatures > 0).all()
    with pytest.raises(NonPositiveCurvatureError, match="non-positive curvature on B"):
        cg(A.__matmul__, b, on_nonpositive="raise")
    # non-positive curvature on B̃ only also stops the joint loop
    Apos = torch.diag(torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64))
    deb = debiased_cg(Apos.__matmul__, b, A.__matmul__, b)
    assert deb.reason == "nonpositive_curvature" and (deb.curvatures > 0).all()


def test_callback_sees_both_processes_and_can_stop():
    A, b = spd(8)
    At, bt = spd(9)
    seen = []

    def stop_when_tilde_residual_grows(state):
        seen.append(state.r_tilde.norm().item())
        return state.iteration == 2

    deb = debiased_cg(A.__matmul__, b, At.__matmul__, bt, callback=stop_when_tilde_residual_grows)
    assert deb.reason == "callback" and deb.n_iter == 3
    torch.testing.assert_close(torch.tensor(seen, dtype=torch.float64), deb.residual_norms[1:])


def test_debiased_cg_on_network_quadratics():
    """Two batches of a tiny network: B̃ = B reproduces CG; independent B̃ changes the steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X = torch.randn(40, 3, dtype=torch.float64)
    y = torch.randint(0, 3, (40,))
    B, Bt = [(X[:20], y[:20])], [(X[20:], y[20:])]
    q = mini_batch_quadratic(model, nn.CrossEntropyLoss(), B, "ggn", beta=1e-2)
    qt = mini_batch_quadratic(model, nn.CrossEntropyLoss(), Bt, "ggn", beta=1e-2)
    plain = cg(q.curvature, -q.gradient, max_iter=6)
    same = debiased_cg(q.curvature, -q.gradient, q.curvature, -q.gradient, max_iter=6)
    torch.testing.assert_close(same.iterates, plain.iterates, rtol=1e-8, atol=1e-10)
    deb = debiased_cg(q.curvature, -q.gradient, qt.curvature, -qt.gradient, max_iter=6)
    # the debiased trajectory decreases B̃'s quadratic monotonically (exact line minima)
    values = torch.stack([qt(x) for x in deb.iterates])
    assert (values[1:] <= values[:-1] + 1e-12).all()
    assert not torch.allclose(deb.iterates, plain.iterates)
