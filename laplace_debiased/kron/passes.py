"""K-FAC factors of several batch sets from shared forward/backward passes.

The rows of B and B̃ (and of more batch sets) go through the model together and the factor
sums are split by sample
([`laplace_debiased.curvature.kfac.group_kfac_sums`][laplace_debiased.curvature.kfac.group_kfac_sums]), so a
two-batch fit at 2 × b/2 costs one pass over ``b`` rows like a single-batch fit at ``b``. Under an initialised
``torch.distributed`` group each rank passes its shard of every batch and the sums are added over the ranks.

Scale convention (that of a laplace-torch ``KronLaplace`` fit over all ``N`` data): a batch set
of ``m`` samples gives ``G = N/m · Σ g gᵀ`` (output side, summed loss) and ``A = mean a aᵀ``
(input side; over the samples, or under token outputs the tokens, whose targets are not padded).
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any

import torch
from laplace.curvature.curvature import CurvatureInterface
from torch import nn

from laplace_debiased.curvature.kfac import (
    GroupKfacSums,
    KeptFactor,
    factor_rows_of,
    group_kfac_sums,
    zero_sums,
)
from laplace_debiased.curvature.linalg import RowFactor
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size
from laplace_debiased.parallel.distributed import shard_batch
from laplace_debiased.parallel.reducer import Reducer
from laplace_debiased.curvature.layer_blocks import module_blocks

__all__ = ["single_pass_kfacs"]

#: per batch set, per block and factor: the rows ``X`` with ``F = XᵀX`` where known, else ``None``
FactorRows = list[list[list[torch.Tensor | None]]]
#: per batch set, per block and factor: the rank-one terms summed into the factor
FactorTerms = list[list[list[int]]]


def _passes(
    pieces: list[tuple[Batch, int]], max_rows: int, dict_key_x: str, dict_key_y: str
) -> Iterator[tuple[Any, torch.Tensor, list[tuple[int, int, int]]]]:
    """Stack consecutive ``(batch, group)`` pieces into passes ``(X, y, segments)`` of at
    most ``max_rows`` rows (a piece never splits; dict batches pass one at a time), with
    ``segments`` the ``(start, stop, group)`` row ranges of
    [`group_kfac_sums`][laplace_debiased.curvature.kfac.group_kfac_sums]."""
    todo: list[tuple[Any, torch.Tensor, int]] = []
    for b, g in pieces:
        X, y = batch_inputs_targets(b, dict_key_x, dict_key_y)
        if len(y) == 0:
            continue
        if todo and (
            isinstance(X, MutableMapping) or sum(len(t[1]) for t in todo) + len(y) > max_rows
        ):
            yield _stack(todo)
            todo = []
        todo.append((X, y, g))
    if todo:
        yield _stack(todo)


def _stack(
    todo: list[tuple[Any, torch.Tensor, int]],
) -> tuple[Any, torch.Tensor, list[tuple[int, int, int]]]:
    segments, start = [], 0
    for _, y, g in todo:
        segments.append((start, start + len(y), g))
        start += len(y)
    if len(todo) == 1:
        return todo[0][0], todo[0][1], segments
    return torch.cat([t[0] for t in todo]), torch.cat([t[1] for t in todo]), segments


def _group_sums(
    model: nn.Module, modules: list[nn.Module], groups: list[list[Batch]], sizes: list[list[int]],
    *, likelihood: str, backend: CurvatureInterface, fisher: str, keys: tuple[str, str], keep_rows: bool, mean: Any,
    reducer: Reducer,
) -> GroupKfacSums:
    """The factor sums of every batch set over this rank's rows, added over the ranks."""
    pieces = [
        (shard_batch(b, n, reducer.rank, reducer.world), g)
        for g, batches in enumerate(groups)
        for b, n in zip(batches, sizes[g])
    ]
    sums = None
    max_rows = 2 * max(max(s) for s in sizes)
    for X, y, segments in _passes(pieces, max_rows, *keys):
        sums = group_kfac_sums(
            model, modules, X, y, segments, len(groups), likelihood=likelihood,
            lossfunc=backend.lossfunc, factor=backend.factor, fisher=fisher, into=sums, keep_rows=keep_rows,
        )
    if sums is None:  # this rank got no rows (fewer samples than ranks)
        sums = zero_sums(modules, len(groups), mean)
    reducer.sum_(sums.tensors())
    return sums


