"""Shared set-up of the CIFAR-10 benchmarks: data, the 45k/5k split, the MAP model.

Used by ``benchmarks/cifar10_laplace.py`` (engineer G) and ``benchmarks/cg_figure5.py``
(engineer D), so that both run on the same trained network, cached on disk after the first run.

Data location, first match wins: the ``--data`` argument, ``$LAPLACE_DEBIASED_DATA``,
``~/.cache/laplace-debiased/data``.  If the official binary layout
(``<root>/cifar-10-batches-bin/``) is missing there, it is built from ``../shared/data``
(beside the repository) with ``build_cifar10.py``.

Conventions: model inputs are float32 ``(N, 3, 32, 32)``, ``(pixel/255 - mean)/std`` with the
standard CIFAR-10 channel statistics; labels int64 ``(N,)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import TensorDataset

from laplace_debiased.data.cifar import cifar_splits
from laplace_debiased.evaluation.models import cifar_cnn
from laplace_debiased.evaluation.training import TrainConfig, train_map

REPO = Path(__file__).resolve().parents[1]
SHARED_BUILDER = REPO.parent / "shared" / "data" / "build_cifar10.py"
DEFAULT_DATA = Path.home() / ".cache" / "laplace-debiased" / "data"
N_VAL = 5000
SPLIT_SEED = 0

#: Training of the benchmark MAP: Adam, cosine schedule to zero, weak L2 (prior precision 1e-4
#: per data point, i.e. 4.5 on the summed loss), no augmentation. 12 epochs is what the shared
#: 2-core CPU allowed (about 40 minutes under load); the history records train vs validation NLL.
FULL_TRAIN = TrainConfig(epochs=12, lr=2e-3, weight_decay=1e-4, batch_size=128, seed=0)
#: ``--quick``: a few epochs on a subset -- only to exercise the pipeline.
QUICK_TRAIN = TrainConfig(epochs=3, lr=2e-3, weight_decay=1e-4, batch_size=128, seed=0)
QUICK_N_TRAIN = 10000


def data_root(arg: str | Path | None = None) -> Path:
    """Resolve the CIFAR-10 root and build the binary layout there if it is missing."""
    root = Path(arg or os.environ.get("LAPLACE_DEBIASED_DATA") or DEFAULT_DATA).expanduser()
    if (root / "cifar-10-batches-bin" / "test_batch.bin").is_file():
        return root
    if not SHARED_BUILDER.is_file():
        raise FileNotFoundError(
            f"no CIFAR-10 binary layout under {root}/cifar-10-batches-bin and no builder at "
            f"{SHARED_BUILDER}; pass --data DIR (or set LAPLACE_DEBIASED_DATA) to a folder holding "
            "cifar-10-batches-bin/, or put the project's shared/ folder beside the repository."
        )
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(SHARED_BUILDER), str(root)], check=True)
    return root


@dataclass
class CifarData:
    """The benchmark's data as tensors, and the root it was read from.

    ``train``/``val``/``test``: ``TensorDataset`` of normalised float32 ``(N, 3, 32, 32)`` images
    and int64 labels; ``root`` holds ``cifar-10-batches-bin/`` (for
    :func:`laplace_debiased.data.resolve_eval_set`, e.g. the generated corrupted test sets).
    """

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    root: Path


def load_data(root: str | Path | None = None, *, n_train: int | None = None) -> CifarData:
    """The seeded 45k/5k train/val split of the CIFAR-10 training set, and the test set.

    Read with :func:`laplace_debiased.data.cifar_splits` (``n_val=5000``, seed 0, the standard
    CIFAR-10 per-channel normalisation).  ``n_train`` keeps the first ``n_train`` training images
    (``--quick``).
    """
    root = data_root(root)
    splits = cifar_splits(root, n_val=N_VAL, seed=SPLIT_SEED)
    train = splits["train"]
    if n_train is not None:
        train = train.subset(np.arange(min(n_train, len(train))))
    return CifarData(
        train=TensorDataset(*train.tensors()),
        val=TensorDataset(*splits["val"].tensors()),
        test=TensorDataset(*splits["test"].tensors()),
        root=root,
    )


def trained_model(data: CifarData, *, quick: bool = False, log=print) -> tuple[nn.Module, list[dict]]:
    """The benchmark's MAP network (``cifar_cnn``), trained or loaded from the on-disk cache."""
    config = QUICK_TRAIN if quick else FULL_TRAIN
    tag = "cifar_cnn-quick" if quick else "cifar_cnn"
    return train_map(cifar_cnn(), data.train, config, val_set=data.val, tag=tag, log=log)


if __name__ == "__main__":  # train (or load) the benchmark model: python benchmarks/_cifar_common.py
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    d = load_data(args.data, n_train=QUICK_N_TRAIN if args.quick else None)
    model, _ = trained_model(d, quick=args.quick, log=lambda s: print(s, flush=True))
    from laplace_debiased.evaluation.training import evaluate_loss
    from torch.utils.data import DataLoader

    print("test", evaluate_loss(model, DataLoader(d.test, batch_size=1000)), flush=True)
