"""CIFAR-10 data of the benchmark: the root, the seeded train/val split, the evaluation sets.

Data location, first match wins: the ``--data`` argument, ``$LAPLACE_DEBIASED_DATA``,
``~/.cache/laplace-debiased/data``.  The folder must hold the official CIFAR-10 binary version
(``<root>/cifar-10-batches-bin/``, from ``cifar-10-binary.tar.gz`` of
https://www.cs.toronto.edu/~kriz/cifar.html).  Where it is missing and a ``build_cifar10.py``
sits at :data:`SHARED_BUILDER`, that script builds it there.

Every split is read once into tensors (``laplace_debiased.data.cifar.cifar_splits``: uint8 records ->
float32 ``(N, 3, 32, 32)``, ``(pixel/255 - mean)/std`` with the standard CIFAR-10 channel
statistics); labels int64 ``(N,)``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from laplace_debiased.data.eval_sets import resolve_eval_set
from laplace_debiased.data.cifar import cifar_splits

REPO = Path(__file__).resolve().parents[2]
SHARED_BUILDER = REPO.parent / "shared" / "data" / "build_cifar10.py"
DEFAULT_DATA = Path.home() / ".cache" / "laplace-debiased" / "data"
N_VAL = 5000
SPLIT_SEED = 0
SEVERITIES = (1, 2, 3, 4, 5)


def data_root(arg: str | Path | None = None) -> Path:
    """Resolve the CIFAR-10 root and build the binary layout there if it is missing."""
    root = Path(arg or os.environ.get("LAPLACE_DEBIASED_DATA") or DEFAULT_DATA).expanduser()
    if (root / "cifar-10-batches-bin" / "test_batch.bin").is_file():
        return root
    if not SHARED_BUILDER.is_file():
        raise FileNotFoundError(
            f"no CIFAR-10 under {root} (expected {root}/cifar-10-batches-bin/). Download the CIFAR-10 "
            "binary version (cifar-10-binary.tar.gz) from https://www.cs.toronto.edu/~kriz/cifar.html, "
            "unpack it into a folder DIR and pass --data DIR (or set LAPLACE_DEBIASED_DATA=DIR)."
        )
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(SHARED_BUILDER), str(root)], check=True)
    return root


@dataclass
class CifarData:
    """The benchmark's data as tensors, and the root it was read from.

    ``train``/``val``/``test``: ``TensorDataset`` of normalised float32 ``(N, 3, 32, 32)`` images
    and int64 labels; ``root`` holds ``cifar-10-batches-bin/`` (for
    :func:`laplace_debiased.data.eval_sets.resolve_eval_set`, e.g. the generated corrupted test sets).
    """

    train: TensorDataset
    val: TensorDataset
    test: TensorDataset
    root: Path
    verify: str = "official"


def load_data(root: str | Path | None = None, *, n_train: int | None = None) -> CifarData:
    """The seeded 45k/5k train/val split of the CIFAR-10 training set, and the test set.

    Read with :func:`laplace_debiased.data.cifar.cifar_splits` (``n_val=5000``, seed 0, official record
    counts and checksums; a set of fewer than 50,000 training images -- the tiny synthetic sets of
    the tests -- is checked for structure only, and below 25,000 images holds out a fifth).
    ``n_train`` keeps the first ``n_train`` training images (a seeded random subset, since the
    split is a seeded permutation).
    """
    root = data_root(root)
    n_total = sum((root / "cifar-10-batches-bin" / f"data_batch_{i}.bin").stat().st_size for i in range(1, 6)) // 3073
    # the official record counts and checksums for the real set; structure only for tiny test sets
    verify = "official" if n_total == 50000 else "structure"
    splits = cifar_splits(root, n_val=N_VAL if n_total >= 25000 else n_total // 5, seed=SPLIT_SEED, verify=verify)
    train = splits["train"]
    if n_train is not None:
        train = train.subset(np.arange(min(n_train, len(train))))
    return CifarData(
        train=TensorDataset(*train.tensors()),
        val=TensorDataset(*splits["val"].tensors()),
        test=TensorDataset(*splits["test"].tensors()),
        root=root,
        verify=verify,
    )


def scrambled(X: torch.Tensor, seed: int) -> torch.Tensor:
    """Far-OOD images: each image's 1,024 pixel positions randomly permuted (colour statistics
    kept, every spatial structure destroyed).  ``X`` ``(N, 3, H, W)`` -> same shape."""
    gen = torch.Generator().manual_seed(seed)
    flat = X.flatten(2)
    perm = torch.stack([torch.randperm(flat.shape[-1], generator=gen) for _ in range(len(X))])
    return flat.gather(2, perm[:, None, :].expand_as(flat)).reshape(X.shape)


def eval_sets(data: CifarData, n_val: int, n_test: int, n_corrupt: int, n_ood: int, seed: int,
              log=print) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"val", "test", "c1".."c5", "ood"}`` -> ``(X, y)``.

    ``val``: a seeded subset of the validation split (prior selection only, never the test set).
    ``test``: the first ``n_test`` images of a seeded permutation of the test set (all 10,000 by
    default).  ``c<s>``: the first ``n_corrupt`` of those, from the package's generated mixed
    CIFAR-10-C set of severity ``s`` (``resolve_eval_set("cifar10-c-mixed:s")``: every test image
    corrupted by one of the 15 corruptions drawn uniformly with ``seed``).  ``ood``: the first
    ``n_ood`` test images pixel-scrambled (:func:`scrambled`; labels meaningless).
    """
    rng = np.random.default_rng([seed, 1])
    Xv, yv = data.val.tensors
    Xt, yt = data.test.tensors
    val_idx = rng.permutation(len(yv))[:n_val]
    test_idx = rng.permutation(len(yt))[:n_test]
    sets = {"val": (Xv[val_idx], yv[val_idx]), "test": (Xt[test_idx], yt[test_idx])}
    c_idx = test_idx[:n_corrupt]
    for s in SEVERITIES:
        start = time.perf_counter()
        Xc, yc = resolve_eval_set(f"cifar10-c-mixed:{s}", data.root, seed=seed, verify=data.verify).subset(c_idx).tensors()
        if not torch.equal(yc, yt[c_idx]):
            raise RuntimeError(f"the generated corrupted test set under {data.root} is not in the order "
                               "of the benchmark's test set; delete its cache (<cache>/corrupted) and rerun")
        sets[f"c{s}"] = (Xc, yc)
        log(f"  corrupted severity {s}: {len(Xc)} images ({time.perf_counter() - start:.1f} s)")
    o_idx = test_idx[:n_ood]
    sets["ood"] = (scrambled(Xt[o_idx], seed), yt[o_idx])
    return sets
