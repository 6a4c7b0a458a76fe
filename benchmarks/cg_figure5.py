"""Figure 5 of Tatzel et al. (ICLR 2025) on real CIFAR-10: single-batch vs debiased CG.

From the trained benchmark CNN (``laplace_debiased.evaluation.models.cifar_cnn``, the MAP network of
``benchmarks/_cifar_common.py``, shared cache with the headline benchmark) we run ``K`` CG
iterations on the undamped quadratic ``q(θ; B) = mean CE on B + β/2‖θ‖²`` (GGN curvature,
β = the training weight decay):

- **single-batch**: CG on one batch of ``2b`` training points; iterates θ₀ + x_p;
- **debiased**: the same ``2b`` points split into B (``b``, gives the directions) and B̃ (``b``,
  re-measures the step sizes), :func:`laplace_debiased.optim.cg.debiased_cg`; iterates θ₀ + x̃_p.

Both use the same data and the same number of curvature-vector products per iteration on
``2b`` points. Along each trajectory we evaluate the mean cross-entropy and accuracy on fixed
subsets of the training and test sets (sizes in the output). Repeated with independent batches.

Outputs ``benchmarks/results/cg_figure5{,_quick}.{json,md,png}``.

    nice python benchmarks/cg_figure5.py            # full: b=256, K=30, 5 repeats (~7 min)
    nice python benchmarks/cg_figure5.py --quick    # quick model, b=64, K=10, 2 repeats
    nice python benchmarks/cg_figure5.py --model quick   # full settings on the quick model
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cifar_common as common  # noqa: E402

from laplace_debiased.optim.cg import cg, debiased_cg  # noqa: E402
from laplace_debiased.curvature.operators import flat_params, mini_batch_quadratic, trainable_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("single-batch", "debiased")
CURVES = ("train_loss", "train_acc", "test_loss", "test_acc")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small model/batches, a few minutes")
    p.add_argument("--data", default=None, help="CIFAR-10 root (see _cifar_common.py)")
    p.add_argument("--model", choices=("full", "quick"), default=None,
                   help="which cached MAP network of _cifar_common.py: 'full' (FULL_TRAIN on 45k "
                        "images) or 'quick' (QUICK_TRAIN on 10k); default follows --quick")
    p.add_argument("--b", type=int, default=None, help="half batch size b (default 256; quick 64)")
    p.add_argument("--iters", type=int, default=None, help="CG iterations K (30; quick 10)")
    p.add_argument("--repeats", type=int, default=None, help="independent repeats (5; quick 2)")
    p.add_argument("--n-eval", type=int, default=None,
                   help="train and test points evaluated per iterate (1000; quick 500)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="output stem (default results/cg_figure5[_quick])")
    args = p.parse_args(argv)
    q = args.quick
    args.b = args.b or (64 if q else 256)
    args.iters = args.iters or (10 if q else 30)
    args.repeats = args.repeats or (2 if q else 5)
    args.n_eval = args.n_eval or (500 if q else 1000)
    args.model = args.model or ("quick" if q else "full")
    stem = "cg_figure5" + ("_quick" if q else "")
    if args.model != ("quick" if q else "full"):
        stem += f"_{args.model}_model"
    args.out = Path(args.out) if args.out else RESULTS / stem
    return args


def set_params(params: list[nn.Parameter], theta: torch.Tensor) -> None:
    """Write the flat vector ``theta`` into ``params`` (in place)."""
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(theta[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


@torch.no_grad()
def evaluate(model: nn.Module, X: torch.Tensor, y: torch.Tensor, chunk: int = 500) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on ``(X, y)``."""
    loss, correct = 0.0, 0
    for i in range(0, len(y), chunk):
        out = model(X[i : i + chunk])
        loss += float(nn.functional.cross_entropy(out, y[i : i + chunk], reduction="sum"))
        correct += int((out.argmax(-1) == y[i : i + chunk]).sum())
    return loss / len(y), correct / len(y)


def trajectory_metrics(model, params, theta0, iterates, evals) -> dict[str, list[float]]:
    """Loss/accuracy on the train and test subsets at θ₀ + x_p for every iterate ``x_p``."""
    curves = {k: [] for k in CURVES}
    for x in iterates:
        set_params(params, theta0 + x)
        for split, (X, y) in evals.items():
            loss, acc = evaluate(model, X, y)
            curves[f"{split}_loss"].append(loss if math.isfinite(loss) else None)
            curves[f"{split}_acc"].append(acc)
    set_params(params, theta0)
    return curves


