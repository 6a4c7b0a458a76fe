"""Cost of marginal-likelihood prior tuning: ``debiased_full`` (eigenbasis) against stock ``full``
and ``kron``, one thread, all measured in one run.

Models: laplace-torch's README snippet model, a ``64-50-10`` tanh MLP on the embedded 8x8 digits
(P = 3,760), and a ``64-130-10`` one (P = 9,760); MAP by 300 full-batch Adam steps on 1,000
training digits, loader batches of 32, classification.

(a) **Per step** of ``optimize_prior_precision(method="marglik")`` (scalar prior, Adam, lr 0.1):
    ``debiased_full`` with B̃ = B (``magnitude_loader=loader``: the same curvature ``G_B`` as stock
    ``FullLaplace`` fitted on B, so the same marglik) against that stock ``FullLaplace``.  Both run
    the same ``--stock-steps`` Adam steps from δ = 1 (stock's steps are ``O(P³)`` each, so only a
    few): the ratio of seconds per step, and the relative difference of the δ reached.  Then
    ``debiased_full`` runs laplace-torch's default 100 steps to its optimum δ*; the gradient
    ``∂ log Z / ∂ log δ`` at δ* is evaluated by both (stock once, ``O(P³)``): equal gradients,
    both small against the scale of ``log Z``, mean the same optimum to Adam's tolerance.  The
    debiased fit (B ≠ B̃) is tuned too, for its own optimum.
(b) **End to end** on the snippet (P = 3,760): ``fit``, ``optimize_prior_precision`` (100 marglik
    steps), GLM probit predictive on 500 test digits, for ``debiased_full`` and stock ``kron``.
(c) **marglik_training**, ``--epochs`` epochs on the snippet model (scalar prior, 10 hyper-steps
    per epoch, one refit per epoch, laplace-torch's default ``AsdlGGN``) for ``debiased_full`` and
    stock ``full``: seconds per epoch.

All times are CPU seconds of this process (``time.process_time``) with one thread: on a machine
shared with other jobs that is the work done, whatever else runs.

Command (writes ``benchmarks/results/marglik_speed.{json,md}``; ``--sections b`` runs (b) only and
keeps the committed results of the others)::

    PYTHONPATH=. OMP_NUM_THREADS=1 nice python benchmarks/marglik_speed.py
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import torch
from laplace import FullLaplace, Laplace, marglik_training
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import laplace_debiased  # noqa: F401  registers the debiased structures
from laplace_debiased.data.digits import digits_splits

RESULTS = Path(__file__).resolve().parent / "results"


def _data() -> dict[str, TensorDataset]:
    splits = digits_splits(n_val=297, n_test=500)
    return {k: TensorDataset(v.tensors[0].flatten(1), v.tensors[1]) for k, v in splits.items()}


def _map_model(hidden: int, train: TensorDataset, steps: int = 300) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, hidden), nn.Tanh(), nn.Linear(hidden, 10))
    X, y = train.tensors
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=1e-4)
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.eval()


def _tune(la, n_steps: int) -> float:
    """Seconds of ``n_steps`` marglik steps (scalar prior, from δ = 1)."""
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.optimize_prior_precision(method="marglik", n_steps=n_steps, lr=0.1, init_prior_prec=1.0)
    return time.process_time() - start


def _log_grad(la) -> float:
    """``∂ log Z / ∂ log δ`` at the current prior precision."""
    log_prior = la.prior_precision.detach().log().requires_grad_()
    (grad,) = torch.autograd.grad(la.log_marginal_likelihood(log_prior.exp()), log_prior)
    return float(grad.sum())


def per_step(hidden: int, data: dict, stock_steps: int) -> dict:
    model = _map_model(hidden, data["train"])
    loader = DataLoader(data["train"], batch_size=32)
    first = DataLoader(Subset(data["train"], range(32)), batch_size=32)
    stock = FullLaplace(model, "classification")
    stock.fit(first)  # stock FullLaplace on B = the first batch
    ours = Laplace(model, "classification", "all", "debiased_full")
    start = time.process_time()
    ours.fit(first, magnitude_loader=first)  # B̃ = B: the same curvature G_B
    fit_s = time.process_time() - start
    t_stock = _tune(stock, stock_steps) / stock_steps
    t_ours_k = _tune(ours, stock_steps)
    same_steps_diff = float((ours.prior_precision - stock.prior_precision).abs().max() / stock.prior_precision.max())
    t_ours = _tune(ours, 100) / 100
    stock.prior_precision = ours.prior_precision.detach().clone()
    stock_grad = _log_grad(stock)  # stock full's marglik gradient at our optimum: one O(P³) evaluation
    debiased = Laplace(model, "classification", "all", "debiased_full")
    debiased.fit(loader)
    _tune(debiased, 100)
    return {
        "hidden": hidden, "n_params": stock.n_params, "stock_steps": stock_steps,
        "stock_full_s_per_step": t_stock, "ours_s_per_step_same_steps": t_ours_k / stock_steps,
        "ours_s_per_step_100": t_ours, "speedup": t_stock / t_ours, "ours_fit_s": fit_s,
        "rel_diff_delta_after_same_steps": same_steps_diff,
        "ours_optimum_delta_100": float(ours.prior_precision), "ours_grad_at_optimum": _log_grad(ours),
        "stock_grad_at_ours_optimum": stock_grad,
        "debiased_optimum_delta_100": float(debiased.prior_precision),
        "debiased_grad_at_optimum": _log_grad(debiased),
        "rank_of_H_debiased": int(debiased.curvature_eigenpairs()[0].shape[1]),
    }


def end_to_end(data: dict, structure: str) -> dict:
    model = _map_model(50, data["train"])
    loader = DataLoader(data["train"], batch_size=32)
    X_test, y_test = data["test"].tensors
    start = time.process_time()
    la = Laplace(model, "classification", "all", structure)
    la.fit(loader)
    fit_s = time.process_time() - start
    tune_s = _tune(la, 100)
    t = time.process_time()
    probs = la(X_test, pred_type="glm", link_approx="probit")
    pred_s = time.process_time() - t
    nll = float(-probs[torch.arange(len(y_test)), y_test].log().mean())
    return {"structure": structure, "fit_s": fit_s, "tune_s": tune_s, "predict_s": pred_s,
            "total_s": time.process_time() - start, "delta": float(la.prior_precision), "test_nll": nll}


def epochs(data: dict, structure: str, n_epochs: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10))
    loader = DataLoader(data["train"], batch_size=32)
    start = time.process_time()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la, _, margliks, _ = marglik_training(
            model, loader, "classification", hessian_structure=structure, n_epochs=n_epochs,
            prior_structure="scalar", optimizer_kwargs={"lr": 1e-2},
        )
    seconds = time.process_time() - start
    return {"structure": structure, "epochs": n_epochs, "s_per_epoch": seconds / n_epochs,
            "final_neg_log_marglik": float(margliks[-1]), "delta": float(la.prior_precision)}


SECTIONS = {"a": "per_step", "b": "end_to_end", "c": "marglik_training"}


def _markdown(res: dict) -> str:
    commands = res["commands"]
    lines = [
        "# Marglik prior tuning: debiased_full (eigenbasis) vs stock full and kron (`benchmarks/marglik_speed.py`)",
        "", f"{res['device']}. CPU seconds of the process; the ratios within a section come from one run "
        "(its command is under its heading).", "",
        "## (a) Per marglik step (scalar prior; B̃ = B, so the same curvature as stock full on B)", "",
        f"`{commands['per_step']}`", "",
        "Both sides run the same k steps from the same start. debiased_full's fit (timed) holds the "
        "eigendecomposition that makes its steps cheap; stock full's fit is not timed, so the ratio with the fit "
        "is a lower bound. The last columns: debiased_full's steps over 100 steps (stock full did not run them).",
        "",
        "| P | k | stock full [s/step] | debiased_full [s/step] | speed-up, same k steps | debiased_full fit [s] "
        "| k steps + our fit against stock's k steps | rel. diff. of δ after the k steps "
        "| debiased_full [s/step], 100 steps | debiased_full optimum δ* (100 steps) "
        "| ∂logZ/∂logδ at δ*: ours, stock full | debiased fit (B ≠ B̃): rank of H, optimum δ |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["per_step"]:
        k, stock, ours = r["stock_steps"], r["stock_full_s_per_step"], r["ours_s_per_step_same_steps"]
        with_fit = r["ours_fit_s"] + k * ours
        lines.append(
            f"| {r['n_params']:,} | {k} | {stock:.3f} | {ours:.5f} | {stock / ours:,.0f}x | {r['ours_fit_s']:.2f} | "
            f"{with_fit:.2f} s vs {k * stock:.1f} s, ≥ {k * stock / with_fit:.0f}x | "
            f"{r['rel_diff_delta_after_same_steps']:.1e} | {r['ours_s_per_step_100']:.5f} | "
            f"{r['ours_optimum_delta_100']:.4g} | {r['ours_grad_at_optimum']:.3e}, {r['stock_grad_at_ours_optimum']:.3e} | "
            f"{r['rank_of_H_debiased']}, {r['debiased_optimum_delta_100']:.4g} |")
    lines += ["", "## (b) laplace-torch's README snippet end to end (P = 3,760; fit, 100 marglik steps, "
              "probit on 500 test digits)", "", f"`{commands['end_to_end']}`", "",
              "The same steps on both sides, but two different posteriors (stock kron's K-FAC on all 1,000 training "
              "digits against debiased_full from its default two batches of 32): compare the test NLL beside the "
              "time.", "",
              "| structure | fit [s] | tune [s] | predict [s] | total [s] | δ | test NLL |", "|---|---|---|---|---|---|---|"]
    for r in res["end_to_end"]:
        lines.append(f"| {r['structure']} | {r['fit_s']:.2f} | {r['tune_s']:.2f} | {r['predict_s']:.2f} | "
                     f"{r['total_s']:.2f} | {r['delta']:.4g} | {r['test_nll']:.3f} |")
    lines += ["", "## (c) marglik_training on the snippet model (scalar prior, 10 hyper-steps per epoch)", "",
              f"`{commands['marglik_training']}`", "",
              "| structure | epochs | s / epoch | final −log marglik | δ |", "|---|---|---|---|---|"]
    for r in res["marglik_training"]:
        lines.append(f"| {r['structure']} | {r['epochs']} | {r['s_per_epoch']:.2f} | "
                     f"{r['final_neg_log_marglik']:.1f} | {r['delta']:.4g} |")
    return "\n".join(lines) + "\n"


def _previous() -> dict:
    """The committed results, so that a run of some sections keeps the others (each with the
    command that produced it)."""
    path = RESULTS / "marglik_speed.json"
    if not path.exists():
        return {"commands": {}}
    res = json.loads(path.read_text())
    command = res.pop("command", "")
    res.setdefault("commands", dict.fromkeys(SECTIONS.values(), command))
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stock-steps", type=int, nargs=2, default=[5, 2],
                        help="stock full's marglik steps for P = 3,760 and P = 9,760")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--sections", default="abc",
                        help="which sections to run (a subset of 'abc'); the others keep their committed results")
    args = parser.parse_args()
    if not set(args.sections) <= set(SECTIONS):
        parser.error(f"--sections takes letters of 'abc', got {args.sections!r}")
    torch.set_num_threads(args.threads)
    data = _data()
    run = {
        "per_step": lambda: [per_step(h, data, k) for h, k in zip((50, 130), args.stock_steps)],
        "end_to_end": lambda: [end_to_end(data, s) for s in ("kron", "debiased_full")],
        "marglik_training": lambda: [epochs(data, s, args.epochs) for s in ("full", "debiased_full")],
    }
    command = (f"PYTHONPATH=. OMP_NUM_THREADS={args.threads} nice python benchmarks/marglik_speed.py "
               f"--stock-steps {args.stock_steps[0]} {args.stock_steps[1]} --epochs {args.epochs} "
               f"--sections {args.sections}")
    res = _previous()
    res["device"] = (f"CPU ({platform.machine()}), torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
                     "a machine shared with other jobs (high load)")
    for letter in sorted(set(args.sections)):
        key = SECTIONS[letter]
        res[key], res["commands"][key] = run[key](), command
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "marglik_speed.json").write_text(json.dumps(res, indent=2))
    (RESULTS / "marglik_speed.md").write_text(_markdown(res))
    print(_markdown(res))


if __name__ == "__main__":
    main()