def _group_factor(total: torch.Tensor | None, rows: list[KeptFactor] | None, g: int) -> torch.Tensor | RowFactor:
    """Group ``g``'s sum of one side of a module: ``total[g]``, its sum among the kept rows of the other
    groups, or its kept rows as a [`RowFactor`][laplace_debiased.curvature.linalg.RowFactor] where the group's
    side was kept as rows."""
    if total is not None:
        return total[g]
    return rows[g] if isinstance(rows[g], torch.Tensor) else RowFactor(factor_rows_of(rows[g]))


def _scaled(kfacs: list[list[torch.Tensor | RowFactor]], c: float, first: float) -> list[list[torch.Tensor | RowFactor]]:
    """Each factor of a block of ``k`` factors times ``c^(1/k)``, the first also times ``first``;
    factors of one tensor with the same scale stay one tensor."""
    done: dict[tuple[int, float], torch.Tensor] = {}

    def scale(f: torch.Tensor | RowFactor, s: float) -> torch.Tensor | RowFactor:
        key = (id(f), s)
        if key not in done:
            done[key] = f * s
        return done[key]

    return [[scale(f, c ** (1 / len(F)) * (first if j == 0 else 1.0)) for j, f in enumerate(F)] for F in kfacs]


def single_pass_kfacs(
    model: nn.Module, modules: list[nn.Module], groups: list[list[Batch]], N: int,
    *, likelihood: str, backend: CurvatureInterface, fisher: str, keys: tuple[str, str], mean: Any, reducer: Reducer,
) -> tuple[torch.Tensor, list[list[list[torch.Tensor | RowFactor]]], FactorRows | None, FactorTerms]:
    """K-FAC of each batch set in ``groups``, scaled to ``N`` points (module docstring).

    Args:
        model: the network.
        modules: its layers with trainable parameters, in block order.
        groups: the batch sets (B, B̃, ...), each a list of loader batches.
        N: the number of training data the factors are scaled to.
        likelihood: the Laplace class's likelihood.
        backend: laplace-torch's curvature backend (``lossfunc`` and ``factor`` are read).
        fisher: the curvature type (``"type2"`` exact GGN or ``"empirical"``).
        keys: ``(dict_key_x, dict_key_y)`` of dict batches.
        mean: the model output's reduction over token positions (``zero_sums``).
        reducer: the ranks' collectives; each rank passes its shard of every batch.

    Returns:
        ``(loss, kfacs, rows, terms)``: the summed loss over all batches (unscaled), per batch set
        its factors (blocks of 1 or 2 square factors, laplace-torch's ``Kron.kfacs`` layout): a
        ``(d, d)`` tensor, or for a Linear/Conv2d factor with fewer rows than ``d`` in that batch set
        a [`RowFactor`][laplace_debiased.curvature.linalg.RowFactor] (its ``d × d`` sum never formed, whatever
        the other batch sets' rows);
        per batch set and factor the rows ``X`` of a ``RowFactor`` (``XᵀX`` the factor as returned), else
        ``None`` (``None`` in all under a process group, where each rank holds only its rows); and per batch set,
        block and factor the rank-one terms summed into the factor (their float32 round-off,
        [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).
    """
    sizes = [[batch_size(b, *keys) for b in batches] for batches in groups]
    keep_rows = reducer.world == 1
    sums = _group_sums(model, modules, groups, sizes, likelihood=likelihood, backend=backend,
                       fisher=fisher, keys=keys, keep_rows=keep_rows, mean=mean, reducer=reducer)
    krons, all_rows, all_terms = [], [], []
    for g, m in enumerate(sum(s) for s in sizes):
        kfacs, terms = [], []
        for i, module in enumerate(modules):
            G = _group_factor(sums.output[i], sums.output_rows[i], g)
            has_input = sums.input_weight[i] is not None
            blocks = module_blocks(module, G, None, m) if not has_input else module_blocks(
                module, G, _group_factor(sums.input[i], sums.input_rows[i], g), sums.mean_divisor(i, g))
            counts = sums.terms[i][g]  # the counts in the blocks' layout (a mean divides by 1)
            count_blocks = module_blocks(module, counts[0], counts[1] if has_input else None, 1.0)
            terms.extend([[int(t) for t in b] for b in count_blocks])
            kfacs.extend(blocks)
        all_terms.append(terms)
        # the loss factor c scales a block by c: each of two factors by √c (as Kron * c does); one
        # product per factor, and one tensor for equal factors (a bias and its weight's output side at c = 1)
        krons.append(_scaled(kfacs, backend.factor, N / m))
        all_rows.append([[F.rows if isinstance(F, RowFactor) else None for F in block] for block in krons[-1]])
    return sums.loss.sum(), krons, all_rows if keep_rows else None, all_terms
