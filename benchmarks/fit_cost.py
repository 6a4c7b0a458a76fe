"""Fit cost of the debiased K-FAC at 2 × b/2 relative to a single-batch K-FAC fit at b.

Measured in one run (``OMP_NUM_THREADS=1 nice python benchmarks/fit_cost.py``), writing
``benchmarks/results/fit_cost.{json,md}``. For every b in ``--batch-sizes`` the fits are
timed in interleaved repeats (the order of the methods rotates every repeat) and the median
over repeats is reported:

* ``debiased``: ``DebiasedKronLaplace(estimator="paper")`` with B and B̃ one loader batch of
  b/2 each (the single forward/backward pass over B ∪ B̃);
* ``debiased_per_batch``: the same fit with one backend call per batch (the path before the
  single pass; kept for backends the single pass does not reproduce);
* ``corrected``: ``DebiasedKronLaplace(estimator="corrected")`` on the same two
  batches (three float64 eigendecompositions per factor: B ∪ B̃'s and, for the gaps, B's and
  B̃'s; through the rows' Gram matrices for a factor wider than B ∪ B̃);
* ``shrunk``: ``estimator="shrunk"``, the same computation and one weight per factor;
* ``stein``: ``estimator="stein"``, the same and per factor the two batches' difference in the
  pooled eigenbasis (two ``d × d`` products) for the weight;
* ``single``: laplace-torch's ``KronLaplace.fit`` on one batch of b (the reference of the
  target ``debiased / single <= 1.05``);
* ``single_same_code``: ``DebiasedKronLaplace.fit`` with B̃ = B, one batch of b;
* ``eigh_float64`` / ``eigh_stock``: the debiased decomposition alone (float64 ``eigh`` of
  B's factors and B̃'s Rayleigh quotients, or the Gram route for factors wider than B ∪ B̃)
  and laplace-torch's ``Kron.decompose`` (model dtype), on the factors of the paper's b-fit;
* ``decomposition_corrected`` / ``decomposition_shrunk`` (with those methods): the decomposition
  of that estimate alone, on the factors of its own fit;
* ``eigh_extra``: the two float64 ``eigh`` per factor that the corrected and shrunk estimates do
  beyond the paper's (of B ∪ B̃'s factor and of B̃'s; the paper's one is of B's), timed alone on
  the factors of the paper's fit that every estimate decomposes densely. Each of those estimates
  does what the paper's decomposition does (B's ``eigh``, B̃'s quotients along it, the coverage
  record) and these two besides, so ``1 + eigh_extra / debiased`` is a floor under its ratio to
  the paper's fit that no implementation of the estimate with LAPACK's ``eigh`` goes below (the
  column "floor").

With ``--predictive`` also ``debiased+predictive`` / ``single+predictive``: the fit followed by
laplace-torch's first GLM predictive (``la(x, pred_type="glm", link_approx="probit")`` on
``--n-test`` inputs), the target being the same ratio ``<= 1.05``.

Models (``--model``): ``cifar_cnn()`` (56,714 weights, all weights; its largest factor is
1,025), or ``wide_cnn``: two convolutions, then ``Linear(2048, 64)`` and
``Linear(64, 10)`` (138,618 weights), whose 2,048-dimensional input factor has rank ``≤ b/2`` on
each of B and B̃ and is decomposed through their Gram matrices, or ``allcnnc``, the paper's
ALL-CNN-C (1,369,738 weights; its largest factor is 1,728, wider than a batch of up to 1,024). Random
CIFAR-shaped inputs and labels at the random initialisation (fit time does not depend on the
data), float32, Curvlinops GGN (the default backend), ``torch.set_num_threads(--threads)``. With
``--device cuda`` the model and the data lie on the GPU and every timed interval ends with
``torch.cuda.synchronize()`` (a fit ends when its kernels do); a GPU run of ALL-CNN-C (target:
the default costs at most 1.1× the paper's fit) is
``python -m benchmarks.fit_cost --model allcnnc --device cuda --threads 8 --batch-sizes 64 256 1024
--methods debiased corrected single --out DIR``.

The wide-layer run (machine shared, so under ``nice``):
``OMP_NUM_THREADS=1 nice -n 10 python benchmarks/fit_cost.py --model wide_cnn --batch-sizes 64 256
--predictive --out benchmarks/results/fit_cost_wide``
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from laplace import KronLaplace
from torch.utils.data import DataLoader, TensorDataset

from torch import nn

from laplace_debiased.kron.decompose import paired_rows, proportional_blocks
from laplace_debiased.curvature.linalg import symmetric_eigh64, through_rows
from laplace_debiased.evaluation.models import cifar_cnn
from laplace_debiased.kron.laplace import DebiasedKronLaplace

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ["debiased", "debiased_per_batch", "corrected", "shrunk", "stein", "single", "single_same_code"]
CORRECTED = ["corrected", "shrunk", "stein"]
PREDICTIVE = ["debiased+predictive", "single+predictive"]


def wide_cnn(n_classes: int = 10) -> nn.Sequential:
    """Two convolutions and a dense head ``Linear(2048, 64)`` on 32x32 RGB inputs."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64),
        nn.ReLU(),
        nn.Linear(64, n_classes),
    )


