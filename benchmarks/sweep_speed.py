"""Speed and memory of the grid predictive (laplace_debiased.evaluation.predictive) vs laplace-torch.

Measured in one run (``PYTHONPATH=. nice python benchmarks/sweep_speed.py``, one thread,
``--threads``), writing ``benchmarks/results/sweep_speed.{json,md}``.  (a) and (b) are CPU
seconds of this process (``time.process_time``): on a machine shared with other jobs that is the
work done, whatever else runs; ratios are taken within the one run.

(a) a 14-point prior-precision sweep vs a single-point evaluation with the same predictive
    (probit, K-FAC LA of ``cifar_cnn()`` over all weights, 2,000 test inputs);
(b) the same 14-point sweep vs laplace-torch's GLM probit predictive called at each grid point
    (inputs in chunks of 50).  laplace-torch's cost per grid point is independent of the prior
    precision (it rebuilds the Jacobians every call), so it is timed on ``--laplace-points``
    inputs at one grid point and extrapolated linearly to 2,000 inputs x 14 points; the
    probabilities are compared on those inputs;
(c) a 100-class MLP with ~1M parameters: laplace-torch's predictive (50 inputs per call) and
    ours (14 points) each run in a child process under the same address-space limit
    (``--memory-limit-gb``); the Jacobian laplace-torch materialises is reported.

Inputs are random (CIFAR-shaped) and the network is at its random initialisation; the K-FAC is
fitted on 256 random labelled inputs.  Timings do not depend on the data; the equality check does
not depend on training.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.prior_grid import PriorGrid

RESULTS = Path(__file__).resolve().parent / "results"
GRID = list(PriorGrid.default())


def _kfac(model: nn.Module, n_classes: int, n_fit: int = 256):
    from laplace import Laplace

    torch.manual_seed(1)
    X = torch.randn(n_fit, 3, 32, 32)
    y = torch.randint(0, n_classes, (n_fit,))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=128))
    return la


def _big_model() -> nn.Module:
    """100 classes, 1,042,300 parameters."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3072, 300), nn.ReLU(), nn.Linear(300, 300),
                         nn.ReLU(), nn.Linear(300, 100)).eval()


