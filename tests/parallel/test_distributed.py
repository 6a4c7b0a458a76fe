"""Debiased K-FAC fits under torch.distributed: 2 local gloo processes (127.0.0.1) against
the single-process fit in float64.

One spawn runs every case (starting processes costs seconds); each test checks one case.
"""

import sys
from pathlib import Path

import pytest
import torch

from _env import assert_every_rank_equals, spawn_ranks
from _models import loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.parallel.distributed import shard_batch

WORLD = 2
CASES = {
    # name: (model, input shape, n data, batch size, structure, fit kwargs)
    "kron_cnn_batches": (tiny_cnn, (1, 5, 5), 60, 12, "all", {"n_direction_batches": 2}),
    "kron_mlp_halves": (tiny_mlp, (4,), 70, 10, "all", {"split": "halves"}),
    "kron_mlp_regression": (tiny_mlp, (4,), 48, 16, "all", {}),
    "kron_last_layer": (tiny_mlp, (4,), 48, 16, "last_layer", {}),
    "kron_same_batches": (tiny_cnn, (1, 5, 5), 60, 20, "all", {"magnitude_loader": True}),
}


def _fit(name: str):
    from laplace import Laplace

    make, shape, n, bs, subset, kw = CASES[name]
    likelihood = "regression" if "regression" in name else "classification"
    data = loader(toy_data(n, shape, 3, likelihood), bs)
    options = {k: v for k, v in kw.items() if k != "magnitude_loader"}
    la = Laplace(make(), likelihood, subset_of_weights=subset, hessian_structure="debiased_kron", **options)
    la.fit(data, magnitude_loader=data if "magnitude_loader" in kw else None)
    return la


def _state(la) -> dict:
    return {
        "H_facs": la.H_facs.kfacs,
        "H_facs_magnitude": la.H_facs_magnitude.kfacs,
        "eigenvectors": la.H.eigenvectors,
        "eigenvalues": la.H.eigenvalues,
        "posterior_precision": la.posterior_precision.to_matrix(),
        "loss": torch.as_tensor(la.loss),
        "n_data": la.n_data,
    }


def _job(rank: int, out: Path) -> dict:
    return {name: _state(_fit(name)) for name in CASES}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed")
    return spawn_ranks(_job, out, WORLD)


def _flat(state: dict) -> list:
    items = []
    for key in ("H_facs", "H_facs_magnitude", "eigenvectors", "eigenvalues"):
        items += [(key, t) for block in state[key] for t in block]
    return [*items, ("posterior_precision", state["posterior_precision"]), ("loss", state["loss"])]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_fit_equals_single_process(ranks, name):
    torch.set_num_threads(1)
    assert_every_rank_equals([ranks[r][name] for r in range(WORLD)], _state(_fit(name)), _flat, same=("n_data",))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_distributed_ranks_hold_identical_posteriors(ranks, name):
    """Factors (all-reduced) and eigenbasis (broadcast) are bitwise equal on every rank; the
    dense precision each rank derives from them locally agrees to round-off (BLAS results
    may depend on memory alignment)."""
    for (key, a), (_, b) in zip(_flat(ranks[0][name]), _flat(ranks[1][name])):
        if key == "posterior_precision":
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        else:
            assert torch.equal(a, b), key


def test_distributed_shard_batch_partitions_rows():
    X, y = torch.arange(10).reshape(5, 2), torch.arange(5)
    shards = [shard_batch((X, y), 5, r, 3) for r in range(3)]
    assert torch.equal(torch.cat([s[0] for s in shards]), X)
    assert torch.equal(torch.cat([s[1] for s in shards]), y)
    batch = {"input_ids": X, "labels": y, "meta": "kept"}
    half = shard_batch(batch, 5, 1, 2)
    assert half["meta"] == "kept" and torch.equal(half["labels"], y[3:])
    assert len(shard_batch((X[:1], y[:1]), 1, 1, 2)[1]) == 0
    assert shard_batch((X, y), 5, 0, 1) == (X, y)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


def test_local_shards_partition_every_batch_over_the_ranks():
    """The shards of ranks 0..W-1 hold each batch's rows once, in order; a rank with no rows of a
    batch (fewer rows than ranks) gets no shard of it."""
    from laplace_debiased.parallel.distributed import local_shards

    batches = [(torch.arange(5.0)[:, None], torch.arange(5)), (torch.arange(2.0)[:, None], torch.arange(2))]
    world = 3
    parts = [local_shards(batches, "x", "y", rank=r, world=world) for r in range(world)]
    assert [len(p) for p in parts] == [2, 2, 1]
    for b, (X, y) in enumerate(batches):
        got = torch.cat([p[b][1] for p in parts if len(p) > b])
        assert torch.equal(got, y)
    assert local_shards(batches, "x", "y", rank=0, world=1) == batches
