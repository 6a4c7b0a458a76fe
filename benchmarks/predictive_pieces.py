"""The grid predictive's time per input with and without pieces (``GridPredictive`` computes a
chunk's variances in pieces of at most ``PIECE_BYTES`` of per-row Jacobian parts), on ``cifar_cnn``.

    OMP_NUM_THREADS=1 python benchmarks/predictive_pieces.py [--inputs 512] [--chunks 16 64 256]

``cifar_cnn`` (56,714 weights; random weights and inputs, which the cost does not depend on),
``debiased_kron`` fitted on 2 × 128 random images; then the probit predictive of ``--inputs``
images at 15 prior precisions, per chunk size once with the package's pieces and once with one piece
per chunk (``PIECE_BYTES`` above any chunk). Reported per input: wall time and the process's user
and system CPU time (``resource.getrusage``); system time is where buffers larger than glibc's mmap
threshold go, paged in afresh per chunk. Writes ``results/predictive_pieces.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from laplace_debiased.evaluation.models import cifar_cnn  # noqa: E402
from laplace_debiased.kron.laplace import DebiasedKronLaplace  # noqa: E402
from laplace_debiased.posterior import grid as grid_module  # noqa: E402

HERE = Path(__file__).resolve().parent
DELTAS = [float(d) for d in np.logspace(-4, 3, 15)]


def timed(fn) -> dict[str, float]:
    """Wall, user and system seconds of ``fn()``."""
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    fn()
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
    return {"wall": wall, "user": after.ru_utime - before.ru_utime, "sys": after.ru_stime - before.ru_stime}


def run(n_inputs: int, chunks: list[int]) -> dict:
    torch.manual_seed(0)
    model = cifar_cnn().eval()
    X = torch.randn(256, 3, 32, 32)
    y = torch.randint(0, 10, (256,))
    la = DebiasedKronLaplace(model, "classification", estimator="paper")
    la.fit(DataLoader(TensorDataset(X, y), batch_size=128))
    X_test = torch.randn(n_inputs, 3, 32, 32)
    rows = []
    default = grid_module.PIECE_BYTES
    for chunk in chunks:
        pred = grid_module.GridPredictive(la, chunk_size=chunk)
        pred.grid(X_test[:chunk], DELTAS, links=("probit",))  # warm-up
        for label, budget in (("pieces", default), ("whole chunk", 2**62)):
            grid_module.PIECE_BYTES = budget
            try:
                t = timed(lambda: pred.grid(X_test, DELTAS, links=("probit",)))
            finally:
                grid_module.PIECE_BYTES = default
            rows.append({"chunk": chunk, "mode": label, **{k: 1000 * v / n_inputs for k, v in t.items()}})
    return {"command": "OMP_NUM_THREADS=1 python benchmarks/predictive_pieces.py " + " ".join(sys.argv[1:]),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} thread(s); 1-minute load average {os.getloadavg()[0]:.1f}",
            "piece_bytes": default, "inputs": n_inputs, "deltas": len(DELTAS), "rows": rows}


def markdown(res: dict) -> str:
    lines = [f"Command: `{res['command']}` (one run; {res['machine']}).", "",
             f"Probit predictive of `cifar_cnn` (`debiased_kron`) on {res['inputs']} inputs at {res['deltas']} "
             f"prior precisions, per input. Pieces: at most {res['piece_bytes'] // 2**20} MiB of per-row "
             "Jacobian parts at a time; whole chunk: one piece per chunk.", "",
             "| chunk | mode | wall [ms/input] | user CPU [ms/input] | system CPU [ms/input] |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['chunk']} | {r['mode']} | {r['wall']:.2f} | {r['user']:.2f} | {r['sys']:.2f} |" for r in res["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", type=int, default=512)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 256])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    res = run(args.inputs, args.chunks)
    (HERE / "results" / "predictive_pieces.json").write_text(json.dumps(res, indent=1) + "\n")
    text = markdown(res)
    (HERE / "results" / "predictive_pieces.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
