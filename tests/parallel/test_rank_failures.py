"""One-process parts of the rank-failure and rank-consistency machinery: the digests the ranks
compare, and the identity without a process group. The
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
