"""Cost of ``optimize_prior_precision(method="gridsearch")`` for the debiased classes vs one
predictive, and vs laplace-torch's stock ``full`` / ``kron`` gridsearch.

One run (``nice python benchmarks/gridsearch_speed.py``) writes
``benchmarks/results/gridsearch_speed.{json,md}``.  Setting: an MLP ``64-48-10`` with 3,610
weights (all of them in the Laplace approximation), trained for a few hundred full-batch steps
on a random 10-class Gaussian-blob problem; fit on 2 x 128 samples, validation on 1,000 inputs
in batches of 100, GLM predictive with the probit link, RunningNLLMetric, laplace-torch's
default 100-point grid ``logspace(-4, 4)``.

Per structure:

* ``one predictive``: ``laplace.utils.validate`` at one prior precision (what each grid point
  of laplace-torch's gridsearch costs; includes the posterior factorisation the prior change
  invalidates);
* ``gridsearch``: the whole ``optimize_prior_precision`` call; the debiased classes route it
  through :func:`laplace_debiased.posterior.grid.grid_validation_scores`;
* stock ``full`` / ``kron``: their gridsearch timed on ``--stock-points`` grid points and
  extrapolated linearly to the full grid (each point costs one ``validate``; measured ratio of
  the timed points given).

Torch threads are set explicitly (``--threads``, default 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def problem(n_train: int = 256, n_val: int = 1000, seed: int = 0):
    """Trained ``64-48-10`` MLP, a 2-batch train loader and a validation loader (float32)."""
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(10, 64, generator=g)
    def draw(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return centres[y] + 2.0 * torch.randn(n, 64, generator=g), y
    X, y = draw(n_train)
    Xv, yv = draw(n_val)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 48), nn.Tanh(), nn.Linear(48, 10))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.eval(), DataLoader(TensorDataset(X, y), batch_size=n_train // 2), DataLoader(
        TensorDataset(Xv, yv), batch_size=100
    )


def fitted(structure: str, model, train):
    import copy

    from laplace import Laplace

    import laplace_debiased  # noqa: F401  registers the debiased structures

    kw = {"rank": 50} if structure == "debiased_lowrank" else {}
    la = Laplace(copy.deepcopy(model), "classification", subset_of_weights="all",
                 hessian_structure=structure, **kw)
    la.fit(train)
    return la


def one_predictive(la, val) -> float:
    from laplace.utils.metrics import RunningNLLMetric
    from laplace.utils.utils import validate

    la.prior_precision = 1.0
    t = time.perf_counter()
    validate(la, val, RunningNLLMetric(), pred_type="glm", link_approx="probit")
    return time.perf_counter() - t


def gridsearch(la, val, grid_size: int) -> tuple[float, float]:
    t = time.perf_counter()
    la.optimize_prior_precision(pred_type="glm", method="gridsearch", val_loader=val,
                                grid_size=grid_size, link_approx="probit")
    return time.perf_counter() - t, float(la.prior_precision.reshape(-1)[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--grid-size", type=int, default=100)
    ap.add_argument("--stock-points", type=int, default=5,
                    help="grid points at which the stock gridsearch is timed (then extrapolated)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, train, val = problem()
    n_params = sum(p.numel() for p in model.parameters())
    rows = []
    for structure in ("debiased_full", "debiased_kron", "debiased_lowrank"):
        la = fitted(structure, model, train)
        t_one = one_predictive(la, val)
        t_grid, chosen = gridsearch(la, val, args.grid_size)
        rows.append({"structure": structure, "one_predictive_s": t_one, "gridsearch_s": t_grid,
                     "grid_points": args.grid_size, "ratio_grid_to_one": t_grid / t_one,
                     "chosen_prior_precision": chosen})
        print(rows[-1], flush=True)
    for structure in ("full", "kron"):
        la = fitted(structure, model, train)
        t_one = one_predictive(la, val)
        t_part, _ = gridsearch(la, val, args.stock_points)
        t_grid = t_part * args.grid_size / args.stock_points
        rows.append({"structure": structure, "one_predictive_s": t_one,
                     "gridsearch_s": t_grid, "grid_points": args.grid_size,
                     "timed_points": args.stock_points, "extrapolated": True,
                     "ratio_grid_to_one": t_grid / t_one})
        print(rows[-1], flush=True)
    stock = {r["structure"]: r["gridsearch_s"] for r in rows}
    for r in rows:
        base = {"debiased_full": "full", "debiased_kron": "kron"}.get(r["structure"])
        if base:
            r["speedup_vs_stock_gridsearch"] = stock[base] / r["gridsearch_s"]
    meta = {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
            "n_params": n_params, "n_val": len(val.dataset), "val_batch": val.batch_size,
            "link": "probit", "metric": "RunningNLLMetric"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gridsearch_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = [
        "# Prior-precision gridsearch: whole grid vs one predictive (`benchmarks/gridsearch_speed.py`)",
        "",
        f"CPU ({meta['machine']}), torch {meta['torch']}, {args.threads} thread(s), shared machine. "
        f"MLP 64-48-10, {n_params:,} weights (all), {meta['n_val']:,} validation inputs in batches "
        f"of {meta['val_batch']}, GLM probit, RunningNLLMetric, {args.grid_size}-point grid "
        "logspace(-4, 4). Target: debiased gridsearch ≤ 2x one predictive.",
        "",
        "| structure | one predictive (s) | gridsearch (s) | gridsearch / one predictive | speed-up vs stock gridsearch |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        note = f" (extrapolated from {r['timed_points']} points)" if r.get("extrapolated") else ""
        speed = f"{r['speedup_vs_stock_gridsearch']:.0f}x" if "speedup_vs_stock_gridsearch" in r else ""
        lines.append(f"| {r['structure']} | {r['one_predictive_s']:.2f} | {r['gridsearch_s']:.2f}{note} | "
                     f"{r['ratio_grid_to_one']:.2f}x | {speed} |")
    (args.out / "gridsearch_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