def _allcnnc() -> nn.Sequential:
    """The CIFAR-10 benchmark's ALL-CNN-C; imported here, so that the other models also run as
    ``python benchmarks/fit_cost.py`` (this one needs the repository root on the path:
    ``python -m benchmarks.fit_cost``)."""
    from benchmarks.cifar10.models import allcnnc

    return allcnnc()


MODELS = {
    "cifar_cnn": (cifar_cnn, "cifar_cnn (56,714 weights), float32, all weights, CurvlinopsGGN"),
    "wide_cnn": (wide_cnn, "wide_cnn (Linear(2048, 64) head, 138,618 weights), float32, all weights, CurvlinopsGGN"),
    "allcnnc": (_allcnnc, "ALL-CNN-C (1,369,738 weights), float32, all weights, CurvlinopsGGN"),
}


def _sync(device: torch.device) -> None:
    """Wait for the queued GPU work (nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loader(n: int, batch: int, seed: int, device: torch.device) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(X.to(device), y.to(device)), batch_size=batch, shuffle=False)


def _time_fit(method: str, model: torch.nn.Module, b: int, seed: int, n_test: int = 32) -> float:
    method, predictive = method.removesuffix("+predictive"), method.endswith("+predictive")
    device = next(model.parameters()).device
    x_test = torch.randn(n_test, 3, 32, 32, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    if method == "single":
        la, loader, kw = KronLaplace(model, "classification"), _loader(b, b, seed, device), {}
    elif method == "single_same_code":
        loader = _loader(b, b, seed, device)
        la, kw = DebiasedKronLaplace(model, "classification"), {"magnitude_loader": loader}
    else:
        estimator = method if method in CORRECTED else "paper"
        la, loader, kw = DebiasedKronLaplace(model, "classification", estimator=estimator), _loader(b, b // 2, seed, device), {}
        if method == "debiased_per_batch":
            la._single_pass_fisher = lambda: None
    _sync(device)
    t0 = time.perf_counter()
    la.fit(loader, **kw)
    if predictive:
        la(x_test, pred_type="glm", link_approx="probit")
    _sync(device)
    return time.perf_counter() - t0


def _time_decomposition(model: torch.nn.Module, b: int, seed: int, estimator: str) -> tuple[DebiasedKronLaplace, float]:
    """A fit of ``estimator`` and the time of its decomposition alone (``_decompose``, the
    eigendecompositions and the coverage record), redone on the fitted factors."""
    device = next(model.parameters()).device
    la = DebiasedKronLaplace(model, "classification", estimator=estimator)
    la.fit(_loader(b, b // 2, seed, device))
    _sync(device)
    t0 = time.perf_counter()
    la._decompose()
    _sync(device)
    return la, time.perf_counter() - t0


def _time_eigh(model: torch.nn.Module, b: int, seed: int, estimators: list[str]) -> dict[str, float]:
    """The paper's decomposition (``eigh_float64``), laplace-torch's ``Kron.decompose`` of the same
    factors (``eigh_stock``) and the decomposition of each of ``estimators`` (``decomposition_<name>``)."""
    device = next(model.parameters()).device
    la, paper = _time_decomposition(model, b, seed, "paper")
    t0 = time.perf_counter()
    la.H_facs.decompose()
    _sync(device)
    times = {"eigh_float64": paper, "eigh_stock": time.perf_counter() - t0}
    if estimators:
        times["eigh_extra"] = _time_extra_eighs(la)
    for name in estimators:
        times[f"decomposition_{name}"] = _time_decomposition(model, b, seed, name)[1]
    return times


def dense_factor_pairs(la: DebiasedKronLaplace) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(F_B, F_B̃)`` of every factor of ``la``'s fit that the corrected and shrunk estimates
    decompose densely: all but those :func:`~laplace_debiased.curvature.linalg.through_rows` takes
    through the rows' Gram matrices, and but a bias that takes its weight's decomposition
    (:func:`~laplace_debiased.kron.decompose.proportional_blocks`)."""
    rows = la._factor_rows  # per batch set, block and factor: the rows or None
    pairs = paired_rows(rows[0], rows[-1]) if rows else [[None] * len(F) for F in la.H_facs.kfacs]
    copies = proportional_blocks(la.H_facs.kfacs, la.H_facs_magnitude.kfacs)
    factors = [f for k, (F_dir, F_mag, X) in enumerate(zip(la.H_facs.kfacs, la.H_facs_magnitude.kfacs, pairs))
               if k not in copies for f in zip(F_dir, F_mag, X)]
    return [(D, M) for D, M, X in factors if not through_rows(X, D.shape[0])]


