"""Row shards (``laplace_debiased.data.shards``): the partition of the rows over ranks and the
data set that holds only some rows. One process; the exchange between ranks is tested in
``tests/evaluation/test_distributed_shards.py``."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import TensorDataset

from laplace_debiased.data.shards import (
    HeldRows, check_indices, chunk_shard, held_bytes, own_copy, shard_range, tensor_rows,
)


@given(n=st.integers(0, 200), world=st.integers(1, 9))
def test_shard_ranges_partition_the_rows_with_ceil_or_floor_sizes(n, world):
    ranges = [shard_range(n, r, world) for r in range(world)]
    assert [i for part in ranges for i in part] == list(range(n))  # every row once, in order
    assert sorted({len(p) for p in ranges}) in ([n // world], [n // world, -(-n // world)])
    assert [len(p) for p in ranges] == [len(t) for t in torch.tensor_split(torch.arange(n), world)]


@given(n=st.integers(0, 200), chunk=st.integers(1, 17), world=st.integers(1, 9))
def test_chunk_shards_partition_the_rows_in_whole_chunks(n, chunk, world):
    """In order, every row once, each rank's rows the single-process chunks
    ``range(0, n, chunk)`` that :func:`shard_range` gives it over the chunk count."""
    ranges = [chunk_shard(n, chunk, r, world) for r in range(world)]
    assert [i for part in ranges for i in part] == list(range(n))
    starts = list(range(0, n, chunk))
    for r, part in enumerate(ranges):
        mine = [starts[c] for c in shard_range(len(starts), r, world)]
        assert [i for i in part if i % chunk == 0] == mine


def test_chunk_shard_refuses_an_empty_chunk():
    with pytest.raises(ValueError, match="chunk must be a positive integer"):
        chunk_shard(10, 0, 0, 1)


def test_shard_range_refuses_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank < world"):
        shard_range(10, 2, 2)


def _data(n: int = 10) -> TensorDataset:
    return TensorDataset(torch.arange(2.0 * n).reshape(n, 2), torch.arange(n))


def test_held_rows_serves_its_rows_under_their_global_indices_and_refuses_others():
    full = _data()
    held = HeldRows(10, range(3, 6), tensor_rows(full, range(3, 6)), {8: full[8]})
    assert len(held) == 10 and held.held() == [3, 4, 5, 8]
    for i in held.held():
        assert all(torch.equal(a, b) for a, b in zip(held[i], full[i]))
    with pytest.raises(LookupError, match="row 7 of 10 is not held"):
        held[7]
    more = held.with_rows({7: full[7], 4: full[4]})  # an own row is not stored twice
    assert more.held() == [3, 4, 5, 7, 8] and set(more.extra) == {7, 8}
    assert more.own_only().held() == [3, 4, 5]


def test_held_bytes_counts_the_rows_held():
    full = _data()
    shard = tensor_rows(full, range(3, 6))
    assert shard.tensors[0].untyped_storage().nbytes() == 3 * 2 * 4  # a copy, not a view of all rows
    assert held_bytes(HeldRows(10, range(3, 6), shard)) == 3 * (2 * 4 + 8)
    assert held_bytes(HeldRows(10, range(3, 6), shard, {8: full[8]})) == 4 * (2 * 4 + 8)


def test_held_rows_refuses_rows_that_do_not_match_its_range():
    with pytest.raises(ValueError, match="contiguous range"):
        HeldRows(10, range(3, 7), tensor_rows(_data(), range(3, 6)))


def test_check_indices_sorts_and_refuses_rows_outside_the_set():
    assert check_indices([3, 1, 3], 4) == [1, 3]
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        check_indices([4], 4)


def test_own_copy_keeps_the_values_but_not_the_storage():
    full = _data()
    item = own_copy(full[4])
    assert all(torch.equal(a, b) for a, b in zip(item, full[4])) and isinstance(item, tuple)
    assert item[0].untyped_storage().nbytes() == 2 * 4  # one row, not the 10 rows it viewed
