"""Single batch against the two-batch K-FAC estimates at equal samples on ``cifar_cnn`` and the real
CIFAR-10: paired draws, each draw cached so that an interrupted run resumes (setting 3 of
``benchmarks/PROTOCOL_V3.md``, run as ``benchmarks/PROTOCOL_V3_CIFAR.md`` states).

    OMP_NUM_THREADS=1 python benchmarks/cifar_cnn_estimators.py --seeds 70000 70064 \\
        --cache ~/.cache/laplace-debiased-study/v3-cifar-cnn [--data DIR] [--batch-sizes 512 1280 2304]

The MAP: the CIFAR-10 benchmark's ``cifar_cnn`` (56,714 weights), trained by
``python -m benchmarks.cifar10.train`` (its defaults: N = 10,000 training images, 60 epochs of Adam
with a cosine schedule, seed 0; trained here when its cache has no model). The test set: 2,000 images,
the first of a permutation of the CIFAR-10 test set by ``numpy.random.default_rng([0, 1])`` (not
those of the benchmark's ``--n-test 2000``, whose generator draws the validation subset first). Each draw ``s`` permutes the N training images (``numpy.random.default_rng(s)``)
and reads its first ``b``: the single batch is all ``b`` (B̃ = B, stock K-FAC), the two-batch estimates
read the same ``b`` as B (first ``b/2``) and B̃ (next ``b/2``), with ``estimator=`` ``"paper"``,
``"corrected"``, ``"shrunk"`` and ``"stein"``. The reference: K-FAC over all N (batches of 500),
fitted and decomposed as the single batch is (:func:`fit_full`). For each fit and prior precision δ in the 15 of ``digits_mlp_estimators.DELTAS``: the test NLL
of the GLM predictive with laplace-torch's probit link (``κ = (1 + π/8 · diag Σ_f)^(-1/2)``, softmax
of ``κ f``), computed by :class:`~laplace_debiased.posterior.grid.GridPredictive` in each fit's
Kronecker eigenbasis. Per draw the results are written to ``CACHE/b<b>/seed<s>.json`` in the format
of ``digits_mlp_estimators.py`` (skipped when present); ``protocol_summary.py --registration 3`` reads them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cifar10.data import load_data  # noqa: E402
from benchmarks.cifar10.fits import fit_kron  # noqa: E402
from benchmarks.cifar10.train import MapConfig, train  # noqa: E402
from benchmarks.digits_mlp_estimators import DELTAS, save_draw  # noqa: E402
from laplace_debiased.kron.laplace import DebiasedKronLaplace  # noqa: E402
from laplace_debiased.posterior.grid import GridPredictive  # noqa: E402

N_TEST = 2000
FULL_BATCH = 500
#: images per chunk of the predictive: larger chunks' buffers exceed glibc's mmap threshold and are
#: paged in afresh each chunk (at 64 the predictive took 1.7× as long, half of it system time)
CHUNK = 16


def test_set(test: TensorDataset, n: int = N_TEST) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` test images of a permutation seeded by 0 (module docstring)."""
    X, y = test.tensors
    idx = np.random.default_rng([0, 1]).permutation(len(y))[:n]
    return X[idx], y[idx]


def test_nll(la, X: torch.Tensor, y: torch.Tensor) -> list[float]:
    """Test NLL of the probit GLM predictive at each δ in ``DELTAS``."""
    probs = GridPredictive(la, chunk_size=CHUNK).grid(X, list(DELTAS), links=("probit",))["probit"]
    picked = probs.double()[:, torch.arange(len(y)), y]
    return [float(v) for v in -picked.clamp(min=torch.finfo(torch.float64).tiny).log().mean(dim=1)]


def fit_full(model, train_set: TensorDataset) -> DebiasedKronLaplace:
    """K-FAC over all of ``train_set`` (B̃ = B = every loader batch of ``FULL_BATCH``): laplace-torch's
    K-FAC, decomposed by the package in float64 as the single batch is (laplace-torch's own float32
    decomposition leaves round-off in the factors' null spaces that the smallest δ reads)."""
    loader = DataLoader(train_set, batch_size=FULL_BATCH)
    la = DebiasedKronLaplace(model, "classification", n_direction_batches=len(loader), n_magnitude_batches=len(loader))
    la.fit(loader, magnitude_loader=loader)
    return la


def fit(model, train_set: TensorDataset, candidate: str, b: int, seed: int):
    """One candidate's fit on draw ``seed`` at ``b`` samples (module docstring)."""
    idx = np.random.default_rng(seed).permutation(len(train_set))[:b]
    if candidate == "single":
        return fit_kron(model, train_set, idx, debiased=False)
    return fit_kron(model, train_set, idx, debiased=True, estimator=candidate)


def run(seeds: list[int], batch_sizes: list[int], cache: Path, data: str | None, cfg: MapConfig = MapConfig(),
        n_test: int = N_TEST) -> None:
    """Every draw of ``seeds`` at every b of ``batch_sizes`` not yet in ``cache``, on the MAP of ``cfg``
    (trained first if its cache has none) and ``n_test`` test images."""
    torch.set_num_threads(1)
    cifar = load_data(data)
    X, y = cifar.train.tensors
    train_set = TensorDataset(X[:cfg.n_train], y[:cfg.n_train])
    model, _ = train(cfg, *train_set.tensors, *cifar.val.tensors, log=lambda s: print(s, flush=True))
    Xt, yt = test_set(cifar.test, n_test)
    reference = cache / "full.json"
    if reference.exists():
        stored = json.loads(reference.read_text())
        if stored.get("images") != len(train_set):
            raise ValueError(f"{reference} is not the K-FAC of all {len(train_set)} training images (it records "
                             f"{stored.get('images', 'no count')}); move it aside and run again to recompute it.")
        ref = stored["nll"]
    else:
        ref = test_nll(fit_full(model, train_set), Xt, yt)
        reference.parent.mkdir(parents=True, exist_ok=True)
        reference.write_text(json.dumps({"deltas": DELTAS, "nll": ref, "images": len(train_set)}) + "\n")
    for seed in seeds:
        for b in batch_sizes:
            path = cache / f"b{b}" / f"seed{seed}.json"
            if path.exists():
                continue
            start = time.perf_counter()
            save_draw(path, b, seed, ref, lambda c: fit(model, train_set, c, b, seed), lambda la: test_nll(la, Xt, yt))
            print(f"{cfg.model} b={b} seed={seed} done ({time.perf_counter() - start:.0f} s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs=2, required=True, metavar=("FIRST", "STOP"),
                        help="the draws' seeds, range(FIRST, STOP)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[512, 1280, 2304])
    parser.add_argument("--cache", type=Path, required=True, help="one JSON per draw (resumes)")
    parser.add_argument("--data", default=None, help="CIFAR-10 root (benchmarks/cifar10/data.py)")
    args = parser.parse_args(argv)
    run(list(range(*args.seeds)), args.batch_sizes, args.cache.expanduser(), args.data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
