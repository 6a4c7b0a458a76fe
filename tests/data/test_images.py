"""uint8 image sets served as tensors (:mod:`laplace_debiased.data.images`): the normalisation
formula, channels first, subsets, and refused inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from laplace_debiased.data.images import ImageDataset


def _images(n: int = 5, h: int = 4, w: int = 3, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, h, w, 3), dtype=np.uint8)


def test_items_are_normalised_channels_first():
    images, labels = _images(), np.arange(5)
    mean, std = (0.1, 0.5, 0.9), (0.2, 0.25, 0.5)
    ds = ImageDataset(images, labels, mean=mean, std=std)
    x, y = ds[2]
    assert x.shape == (3, 4, 3) and x.dtype == torch.float32 and y.dtype == torch.int64 and int(y) == 2
    for c in range(3):
        expected = (images[2, :, :, c] / 255 - mean[c]) / std[c]
        np.testing.assert_allclose(x[c].numpy(), expected, rtol=1e-5, atol=1e-6)
    X, Y = ds.tensors()
    assert X.shape == (5, 3, 4, 3) and torch.equal(X[2], x) and torch.equal(Y, torch.arange(5))


def test_without_normalisation_items_are_pixels_over_255():
    images = _images()
    x, _ = ImageDataset(images, np.zeros(5), mean=None, std=None)[0]
    torch.testing.assert_close(x, torch.from_numpy(images[0]).permute(2, 0, 1).float() / 255)


def test_normalised_with_its_own_statistics_the_set_has_zero_mean_unit_variance():
    images = _images(n=20, seed=3)
    pixels = images.astype(np.float64).reshape(-1, 3) / 255
    mean, std = pixels.mean(0), pixels.std(0)
    X, _ = ImageDataset(images, np.zeros(20), mean=mean, std=std).tensors()
    per_channel = X.double().transpose(0, 1).reshape(3, -1)
    torch.testing.assert_close(per_channel.mean(1), torch.zeros(3, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(per_channel.std(1, correction=0), torch.ones(3, dtype=torch.float64), atol=1e-5, rtol=0)


def test_subset_keeps_the_items_and_the_normalisation():
    ds = ImageDataset(_images(), np.arange(5), classes=("a", "b"), info={"file": "x"})
    sub = ds.subset(np.array([4, 1]))
    assert len(sub) == 2 and sub.classes == ds.classes and sub.info == {"file": "x", "subset_of": 5}
    for i, j in enumerate([4, 1]):
        assert torch.equal(sub[i][0], ds[j][0]) and int(sub[i][1]) == j


@pytest.mark.parametrize("images, labels, kwargs, match", [
    (np.zeros((2, 4, 4, 3), dtype=np.float32), np.zeros(2), {}, "must be uint8"),
    (np.zeros((2, 4, 4, 1), dtype=np.uint8), np.zeros(2), {}, r"\(N, H, W, 3\)"),
    (np.zeros((2, 4, 4, 3), dtype=np.uint8), np.zeros(3), {}, "3 labels for 2 images"),
    (np.zeros((2, 4, 4, 3), dtype=np.uint8), np.zeros(2), {"std": None}, "both mean and std"),
])
def test_bad_inputs_are_refused(images, labels, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ImageDataset(images, labels, **kwargs)
