"""Row shards of a training set: which rows a process loads, and a data set that holds only some.

Under ``torchrun --nproc-per-node W`` rank ``r`` loads only the rows
[`shard_range`][laplace_debiased.data.shards.shard_range] ``(N, r, W)`` of the N training rows: contiguous
blocks whose sizes are ``ceil(N/W)`` for the first ``N % W`` ranks and ``floor(N/W)`` for the others
(``torch.tensor_split``'s rule), so every row is loaded by exactly one rank.
[`HeldRows`][laplace_debiased.data.shards.HeldRows] serves such a shard under the rows' global indices (its
length is N, as a sampler over the whole set needs) together with any rows added later (the rows a rank's fits
draw, sent by the ranks that own them: ``parallel.distributed.fetch_rows``). Asking it for a row it does not
hold is an error that says so, never a silent substitute.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

__all__ = ["shard_range", "chunk_shard", "HeldRows", "tensor_rows", "held_bytes", "check_indices", "own_copy"]


def shard_range(n: int, rank: int, world: int) -> range:
    """The global indices of rank ``rank``'s rows among ``n`` rows split over ``world`` ranks.

    Contiguous; the first ``n % world`` ranks get ``ceil(n/world)`` rows, the others
    ``floor(n/world)`` (possibly none); the ranges of ranks ``0..world-1`` partition ``range(n)``
    in order.
    """
    if world < 1 or not 0 <= rank < world or n < 0:
        raise ValueError(f"need n >= 0 and 0 <= rank < world, got n={n}, rank={rank}, world={world}")
    q, extra = divmod(n, world)
    start = rank * q + min(rank, extra)
    return range(start, start + q + (rank < extra))


def chunk_shard(n: int, chunk: int, rank: int, world: int) -> range:
    """The global indices of rank ``rank``'s rows among ``n`` rows read in chunks of ``chunk``
    (``range(0, n, chunk)``, the last one shorter), split over ``world`` ranks in whole chunks.

    Rank ``rank`` gets the chunks [`shard_range`][laplace_debiased.data.shards.shard_range]
    ``(⌈n/chunk⌉, rank, world)``, so every chunk it reads is a chunk of the single-process pass, row for row;
    the ranges of ranks ``0..world-1`` partition ``range(n)`` in order (a rank may get none).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be a positive integer, got {chunk}")
    chunks = shard_range(-(-n // chunk), rank, world)
    return range(min(chunks.start * chunk, n), min(chunks.stop * chunk, n))


def tensor_rows(ds: TensorDataset, rows: range) -> TensorDataset:
    """Rows ``rows`` of a ``TensorDataset`` as a new one that owns copies (no view keeps the
    whole tensors alive)."""
    return TensorDataset(*(t[rows.start:rows.stop].clone() for t in ds.tensors))


class HeldRows(Dataset):
    """A data set of ``n`` rows of which this process holds only some, under their global indices.

    ``len()`` is ``n``; an index that is not held raises ``LookupError``.

    Args:
        n: The number of rows of the whole data set.
        own: The contiguous global indices of the rows this process loaded (step 1, within
            ``[0, n)``).
        rows: The rows this process loaded, one per index of ``own``: item ``i`` is served as
            ``rows[i - own.start]``.
        extra: Further rows, ``{global index: item}`` (items as the full data set serves
            them); indices in ``own`` are ignored.

    Raises:
        ValueError: If ``own`` is not a contiguous range within ``[0, n)`` with one row of
            ``rows`` each.
    """

    def __init__(self, n: int, own: range, rows: Dataset, extra: Mapping[int, Any] | None = None) -> None:
        if len(rows) != len(own) or (len(own) and not 0 <= own.start <= own.stop <= n) or own.step != 1:
            raise ValueError(f"own must be a contiguous range within [0, {n}) with one row of rows each; "
                             f"got {own} for {len(rows)} rows")
        self.n, self.own, self.rows = n, own, rows
        self.extra = {int(i): item for i, item in (extra or {}).items() if int(i) not in own}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        i = int(i)
        if i in self.own:
            return self.rows[i - self.own.start]
        if i in self.extra:
            return self.extra[i]
        raise LookupError(
            f"row {i} of {self.n} is not held by this process (it holds rows {self.own.start}..{self.own.stop - 1} "
            f"and {len(self.extra)} others); a process that reads a row must fetch it first "
            "(laplace_debiased.parallel.distributed.fetch_rows)")

    def held(self) -> list[int]:
        """The global indices held, ascending."""
        return sorted({*self.own, *self.extra})

    def with_rows(self, items: Mapping[int, Any]) -> HeldRows:
        """The same own rows plus ``items`` (``{global index: item}``) added to the extra rows."""
        return HeldRows(self.n, self.own, self.rows, {**self.extra, **items})

    def own_only(self) -> HeldRows:
        """The own rows alone (the extra rows dropped)."""
        return HeldRows(self.n, self.own, self.rows)


def own_copy(item: Any) -> Any:
    """An item with each tensor replaced by a copy of its own values (a row of a
    ``TensorDataset`` is a view, which would pickle the whole tensor's storage with it)."""
    if isinstance(item, torch.Tensor):
        return item.clone()
    if isinstance(item, (tuple, list)):
        return type(item)(own_copy(t) for t in item)
    return item


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return obj.nbytes
    if isinstance(obj, (tuple, list)):
        return sum(_nbytes(o) for o in obj)
    return 0


def held_bytes(ds: Dataset) -> int:
    """Bytes of the array data a data set holds: the tensors of a ``TensorDataset``, the images
    and labels of an ``ImageDataset``, and for [`HeldRows`][laplace_debiased.data.shards.HeldRows] its own
    rows plus its extra items (tensors and arrays counted, Python objects not)."""
    if isinstance(ds, HeldRows):
        return held_bytes(ds.rows) + sum(_nbytes(item) for item in ds.extra.values())
    if isinstance(ds, TensorDataset):
        return _nbytes(list(ds.tensors))
    return _nbytes([getattr(ds, name) for name in ("images", "labels") if hasattr(ds, name)])


def check_indices(indices: Iterable[int], n: int) -> list[int]:
    """``indices`` as sorted unique ints; ``ValueError`` for one outside ``[0, n)``."""
    out = sorted({int(i) for i in indices})
    if out and (out[0] < 0 or out[-1] >= n):
        raise ValueError(f"row indices must lie in [0, {n}), got {out[0]}..{out[-1]}")
    return out
