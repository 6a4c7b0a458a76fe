"""The reducer a fit uses: one process, an installed one, and the collectives it is asked for."""

import pytest
import torch
from laplace import Laplace

from _faults import FaultyReducer
from _models import loader, tiny_mlp, toy_data
from laplace_debiased.parallel.reducer import ProcessGroupReducer, Reducer, current_reducer, use_reducer


def test_one_process_collectives_are_identities():
    reducer = current_reducer()
    assert type(reducer) is Reducer and (reducer.rank, reducer.world) == (0, 1)
    t = torch.arange(4.0)
    reducer.sum_([t])
    reducer.broadcast_([t])
    assert torch.equal(t, torch.arange(4.0))


def test_one_process_runs_rank_zero_computations_in_place():
    """``computed_on_rank0`` returns what it computes; ``run_with_summed_operator`` hands the
    solver this process's product, so a solver that applies it to the unit vectors reads back
    the matrix."""
    reducer = Reducer()
    A = torch.arange(9.0).reshape(3, 3)
    assert [t.shape for t in reducer.computed_on_rank0(lambda: [A, A[0]], "cpu")] == [(3, 3), (3,)]
    (columns,) = reducer.run_with_summed_operator(
        lambda v: A @ v, lambda op: [torch.stack([op(e) for e in torch.eye(3)], dim=1)], 3, A.dtype, "cpu")
    assert torch.equal(columns, A)


def test_installed_reducer_is_current_inside_the_block_only():
    mine = ProcessGroupReducer()
    with use_reducer(mine):
        assert current_reducer() is mine
        with use_reducer(Reducer()) as inner:
            assert current_reducer() is inner
        assert current_reducer() is mine
    assert current_reducer() is not mine


class _Counting(Reducer):
    def __init__(self) -> None:
        self.sums: list[list[torch.Size]] = []

    def sum_(self, tensors):
        self.sums.append([t.shape for t in tensors])


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
def test_a_kfac_fit_sums_its_factors_through_the_current_reducer(structure):
    """One sum of the factor sums per fit, holding every block's two factors for B and B̃."""
    data = loader(toy_data(48, (4,), 3, "classification"), 8)
    la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure=structure)
    counting = _Counting()
    with use_reducer(counting):
        la.fit(data)
    assert len(counting.sums) >= 1
    d_in = [p.shape[1] for p in la.model.parameters() if p.ndim == 2]
    shapes = {tuple(s) for s in counting.sums[0]}
    assert all(any(s[-2:] == (d, d) for s in shapes) for d in d_in)


def test_a_failing_reducer_ends_the_fit_with_its_error():
    data = loader(toy_data(48, (4,), 3, "classification"), 8)
    la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure="debiased_kron")
    with use_reducer(FaultyReducer(0, "raise", count=2)):
        la.fit(data)  # the first sum passes
        with pytest.raises(RuntimeError, match="injected fault at sum 2 on rank 0"):
            la.fit(data)
