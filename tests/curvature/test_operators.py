"""Curvature operators of the mean loss against dense explicit matrices on tiny float64 models."""

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.curvature.operators import (
    CountingOperator,
    curvature_operator,
    mini_batch_quadratic,
)

BETA = 0.3


def tiny_mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def batches(seed=1, sizes=(5, 3)):
    """Two classification batches of *different* sizes (tests the mean-over-points weighting)."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, 3, (n,), generator=g))
        for n in sizes
    ]


def flat_functions(model, data):
    """Mean loss over all points, per-sample logits and per-sample losses as functions of θ."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    X = torch.cat([x for x, _ in data])
    y = torch.cat([t for _, t in data])

    def unflat(theta):
        out, i = {}, 0
        for n, s in zip(names, shapes):
            out[n] = theta[i : i + s.numel()].reshape(s)
            i += s.numel()
        return out

    def logits(theta, x):
        return functional_call(model, unflat(theta), (x,))

    def mean_loss(theta):
        return nn.functional.cross_entropy(logits(theta, X), y)

    return theta0, X, y, logits, mean_loss


def dense_ggn(model, data):
    theta0, X, y, logits, _ = flat_functions(model, data)
    G = torch.zeros(theta0.numel(), theta0.numel(), dtype=torch.float64)
    for x, t in zip(X, y):
        J = jacrev(lambda th: logits(th, x[None])[0])(theta0)  # [C, D]
        p = torch.softmax(logits(theta0, x[None])[0], -1)
        Lam = torch.diag(p) - torch.outer(p, p)  # Hessian of CE w.r.t. logits
        G += J.T @ Lam @ J
    return G / X.shape[0]


def _dense(op: CountingOperator) -> torch.Tensor:
    """The operator's dense ``[D, D]`` matrix (``D`` products)."""
    return op(torch.eye(op.dim, dtype=op.dtype))


def test_ggn_equals_dense_jt_lambda_j_plus_beta():
    model, data = tiny_mlp(), batches()
    op = curvature_operator(model, nn.CrossEntropyLoss(), data, "ggn", beta=BETA)
    G = dense_ggn(model, data)
    torch.testing.assert_close(_dense(op), G + BETA * torch.eye(G.shape[0], dtype=G.dtype))


def test_hessian_equals_autograd_hessian_of_mean_loss():
    model, data = tiny_mlp(), batches()
    theta0, *_, mean_loss = flat_functions(model, data)
    H = torch.autograd.functional.hessian(mean_loss, theta0)
    op = curvature_operator(model, nn.CrossEntropyLoss(), data, "hessian", beta=BETA)
    torch.testing.assert_close(_dense(op), H + BETA * torch.eye(H.shape[0], dtype=H.dtype))
    # the Hessian of a tanh net is not its GGN: the test can tell the two apart
    assert not torch.allclose(H, dense_ggn(model, data), atol=1e-4)


def test_ef_equals_mean_outer_product_of_per_sample_gradients():
    model, data = tiny_mlp(), batches()
    theta0, X, y, logits, _ = flat_functions(model, data)
    per_sample = torch.stack([
        torch.func.grad(lambda th: nn.functional.cross_entropy(logits(th, x[None]), t[None]))(theta0)
        for x, t in zip(X, y)
    ])
    F = per_sample.T @ per_sample / X.shape[0]
    op = curvature_operator(model, nn.CrossEntropyLoss(), data, "ef")
    torch.testing.assert_close(_dense(op), F)


def test_gradient_and_value_of_q_include_beta_term():
    model, data = tiny_mlp(), batches()
    theta0, *_, mean_loss = flat_functions(model, data)
    q = mini_batch_quadratic(model, nn.CrossEntropyLoss(), data, beta=BETA)
    value, grad = q.value, q.gradient
    torch.testing.assert_close(value, mean_loss(theta0) + 0.5 * BETA * theta0.dot(theta0))
    expected = torch.autograd.functional.jacobian(mean_loss, theta0) + BETA * theta0
    torch.testing.assert_close(grad, expected)


