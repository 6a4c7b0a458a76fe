"""Regression: debiased K-FAC Laplace with the noise σ and prior precision δ tuned by marginal likelihood.

A tanh MLP fits y = sin(3x) + noise (σ = 0.1) on x in [-1, 1].  Its Laplace approximations (all
weights) come from two batches of 32 points (``debiased_kron``) and, for reference, from all 512
points (laplace-torch's ``kron``).  σ and δ are tuned jointly by maximising the Laplace marginal
likelihood (the debiased fit rescales its loss to the full data set, so the evidence is on the
right scale).  The table gives the Gaussian test NLL inside the training range and outside it
(x in [1, 1.5], extrapolation), for the MAP network with σ alone and for the LA with the
``nn`` predictive (Monte-Carlo weight samples) and the linearized ``glm`` one: the LA's variance
grows away from the data, so it is much less overconfident where the MAP network is wrong.  The
``nn`` predictive pushes weight samples through the network, which leaves the linear regime at
the evidence-optimal δ; its δ is chosen on a validation set instead.

Run: ``python examples/regression.py``.  Committed output: ``docs/tutorials/output/regression.txt``.
"""

from __future__ import annotations

import math
import warnings

import torch
import laplace_debiased  # noqa: F401  registers hessian_structure="debiased_kron"
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


SIGMA = 0.1


def data(n: int, low: float, high: float, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = low + (high - low) * torch.rand(n, 1, generator=gen)
    return x, torch.sin(3 * x) + SIGMA * torch.randn(n, 1, generator=gen)


def train_map(x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 50), nn.Tanh(), nn.Linear(50, 50), nn.Tanh(), nn.Linear(50, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-5)
    for _ in range(1500):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.eval()


def tune_sigma_and_prior(la) -> None:
    """Maximise the Laplace marginal likelihood over log σ and log δ (Adam, 100 steps)."""
    warnings.filterwarnings("ignore", message="Converting a tensor with requires_grad")  # inside laplace
    log_sigma, log_prior = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([log_sigma, log_prior], lr=0.1)
    for _ in range(100):
        opt.zero_grad()
        (-la.log_marginal_likelihood(log_prior.exp(), log_sigma.exp())).backward()
        opt.step()
    la.sigma_noise, la.prior_precision = log_sigma.exp().detach(), log_prior.exp().detach()


def gaussian_nll(mean: torch.Tensor, var: torch.Tensor, y: torch.Tensor) -> float:
    return float((0.5 * torch.log(2 * math.pi * var) + 0.5 * (y - mean) ** 2 / var).mean())


def predict(la, x: torch.Tensor, pred: str, prior: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and predictive variance (function variance + σ²) at prior precision ``prior``."""
    la.prior_precision = prior
    torch.manual_seed(0)
    if pred == "nn":  # Monte-Carlo over weight samples, through the network itself
        f_mu, f_var = la(x, pred_type="nn", link_approx="mc", n_samples=100)
    else:
        f_mu, f_var = la(x, pred_type="glm")
    return f_mu.reshape(-1, 1), f_var.reshape(-1, 1) + la.sigma_noise ** 2


def prior_on_validation(la, x_val: torch.Tensor, y_val: torch.Tensor) -> float:
    """The prior precision (log grid around the marginal-likelihood one) of least validation NLL
    for the ``nn`` predictive, whose weight samples leave the linear regime at small δ."""
    grid = (float(la.prior_precision) * torch.logspace(0, 4, 9)).tolist()
    return min(grid, key=lambda d: gaussian_nll(*predict(la, x_val, "nn", d), y_val))


def main() -> None:
    gen = torch.Generator().manual_seed(0)
    x, y = data(512, -1.0, 1.0, gen)
    x_val, y_val = data(200, -1.0, 1.0, gen)
    tests = {"inside [-1, 1]": data(500, -1.0, 1.0, gen), "outside [1, 1.5]": data(500, 1.0, 1.5, gen)}
    model = train_map(x, y)
    with torch.no_grad():
        map_sigma2 = float(((model(x) - y) ** 2).mean())  # the MAP network's own noise estimate

    fits = {}
    for name, structure, batch in (("debiased_kron, 2 x 32", "debiased_kron", 32), ("kron, all 512", "kron", 512)):
        la = Laplace(model, "regression", subset_of_weights="all", hessian_structure=structure)
        la.fit(DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True,
                          generator=torch.Generator().manual_seed(1)))
        tune_sigma_and_prior(la)
        fits[name] = la

    print(f"true σ = {SIGMA}; Gaussian test NLL (lower is better)")
    print(f"{'':44s} {'σ':>6s} {'δ':>8s}" + "".join(f"{name:>18s}" for name in tests))
    with torch.no_grad():
        cells = [gaussian_nll(model(xt), torch.full_like(yt, map_sigma2), yt) for xt, yt in tests.values()]
    print(f"{'MAP, σ from the training residuals':44s} {math.sqrt(map_sigma2):6.3f} {'-':>8s}"
          + "".join(f"{c:18.3f}" for c in cells))
    for name, la in fits.items():
        marglik = float(la.prior_precision)
        for pred, label, prior in (("glm", "glm", marglik), ("nn", "nn, δ on validation", prior_on_validation(la, x_val, y_val))):
            cells = [gaussian_nll(*predict(la, xt, pred, prior), yt) for xt, yt in tests.values()]
            print(f"{name + ', ' + label:44s} {float(la.sigma_noise):6.3f} {prior:8.3g}"
                  + "".join(f"{c:18.3f}" for c in cells))
        la.prior_precision = marglik


if __name__ == "__main__":
    main()
