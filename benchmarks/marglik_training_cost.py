"""Cost of laplace-torch's ``marglik_training`` with ``debiased_full`` against stock ``full`` and
``kron``, on laplace-torch's regression snippet.

Setting (laplace-torch's ``examples/regression_example.md``): 150 points of ``sin(x) + 0.3·ε`` on
``x ∈ [0, 8]``, one loader batch of 150, ``Linear(1, 50) - Tanh - Linear(50, 1)`` (151 weights, all
weights), ``BackPackGGN``, ``prior_structure="scalar"``, Adam lr 1e-2, ``--epochs`` epochs
(laplace-torch's default 10 hyper-steps per epoch). Each structure trains the same seeded model
on the same data, in one process, one after the other, with ``torch.set_num_threads(--threads)``.

Measured: CPU seconds of the process (``time.process_time``) for the whole ``marglik_training``
call, and wall seconds. On a shared machine the CPU time is the comparable figure. With 1 thread it
is the work done, whatever else runs. Reported: the ratio of every structure's CPU time to stock
``full``'s, and the final negative log marginal likelihood.

Command (writes ``benchmarks/results/marglik_training_cost.{json,md}``)::

    OMP_NUM_THREADS=1 nice python benchmarks/marglik_training_cost.py --epochs 1000 --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import warnings
from pathlib import Path

import torch
from laplace import marglik_training
from laplace.curvature import BackPackGGN
from torch.utils.data import DataLoader, TensorDataset

import laplace_debiased  # noqa: F401  registers the debiased structures

RESULTS = Path(__file__).resolve().parent / "results"
STRUCTURES = ["full", "kron", "debiased_full"]


def _snippet(seed: int = 711) -> tuple[torch.nn.Module, DataLoader]:
    """laplace-torch's sinusoid regression data and single-hidden-layer tanh network."""
    torch.manual_seed(seed)
    X = (torch.rand(150) * 8).unsqueeze(-1)
    y = torch.sin(X) + torch.randn_like(X) * 0.3
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(1, 50), torch.nn.Tanh(), torch.nn.Linear(50, 1))
    return model, DataLoader(TensorDataset(X, y), batch_size=150)


def _run(structure: str, epochs: int) -> dict:
    model, loader = _snippet()
    cpu, wall = time.process_time(), time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la, _, margliks, _ = marglik_training(
            model=model, train_loader=loader, likelihood="regression", hessian_structure=structure,
            backend=BackPackGGN, n_epochs=epochs, optimizer_kwargs={"lr": 1e-2}, prior_structure="scalar",
        )
    return {"structure": structure, "cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall,
            "neg_log_marglik": float(margliks[-1]), "sigma_noise": float(la.sigma_noise),
            "prior_precision": float(la.prior_precision)}


def _markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# marglik_training cost: debiased_full vs stock full and kron",
        "",
        f"`{meta['command']}`. The snippet: {meta['setting']}. Host {meta['host']}, torch {meta['torch']},",
        f"{meta['threads']} thread(s), on a shared machine. CPU time is the process's own.",
        "",
        "| structure | CPU time [s] | CPU / stock full | wall [s] | final −log marglik | σ | δ |",
        "|---|---|---|---|---|---|---|",
    ]
    full = next(r for r in rows if r["structure"] == "full")["cpu_s"]
    for r in rows:
        lines.append(f"| {r['structure']} | {r['cpu_s']:.1f} | {r['cpu_s'] / full:.2f} | {r['wall_s']:.1f} | "
                     f"{r['neg_log_marglik']:.2f} | {r['sigma_noise']:.3f} | {r['prior_precision']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "marglik_training_cost")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for structure in STRUCTURES:
        rows.append(_run(structure, args.epochs))
        print(json.dumps(rows[-1]), flush=True)
    meta = {"command": f"OMP_NUM_THREADS=1 nice python benchmarks/marglik_training_cost.py --epochs {args.epochs} "
                       f"--threads {args.threads}",
            "setting": f"150 points, one batch, Linear(1,50)-Tanh-Linear(50,1), BackPackGGN, scalar prior, "
                       f"{args.epochs} epochs",
            "host": platform.machine(), "torch": torch.__version__, "threads": args.threads}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(_markdown(meta, rows))


if __name__ == "__main__":
    main()
