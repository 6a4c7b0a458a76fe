"""Token outputs (batch, tokens, classes): last-layer ``debiased_kron`` vs laplace-torch's
``KronLLLaplace`` on the same problem: time and peak memory of fit + predict.

One run (``nice python benchmarks/token_outputs.py``, under 3 minutes on one thread) writes
``benchmarks/results/token_outputs.{json,md}``.  Problem: a small next-token model
``Embedding(V, 32) - ShiftConcat - Linear(64, D) - Tanh - Linear(D, V)`` (``V = --vocab``
classes, ``D = --features``; ``ShiftConcat`` from ``examples/adapter_sequence.py``) at its
random initialisation (timings and memory do not depend on training), outputs
``(batch, T tokens, V)``, every token an output of the likelihood.  Fit data: 2 x
``--fit-batch`` sequences of ``T`` tokens; predict: ``--n-test`` sequences.

* ours (one child process): ``Laplace(model, "classification", hessian_structure=
  "debiased_kron")`` fitted on the token outputs directly (B and B̃ one loader batch each);
  predict (a) laplace-torch's NN-sampling predictive ``la(x, pred_type="nn")`` with
  ``--samples`` last-layer samples, ``(n, T, V)``; (b) the GLM predictive of every token over a
  14-point prior grid with :class:`GridPredictive` (probit_projected + probit) on the last layer
  applied to the token features (``n·T`` rows; never the ``(rows, V, P)`` Jacobian).
* laplace-torch (another child): its backends cannot fit ``(batch, tokens, classes)`` outputs
  (the error is recorded from a fit attempt on the token model), so the tokens go in as samples:
  the last-layer features of every token (computed by the frozen body, timed) with its label, a
  data set of ``N·T`` rows, ``KronLLLaplace`` (default CurvlinopsGGN) fitted on the same rows.
  This is the same posterior: K-FAC factors equal ours with B̃ = B to round-off (checked in
  ``tests/test_token_outputs.py`` for the flattening, and against stock at small size).
  Predict (a) the same NN-sampling predictive on the test rows; (b) ``la(x, link_approx=
  "probit")`` on ``--stock-inputs`` token rows under an address-space limit
  ``--stock-limit-gb`` (its Jacobian is ``rows x V x P`` floats), extrapolated to all
  ``n·T`` rows x 14 points, or recorded as failed.

Peak memory is each child's peak resident set size (``VmHWM`` of ``/proc/self/status``, torch's
import included).  Torch threads are set explicitly (``--threads``, default 1).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._children import run_children  # noqa: E402

from examples.adapter_sequence import ShiftConcat  # noqa: E402
from laplace_debiased.prior_grid import PriorGrid  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GRID = list(PriorGrid.default())


def vm_hwm_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


class Clock:
    """Wall-clock and CPU (this process) seconds since it was started; the machine is shared,
    so the ratios are quoted in CPU seconds, which other processes barely change."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def record(self, out: dict, key: str) -> None:
        out[f"{key}_s"] = time.perf_counter() - self.wall
        out[f"{key}_cpu_s"] = time.process_time() - self.cpu


def problem(args):
    """Model, fit sequences ``(2b, T)`` with labels ``(2b, T)``, test sequences ``(n_test, T)``."""
    torch.manual_seed(0)
    V, T = args.vocab, args.tokens
    model = nn.Sequential(
        nn.Embedding(V, 32), ShiftConcat(), nn.Linear(64, args.features), nn.Tanh(),
        nn.Linear(args.features, V),
    ).eval()  # fmt: skip
    x = torch.randint(0, V, (2 * args.fit_batch, T))
    y = torch.randint(0, V, (2 * args.fit_batch, T))
    return model, x, y, torch.randint(0, V, (args.n_test, T))


