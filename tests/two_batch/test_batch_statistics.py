"""Normalisation that normalises with the batch's own statistics is refused before any forward pass.

A ``BatchNorm`` built with ``track_running_stats=False`` normalises with the statistics of the
batch it is given even in eval mode, so one input's prediction (and its predictive variance)
would change with its batch mates. Every structure refuses such a model in ``fit``, before the
model sees any data, with a message that says why and what to do.
"""

from __future__ import annotations

import pytest
import torch
from laplace import Laplace
from torch import nn

import laplace_debiased  # noqa: F401  (registers the debiased structures)
from _models import loader, toy_data

STRUCTURES = ("debiased_kron", "debiased_ekfac", "debiased_full", "debiased_lowrank")


def _bn1d_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(4, 3), nn.BatchNorm1d(3, track_running_stats=False), nn.Tanh(), nn.Linear(3, 3)
    ).double().eval()


def _bn2d_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2, track_running_stats=False), nn.Tanh(),
        nn.Flatten(), nn.Linear(2 * 3 * 3, 3),
    ).double().eval()


@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize(("net", "shape"), [(_bn1d_net, (4,)), (_bn2d_net, (1, 5, 5))], ids=["bn1d", "bn2d"])
def test_batch_statistics_refused_before_any_forward(structure, net, shape):
    model = net()
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure)
    with pytest.raises(ValueError, match=r"track_running_stats=False.*depend on the batch") as err:
        la.fit(loader(toy_data(24, shape, 3, "classification"), 8))
    assert "'1' (BatchNorm" in str(err.value)
    assert not forwards


def test_running_statistics_still_fit():
    """The same network with running statistics (the default) fits: the refusal is about the
    statistics, not about BatchNorm."""
    model = _bn1d_net()
    model[1] = nn.BatchNorm1d(3).double().eval()
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    la.fit(loader(toy_data(24, (4,), 3, "classification"), 8))
    assert la.n_data == 24
