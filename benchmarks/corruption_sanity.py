"""Sanity check of the corruption generator: a trained model's accuracy falls with severity.

    python benchmarks/corruption_sanity.py [--data DIR] [--out DIR] [--n-train 20000]
                                           [--epochs 4] [--n-eval 2000] [--seed 0] [--threads 1]

Trains ``cifar_cnn`` (cached by :func:`laplace_debiased.evaluation.training.train_map`) on the seeded
CIFAR-10 training split, then measures its accuracy on the first ``n_eval`` test images
corrupted by each of the 15 generated corruptions at severities 1-5
(:func:`laplace_debiased.data.corruptions.corrupt`).  Checks, per corruption, that accuracy is
non-increasing in severity up to sampling noise (a rise of more than two binomial standard errors
counts as a violation) and that the mean over corruptions falls strictly with severity.  Writes
``corruption_sanity.json`` and ``corruption_sanity.md`` to ``--out`` (default
``<cache dir>/benchmarks``).  Needs the real CIFAR-10 binary version (``cifar-10-binary.tar.gz`` from
https://www.cs.toronto.edu/~kriz/cifar.html, unpacked into DIR) and ``--data DIR`` (or
``$LAPLACE_DEBIASED_DATA``).
Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from laplace_debiased.data.cifar import cifar_splits
from laplace_debiased.data.corruptions import CORRUPTIONS, corrupt
from laplace_debiased.data.images import ImageDataset
from laplace_debiased.evaluation.models import cifar_cnn
from laplace_debiased.evaluation.training import TrainConfig, train_map
from laplace_debiased.paths import default_cache_dir


@torch.no_grad()
def accuracy(model: torch.nn.Module, images: np.ndarray, labels: np.ndarray, ref: ImageDataset) -> float:
    """Accuracy on uint8 ``(N, 32, 32, 3)`` images, normalised like ``ref``."""
    x, y = ImageDataset(images, labels, mean=ref.mean, std=ref.std).tensors()
    correct = sum((model(x[i : i + 1000]).argmax(1) == y[i : i + 1000]).sum().item()
                  for i in range(0, len(y), 1000))  # fmt: skip
    return correct / len(y)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", default=None, help="directory holding cifar-10-batches-bin/")
    parser.add_argument("--out", default=None, help="output directory (JSON + Markdown)")
    parser.add_argument("--n-train", type=int, default=20000)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--n-eval", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: 1)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    out = Path(args.out) if args.out else default_cache_dir() / "benchmarks"
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()

    splits = cifar_splits(args.data, seed=args.seed)
    train = splits["train"].subset(np.arange(min(args.n_train, len(splits["train"]))))
    config = TrainConfig(epochs=args.epochs, lr=2e-3, weight_decay=1e-4, batch_size=128, seed=args.seed)
    torch.manual_seed(args.seed)
    model, _ = train_map(cifar_cnn(), train, config, tag="corruption-sanity")
    model.eval()

    test = splits["test"]
    images, labels = test.uint8(slice(0, args.n_eval)), test.labels[: args.n_eval]
    clean = accuracy(model, images, labels, test)
    table = {}
    for name in CORRUPTIONS:
        table[name] = [accuracy(model, corrupt(images, name, s, args.seed), labels, test)
                       for s in range(1, 6)]  # fmt: skip
        print(f"{name:18s}", " ".join(f"{a:.3f}" for a in table[name]), flush=True)

    se = 2 * np.sqrt(0.25 / len(labels))  # two binomial standard errors (worst case p = 1/2)
    violations = {name: [s + 2 for s in range(4) if acc[s + 1] > acc[s] + se]
                  for name, acc in table.items()}  # fmt: skip
    mean = np.mean([table[n] for n in CORRUPTIONS], axis=0)
    checks = {
        "mean_strictly_decreasing": bool(np.all(np.diff(mean) < 0)),
        "severity1_below_clean": bool(mean[0] < clean),
        "corruptions_with_violations": {n: v for n, v in violations.items() if v},
    }
    ok = checks["mean_strictly_decreasing"] and checks["severity1_below_clean"] and not any(
        violations.values()
    )
    result = {
        "config": vars(args) | {"tolerance": se}, "clean_accuracy": clean, "accuracy": table,
        "mean_accuracy": mean.tolist(), "checks": checks, "passed": ok,
        "seconds": round(time.time() - start, 1),
    }  # fmt: skip
    (out / "corruption_sanity.json").write_text(json.dumps(result, indent=2))
    command = (f"OMP_NUM_THREADS={args.threads} python benchmarks/corruption_sanity.py --n-train {args.n_train} "
               f"--epochs {args.epochs} --n-eval {args.n_eval} --seed {args.seed} --threads {args.threads}")
    lines = [
        f"Written by `{command}` (with `--data DIR`, the real CIFAR-10's binary layout; "
        f"{result['seconds']:.0f} s including the training).",
        "",
        f"Accuracy of cifar_cnn ({args.n_train} training images, {args.epochs} epochs) on the "
        f"first {args.n_eval} CIFAR-10 test images; clean accuracy {clean:.3f}.",
        "",
        "| corruption | s=1 | s=2 | s=3 | s=4 | s=5 |",
        "|---|---|---|---|---|---|",
        *(f"| {n} | " + " | ".join(f"{a:.3f}" for a in table[n]) + " |" for n in CORRUPTIONS),
        "| **mean** | " + " | ".join(f"**{a:.3f}**" for a in mean) + " |",
        "",
        f"Checks (tolerance {se:.3f}): {json.dumps(checks)} -> {'PASS' if ok else 'FAIL'}",
    ]
    (out / "corruption_sanity.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out / 'corruption_sanity.json'} and .md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
