"""A wide layer at the cost of its rows: fit and predictive of stock ``kron`` and the debiased
structures on ``Linear(w, w) + ReLU + Linear(w, 10)``, each row in a fresh process (its own peak RSS).

    OMP_NUM_THREADS=1 python benchmarks/wide_predict.py --widths 1024 2048 4096

Per width ``w`` (float32, all weights, 512 random inputs ``(w,)`` with random labels in loader
batches of 128, the network at its random initialisation): stock laplace-torch ``kron`` fitted on
all 512, the debiased structures with their defaults (B and B̃ one loader batch each, 2 × 128).
Reported per row: the fit time (``la.fit``, wall clock and the process's CPU time, which a loaded
machine disturbs less) and the time to a usable posterior (``la.fit`` plus the first
``la.posterior_precision``; laplace-torch's ``kron`` eigendecomposes its factors in the fit, as the
debiased structures do); ``la(x)`` per input (GLM, probit) on 2 inputs, the first call and
the second; ``GridPredictive`` over 14 prior precisions (projected probit) per input on 64 inputs;
and the process's peak RSS (``ru_maxrss``, which includes the interpreter and torch, ~0.3 GB).
``debiased_full`` holds ``P × P`` curvature (rows above ``--max-dense-params`` are listed as not
run); ``debiased_lowrank`` fits ``P × k`` by Lanczos over all ``P`` parameters, whose cost grows with
``P`` (rows above ``--max-lowrank-params``, by default widths above 1,024, are listed as not run).
``debiased_kron(paper)`` is ``debiased_kron`` with ``estimator="paper"`` (B's eigenvectors, B̃'s
Rayleigh quotients: one decomposition per factor where the default needs three, below).

The decomposition floor: per width, the CPU time of one ``torch.linalg.eigh`` of an SPD matrix in
float64 (the package's precision) and float32 (laplace-torch's, on float32 factors), 1 thread. The
default (``"corrected"``; ``"shrunk"`` and ``"stein"`` do the same decompositions) estimate of the
first layer's output factor needs the pooled factor's
eigenvectors and each batch's own spectrum (the gaps of the two orders), each from a ``w × w``
decomposition or, where the rows are fewer than ``w``, from their Gram matrix: batch ``b`` samples
give ``b (C - 1)`` output rows (1,152 for 128 samples and 10 classes), the pooled factor twice that.
Stock ``kron`` decomposes four ``w × w`` float32 factors (the first layer's output, bias and input
factor, the second layer's input factor). The table lists both sums and the ratio they bound. ``--conv`` and
``--token`` add one row each of a convolutional and a token model (``debiased_kron``).
Writes benchmarks/results/wide_predict.{json,md} (the command in the Markdown).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._children import run_children  # noqa: E402

STRUCTURES = ("kron", "debiased_kron", "debiased_kron(paper)", "debiased_ekfac", "debiased_lowrank", "debiased_full")
#: a row name -> (hessian_structure, constructor options)
VARIANTS = {"debiased_kron(paper)": ("debiased_kron", {"estimator": "paper"})}
GRID = [10.0 ** (e / 2) for e in range(-8, 6)]  # 14 prior precisions, 1e-4 ... 10^2.5


def _model(kind: str, w: int):
    import torch
    from torch import nn

    torch.manual_seed(0)
    if kind == "conv":  # a 32-channel 3 × 3 conv on 8 × 8 images, then a w-wide head
        return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 64, w),
                             nn.ReLU(), nn.Linear(w, 10))
    if kind == "token":  # 8 tokens of width w, every token an output
        return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))
    return nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10))


def _data(kind: str, w: int, n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = {"conv": (3, 8, 8), "token": (8, w)}.get(kind, (w,))
    X = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, 10, (n, 8) if kind == "token" else (n,), generator=g)
    return X, y


def _eigh_seconds(n: int, dtype) -> float:
    """CPU seconds of one ``torch.linalg.eigh`` of an ``n × n`` SPD matrix in ``dtype`` (best of 2)."""
    import torch

    X = torch.randn(n + 8, n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    S = (X.T @ X).to(dtype)
    best = float("inf")
    for _ in range(2):
        t0 = time.process_time()
        torch.linalg.eigh(S)
        best = min(best, time.process_time() - t0)
    return best


def floor(w: int, a) -> dict:
    """The decomposition floor at width ``w`` (module docstring)."""
    import torch

    torch.set_num_threads(1)
    rows = a.batch * 9  # one batch's output rows: samples × (C - 1), 10 classes
    e64 = {n: _eigh_seconds(n, torch.float64) for n in {w, min(w, rows), min(w, 2 * rows)}}
    default = e64[min(w, 2 * rows)] + 2 * e64[min(w, rows)]
    return {"which": f"floor:eigh:{w}", "width": w, "eigh64_s": e64[w], "eigh32_s": _eigh_seconds(w, torch.float32),
            "default_floor_s": default, "paper_floor_s": e64[min(w, rows)]}


def child(which: str, a) -> dict:
    import torch
    from laplace import Laplace
    from torch.utils.data import DataLoader, TensorDataset

    import laplace_debiased  # noqa: F401  (registers the structures)
    from laplace_debiased.posterior.grid import GridPredictive

    torch.set_num_threads(1)
    kind, structure, w = which.split(":")
    if kind == "floor":
        return floor(int(w), a)
    w = int(w)
    model = _model(kind, w)
    X, y = _data(kind, w, a.samples, 0)
    loader = DataLoader(TensorDataset(X, y), batch_size=a.batch)
    hessian_structure, options = VARIANTS.get(structure, (structure, {}))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=hessian_structure, **options)
    t0, c0 = time.perf_counter(), time.process_time()
    la.fit(loader)
    fit, fit_cpu = time.perf_counter() - t0, time.process_time() - c0
    la.prior_precision = 1.0
    t0 = time.perf_counter()
    la.posterior_precision  # a usable posterior (nothing left to decompose for any structure here)
    decompose = time.perf_counter() - t0
    xt, _ = _data(kind, w, max(a.n_predict, a.n_grid), 1)
    x = xt[: a.n_predict]
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.no_grad():
            la(x, pred_type="glm", link_approx="probit")
        times.append((time.perf_counter() - t0) / len(x))
    xg = xt[: a.n_grid]
    t0 = time.perf_counter()
    GridPredictive(la, chunk_size=32).grid(xg, GRID, links=("probit_projected",))
    grid = (time.perf_counter() - t0) / len(xg)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB -> GB
    params = sum(p.numel() for p in model.parameters())
    return {"which": which, "model": kind, "structure": structure, "width": w, "params": params,
            "fit_s": fit, "fit_cpu_s": fit_cpu, "first_use_s": decompose, "la_first_ms": 1e3 * times[0], "la_later_ms": 1e3 * times[1],
            "grid14_ms": 1e3 * grid, "peak_gb": peak}


def _markdown(rows: list[dict], floors: list[dict], command: str, load: tuple[float, float]) -> str:
    """The report; ``load``: the machine's 1-minute load average at the start and end of the run."""
    lines = [f"Command: `{command}` (one run; {os.cpu_count()}-core machine, 1 thread; 1-minute load average "
             f"{load[0]:.1f} at the start, {load[1]:.1f} at the end).", "",
             "| model | width | structure | fit [s] | fit / stock fit | fit CPU [s] | CPU / stock CPU | fit + first use [s] "
             "| ratio to stock | `la(x)` first [ms/input] | `la(x)` later [ms/input] | 14-δ grid [ms/input] | peak RSS [GB] |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    stock = {(r["model"], r["width"]): r for r in rows if r["structure"] == "kron" and "fit_s" in r}
    for r in rows:
        head = f"| {r['model']} | {r['width']} | {r['structure']} |"
        if "skipped" in r or "failed" in r:
            text = r.get("skipped") or "failed: " + r["failed"][-120:].replace(chr(10), " ")
            lines.append(f"{head} {text} |" + " |" * 9)
            continue
        ref = stock.get((r["model"], r["width"]))
        used = r["fit_s"] + r["first_use_s"]
        nan = float("nan")
        ratio = r["fit_s"] / ref["fit_s"] if ref else nan
        ratio_cpu = r["fit_cpu_s"] / ref["fit_cpu_s"] if ref else nan
        ratio_used = used / (ref["fit_s"] + ref["first_use_s"]) if ref else nan
        lines.append(f"{head} {r['fit_s']:.1f} | {ratio:.2f} | {r['fit_cpu_s']:.1f} | {ratio_cpu:.2f} | {used:.1f} | "
                     f"{ratio_used:.2f} | {r['la_first_ms']:.0f} | {r['la_later_ms']:.0f} | {r['grid14_ms']:.1f} | "
                     f"{r['peak_gb']:.2f} |")
    if floors:
        lines += ["", "The decomposition floor of the fit (CPU seconds, 1 thread; module docstring): one `eigh` of a "
                  "width × width SPD matrix, stock `kron`'s four float32 ones, the float64 decompositions the default "
                  "(`corrected`, `shrunk` and `stein` alike) and the paper's estimate of the first layer's output "
                  "factor need, and the ratio to stock `kron`'s whole fit (CPU) that the default's alone reach.", "",
                  "| width | `eigh` float64 [s] | `eigh` float32 [s] | stock: 4 × float32 [s] | default: pooled + 2 orders "
                  "[s] | paper: B's factor [s] | stock fit CPU [s] | default floor / stock fit CPU |",
                  "|---|---|---|---|---|---|---|---|"]
        for f in floors:
            ref = stock.get(("mlp", f["width"]))
            bound = f"{f['default_floor_s'] / ref['fit_cpu_s']:.2f}" if ref else "nan"
            ref_cpu = f"{ref['fit_cpu_s']:.2f}" if ref else "nan"
            lines.append(f"| {f['width']} | {f['eigh64_s']:.2f} | {f['eigh32_s']:.2f} | {4 * f['eigh32_s']:.2f} | "
                         f"{f['default_floor_s']:.2f} | {f['paper_floor_s']:.2f} | {ref_cpu} | {bound} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", type=int, nargs="*", default=[1024, 2048, 4096], help="MLP widths (none: only --conv and --token)")
    p.add_argument("--structures", nargs="+", default=list(STRUCTURES))
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--n-predict", type=int, default=2)
    p.add_argument("--n-grid", type=int, default=64)
    p.add_argument("--max-dense-params", type=int, default=300_000)
    p.add_argument("--max-lowrank-params", type=int, default=1_100_000)
    p.add_argument("--conv", type=int, default=0, help="width of the conv model's head (0: no conv row)")
    p.add_argument("--token", type=int, default=0, help="width of the token model (0: no token row)")
    p.add_argument("--child")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "wide_predict.json"))
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a)), flush=True)
        return
    argv = [f"--samples={a.samples}", f"--batch={a.batch}", f"--n-predict={a.n_predict}", f"--n-grid={a.n_grid}"]
    whiches, skipped = [], []
    for w in a.widths:
        for s in a.structures:
            params = w * w + w + 10 * w + 10
            if s == "debiased_full" and params > a.max_dense_params:
                reason = f"not run: P = {params / 1e6:.1f}M parameters (debiased_full holds P × P)"
            elif s == "debiased_lowrank" and params > a.max_lowrank_params:
                reason = (f"not run: P = {params / 1e6:.1f}M parameters (debiased_lowrank's Lanczos products and "
                          "la(x)'s Jacobians run over all P: about P / 1.1M times the width-1,024 row)")
            else:
                whiches.append(f"mlp:{s}:{w}")
                continue
            skipped.append({"which": f"mlp:{s}:{w}", "model": "mlp", "structure": s, "width": w, "skipped": reason})
    whiches += [f"conv:{s}:{a.conv}" for s in ("kron", "debiased_kron") if a.conv]
    whiches += [f"token:debiased_kron:{a.token}"] if a.token else []
    load_start = os.getloadavg()[0]
    rows = run_children(__file__, whiches, argv)
    floors = run_children(__file__, [f"floor:eigh:{w}" for w in a.widths], argv)
    for r in rows:  # a failed child reports only its name
        kind, structure, w = r["which"].split(":")
        r.update(model=kind, structure=structure, width=int(w))
    rows += skipped
    order = {wh: i for i, wh in enumerate(whiches + [s["which"] for s in skipped])}
    rows.sort(key=lambda r: (r["which"].split(":")[0] != "mlp", int(r["which"].split(":")[2]), order[r["which"]]))
    floors = [f for f in floors if "failed" not in f]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = "OMP_NUM_THREADS=1 python benchmarks/wide_predict.py " + " ".join(sys.argv[1:])
    load = (load_start, os.getloadavg()[0])
    out.write_text(json.dumps({"command": command, "load_average_1min": load, "rows": rows, "floors": floors},
                              indent=1) + "\n")
    text = _markdown(rows, floors, command, load)
    out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
