"""Small model zoo used by the examples, the main job, the diagnostics and the benchmarks.

All models are plain ``nn.Sequential`` stacks of ``Conv2d``/``Linear``/``ReLU``/pooling layers:
no BatchNorm and no dropout, so that every parameter is covered by K-FAC and the network is a
deterministic function of its parameters (what a Laplace approximation assumes).

Input conventions: images as float tensors of shape ``(N, C, H, W)``; outputs are logits of shape
``(N, n_classes)``.
"""

from __future__ import annotations

from torch import nn


def digits_mlp(hidden: tuple[int, ...] = (64,), n_classes: int = 10) -> nn.Sequential:
    """MLP for 8x8 grey-scale digits, input ``(N, 1, 8, 8)``."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = 64
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        width = h
    layers.append(nn.Linear(width, n_classes))
    return nn.Sequential(*layers)


def digits_cnn(n_classes: int = 10) -> nn.Sequential:
    """Two-convolution CNN for 8x8 grey-scale digits, input ``(N, 1, 8, 8)`` (9,802 parameters)."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, n_classes),
    )


def cifar_cnn(n_classes: int = 10) -> nn.Sequential:
    """Three-convolution CNN for 32x32 RGB images, input ``(N, 3, 32, 32)``.

    56,714 parameters for 10 classes: small enough that a full-batch K-FAC Laplace
    approximation over all of CIFAR-10 runs on a 2-core CPU, large enough to overfit.
    """
    blocks = [
        layer
        for c_in, c_out in ((3, 16), (16, 32), (32, 64))
        for layer in (nn.Conv2d(c_in, c_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
    ]
    return nn.Sequential(
        *blocks,
        nn.Flatten(),
        nn.Linear(64 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, n_classes),
    )


MODELS = {"digits_mlp": digits_mlp, "digits_cnn": digits_cnn, "cifar_cnn": cifar_cnn}
