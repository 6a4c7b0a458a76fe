"""Torch data sets over uint8 RGB images, with optional per-channel normalisation.

Storage convention (the same as the CIFAR-C ``.npy`` files): images are uint8 arrays of shape
``(N, H, W, 3)`` (channels last, RGB) that may be memory-mapped; labels are int64 ``(N,)``.
Items are served channels first, as ``(x, y)`` with ``x`` float32 ``(3, H, W)`` equal to
``(pixel / 255 - mean) / std`` per channel (or ``pixel / 255`` without normalisation) and ``y``
an int64 scalar tensor.  No augmentation, ever: the same index always gives the same tensor, so
curvature computed over the same data is reproducible.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

# Per-channel pixel mean and standard deviation (over all training pixels, in [0, 1] units).
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


class ImageDataset(Dataset):
    """uint8 images ``(N, H, W, 3)`` plus int64 labels ``(N,)``, served as normalised tensors.

    Args:
        images: uint8 ``(N, H, W, 3)``: an ndarray, a lazy ``np.memmap`` view, or any array-like
            with ``dtype``, ``shape`` and numpy indexing (never copied; only indexed items read).
        labels: integer array ``(N,)``.
        mean: per-channel mean in [0, 1] units, or ``None`` (with ``std``) for plain ``pixel/255``.
        std: per-channel standard deviation in [0, 1] units, or ``None`` (with ``mean``).
        classes: class names, index = label.
        info: free-form description of provenance (file, corruption, severity, seed, ...).
        corruption_names: for corrupted sets, the corruption names.
        corruption_index: for corrupted sets, item ``i`` carries corruption
            ``corruption_names[corruption_index[i]]``.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        *,
        mean: Sequence[float] | None = CIFAR10_MEAN,
        std: Sequence[float] | None = CIFAR10_STD,
        classes: Sequence[str] = (),
        info: dict | None = None,
        corruption_names: Sequence[str] = (),
        corruption_index: np.ndarray | None = None,
    ) -> None:
        if images.dtype != np.uint8 or images.ndim != 4 or images.shape[-1] != 3:
            raise ValueError(
                f"images must be uint8 of shape (N, H, W, 3), got {images.dtype} {images.shape}."
            )
        if len(labels) != len(images):
            raise ValueError(f"{len(labels)} labels for {len(images)} images.")
        if (mean is None) != (std is None):
            raise ValueError("Give both mean and std for normalisation, or neither.")
        self.images = images
        self.labels = np.asarray(labels, dtype=np.int64)
        self.mean = None if mean is None else tuple(float(m) for m in mean)
        self.std = None if std is None else tuple(float(s) for s in std)
        self.classes = tuple(classes)
        self.info = dict(info or {})
        self.corruption_names = tuple(corruption_names)
        self.corruption_index = (
            None if corruption_index is None else np.asarray(corruption_index, dtype=np.int64)
        )

    def __len__(self) -> int:
        return len(self.labels)

    def uint8(self, index: int | slice | np.ndarray) -> np.ndarray:
        """Raw uint8 images ``(H, W, 3)`` or ``(n, H, W, 3)`` of the given item(s)."""
        return np.asarray(self.images[index])

    def _to_tensor(self, pixels: np.ndarray) -> torch.Tensor:
        """uint8 ``(..., H, W, 3)`` -> float32 ``(..., 3, H, W)``, normalised."""
        x = torch.from_numpy(np.array(pixels)).movedim(-1, -3).float() / 255.0
        if self.mean is not None:
            mean = torch.tensor(self.mean).view(3, 1, 1)
            std = torch.tensor(self.std).view(3, 1, 1)
            x = (x - mean) / std
        return x

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._to_tensor(self.uint8(index)), torch.tensor(self.labels[index])

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole set at once: ``X`` float32 ``(N, 3, H, W)`` and ``y`` int64 ``(N,)``."""
        return self._to_tensor(self.uint8(slice(None))), torch.from_numpy(self.labels.copy())

    def subset(self, indices: np.ndarray) -> "ImageDataset":
        """A new data set of the items ``indices`` (pixels copied into memory)."""
        indices = np.asarray(indices, dtype=np.int64)
        return ImageDataset(
            self.uint8(indices),
            self.labels[indices],
            mean=self.mean,
            std=self.std,
            classes=self.classes,
            info={**self.info, "subset_of": len(self)},
        )