def subset(ds, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randperm(len(ds), generator=torch.Generator().manual_seed(seed))[:n]
    X, y = ds.tensors
    return X[idx], y[idx]


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    quick_model = args.model == "quick"
    data = common.load_data(args.data, n_train=common.QUICK_N_TRAIN if quick_model else None)
    model, history = common.trained_model(data, quick=quick_model,
                                          log=lambda s: print(s, flush=True))
    config = common.QUICK_TRAIN if quick_model else common.FULL_TRAIN
    beta, loss_func = config.weight_decay, nn.CrossEntropyLoss()
    params = trainable_params(model)
    theta0 = flat_params(params)
    evals = {"train": subset(data.train, args.n_eval, 1), "test": subset(data.test, args.n_eval, 2)}
    Xtr, ytr = data.train.tensors
    b, K = args.b, args.iters

    repeats = []
    for r in range(args.repeats):
        t0 = time.perf_counter()
        idx = torch.randperm(len(ytr), generator=torch.Generator().manual_seed(100 + r))[: 2 * b]
        X, y = Xtr[idx], ytr[idx]
        kw = dict(max_iter=K, rtol=0.0)
        q2b = mini_batch_quadratic(model, loss_func, [(X, y)], "ggn", beta)
        single = cg(q2b.curvature, -q2b.gradient, **kw)
        qB = mini_batch_quadratic(model, loss_func, [(X[:b], y[:b])], "ggn", beta)
        qBt = mini_batch_quadratic(model, loss_func, [(X[b:], y[b:])], "ggn", beta)
        deb = debiased_cg(qB.curvature, -qB.gradient, qBt.curvature, -qBt.gradient, **kw)
        t_cg = time.perf_counter() - t0
        row = {
            "seed": 100 + r,
            "cg_seconds": t_cg,
            "reason": {"single-batch": single.reason, "debiased": deb.reason},
            "step_sizes": {"single-batch": single.step_sizes.tolist(),
                           "debiased": deb.step_sizes.tolist(),
                           "debiased_directions_cg": deb.cg.step_sizes.tolist()},
            "curvatures": {"single-batch": single.curvatures.tolist(),
                           "debiased": deb.curvatures.tolist(),
                           "debiased_directions_cg": deb.cg.curvatures.tolist()},
            "products": {"single-batch": q2b.curvature.n_products,
                         "debiased": qB.curvature.n_products + qBt.curvature.n_products},
            "curves": {
                "single-batch": trajectory_metrics(model, params, theta0, single.iterates, evals),
                "debiased": trajectory_metrics(model, params, theta0, deb.iterates, evals),
            },
        }
        row["seconds"] = time.perf_counter() - t0
        repeats.append(row)
        c = row["curves"]
        print(f"repeat {r}: cg {t_cg:.0f}s total {row['seconds']:.0f}s | test loss "
              f"single {fmt(c['single-batch']['test_loss'][-1])} "
              f"debiased {fmt(c['debiased']['test_loss'][-1])} (start {c['debiased']['test_loss'][0]:.3f})",
              flush=True)

    out = {
        "config": {
            "quick": args.quick, "b": b, "single_batch_size": 2 * b, "K": K,
            "repeats": args.repeats, "curvature": "ggn", "damping": 0.0, "beta": beta,
            "n_eval_train": args.n_eval, "n_eval_test": args.n_eval,
            "n_params": theta0.numel(), "n_train": len(ytr), "threads": args.threads,
            "model": f"cifar_cnn ({args.model} MAP of _cifar_common.py)",
            "train_config": config.__dict__, "train_history_last": history[-1] if history else None,
        },
        "repeats": repeats,
        "summary": summarise(repeats),
        "seconds": time.perf_counter() - t_start,
    }
    return out


def fmt(v) -> str:
    return "inf/nan" if v is None else f"{v:.3f}"


def _arr(vals) -> np.ndarray:
    return np.array([np.inf if v is None else v for v in vals], dtype=float)


def summarise(repeats: list[dict]) -> dict:
    """Per method: start, final, best (and where) of each curve, medians over repeats."""
    summary = {}
    for m in METHODS:
        s = {}
        for k in CURVES:
            A = np.stack([_arr(r["curves"][m][k]) for r in repeats])  # [R, K+1]
            best = A.argmax(1) if k.endswith("acc") else A.argmin(1)
            s[k] = {
                "start": float(np.median(A[:, 0])),
                "final_median": float(np.median(A[:, -1])),
                "final_min": float(A[:, -1].min()),
                "final_max": float(A[:, -1].max()),
                "best_median": float(np.median(A[np.arange(len(A)), best])),
                "best_iteration_median": float(np.median(best)),
            }
        A = np.stack([_arr(r["curves"][m]["train_loss"]) for r in repeats])
        # how far the trajectory ends above (>1) or below (<1) where it started
        s["final_over_start_train_loss_median"] = float(np.median(A[:, -1] / A[:, 0]))
        s["n_final_above_start"] = int(((A[:, -1] > A[:, 0]) | ~np.isfinite(A[:, -1])).sum())
        tau = np.stack([np.asarray(r["step_sizes"][m]) for r in repeats])  # [R, K]
        s["sum_abs_step_sizes_median"] = float(np.median(np.abs(tau).sum(1)))
        s["fraction_negative_step_sizes"] = float((tau < 0).mean())
        s["n_repeats"] = len(repeats)
        summary[m] = {k: (_json_float(v) if not isinstance(v, dict) else
                          {kk: _json_float(vv) for kk, vv in v.items()}) for k, v in s.items()}
    return summary


def _json_float(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


def markdown(out: dict) -> str:
    c = out["config"]
    lines = [
        f"# CG on mini-batch quadratics, CIFAR-10 (paper Fig. 5){' — quick' if c['quick'] else ''}",
        "",
        f"{c['model']}, {c['n_params']} parameters, trained on {c['n_train']} images; GGN, no damping, "
        f"β = {c['beta']:g}, K = {c['K']} CG iterations, {c['repeats']} repeats. Single-batch: "
        f"one batch of {c['single_batch_size']}; debiased: the same points as two batches of "
        f"{c['b']} (directions / step sizes). Metrics on {c['n_eval_train']} training and "
        f"{c['n_eval_test']} test points; medians over repeats (final: min–max).",
        "",
        "| method | metric | θ₀ | final (median) | final (min–max) | best (median) | best at iteration |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in METHODS:
        s = out["summary"][m]
        for k in CURVES:
            v = s[k]
            lines.append(
                f"| {m} | {k} | {fmt(v['start'])} | {fmt(v['final_median'])} | "
                f"{fmt(v['final_min'])}–{fmt(v['final_max'])} | {fmt(v['best_median'])} | "
                f"{v['best_iteration_median']:.0f} |"
            )
    lines += ["", "Final training loss / θ₀'s (median; repeats ending above θ₀): " + ", ".join(
        f"{m} {fmt(out['summary'][m]['final_over_start_train_loss_median'])} "
        f"({out['summary'][m]['n_final_above_start']}/{out['summary'][m]['n_repeats']})"
        for m in METHODS
    ) + ". Σ_p |τ_p| along the unit directions (median): " + ", ".join(
        f"{m} {out['summary'][m]['sum_abs_step_sizes_median']:.2f} "
        f"({100 * out['summary'][m]['fraction_negative_step_sizes']:.0f}% of τ_p < 0)"
        for m in METHODS
    ) + f". Total time {out['seconds']:.0f} s ({c['threads']} thread(s)).", ""]
    return "\n".join(lines)


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    colors = {"single-batch": "tab:red", "debiased": "tab:blue"}
    for ax, k in zip(axes, CURVES):
        for m in METHODS:
            A = np.stack([_arr(r["curves"][m][k]) for r in out["repeats"]])
            A = np.where(np.isfinite(A), A, np.nan)
            it = np.arange(A.shape[1])
            for row in A:
                ax.plot(it, row, color=colors[m], alpha=0.25, lw=0.8)
            ax.plot(it, np.nanmedian(A, 0), color=colors[m], lw=2, label=m)
        ax.set_xlabel("CG iteration")
        ax.set_title(k.replace("_", " "))
        if k.endswith("loss"):
            ax.set_yscale("log")
    axes[0].legend()
    c = out["config"]
    fig.suptitle(f"CIFAR-10 {c['model']}, GGN, no damping: single batch {c['single_batch_size']} "
                 f"vs debiased {c['b']}+{c['b']} ({c['repeats']} repeats)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    out = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(out, indent=1, allow_nan=False))
    args.out.with_suffix(".md").write_text(markdown(out))
    plot(out, args.out.with_suffix(".png"))
    print(markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
