"""Shared set-up of the CIFAR-10 benchmarks: data, the 45k/5k split, normalisation, the MAP model.

Used by ``benchmarks/cifar10_laplace.py`` (engineer G) and ``benchmarks/cg_figure5.py``
(engineer D), so that both run on the same trained network, cached on disk after the first run.

Data location, first match wins: the ``--data`` argument, ``$LAPLACE_DEBIASED_DATA``,
``~/.cache/laplace-debiased/data``.  If the official binary layout
(``<root>/cifar-10-batches-bin/``) is missing there, it is built from ``../shared/data``
(beside the repository) with ``build_cifar10.py``.

Conventions: images are float32 ``(N, 3, 32, 32)``, scaled to [0, 1] and normalised per channel
with the mean/std of the 45k training split; labels int64 ``(N,)``.
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

from laplace_debiased.models import cifar_cnn
from laplace_debiased.training import TrainConfig, train_map

REPO = Path(__file__).resolve().parents[1]
SHARED_BUILDER = REPO.parent / "shared" / "data" / "build_cifar10.py"
DEFAULT_DATA = Path.home() / ".cache" / "laplace-debiased" / "data"
N_VAL = 5000
SPLIT_SEED = 0

#: Training of the benchmark MAP: Adam, cosine schedule, weak L2 (prior precision 1e-4 per
#: data point, i.e. 4.5 on the summed loss), long enough to overfit (train NLL << test NLL).
FULL_TRAIN = TrainConfig(epochs=40, lr=1e-3, weight_decay=1e-4, batch_size=128, seed=0)
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


def _read_bin(path: Path) -> tuple[np.ndarray, np.ndarray]:
    raw = np.fromfile(path, dtype=np.uint8).reshape(-1, 1 + 3072)
    return raw[:, 1:].reshape(-1, 3, 32, 32), raw[:, 0].astype(np.int64)


def load_uint8(root: Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 ``(N, 3, 32, 32)`` and labels int64 of ``split`` ('train' or 'test')."""
    base = root / "cifar-10-batches-bin"
    names = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    parts = [_read_bin(base / n) for n in names]
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


@dataclass
class CifarData:
    """The benchmark's data: normalised train/val/test sets plus what is needed to corrupt."""

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    test_uint8: np.ndarray  # (10000, 3, 32, 32), for generated corruptions
    test_labels: np.ndarray
    mean: torch.Tensor  # (3,) in [0, 1] units
    std: torch.Tensor

    def normalise(self, images_uint8: np.ndarray) -> torch.Tensor:
        """uint8 ``(N, 3, 32, 32)`` -> normalised float32 tensor of the same shape."""
        x = torch.as_tensor(np.ascontiguousarray(images_uint8), dtype=torch.float32) / 255.0
        return (x - self.mean.view(1, 3, 1, 1)) / self.std.view(1, 3, 1, 1)


def load_data(root: str | Path | None = None, *, n_train: int | None = None) -> CifarData:
    """The seeded 45k/5k train/val split of the CIFAR-10 training set and the test set.

    ``n_train`` keeps only the first ``n_train`` images of the (shuffled) training split
    (``--quick``).
    """
    root = data_root(root)
    x_all, y_all = load_uint8(root, "train")
    x_test, y_test = load_uint8(root, "test")
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(y_all))
    val_idx, train_idx = perm[:N_VAL], perm[N_VAL:]
    if n_train is not None:
        train_idx = train_idx[:n_train]
    x_train = x_all[train_idx]
    flat = x_train.reshape(len(x_train), 3, -1).astype(np.float64) / 255.0
    mean = torch.tensor(flat.mean(axis=(0, 2)), dtype=torch.float32)
    std = torch.tensor(flat.std(axis=(0, 2)), dtype=torch.float32)
    data = CifarData(None, None, None, x_test, y_test, mean, std)  # type: ignore[arg-type]
    data.train = TensorDataset(data.normalise(x_train), torch.as_tensor(y_all[train_idx]))
    data.val = TensorDataset(data.normalise(x_all[val_idx]), torch.as_tensor(y_all[val_idx]))
    data.test = TensorDataset(data.normalise(x_test), torch.as_tensor(y_test))
    return data


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
    from laplace_debiased.training import evaluate_loss
    from torch.utils.data import DataLoader

    print("test", evaluate_loss(model, DataLoader(d.test, batch_size=1000)), flush=True)
