"""One-process parts of the rank-failure and rank-consistency machinery (issue 24): fault
injection, the digests the ranks compare, and the identity without a process group. The
multi-process behaviour is in ``test_distributed_failures.py``."""

import pytest
import torch

from _models import tiny_mlp
from laplace_debiased.parallel.distributed import (
    _digest,
    _leaves,
    check_same_fit_inputs,
    fail_together,
)
from laplace_debiased.parallel.rank_failures import FAULT_ENV, fault_point


def test_fault_point_does_nothing_unless_asked(monkeypatch):
    monkeypatch.delenv(FAULT_ENV, raising=False)
    fault_point("fit")
    monkeypatch.setenv(FAULT_ENV, "1:fit:raise")  # another rank (this process is rank 0)
    fault_point("fit")
    monkeypatch.setenv(FAULT_ENV, "0:other-point:raise")
    fault_point("fit")


def test_fault_point_raises_at_the_named_point_and_count(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setenv(FAULT_ENV, "0:count-point:raise:2")
    fault_point("count-point")  # first arrival: not yet
    with pytest.raises(RuntimeError, match="injected fault .* at 'count-point' on rank 0"):
        fault_point("count-point")
    fault_point("count-point")  # only the COUNT-th arrival


def test_fault_point_refuses_a_malformed_spec(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "0:fit:explode")
    with pytest.raises(ValueError, match="RANK:POINT:raise\\|kill"):
        fault_point("fit")


def test_digest_sees_one_ulp_a_permutation_and_the_dtype():
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    assert _digest([x]) == _digest([x.clone()])
    bumped = x.clone()
    bumped[4, 1] = torch.nextafter(bumped[4, 1], torch.tensor(float("inf")))
    assert _digest([bumped]) != _digest([x])
    assert _digest([x[[1, 0, 2, 3, 4, 5]]]) != _digest([x])
    assert _digest([x.double()]) != _digest([x])
    assert _digest([x.reshape(3, 6)]) != _digest([x])  # the shape is hashed too


def test_batch_leaves_cover_tuples_and_dicts_in_key_order():
    X, y = torch.zeros(2, 3), torch.ones(2)
    assert [t is X for t in _leaves([(X, y)])] == [True, False]
    assert _digest(_leaves({"b": y, "a": X})) == _digest(_leaves({"a": X, "b": y}))
    assert list(_leaves({"ids": X, "meta": "text"})) == [X]


def test_without_a_group_the_checks_do_nothing():
    batch = (torch.zeros(2, 4, dtype=torch.float64), torch.zeros(2, dtype=torch.long))
    check_same_fit_inputs(tiny_mlp(), [batch], [batch])
    with pytest.raises(KeyError):
        with fail_together("a fit"):
            raise KeyError("passes through unchanged")
