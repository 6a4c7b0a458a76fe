"""Where the headline MAP's curvature sits, and how often a mini-batch sees it.

    OMP_NUM_THREADS=1 python benchmarks/curvature_concentration.py [--batch 256] [--threads 1]

For the converged CIFAR-10 MAP of the headline benchmark (``cifar_cnn``, 60 epochs on the seeded
10k training subset, loaded from its cache; trained first if missing) this computes, for every
training point, the trace of its GGN ``tr(J_nᵀ Λ_n J_n)`` over all 56,714 weights
(:func:`benchmarks.concentration.softmax_ggn_traces`; exact per-sample logit
Jacobians of the predictive, in float64), then

* the share of the full-batch GGN trace held by the top 0.1 / 1 / 5 / 10 % of the points;
* the training NLL and accuracy of those points against the rest;
* how a batch of ``--batch`` points samples them (expected count, probability of none).

Writes ``benchmarks/results/curvature_concentration.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cifar10.data import load_data  # noqa: E402
from benchmarks.cifar10.train import MapConfig, train  # noqa: E402
from benchmarks.concentration import batch_coverage, softmax_ggn_traces, top_shares  # noqa: E402
from laplace_debiased.posterior.jacobians import logit_jacobians  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.001, 0.01, 0.05, 0.1)


def per_sample(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, chunk: int) -> dict[str, torch.Tensor]:
    """GGN trace, NLL and correctness of every sample ``(N,)``; the logit Jacobians are the
    predictive's (:func:`~laplace_debiased.posterior.jacobians.logit_jacobians`), summed into one
    ``(n, C, C)`` Gram matrix per chunk."""
    params = list(model.parameters())
    traces, nll, correct = [], [], []
    for xb, yb in zip(X.split(chunk), y.split(chunk)):
        f, jacs = logit_jacobians(model, params, xb)
        gram = sum(j.gram().expand(len(xb), -1, -1) for j in jacs)
        traces.append(softmax_ggn_traces(gram, torch.softmax(f.detach().double(), -1)))
        nll.append(torch.nn.functional.cross_entropy(f.detach().double(), yb, reduction="none"))
        correct.append(f.detach().argmax(-1) == yb)
    return {"trace": torch.cat(traces), "nll": torch.cat(nll), "correct": torch.cat(correct)}


def summarise(s: dict[str, torch.Tensor], batch: int) -> dict:
    n = len(s["trace"])
    order = s["trace"].argsort(descending=True)
    rows = []
    for f, share in top_shares(s["trace"], FRACTIONS).items():
        k = max(1, round(f * n))
        top, rest = order[:k], order[k:]
        rows.append({"fraction": f, "points": k, "trace_share": share,
                     "nll_top": float(s["nll"][top].mean()), "nll_rest": float(s["nll"][rest].mean()),
                     "misclassified_top": int((~s["correct"][top]).sum()), **batch_coverage(k, n, batch)})
    return {"n_train": n, "batch": batch, "misclassified": int((~s["correct"]).sum()),
            "train_nll": float(s["nll"].mean()), "rows": rows}


def markdown(r: dict, command: str) -> str:
    L = ["# Where the curvature of the converged CIFAR-10 MAP sits", "",
         f"`{command}` ({r['seconds']:.0f} s). `cifar_cnn` MAP of the headline benchmark, {r['n_train']:,} "
         f"training points (train NLL {r['train_nll']:.4f}, {r['misclassified']} misclassified); per-point "
         f"GGN trace over all weights. Batch: {r['batch']} points drawn without replacement.", "",
         "| top points by GGN trace | points | share of the full-batch GGN trace | mean train NLL: top / rest "
         "| misclassified among them | expected in a batch | P(batch has none) |",
         "|---|---|---|---|---|---|---|"]
    for row in r["rows"]:
        L.append(f"| {100 * row['fraction']:g} % | {row['points']:,} | {100 * row['trace_share']:.1f} % | "
                 f"{row['nll_top']:.3f} / {row['nll_rest']:.5f} | {row['misclassified_top']} | "
                 f"{row['expected']:.2f} | {100 * row['p_none']:.1f} % |")
    return "\n".join(L) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=50)
    ap.add_argument("--data", default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = load_data(args.data)
    cfg = MapConfig()
    X, y = (t[: cfg.n_train] for t in data.train.tensors)
    model, _ = train(cfg, X, y, *data.val.tensors)
    r = summarise(per_sample(model.eval().double(), X.double(), y, args.chunk), args.batch)
    r["seconds"] = time.perf_counter() - start
    command = "OMP_NUM_THREADS=1 python benchmarks/curvature_concentration.py" + "".join(f" {a}" for a in sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "curvature_concentration.json").write_text(json.dumps({"command": command, **r}, indent=1))
    (args.out / "curvature_concentration.md").write_text(markdown(r, command))
    print(markdown(r, command))


if __name__ == "__main__":
    main()
