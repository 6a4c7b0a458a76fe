"""Single batch against the two-batch K-FAC estimates at equal samples, a tanh MLP on scikit-learn's
digits (no download): paired draws, each draw cached so that an interrupted run resumes.

    OMP_NUM_THREADS=1 python benchmarks/digits_mlp_estimators.py --seeds 10000 10016 \\
        --cache ~/.cache/laplace-debiased-study/digits-mlp [--batch-sizes 32 64 128]

The MAP: ``Linear(64, 100) - Tanh - Linear(100, 10)`` (7,510 weights) trained on N = 1,000 of the
1,797 digits (pixels / 16; a permutation seeded by 0 splits them), the other 797 the test set;
full-batch Adam (lr 1e-2, 500 steps, torch seed 0), the same MAP for every draw. Each draw ``s`` (a
seed) permutes the training set (``torch.Generator().manual_seed(s)``) and reads its first ``b``
samples: the single batch is all ``b`` (``magnitude_loader`` = the same loader, stock K-FAC), the
two-batch estimates read the same ``b`` as B (first ``b/2``) and B̃ (next ``b/2``):
``fit(estimator=...)`` with ``"paper"``, ``"corrected"``, ``"shrunk"`` and ``"stein"``. The
reference: K-FAC over all N. For each fit and prior precision δ in 15 log-spaced values over
1e-4 … 1e3: the test NLL of the GLM predictive with laplace-torch's probit link
(``κ = (1 + π/8 · diag Σ_f)^(-1/2)``, softmax of ``κ f``, ``Σ_f = J (H + δI)⁻¹ Jᵀ``: laplace-torch's
``functional_variance``, computed in each fit's Kronecker eigenbasis, :func:`variance_diagonals`),
and its relative gap to the full batch's at the same δ. Per draw the results are written to ``CACHE/b<b>/seed<s>.json`` (skipped
when present); :func:`summary` reads them back.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.data.digits import load_digits_tensors
from laplace_debiased.kron.laplace import DebiasedKronLaplace

CANDIDATES = ("single", "paper", "corrected", "shrunk", "stein")
DELTAS = tuple(float(d) for d in np.logspace(-4, 3, 15))
N_TRAIN = 1000


def data() -> tuple[TensorDataset, TensorDataset]:
    """Training (1,000) and test (797) digits, flattened ``(n, 64)`` in [0, 1]."""
    X, y = load_digits_tensors()
    X = X.reshape(len(X), -1)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:N_TRAIN], perm[N_TRAIN:]
    return TensorDataset(X[train], y[train]), TensorDataset(X[test], y[test])


def train_map(train: TensorDataset) -> nn.Module:
    """The MAP (module docstring)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 100), nn.Tanh(), nn.Linear(100, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    X, y = train.tensors
    for _ in range(500):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.eval()


def fit(model: nn.Module, train: TensorDataset, candidate: str, b: int | None, seed: int) -> DebiasedKronLaplace:
    """One candidate's fit on draw ``seed`` at ``b`` samples (``b=None``: the full batch)."""
    la = DebiasedKronLaplace(model, "classification",
                             **({} if b is None or candidate == "single" else {"estimator": candidate}))
    if b is None:
        full = DataLoader(train, batch_size=len(train))
        la.fit(full, magnitude_loader=full)
        return la
    size = b if candidate == "single" else b // 2
    loader = DataLoader(train, batch_size=size, shuffle=True, generator=torch.Generator().manual_seed(seed))
    if candidate == "single":
        la.fit(loader, magnitude_loader=loader)
    else:
        la.fit(loader)
    return la


def _dense_factor(Q: torch.Tensor, lam: torch.Tensor) -> torch.Tensor:
    """A factor's dense matrix from its eigenpairs (``Q (d, r)``; ``r < d``: one more eigenvalue,
    that of the implicit complement ``I - QQᵀ``)."""
    Q, lam = Q.double(), lam.double()
    F = Q @ torch.diag(lam[:Q.shape[1]]) @ Q.T
    if Q.shape[1] < Q.shape[0]:
        F = F + lam[-1] * (torch.eye(Q.shape[0], dtype=F.dtype) - Q @ Q.T)
    return F


def variance_diagonals(la: DebiasedKronLaplace, Js: torch.Tensor) -> torch.Tensor:
    """``diag(J (H + δI)⁻¹ Jᵀ)`` per test point and output, for every δ in :data:`DELTAS`:
    ``(len(DELTAS), n, c)``. Each K-FAC block's factors are rebuilt densely and eigendecomposed
    (float64), the Jacobian rotated into the Kronecker eigenbasis once, then per δ a weighted sum of
    squares (laplace-torch's ``functional_variance`` of the same posterior, without the full matrix)."""
    n, c, _ = Js.shape
    out = torch.zeros(len(DELTAS), n, c, dtype=torch.float64)
    start = 0
    for Qs, lams in zip(la.H.eigenvectors, la.H.eigenvalues):
        pairs = [torch.linalg.eigh(_dense_factor(Q, lam)) for Q, lam in zip(Qs, lams)]
        if len(pairs) == 2:
            (lo, Uo), (li, Ui) = pairs
            size = Uo.shape[0] * Ui.shape[0]
            J = Js[:, :, start:start + size].double().reshape(n, c, Uo.shape[0], Ui.shape[0])
            rotated = torch.einsum("ncoi,op,iq->ncpq", J, Uo, Ui).square().reshape(n, c, -1)
            eig = torch.outer(lo, li).reshape(-1)
        else:
            (lo, Uo), = pairs
            size = Uo.shape[0]
            rotated = (Js[:, :, start:start + size].double() @ Uo).square()
            eig = lo
        for k, delta in enumerate(DELTAS):
            out[k] += rotated @ (1 / (eig.clamp(min=0) + delta))
        start += size
    if start != Js.shape[-1]:
        raise ValueError(f"the K-FAC blocks cover {start} of the Jacobian's {Js.shape[-1]} parameters.")
    return out


def test_nll(la: DebiasedKronLaplace, Js: torch.Tensor, f_mu: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Test NLL of the probit GLM predictive at each δ in :data:`DELTAS`."""
    out = []
    for f_var in variance_diagonals(la, Js):
        kappa = 1 / torch.sqrt(1 + math.pi / 8 * f_var)
        logp = torch.log_softmax(kappa * f_mu.double(), dim=-1)
        out.append(float(-logp[torch.arange(len(y)), y].mean()))
    return out


def save_draw(path: Path, b: int, seed: int, full: list[float], fitted: Callable[[str], DebiasedKronLaplace],
              nll: Callable[[DebiasedKronLaplace], list[float]]) -> None:
    """Write one draw's record to ``path`` (atomically): per candidate ``c`` the test NLL per δ of
    ``fitted(c)`` (``nll``) and, for a corrected estimate, the share of each factor's correction it
    kept; ``full`` the reference's NLL per δ."""
    record = {"b": b, "seed": seed, "deltas": DELTAS, "full": full, "nll": {}, "kept": {}}
    for c in CANDIDATES:
        la = fitted(c)
        record["nll"][c] = nll(la)
        if la.correction is not None:
            record["kept"][c] = [r["kept"] for r in la.correction.rows()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".tmp").write_text(json.dumps(record) + "\n")
    path.with_suffix(".tmp").replace(path)


def run(seeds: list[int], batch_sizes: list[int], cache: Path) -> None:
    torch.set_num_threads(1)
    train, test = data()
    model = train_map(train)
    X, y = test.tensors
    full = fit(model, train, "single", None, 0)
    Js, f_mu = full.backend.jacobians(X)
    f_mu = f_mu.detach()
    ref = test_nll(full, Js, f_mu, y)
    for b in batch_sizes:
        for seed in seeds:
            path = cache / f"b{b}" / f"seed{seed}.json"
            if path.exists():
                continue
            save_draw(path, b, seed, ref, lambda c: fit(model, train, c, b, seed), lambda la: test_nll(la, Js, f_mu, y))
            print(f"digits MLP b={b} seed={seed} done", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, required=True, metavar=("FIRST", "STOP"),
                        help="the draws' seeds, range(FIRST, STOP)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--cache", type=Path, required=True, help="one JSON per draw (resumes)")
    args = parser.parse_args(argv)
    run(list(range(*args.seeds)), args.batch_sizes, args.cache.expanduser())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