def child_ours(args) -> dict:
    from laplace import Laplace

    import laplace_debiased  # noqa: F401  registers debiased_kron
    from laplace_debiased.posterior.grid import GridPredictive

    model, x, y, x_test = problem(args)
    out, clock = {"which": "ours"}, Clock()
    la = Laplace(model, "classification", hessian_structure="debiased_kron")
    la.fit(DataLoader(TensorDataset(x, y), batch_size=args.fit_batch))
    clock.record(out, "fit")
    out["fit_peak_rss_gb"], clock = vm_hwm_gb(), Clock()
    probs = la(x_test, pred_type="nn", link_approx="mc", n_samples=args.samples)
    clock.record(out, "nn_predict")
    out["nn_shape"], clock = list(probs.shape), Clock()
    grid = GridPredictive(la, chunk_size=args.chunk_size).grid(x_test, GRID, links=("probit_projected", "probit"))
    clock.record(out, "glm_grid")
    out.update(glm_rows=len(x_test) * args.tokens, grid_points=len(GRID),
               glm_shape=list(next(iter(grid.values())).shape),
               finite=bool(all(torch.isfinite(p).all() for p in grid.values())))
    out["peak_rss_gb"] = vm_hwm_gb()
    return out


def _stock_on_tokens(model, x, y) -> str:
    """laplace-torch's KronLLLaplace fitted on the token outputs directly: the error it raises."""
    from laplace import Laplace

    try:
        la = Laplace(model, "classification", hessian_structure="kron")
        la.fit(DataLoader(TensorDataset(x[:2], y[:2]), batch_size=2))
    except Exception as err:  # noqa: BLE001  recorded, not handled
        return f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    return "no error"


def child_stock(args) -> dict:
    from laplace import Laplace

    model, x, y, x_test = problem(args)
    out = {"which": "stock"}
    body, head = model[:-1], model[-1]
    clock = Clock()
    with torch.no_grad():
        rows = body(x).reshape(-1, args.features)
    la = Laplace(nn.Sequential(nn.Identity(), head), "classification", hessian_structure="kron")
    la.fit(DataLoader(TensorDataset(rows, y.reshape(-1)), batch_size=args.fit_batch * args.tokens))
    clock.record(out, "fit")
    out["fit_peak_rss_gb"], clock = vm_hwm_gb(), Clock()
    with torch.no_grad():
        test_rows = body(x_test).reshape(-1, args.features)
    probs = la(test_rows, pred_type="nn", link_approx="mc", n_samples=args.samples)
    clock.record(out, "nn_predict")  # the body's forward included, as in ours
    out["nn_shape"] = list(probs.shape)
    out["token_outputs_error"] = _stock_on_tokens(model, x, y)  # after the fit's peak memory
    n = args.stock_inputs
    out.update(glm_rows=n, grid_points=1, jacobian_gb_per_call=n * args.vocab * la.n_params * 4 / 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (int(args.stock_limit_gb * 2**30),) * 2)
    clock = Clock()
    try:
        la(test_rows[:n], pred_type="glm", link_approx="probit")
        clock.record(out, "glm")
        out["glm_extrapolated_s"] = out["glm_cpu_s"] / n * len(test_rows) * len(GRID)
    except (MemoryError, RuntimeError) as err:
        out["glm_failed"] = str(err).splitlines()[0][:200]
    out["peak_rss_gb"] = vm_hwm_gb()
    return out


def fmt(v, spec: str = ".1f") -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "n/a"