def test_least_squares_ggn_equals_hessian_equals_kfac_and_quadratic_is_exact():
    """Linear least squares with MSELoss (mean): GGN = Hessian = 2 XᵀX / N (⊗ I for 2 outputs)."""
    torch.manual_seed(0)
    N, d, c = 7, 4, 2
    X, Y = torch.randn(N, d, dtype=torch.float64), torch.randn(N, c, dtype=torch.float64)
    model = nn.Linear(d, c, bias=False).double()
    data = [(X[:4], Y[:4]), (X[4:], Y[4:])]
    loss = nn.MSELoss()
    # MSELoss(mean) averages over N·c entries; weight is [c, d], flattened row-major
    expected = torch.kron(torch.eye(c, dtype=torch.float64), 2 * X.T @ X / (N * c))
    for curvature in ("ggn", "hessian", "kfac"):
        op = curvature_operator(model, loss, data, curvature)
        torch.testing.assert_close(_dense(op), expected, msg=curvature)
    # the quadratic model of a quadratic loss is exact, β term included
    q = mini_batch_quadratic(model, loss, data, "hessian", beta=BETA)
    step = torch.randn(d * c, dtype=torch.float64)
    W = (q.theta + step).reshape(c, d)
    exact = ((X @ W.T - Y) ** 2).mean() + 0.5 * BETA * (q.theta + step).square().sum()
    torch.testing.assert_close(q(step), exact)
    assert q.n_data == N


def test_loader_equals_list_of_batches_and_products_are_counted():
    model, data = tiny_mlp(), batches(sizes=(4, 4, 2))
    X = torch.cat([x for x, _ in data])
    y = torch.cat([t for _, t in data])
    loader = DataLoader(TensorDataset(X, y), batch_size=3)  # different batching, same points
    q_list = mini_batch_quadratic(model, nn.CrossEntropyLoss(), data, "ggn", beta=BETA)
    q_loader = mini_batch_quadratic(model, nn.CrossEntropyLoss(), loader, "ggn", beta=BETA)
    v = torch.randn(q_list.theta.numel(), dtype=torch.float64)
    torch.testing.assert_close(q_loader.curvature(v), q_list.curvature(v))
    torch.testing.assert_close(q_loader.gradient, q_list.gradient)
    assert q_loader.n_data == q_list.n_data == 10
    assert q_list.curvature.n_products == 1
    q_list.curvature(torch.randn(v.numel(), 3, dtype=torch.float64))
    assert q_list.curvature.n_products == 4


def test_bad_input_gives_clear_errors():
    model, data = tiny_mlp(), batches()
    with pytest.raises(ValueError, match="reduction='mean'"):
        curvature_operator(model, nn.CrossEntropyLoss(reduction="sum"), data)
    with pytest.raises(ValueError, match="unknown curvature"):
        curvature_operator(model, nn.CrossEntropyLoss(), data, "fisher")
    with pytest.raises(TypeError, match="wrap it"):
        curvature_operator(model, nn.CrossEntropyLoss(), data[0])
    with pytest.raises(ValueError, match="beta"):
        curvature_operator(model, nn.CrossEntropyLoss(), data, beta=-1.0)
    op = CountingOperator(torch.eye(3, dtype=torch.float64).__matmul__, 3)
    with pytest.raises(ValueError, match="flat vector"):
        op(torch.ones(4, dtype=torch.float64))


@pytest.mark.parametrize("curvature", ["ggn", "ef", "hessian"])
def test_mapping_inputs_with_batch_size_fn_equal_tensor_inputs(curvature):
    """Dict inputs that the model consumes whole (laplace-torch's dict_key_x convention)."""
    from laplace_debiased.curvature.operators import curvature_linop

    class DictModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = tiny_mlp()

        def forward(self, batch):
            return self.net(batch["x"])

    data = batches()
    mapped = [({"x": X, "mask": torch.ones(len(X))}, y) for X, y in data]
    ref = curvature_linop(tiny_mlp(), nn.CrossEntropyLoss(), data, curvature)
    op = curvature_linop(DictModel(), nn.CrossEntropyLoss(), mapped, curvature, batch_size_fn=lambda X: len(X["x"]))
    eye = torch.eye(ref.shape[0], dtype=torch.float64)
    torch.testing.assert_close(op @ eye, ref @ eye, atol=1e-12, rtol=0)