def child(which: str, n_inputs: int, limit_gb: float) -> None:
    """Run one predictive on the 1M-parameter model under an address-space limit; print JSON."""
    resource.setrlimit(resource.RLIMIT_AS, (int(limit_gb * 2**30), int(limit_gb * 2**30)))
    from laplace_debiased.posterior.grid import GridPredictive

    model = _big_model()
    la = _kfac(model, 100)
    x = torch.randn(n_inputs, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    start = time.perf_counter()
    out = {"which": which, "n_inputs": n_inputs, "n_params": la.n_params}
    try:
        if which == "laplace":
            la.prior_precision = GRID[0]
            torch.cat([la(c, pred_type="glm", link_approx="probit") for c in x.split(50)])
            out["grid_points"] = 1
        else:
            GridPredictive(la, chunk_size=16).grid(x, GRID, links=("probit_projected", "probit"))
            out["grid_points"] = len(GRID)
        out["ok"] = True
    except (RuntimeError, MemoryError) as err:
        out["ok"] = False
        out["error"] = str(err).splitlines()[0][:200]
    out["seconds"] = time.perf_counter() - start
    # VmHWM (peak RSS of this program); ru_maxrss would include the parent's peak before exec
    hwm = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM"))
    out["max_rss_gb"] = int(hwm.split()[1]) / 2**20
    print("RESULT " + json.dumps(out))


def _run_child(which: str, n_inputs: int, limit_gb: float) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", which, "--child-inputs", str(n_inputs),
         "--memory-limit-gb", str(limit_gb)],
        capture_output=True, text=True,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"which": which, "ok": False, "error": (proc.stderr.strip().splitlines() or ["?"])[-1][:200],
            "returncode": proc.returncode}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-test", type=int, default=2000)
    parser.add_argument("--laplace-points", type=int, default=100,
                        help="inputs on which laplace-torch is timed (then extrapolated)")
    parser.add_argument("--memory-limit-gb", type=float, default=3.0)
    parser.add_argument("--big-inputs", type=int, default=200)
    parser.add_argument("--child", choices=("laplace", "ours"))
    parser.add_argument("--child-inputs", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        child(args.child, args.child_inputs, args.memory_limit_gb)
        return

    from laplace_debiased.evaluation.models import cifar_cnn
    from laplace_debiased.posterior.grid import GridPredictive

    torch.manual_seed(0)
    model = cifar_cnn().eval()
    la = _kfac(model, 10)
    x = torch.randn(args.n_test, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    pred = GridPredictive(la, chunk_size=50)

    # (a) one point vs 14 points, same predictive
    t = time.process_time()
    one = pred.grid(x, GRID[:1], links=("probit",))["probit"]
    t_one = time.process_time() - t
    t = time.process_time()
    sweep = pred.grid(x, GRID, links=("probit",))["probit"]
    t_sweep = time.process_time() - t
    # one point takes the per-point path of posterior.grams.weighted_grams, 14 points the batched one
    a_diff = float((one[0] - sweep[0]).abs().max())
    if a_diff > 1e-5:
        raise AssertionError(f"sweep and single-point probabilities differ by {a_diff:.1e}")

    # (b) laplace-torch at one grid point on a subset, extrapolated
    k = args.laplace_points
    delta_idx = 6  # 1e-2
    la.prior_precision = GRID[delta_idx]
    t = time.process_time()
    ref = torch.cat([la(c, pred_type="glm", link_approx="probit") for c in x[:k].split(50)])
    t_lap_subset = time.process_time() - t
    t_lap_sweep = t_lap_subset * (args.n_test / k) * len(GRID)
    diff = float((ref - sweep[delta_idx, :k]).abs().max())

    # (c) 100 classes, ~1M parameters, same memory limit for both
    lap_big = _run_child("laplace", 50, args.memory_limit_gb)
    ours_big = _run_child("ours", args.big_inputs, args.memory_limit_gb)
    n_big = ours_big.get("n_params", 1_042_300)
    jac_gb = 50 * 100 * n_big * 4 / 2**30

    res = {
        "device": f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
                  f"{torch.get_num_threads()} thread(s), shared machine (high load); (a), (b): CPU seconds",
        "cifar_cnn_params": la.n_params,
        "n_test": args.n_test,
        "grid": GRID,
        "a_single_point_s": t_one,
        "a_sweep_14_s": t_sweep,
        "a_ratio": t_sweep / t_one,
        "a_max_abs_prob_diff": a_diff,
        "b_laplace_points_timed": k,
        "b_laplace_one_point_subset_s": t_lap_subset,
        "b_laplace_sweep_14_extrapolated_s": t_lap_sweep,
        "b_speedup": t_lap_sweep / t_sweep,
        "b_max_abs_prob_diff": diff,
        "c_memory_limit_gb": args.memory_limit_gb,
        "c_laplace_jacobian_gb_per_50_inputs": jac_gb,
        "c_laplace": lap_big,
        "c_ours": ours_big,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sweep_speed.json").write_text(json.dumps(res, indent=2))
    md = [
        "# Grid predictive: speed and memory (`benchmarks/sweep_speed.py`)",
        "",
        f"{res['device']}. K-FAC LA over all {la.n_params:,} weights of `cifar_cnn()`, "
        f"{args.n_test:,} random CIFAR-shaped inputs, probit, 14 prior precisions.",
        "",
        "| measurement | value |",
        "|---|---|",
        f"| (a) single grid point, ours | {t_one:.1f} s |",
        f"| (a) 14-point sweep, ours | {t_sweep:.1f} s ({t_sweep / t_one:.2f}x single point; target ≤ 2x) |",
        f"| (b) laplace-torch GLM probit, 1 point on {k} inputs | {t_lap_subset:.1f} s |",
        f"| (b) laplace-torch, 14 points x {args.n_test} inputs (extrapolated) | {t_lap_sweep:.0f} s |",
        f"| (b) speed-up of the sweep | {t_lap_sweep / t_sweep:.0f}x (target ≥ 500x) |",
        f"| (b) max abs difference of probabilities (float32) | {diff:.1e} |",
        f"| (c) 100 classes, {n_big:,} params: laplace-torch, 50 inputs/call, {args.memory_limit_gb:g} GB limit | "
        + ("ran" if lap_big.get("ok") else f"failed: {lap_big.get('error', '')}")
        + f" (its Jacobian alone: {jac_gb:.1f} GB per 50 inputs) |",
        f"| (c) ours, 14 points x {args.big_inputs} inputs, same limit | "
        + (f"ran in {ours_big['seconds']:.1f} s, peak RSS {ours_big['max_rss_gb']:.2f} GB" if ours_big.get("ok")
           else f"failed: {ours_big.get('error')}") + " |",
        "",
    ]
    (RESULTS / "sweep_speed.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
