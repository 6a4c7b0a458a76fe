"""Single batch against ``debiased_lowrank``'s two estimates at equal samples, three models on
scikit-learn's digits (no download): paired draws, each cached so that an interrupted run resumes
(``benchmarks/PROTOCOL_LOWRANK.md``).

    OMP_NUM_THREADS=1 python benchmarks/digits_lowrank_estimators.py --model mlp32 --seeds 60000 60016 \\
        --cache ~/.cache/laplace-debiased-study/lowrank [--batch-sizes 32 64 128 256]
    python benchmarks/digits_lowrank_estimators.py --summary --cache ~/.cache/laplace-debiased-study/lowrank

Models (``--model``), each a MAP trained on N = 1,000 of the 1,797 digits (pixels / 16; a
permutation seeded by 0 splits them; the other 797 the test set) by full-batch Adam (lr 1e-2,
weight decay 1e-4, 500 steps, torch seed 0), the same MAP for every draw:

* ``mlp32``: ``Linear(64, 32) - Tanh - Linear(32, 10)``, 2,410 weights;
* ``mlp100``: ``Linear(64, 100) - Tanh - Linear(100, 10)``, 7,510 weights;
* ``cnn``: the main job's ``digits_cnn`` (two 3x3 convolutions, ReLU, max-pool, two linear layers),
  9,802 weights, on ``(1, 8, 8)`` images.

Each draw ``s`` permutes the training set (``torch.Generator().manual_seed(s)``) and reads its first
``b`` samples. Every fit is ``DebiasedLowRankLaplace`` (``hessian_structure="debiased_lowrank"``, all
weights, rank ``k = 50``, laplace-torch's GGN): ``single`` reads all ``b`` as B and B̃ (B̃ = B, the
single-batch top-``k`` LA); ``paper`` (the structure's present default) and ``corrected``
(``estimator="corrected"``) read B = the first ``b/2`` and B̃ = the next ``b/2``. The reference is
the same structure over all N (B̃ = B), through Lanczos. For each fit and prior precision δ in 15
log-spaced values over 1e-4 … 1e3: the test NLL of the GLM predictive with laplace-torch's probit
link (``κ = (1 + π/8 · diag Σ_f)^(-1/2)``, softmax of ``κ f``, ``Σ_f`` the class's
``functional_variance``). Per draw: ``CACHE/<model>/b<b>/seed<s>.json``. ``--summary`` writes
``results/lowrank_protocol.{json,md}`` with the protocol's metrics and decision.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.data.digits import load_digits_tensors
from laplace_debiased.eigen.laplace import DebiasedLowRankLaplace
from laplace_debiased.evaluation.models import digits_cnn
from laplace_debiased.evaluation.tracking import largest_gap, mean_stderr

HERE = Path(__file__).resolve().parent
MODELS = ("mlp32", "mlp100", "cnn")
CANDIDATES = ("single", "paper", "corrected")
DELTAS = tuple(float(d) for d in np.logspace(-4, 3, 15))
SIZES = (32, 64, 128, 256)
N_TRAIN, RANK, DRAWS = 1000, 50, 16
T15 = 1.753  # one-sided 95 % t quantile, 15 degrees of freedom
MARGIN = 1.0  # points


def data(model: str) -> tuple[TensorDataset, TensorDataset]:
    """Training (1,000) and test (797) digits in [0, 1]: ``(n, 64)`` for an MLP, ``(n, 1, 8, 8)`` for the CNN."""
    X, y = load_digits_tensors()
    X = X.reshape(len(X), 1, 8, 8) if model == "cnn" else X.reshape(len(X), -1)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = perm[:N_TRAIN], perm[N_TRAIN:]
    return TensorDataset(X[train], y[train]), TensorDataset(X[test], y[test])


def train_map(model: str, train: TensorDataset) -> nn.Module:
    """The MAP of ``model`` (module docstring)."""
    torch.manual_seed(0)
    net = digits_cnn() if model == "cnn" else nn.Sequential(
        nn.Linear(64, int(model[3:])), nn.Tanh(), nn.Linear(int(model[3:]), 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    X, y = train.tensors
    for _ in range(500):
        opt.zero_grad()
        nn.functional.cross_entropy(net(X), y).backward()
        opt.step()
    return net.eval()


def fit(net: nn.Module, train: TensorDataset, candidate: str, b: int | None, seed: int) -> DebiasedLowRankLaplace:
    """One candidate's fit on draw ``seed`` at ``b`` samples (``b=None``: the full-batch reference)."""
    options = {"estimator": "corrected"} if candidate == "corrected" else {}
    la = DebiasedLowRankLaplace(net, "classification", rank=RANK, method="lanczos" if b is None else "auto", **options)
    if b is None:
        full = DataLoader(train, batch_size=len(train))
        la.fit(full, magnitude_loader=full)
        return la
    # the draw's permutation as the sampler: batches of the whole training set (N = 1,000), the
    # first b samples read as one batch (single) or as B and B̃ of b/2
    order = torch.randperm(N_TRAIN, generator=torch.Generator().manual_seed(seed)).tolist()
    loader = DataLoader(train, batch_size=b if candidate == "single" else b // 2, sampler=order)
    la.fit(loader, **({"magnitude_loader": loader} if candidate == "single" else {}))
    return la


def test_nll(la: DebiasedLowRankLaplace, Js: torch.Tensor, f_mu: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Test NLL of the probit GLM predictive at each δ in :data:`DELTAS`."""
    out = []
    for delta in DELTAS:
        la.prior_precision = delta
        f_var = torch.diagonal(la.functional_variance(Js), dim1=-2, dim2=-1).double()
        kappa = 1 / torch.sqrt(1 + math.pi / 8 * f_var)
        logp = torch.log_softmax(kappa * f_mu.double(), dim=-1)
        out.append(float(-logp[torch.arange(len(y)), y].mean()))
    return out


def run(model: str, seeds: list[int], batch_sizes: list[int], cache: Path) -> None:
    torch.set_num_threads(1)
    train, test = data(model)
    net = train_map(model, train)
    X, y = test.tensors
    full = fit(net, train, "single", None, 0)
    parts = [full.backend.jacobians(x) for x in X.split(50)]  # chunks: the CNN's Jacobians in one call need GBs
    Js, f_mu = torch.cat([J for J, _ in parts]).detach(), torch.cat([f for _, f in parts]).detach()
    ref = test_nll(full, Js, f_mu, y)
    for b in batch_sizes:
        for seed in seeds:
            path = cache / model / f"b{b}" / f"seed{seed}.json"
            if path.exists():
                continue
            record = {"model": model, "b": b, "seed": seed, "deltas": DELTAS, "full": ref, "nll": {}, "rank": {}}
            for c in CANDIDATES:
                la = fit(net, train, c, b, seed)
                record["nll"][c] = test_nll(la, Js, f_mu, y)
                record["rank"][c] = int(la.H[0].shape[1])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".tmp").write_text(json.dumps(record) + "\n")
            path.with_suffix(".tmp").replace(path)
            print(f"lowrank {model} b={b} seed={seed} done", flush=True)


def cell(records: list[dict]) -> dict:
    """One (model, b): M per candidate (points), D = M − M(single) and M(corrected) − M(paper),
    paired by draw, with the one-sided upper bounds ``mean + 1.753 s.e.``."""
    M = {c: 100 * np.array([largest_gap(r["nll"][c], r["full"]) for r in records]) for c in CANDIDATES}
    out: dict = {"draws": len(records), "M": {c: mean_stderr(M[c]) for c in CANDIDATES}, "M_raw": {c: M[c].tolist() for c in CANDIDATES}}
    pairs = {"paper-single": M["paper"] - M["single"], "corrected-single": M["corrected"] - M["single"],
             "corrected-paper": M["corrected"] - M["paper"]}
    for name, D in pairs.items():
        mean, se = mean_stderr(D)
        out[name] = {"mean": mean, "se": se, "upper": mean + T15 * se, "worse": int((D > 0).sum())}
    return out


def decide(cells: dict[str, dict[int, dict]]) -> dict:
    """PROTOCOL_LOWRANK.md's criterion over every (model, b)."""
    flat = [c for bs in cells.values() for c in bs.values()]
    eligible = [r for r in ("paper", "corrected") if all(c[f"{r}-single"]["upper"] < MARGIN for c in flat)]
    W = {r: max(c[f"{r}-single"]["mean"] for c in flat) for r in ("paper", "corrected")}
    if eligible == ["paper", "corrected"]:
        worst = max(flat, key=lambda c: c["paper-single"]["mean"])
        switch = W["paper"] - W["corrected"] > 2 * worst["corrected-paper"]["se"]
        why = (f"both non-inferior; W(paper) − W(corrected) = {W['paper'] - W['corrected']:.2f} pt against 2 s.e. "
               f"= {2 * worst['corrected-paper']['se']:.2f} pt where paper attains W")
        return {"eligible": eligible, "W": W, "default": "corrected" if switch else "paper", "why": why}
    if eligible:
        return {"eligible": eligible, "W": W, "default": eligible[0], "why": "the only candidate non-inferior everywhere"}
    default = min(("paper", "corrected"), key=W.get)
    return {"eligible": [], "W": W, "default": default,
            "why": "neither is non-inferior to the single batch everywhere; the smaller worst-case paired loss W"}


def summary(cache: Path) -> str:
    """Reads every finished (model, b) from ``cache``, writes ``results/lowrank_protocol.{json,md}``."""
    cells: dict[str, dict[int, dict]] = {}
    for model in MODELS:
        for b in SIZES:
            records = [json.loads(p.read_text()) for p in sorted((cache / model / f"b{b}").glob("seed*.json"))]
            if records:
                cells.setdefault(model, {})[b] = cell(records)
    finished = all(len(cells.get(m, {})) == len(SIZES) and all(c["draws"] >= DRAWS for c in cells[m].values())
                   for m in MODELS)
    decision = decide(cells) if finished else {"eligible": [], "W": {}, "default": "paper", "why": "the run has not finished"}
    lines = ["# Pre-registered choice of `debiased_lowrank`'s default estimate (benchmarks/PROTOCOL_LOWRANK.md)", "",
             "Written by `python benchmarks/digits_lowrank_estimators.py --summary` from the run's cache. M: largest "
             "relative test-NLL gap over δ to the same structure fitted on the full batch (points, mean ± s.e. over "
             "draws). D: paired differences of M on the same draw, mean ± s.e. (draws worse). Non-inferior: "
             f"mean + {T15} s.e. < {MARGIN} pt.", "",
             "| model | b | draws | single M | paper M | corrected M | paper − single | corrected − single | corrected − paper |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, bs in cells.items():
        for b, c in sorted(bs.items()):
            Ms = " | ".join(f"{c['M'][k][0]:.2f} ± {c['M'][k][1]:.2f}" for k in CANDIDATES)
            Ds = " | ".join(f"{c[k]['mean']:+.2f} ± {c[k]['se']:.2f} ({c[k]['worse']} of {c['draws']})"
                            for k in ("paper-single", "corrected-single", "corrected-paper"))
            lines.append(f"| {model} | {b} | {c['draws']} | {Ms} | {Ds} |")
    lines += ["", "## Decision", "", f"- non-inferior to the single batch in every cell: {', '.join(decision['eligible']) or 'none'}",
              "- worst-case paired loss against the single batch W (pt): "
              + ", ".join(f"{k} {v:+.2f}" for k, v in decision["W"].items()),
              f"- default: **{decision['default']}** ({decision['why']})"]
    text = "\n".join(lines) + "\n"
    (HERE / "results" / "lowrank_protocol.json").write_text(json.dumps(
        {"cells": {m: {str(b): c for b, c in bs.items()} for m, bs in cells.items()}, "finished": finished,
         "decision": decision}, indent=1) + "\n")
    (HERE / "results" / "lowrank_protocol.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS)
    parser.add_argument("--seeds", type=int, nargs=2, metavar=("FIRST", "STOP"), help="the draws' seeds, range(FIRST, STOP)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--cache", type=Path, required=True, help="one JSON per draw (resumes)")
    parser.add_argument("--summary", action="store_true", help="write the results from the cache and stop")
    args = parser.parse_args(argv)
    if args.summary:
        print(summary(args.cache.expanduser()))
        return 0
    if args.model is None or args.seeds is None:
        parser.error("--model and --seeds are needed to run draws")
    run(args.model, list(range(*args.seeds)), args.batch_sizes, args.cache.expanduser())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
