"""1,000 classes: last-layer ``debiased_kron`` on 2,048 features vs laplace-torch's
``KronLLLaplace`` on the same problem: time and peak memory.

One run (``nice python benchmarks/many_classes.py``) writes
``benchmarks/results/many_classes.{json,md}``.  Problem: ``Linear(64, 2048) - ReLU -
Linear(2048, 1000)`` at its random initialisation (timings and memory do not depend on
training); the last layer has 2,049,000 weights.  The Laplace approximations are fitted on
2 x ``--fit-batch`` random labelled inputs (debiased: B and B̃ one batch each; stock: both
batches), and predict ``--n-test`` inputs.

* ours (one child process): fit, then :class:`GridPredictive` with ``probit_projected`` and
  ``probit`` over a 14-point prior grid; the projected probit uses diag(ΠΣΠ) from the
  projected rotated Jacobian, never the ``(n, C, C)`` covariance;
* laplace-torch (another child process, under an address-space limit ``--stock-limit-gb`` so
  that it cannot take the shared machine down): fit, then ``la(x, link_approx="probit")`` on
  ``--stock-inputs`` inputs at one prior precision; its per-input time is extrapolated to
  ``n-test`` inputs x 14 points, and the Jacobian it materialises (``n x C x P`` floats) is
  reported.

Peak memory is each child's peak resident set size (``VmHWM`` of ``/proc/self/status``,
torch's import included).  Torch threads are set explicitly (``--threads``).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._children import run_children  # noqa: E402
from laplace_debiased.prior_grid import PriorGrid  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GRID = list(PriorGrid.default())
N_FEATURES, N_CLASSES = 2048, 1000


def vm_hwm_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def problem(fit_batch: int, n_test: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, N_FEATURES), nn.ReLU(), nn.Linear(N_FEATURES, N_CLASSES)).eval()
    X = torch.randn(2 * fit_batch, 64)
    y = torch.randint(0, N_CLASSES, (2 * fit_batch,))
    return model, DataLoader(TensorDataset(X, y), batch_size=fit_batch), torch.randn(n_test, 64)


def child(which: str, args) -> dict:
    from laplace import Laplace

    import laplace_debiased  # noqa: F401  registers debiased_kron
    from laplace_debiased.posterior.grid import GridPredictive

    torch.set_num_threads(args.threads)
    model, train, X_test = problem(args.fit_batch, args.n_test)
    structure = "debiased_kron" if which == "ours" else "kron"
    t = time.perf_counter()
    la = Laplace(model, "classification", subset_of_weights="last_layer", hessian_structure=structure)
    la.fit(train)
    out = {"which": which, "fit_s": time.perf_counter() - t, "fit_peak_rss_gb": vm_hwm_gb()}
    if which == "ours":
        t = time.perf_counter()
        probs = GridPredictive(la, chunk_size=args.chunk_size).grid(
            X_test, GRID, links=("probit_projected", "probit"))
        out.update(predict_s=time.perf_counter() - t, n_inputs=args.n_test, grid_points=len(GRID),
                   finite=bool(all(torch.isfinite(p).all() for p in probs.values())))
    else:
        resource.setrlimit(resource.RLIMIT_AS, (int(args.stock_limit_gb * 2**30),) * 2)
        n = args.stock_inputs
        out.update(n_inputs=n, grid_points=1,
                   jacobian_gb_per_call=n * N_CLASSES * la.n_params * 4 / 2**30)
        t = time.perf_counter()
        try:
            la(X_test[:n], pred_type="glm", link_approx="probit")
            out["predict_s"] = time.perf_counter() - t
            out["extrapolated_s"] = out["predict_s"] / n * args.n_test * len(GRID)
        except (MemoryError, RuntimeError) as err:
            out["failed"] = str(err).splitlines()[0][:200]
    out["peak_rss_gb"] = vm_hwm_gb()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fit-batch", type=int, default=32)
    ap.add_argument("--n-test", type=int, default=1000)
    ap.add_argument("--chunk-size", type=int, default=100)
    ap.add_argument("--stock-inputs", type=int, default=1)
    ap.add_argument("--stock-limit-gb", type=float, default=6.0)
    ap.add_argument("--child", choices=["ours", "stock"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args)))
        return
    rows = run_children(__file__, ("ours", "stock"), sys.argv[1:])
    meta = {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
            "features": N_FEATURES, "classes": N_CLASSES, "last_layer_params": (N_FEATURES + 1) * N_CLASSES,
            "fit_samples": 2 * args.fit_batch, "grid": GRID, "chunk_size": args.chunk_size}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "many_classes.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    ours, stock = rows
    lines = [
        "# 1,000 classes, last-layer K-FAC (`benchmarks/many_classes.py`)",
        "",
        f"CPU ({meta['machine']}), torch {meta['torch']}, {args.threads} thread(s), shared machine. "
        f"Last layer {N_FEATURES:,} features x {N_CLASSES:,} classes ({meta['last_layer_params']:,} "
        f"weights), fitted on {meta['fit_samples']} samples. Peak memory = the process's VmHWM. "
        "Target: debiased_kron fits and predicts 1,000 inputs over 14 prior precisions in < 2 GB.",
        "",
        "| | fit (s) | predict (s) | peak RSS (GB) |",
        "|---|---|---|---|",
        f"| debiased_kron + GridPredictive, {ours.get('n_inputs')} inputs x {ours.get('grid_points')} "
        f"points, probit_projected + probit | {ours.get('fit_s', float('nan')):.1f} | "
        f"{ours.get('predict_s', float('nan')):.1f} | {ours.get('peak_rss_gb', float('nan')):.2f} |",
    ]
    if "failed" in stock:
        pred = (f"failed under a {args.stock_limit_gb:g} GB limit: {stock['failed']} (its Jacobian "
                f"alone: {stock.get('jacobian_gb_per_call', float('nan')):.1f} GB for "
                f"{stock.get('n_inputs')} input(s))")
    else:
        pred = (f"{stock['predict_s']:.1f} for {stock['n_inputs']} input(s) x 1 point; "
                f"{stock['extrapolated_s']:.0f} extrapolated to {args.n_test} x {len(GRID)}")
    lines.append(f"| laplace-torch KronLLLaplace, la(x, probit) | {stock.get('fit_s', float('nan')):.1f} | "
                 f"{pred} | {stock.get('peak_rss_gb', float('nan')):.2f} |")
    (args.out / "many_classes.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