def _time_extra_eighs(la: DebiasedKronLaplace) -> float:
    """Seconds of ``eigh(F_B + F_B̃)`` and ``eigh(F_B̃)`` in float64 (module docstring:
    ``eigh_extra``) over :func:`dense_factor_pairs` (the factors left out only lower the floor)."""
    device = next(la.model.parameters()).device
    pairs = dense_factor_pairs(la)
    _sync(device)
    t0 = time.perf_counter()
    for D, M in pairs:
        symmetric_eigh64(D + M)
        symmetric_eigh64(M)
    _sync(device)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "fit_cost")
    parser.add_argument("--model", choices=sorted(MODELS), default="cifar_cnn")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (model and data on the GPU)")
    parser.add_argument("--predictive", action="store_true", help="also time fit + first GLM predictive")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="fit methods timed")
    parser.add_argument("--notes", default="", help="the run's circumstances (machine load), written to the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = MODELS[args.model][0]().eval().to(device)
    if not {"debiased", "single"} <= set(args.methods):
        parser.error("--methods must include debiased and single (the ratio's terms)")
    methods = [*args.methods, *(PREDICTIVE if args.predictive else [])]
    start, load_start = time.perf_counter(), os.getloadavg()[0]
    for b in args.batch_sizes[:1]:  # warm-up (allocator, lazy imports), not recorded
        for method in methods:
            _time_fit(method, model, b, seed=0)
    estimators = [m for m in CORRECTED if m in args.methods]
    decompositions = ["eigh_float64", "eigh_stock", *(f"decomposition_{m}" for m in estimators),
                      *(["eigh_extra"] if estimators else [])]
    times = {b: {m: [] for m in [*methods, *decompositions]} for b in args.batch_sizes}
    for r in range(args.repeats):
        for b in args.batch_sizes:
            order = methods[r % len(methods) :] + methods[: r % len(methods)]
            for method in order:
                times[b][method].append(_time_fit(method, model, b, seed=r))
            for key, t in _time_eigh(model, b, r, estimators).items():
                times[b][key].append(t)
    rows = [_row(b, times[b], args.predictive) for b in args.batch_sizes]
    meta = {
        "model": MODELS[args.model][1],
        "command": f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '')} "
        + (f"nice -n {os.nice(0)} " if os.nice(0) else "")
        + ("python -m benchmarks.fit_cost " if args.model == "allcnnc" else "python benchmarks/fit_cost.py ")
        + " ".join(f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                   for k, v in vars(args).items() if k not in ("predictive", "out", "notes"))
        + (" --predictive" if args.predictive else "") + f" --out {args.out}",
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "cpu": f"{platform.machine()} ({platform.processor() or 'cpu'})" if device.type == "cpu"
        else f"{torch.cuda.get_device_name(device)} (cuda)",
        "wall_seconds": time.perf_counter() - start,
        "load_average_1min": [load_start, os.getloadavg()[0]],  # at start and end (2 cores here)
        "notes": args.notes,
        "times": {str(b): t for b, t in times.items()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    finite = [{k: _finite(v) for k, v in r.items()} for r in rows]  # methods not timed: null
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": finite}, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(meta, rows))
    print(_markdown(meta, rows))


def _row(b: int, times: dict[str, list[float]], predictive: bool) -> dict:
    """The medians and ratios of one batch size (NaN for methods not timed)."""
    med = {m: statistics.median(ts) for m, ts in times.items()}
    med.update({m: float("nan") for m in METHODS if m not in med})
    paired = [d / s for d, s in zip(times["debiased"], times["single"])]
    row = {
        "b": b,
        "median_seconds": med,
        "ratio_debiased_over_single": med["debiased"] / med["single"],
        "ratio_debiased_over_single_worst_repeat": max(paired),
        "ratio_debiased_over_single_same_code": med["debiased"] / med["single_same_code"],
        "ratio_per_batch_over_single": med["debiased_per_batch"] / med["single"],
        "eigh_float64_share_of_debiased_fit": med["eigh_float64"] / med["debiased"],
        "ratio_without_decompositions": (med["debiased"] - med["eigh_float64"])
        / (med["single"] - med["eigh_stock"]),
        "met": med["debiased"] / med["single"] <= 1.05,
        "ratio_corrected_over_debiased": med["corrected"] / med["debiased"],
        "ratio_shrunk_over_debiased": med["shrunk"] / med["debiased"],
        "ratio_stein_over_debiased": med["stein"] / med["debiased"],
        **{f"ratio_{name}_over_single": med[name] / med["single"] for name in CORRECTED},
        "floor_over_debiased": (med["debiased"] + med.get("eigh_extra", float("nan"))) / med["debiased"],
    }
    if predictive:
        row["ratio_with_predictive"] = med["debiased+predictive"] / med["single+predictive"]
        row["met_with_predictive"] = row["ratio_with_predictive"] <= 1.05
    return row


def _finite(v):
    """``None`` for NaN (a method not timed), recursively through dicts."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    return None if isinstance(v, float) and v != v else v


def _markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Fit cost: debiased K-FAC at 2 × b/2 vs single-batch K-FAC at b "
        "(`benchmarks/fit_cost.py`)",
        "",
        f"{meta['model']}; {meta['cpu']}, torch {meta['torch']}, {meta['threads']} thread(s), "
        f"median of {meta['repeats']} interleaved repeats, one run ({meta['wall_seconds']:.0f} s).",
        "",
        *([f"Load average (1 min) at start / end: {meta['load_average_1min'][0]:.1f} / "
           f"{meta['load_average_1min'][1]:.1f}. {meta['notes']}", ""] if "load_average_1min" in meta else []),
        f"Command: `{meta.get('command', 'OMP_NUM_THREADS=1 nice python benchmarks/fit_cost.py')}`",
        "",
        "| b | debiased 2×b/2 (s) | single b, laplace-torch (s) | **ratio** (target ≤ 1.05) "
        "| worst repeat | vs B̃ = B same code | per-batch calls / single | debiased decomposition (s) "
        "| stock eigh (s) | ratio without the decompositions |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s = r["median_seconds"]
        lines.append(
            f"| {r['b']} | {s['debiased']:.3f} | {s['single']:.3f} | "
            f"**{r['ratio_debiased_over_single']:.2f}** | "
            f"{r['ratio_debiased_over_single_worst_repeat']:.2f} | "
            f"{r['ratio_debiased_over_single_same_code']:.2f} | "
            f"{r['ratio_per_batch_over_single']:.2f} | {s['eigh_float64']:.3f} | "
            f"{s['eigh_stock']:.3f} | {r['ratio_without_decompositions']:.2f} |"
        )
    for name, what in (("corrected", "The corrected estimate (`estimator='corrected'`, the default)"),
                       ("shrunk", "The shrunk estimate (`estimator='shrunk'`)"),
                       ("stein", "The James–Stein estimate (`estimator='stein'`)")):
        if all(r["median_seconds"][name] == r["median_seconds"][name] for r in rows):  # timed
            lines += ["", f"{what} on the same two batches, and its decomposition against the paper's:", "",
                      f"| b | {name} 2×b/2 (s) | **{name} / debiased** (target ≤ 1.1) | {name} / single b, "
                      f"laplace-torch | {name} decomposition (s) "
                      "| more than the paper's decomposition (s) | its two more float64 eigh per factor alone (s) "
                      "| floor of the ratio: 1 + those / the paper's fit |", "|---|---|---|---|---|---|---|---|"]
            lines += [f"| {r['b']} | {r['median_seconds'][name]:.3f} | **{r[f'ratio_{name}_over_debiased']:.2f}** "
                      f"| {r[f'ratio_{name}_over_single']:.2f} "
                      f"| {r['median_seconds'][f'decomposition_{name}']:.3f} "
                      f"| {r['median_seconds'][f'decomposition_{name}'] - r['median_seconds']['eigh_float64']:.3f} "
                      f"| {r['median_seconds']['eigh_extra']:.3f} | {r['floor_over_debiased']:.2f} |"
                      for r in rows]
    if "ratio_with_predictive" in rows[0]:
        lines += [
            "",
            "Fit + first GLM predictive (laplace-torch's `la(x, pred_type='glm', link_approx='probit')`):",
            "",
            "| b | debiased 2×b/2 + predictive (s) | single b + predictive, laplace-torch (s) "
            "| **ratio** (target ≤ 1.05) |",
            "|---|---|---|---|",
        ]
        for r in rows:
            s = r["median_seconds"]
            lines.append(
                f"| {r['b']} | {s['debiased+predictive']:.3f} | {s['single+predictive']:.3f} | "
                f"**{r['ratio_with_predictive']:.2f}** |"
            )
    return "\n".join(lines).replace("nan", "–") + "\n"


if __name__ == "__main__":
    main()
