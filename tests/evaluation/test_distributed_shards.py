"""Per-rank data sharding of the main job under ``torchrun``.

Rank ``r`` of ``W`` loads only its rows ``shard_range(N, r, W)`` of the training set, fetches
from their owners the rows its own fits read (``fit_rows``: replayed from the fits' seeded
loaders) and nothing else. Tested here: the shards partition the data (each row loaded by
exactly one rank, ``ceil``/``floor(N/W)`` rows each), the fetched rows are bitwise the rows, and
the replay names exactly the rows a real fit reads. That the whole run's rows stay bitwise a
single-process run's is ``test_distributed_pipeline.py``'s test.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from _env import spawn_ranks
from laplace_debiased.evaluation.options import DEFAULTS
from laplace_debiased.evaluation.methods import METHODS
from laplace_debiased.evaluation.pipeline import _digits, fit_rows, sweep_job
from laplace_debiased.evaluation.models import digits_cnn
from laplace_debiased.parallel.distributed import fetch_rows

#: 251 of the 300 training digits: no world size below divides it, so the shards differ in size
OPTS = {**DEFAULTS, "seed": 1, "train_size": 251, "repeats": 2, "batch_size": 32, "subset": "last_layer",
        "methods": ["kron_single", "kron_debiased", "kron_full"]}


def _single_process_rows() -> Dataset:
    return _digits(OPTS)[0]  # no process group: the whole training set (a Subset of 251 rows)


def _job(rank: int, out: Path) -> dict:
    train = _digits(OPTS)[0]
    loaded = train.held()
    wanted = fit_rows(OPTS, len(train), rank, dist.get_world_size())
    fetched = fetch_rows(train, wanted)
    return {"n": len(train), "own": train.own, "loaded": loaded, "wanted": wanted, "held": fetched.held(),
            "items": {i: fetched[i] for i in fetched.held()}}


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def world_ranks(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(f"shards{request.param}")
    return request.param, spawn_ranks(_job, out, request.param)


@pytest.mark.slow
def test_each_rank_loads_its_shard_and_the_shards_are_the_data_set_once(world_ranks):
    world, ranks = world_ranks
    n = len(_single_process_rows())
    assert [r["n"] for r in ranks] == [n] * world  # every rank serves the global indices
    sizes = [len(r["loaded"]) for r in ranks]
    assert sizes == [n // world + (r < n % world) for r in range(world)]  # ceil(N/W), then floor(N/W)
    assert all(r["loaded"] == list(r["own"]) for r in ranks)
    assert [i for r in ranks for i in r["loaded"]] == list(range(n))  # each row once, disjoint


@pytest.mark.slow
def test_each_rank_holds_its_shard_plus_the_rows_its_fits_read_bitwise(world_ranks):
    world, ranks = world_ranks
    single = _single_process_rows()
    for r, got in enumerate(ranks):
        assert got["held"] == sorted({*got["loaded"], *got["wanted"]}), f"rank {r}"
        for i, item in got["items"].items():
            assert all(torch.equal(a, b) for a, b in zip(item, single[i])), f"rank {r} row {i}"
    assert sorted({i for r in ranks for i in r["wanted"]}) == fit_rows(OPTS, len(single), 0, 1)


class _Recording(Dataset):
    """A data set that records which rows are read."""

    def __init__(self, data: Dataset) -> None:
        self.data, self.read = data, set()

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        self.read.add(int(i))
        return self.data[i]


@pytest.mark.parametrize("name", OPTS["methods"])
def test_fit_rows_are_the_rows_the_fit_reads(name):
    """Each job alone on a rank (world = number of jobs): the replay names the rows that the
    method's real fit reads, no more, no fewer."""
    torch.manual_seed(0)
    jobs = [(m, r) for m in OPTS["methods"] for r in range(1 if METHODS[m].full_batch else OPTS["repeats"])]
    for k, (method, repeat) in enumerate(jobs):
        if method != name:
            continue
        data = _Recording(_single_process_rows())
        b = None if METHODS[method].full_batch else OPTS["batch_size"]
        sweep_job(method, METHODS[method], digits_cnn().eval(), data, OPTS, b).fit(repeat)
        assert sorted(data.read) == fit_rows(OPTS, len(data), k, len(jobs)), (method, repeat)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
