"""Networks of the benchmark: the CPU ``cifar_cnn``, the paper's ALL-CNN-C (GPU setting) and a
BatchNorm ResNet-20 (the normalisation benchmark, ``benchmarks/normalisation.py``)."""

from __future__ import annotations

import torch
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


class BasicBlock(nn.Module):
    """ResNet basic block: ``conv3x3-BN-ReLU-conv3x3-BN`` plus the shortcut (identity, or a
    ``bias=False`` 1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet20(width: int = 16, n_classes: int = 10) -> nn.Sequential:
    """ResNet-20 for CIFAR (He et al. 2016, three stages of three basic blocks, channels
    ``width, 2 width, 4 width``), BatchNorm after every convolution, ``bias=False`` convolutions,
    1x1-conv shortcuts where the shape changes; input ``(N, 3, 32, 32)``.  ``width=16`` is the
    original (272,474 parameters for 10 classes); ``width=8`` (68,786) is the CPU benchmark's."""
    layers: list[nn.Module] = [nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    c = width
    for stage, c_out in enumerate((width, 2 * width, 4 * width)):
        for block in range(3):
            layers.append(BasicBlock(c, c_out, 2 if stage > 0 and block == 0 else 1))
            c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, n_classes)]
    return nn.Sequential(*layers)


def resnet20_w8(n_classes: int = 10) -> nn.Sequential:
    """The CPU benchmark's narrow ResNet-20 (:func:`resnet20` with ``width=8``)."""
    return resnet20(8, n_classes)


MODELS = {"cifar_cnn": cifar_cnn, "allcnnc": allcnnc, "resnet20": resnet20, "resnet20_w8": resnet20_w8}
