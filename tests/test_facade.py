"""The public API at the top of the package: ``import laplace_debiased as ld``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import laplace_debiased as ld

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", ld.__all__)
def test_every_public_name_resolves_to_the_object_of_its_module(name):
    value = getattr(ld, name)
    module = sys.modules[value.__module__]
    assert getattr(module, name) is value
    assert name in dir(ld)


def test_all_names_each_public_name_once():
    assert len(set(ld.__all__)) == len(ld.__all__) >= 15


def test_an_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        ld.no_such_name  # noqa: B018


def test_the_classes_are_those_the_factory_builds():
    import torch
    from laplace import Laplace

    la = Laplace(torch.nn.Linear(3, 2), "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    assert type(la) is ld.DebiasedKronLaplace


def test_importing_the_package_does_not_import_torch():
    code = "import sys, laplace_debiased; print('torch' in sys.modules, 'laplace' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert res.stdout.split() == ["False", "False"], res.stderr
