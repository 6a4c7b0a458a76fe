"""Networks of the benchmark: the CPU ``cifar_cnn`` and the paper's ALL-CNN-C (GPU setting)."""

from __future__ import annotations

from torch import nn

from laplace_debiased.evaluation.models import cifar_cnn


def allcnnc(n_classes: int = 10) -> nn.Sequential:
    """ALL-CNN-C (Springenberg et al. 2015) without dropout, as in the paper's test problems (A, B):
    input ``(N, 3, 32, 32)``, 1,369,738 parameters for 10 classes.  Ends in a 1x1 conv + global
    average pooling, so the last ``nn.Linear`` of laplace-torch's last-layer LA does not exist:
    the last-layer rows are skipped for this model."""
    def conv(i, o, k, s=1, p=1):
        return [nn.Conv2d(i, o, k, stride=s, padding=p), nn.ReLU()]

    return nn.Sequential(
        *conv(3, 96, 3), *conv(96, 96, 3), *conv(96, 96, 3, s=2),
        *conv(96, 192, 3), *conv(192, 192, 3), *conv(192, 192, 3, s=2),
        *conv(192, 192, 3, p=0), *conv(192, 192, 1, p=0), nn.Conv2d(192, n_classes, 1),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    )


MODELS = {"cifar_cnn": cifar_cnn, "allcnnc": allcnnc}
