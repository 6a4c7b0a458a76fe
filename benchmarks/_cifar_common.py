"""The 12-epoch ``cifar_cnn`` MAP of ``benchmarks/cg_figure5.py`` and its CIFAR-10 data.

The data code lives in :mod:`benchmarks.cifar10.data` (the headline benchmark's package) and is
re-exported here; the headline benchmark trains its own converged MAP (:mod:`benchmarks.cifar10.train`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cifar10.data import DEFAULT_DATA, N_VAL, SPLIT_SEED, CifarData, data_root, load_data  # noqa: E402,F401
from laplace_debiased.evaluation.models import cifar_cnn  # noqa: E402
from laplace_debiased.evaluation.training import TrainConfig, train_map  # noqa: E402

#: Training of this MAP: Adam, cosine schedule to zero, weak L2 (prior precision 1e-4 per data
#: point), no augmentation, 12 epochs on the 45k split (under-trained; see benchmarks/README.md).
FULL_TRAIN = TrainConfig(epochs=12, lr=2e-3, weight_decay=1e-4, batch_size=128, seed=0)
#: ``--quick``: a few epochs on a subset -- only to exercise the pipeline.
QUICK_TRAIN = TrainConfig(epochs=3, lr=2e-3, weight_decay=1e-4, batch_size=128, seed=0)
QUICK_N_TRAIN = 10000


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
