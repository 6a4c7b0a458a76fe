"""NewtonCG optimizer on convex quadratic losses (linear least squares, float64)."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.optim.newton_cg import NewtonCG

N, DIM = 64, 5


def problem(noise=0.1, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, DIM, generator=g, dtype=torch.float64)
    w = torch.randn(1, DIM, generator=g, dtype=torch.float64)
    y = X @ w.T + noise * torch.randn(N, 1, generator=g, dtype=torch.float64)
    torch.manual_seed(seed)
    model = nn.Linear(DIM, 1, bias=False).double()
    return model, X, y


def full_loss(model, X, y):
    with torch.no_grad():
        return nn.functional.mse_loss(model(X), y).item()


@pytest.mark.parametrize("curvature", ["ggn", "hessian"])
def test_single_batch_full_data_step_is_the_newton_step(curvature):
    model, X, y = problem()
    opt = NewtonCG(model, nn.MSELoss(), debiased=False, curvature=curvature, max_iter=DIM)
    loss_before = opt.step((X, y))
    assert loss_before.item() == pytest.approx(problem()[0](X).sub(y).pow(2).mean().item())
    w_star = torch.linalg.lstsq(X, y).solution.T
    torch.testing.assert_close(model.weight.detach(), w_star)
    assert opt.last_step.result.n_iter <= DIM


def test_damping_and_weight_decay_solve_the_regularised_system():
    model, X, y = problem()
    w0 = model.weight.detach().clone()
    lam, beta = 0.5, 0.2
    opt = NewtonCG(model, nn.MSELoss(), debiased=False, max_iter=DIM, damping=lam,
                   weight_decay=beta)
    opt.step((X, y))
    H = 2 * X.T @ X / N + beta * torch.eye(DIM, dtype=torch.float64)
    g = (2 * X.T @ (X @ w0.T - y) / N).T + beta * w0
    step = -torch.linalg.solve(H + lam * torch.eye(DIM, dtype=torch.float64), g.T).T
    torch.testing.assert_close(model.weight.detach(), w0 + step)


@pytest.mark.parametrize("debiased", [False, True])
def test_training_loop_from_a_loader_decreases_the_loss(debiased):
    model, X, y = problem(noise=0.3)
    loader = DataLoader(TensorDataset(X, y), batch_size=8, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    opt = NewtonCG(model, nn.MSELoss(), loader=loader, debiased=debiased, max_iter=3, lr=0.5)
    start = full_loss(model, X, y)
    losses = [opt.step(closure=lambda: nn.functional.mse_loss(model(X), y)).item()
              for _ in range(15)]
    assert losses[-1] < 0.2 * start
    assert losses[-1] == pytest.approx(full_loss(model, X, y))
    info = opt.last_step
    n_b = info.quadratic.n_data
    assert n_b == (8 if debiased else 16)  # same data per step: b + b vs 2b
    assert (info.quadratic_tilde is not None) == debiased


def test_debiased_with_the_same_batch_twice_equals_single_batch():
    model_a, X, y = problem()
    model_b, _, _ = problem()
    batch = (X[:10], y[:10])
    NewtonCG(model_a, nn.MSELoss(), debiased=False, max_iter=3).step(batch)
    NewtonCG(model_b, nn.MSELoss(), debiased=True, max_iter=3).step(batch, batch)
    torch.testing.assert_close(model_a.weight, model_b.weight)
    # and an independent B̃ changes the step
    model_c, _, _ = problem()
    NewtonCG(model_c, nn.MSELoss(), debiased=True, max_iter=3).step(batch, (X[10:20], y[10:20]))
    assert not torch.allclose(model_a.weight, model_c.weight)


def test_bad_usage_gives_clear_errors():
    model, X, y = problem()
    with pytest.raises(ValueError, match="second batch"):
        NewtonCG(model, nn.MSELoss(), debiased=True).step((X, y))
    with pytest.raises(ValueError, match="no loader"):
        NewtonCG(model, nn.MSELoss()).step()
    with pytest.raises(ValueError, match="damping"):
        NewtonCG(model, nn.MSELoss(), damping=-1.0)
    with pytest.raises(ValueError, match="debiased=False"):
        NewtonCG(model, nn.MSELoss(), debiased=False).step((X, y), (X, y))


def test_hessian_with_negative_curvature_leaves_theta_unchanged_and_warns():
    """q(w) = −w² + ... along the first direction: CG stops before it, nothing moves."""
    model = nn.Linear(1, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(0.5)

    class NegQuad(nn.Module):  # mean of −(output − y)²: concave in w
        reduction = "mean"

        def forward(self, out, y):
            return -((out - y) ** 2).mean()

    X = torch.ones(4, 1, dtype=torch.float64)
    y = torch.zeros(4, 1, dtype=torch.float64)
    opt = NewtonCG(model, NegQuad(), debiased=False, curvature="hessian", max_iter=3)
    with pytest.warns(RuntimeWarning, match="non-positive curvature"):
        opt.step((X, y))
    assert model.weight.item() == 0.5
    assert opt.last_step.result.reason == "nonpositive_curvature"