def table(meta: dict, ours: dict, stock: dict) -> list[str]:
    rows, grid = ours.get("glm_rows"), len(GRID)
    if "glm_failed" in stock:
        why = "out of memory" if "allocate" in stock["glm_failed"] else stock["glm_failed"][:90]
        stock_glm = (f"failed for {stock['glm_rows']} token row under a {meta['stock_limit_gb']:g} GB "
                     f"address-space limit ({why}; its Jacobian alone is "
                     f"{stock['jacobian_gb_per_call']:.1f} GB per token row)")
    elif "glm_cpu_s" in stock:
        stock_glm = (f"{stock['glm_cpu_s']:.1f} CPU s for {stock['glm_rows']} row(s) x 1 point, "
                     f"{stock['glm_extrapolated_s']:.0f} s extrapolated to {rows} rows x {grid}")
    else:
        stock_glm = "n/a"
    nan = float("nan")
    fit_ratio = ours.get("fit_cpu_s", nan) / stock.get("fit_cpu_s", nan)
    nn_ratio = ours.get("nn_predict_cpu_s", nan) / stock.get("nn_predict_cpu_s", nan)
    total = [r.get("fit_cpu_s", nan) + r.get("nn_predict_cpu_s", nan) for r in (ours, stock)]
    mem_ratio = ours.get("fit_peak_rss_gb", float("nan")) / stock.get("fit_peak_rss_gb", float("nan"))
    return [
        "# Token outputs, last-layer K-FAC (`benchmarks/token_outputs.py`)",
        "",
        f"CPU ({meta['machine']}), torch {meta['torch']}, {meta['threads']} thread(s), shared machine. "
        f"Next-token model, vocabulary = classes V = {meta['vocab']:,}, {meta['features']} features "
        f"(last layer {meta['last_layer_params']:,} weights), outputs (batch, {meta['tokens']} tokens, V); "
        f"fitted on {meta['fit_sequences']} sequences = {meta['fit_rows']:,} token outputs, predicting "
        f"{meta['test_sequences']} sequences = {meta['test_rows']:,} token outputs. Times are CPU "
        "seconds of each process (wall-clock seconds in the JSON); peak memory = each process's VmHWM.",
        "",
        f"laplace-torch cannot fit the (batch, tokens, classes) outputs ({stock.get('token_outputs_error', 'n/a')}); "
        "it gets every token's last-layer features as a sample (same K-FAC factors as ours with B̃ = B).",
        "",
        f"| | fit (CPU s) | peak RSS after fit (GB) | NN-sampling predictive, {meta['samples']} samples (CPU s) "
        "| GLM predictive of every token | peak RSS at the end (GB) |",
        "|---|---|---|---|---|---|",
        f"| debiased_kron on the token outputs (B, B̃ one batch each) | {fmt(ours.get('fit_cpu_s'))} | "
        f"{fmt(ours.get('fit_peak_rss_gb'), '.2f')} | {fmt(ours.get('nn_predict_cpu_s'), '.2f')} | "
        f"{fmt(ours.get('glm_grid_cpu_s'))} CPU s for {rows} rows x {grid} points (GridPredictive, "
        f"probit_projected + probit) | {fmt(ours.get('peak_rss_gb'), '.2f')} |",
        f"| laplace-torch KronLLLaplace on the token rows | {fmt(stock.get('fit_cpu_s'))} | "
        f"{fmt(stock.get('fit_peak_rss_gb'), '.2f')} | {fmt(stock.get('nn_predict_cpu_s'), '.2f')} | {stock_glm} | "
        f"{fmt(stock.get('peak_rss_gb'), '.2f')} |",
        "",
        f"Ratios ours / laplace-torch from this run: fit {fit_ratio:.2f}x, NN-sampling predictive "
        f"{nn_ratio:.2f}x (laplace-torch eigendecomposes its K-FAC on the first prediction, ours in "
        f"the fit), fit + NN-sampling predictive {total[0] / total[1]:.2f}x, peak memory of the fit "
        f"{mem_ratio:.2f}x.",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--features", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--fit-batch", type=int, default=2, help="sequences per loader batch")
    ap.add_argument("--n-test", type=int, default=8, help="test sequences")
    ap.add_argument("--samples", type=int, default=20, help="NN-sampling predictive samples")
    ap.add_argument("--chunk-size", type=int, default=32)
    ap.add_argument("--stock-inputs", type=int, default=1)
    ap.add_argument("--stock-limit-gb", type=float, default=4.0)
    ap.add_argument("--child", choices=["ours", "stock"])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        warnings.filterwarnings("ignore")
        print(json.dumps(child_ours(args) if args.child == "ours" else child_stock(args)))
        return
    results = run_children(__file__, ("ours", "stock"), sys.argv[1:])
    meta = {"torch": torch.__version__, "threads": args.threads, "machine": platform.machine(),
            "vocab": args.vocab, "features": args.features, "tokens": args.tokens,
            "last_layer_params": (args.features + 1) * args.vocab,
            "fit_sequences": 2 * args.fit_batch, "fit_rows": 2 * args.fit_batch * args.tokens,
            "test_sequences": args.n_test, "test_rows": args.n_test * args.tokens,
            "samples": args.samples, "grid": GRID, "chunk_size": args.chunk_size,
            "stock_limit_gb": args.stock_limit_gb}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "token_outputs.json").write_text(json.dumps({"meta": meta, "rows": results}, indent=2))
    lines = table(meta, *results)
    (args.out / "token_outputs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
