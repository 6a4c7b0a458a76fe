"""The flat import paths of 0.1 still work after the layout move, as the same module objects."""

import importlib
import pickle

import pytest

from laplace_debiased._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_new_module(old):
    assert importlib.import_module(f"laplace_debiased.{old}") is importlib.import_module(
        f"laplace_debiased.{MOVED[old]}"
    )


def test_from_imports_of_old_paths():
    from laplace_debiased.kron import DebiasedKronLaplace
    from laplace_debiased.optim import NewtonCG
    from laplace_debiased import metrics
    from laplace_debiased.structures.kron import DebiasedKronLaplace as New
    from laplace_debiased.optim.newton_cg import NewtonCG as NewNewtonCG

    assert DebiasedKronLaplace is New and NewtonCG is NewNewtonCG
    assert metrics is importlib.import_module("laplace_debiased.evaluation.metrics")


def test_pickle_naming_an_old_path_loads():
    from laplace_debiased.optim.cg import CGResult

    payload = pickle.dumps(CGResult, protocol=0).replace(b"laplace_debiased.optim.cg", b"laplace_debiased.cg")
    assert b"laplace_debiased.cg" in payload
    assert pickle.loads(payload) is CGResult
