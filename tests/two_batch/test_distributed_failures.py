"""Distributed fits on 2 local gloo processes whose ranks disagree or fail.

* Ranks that hold different models (seeded differently) or select different batches (each
  loader shuffled with its own seed) are refused at fit, on every rank, with an error that says
  what differs and how to fix it; ranks that agree fit.
* A rank that raises, or is killed (``SIGKILL``), during a distributed fit ends the fit on the
  other rank with a ``PeerRankError`` naming it. The faults are injected by a reducer that
  fails at a chosen collective (``tests/_faults.py``), never by timing; the ranks are left to end by themselves
  (nothing stops a rank because another one failed), and the collective timeout is 30 minutes,
  so a rank that ends does so because the failure reached it.
"""

import functools
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from laplace import Laplace
from torch.utils.data import DataLoader

from _env import spawn_ranks_outcomes
from _models import loader, tiny_mlp, toy_data
from _faults import FaultyReducer
from laplace_debiased.parallel.reducer import use_reducer

WORLD = 2


def _fit(model: torch.nn.Module, data: DataLoader) -> None:
    Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron").fit(data)


def _shuffled(seed: int) -> DataLoader:
    return DataLoader(toy_data(48, (4,), 3, "classification"), batch_size=8, shuffle=True,
                      generator=torch.Generator().manual_seed(seed))


def _outcome(fn) -> str | tuple[str, str]:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the outcome under test
        return type(err).__name__, str(err)
    return "fitted"


def _mismatch_job(rank: int, out: Path) -> dict:
    data = loader(toy_data(48, (4,), 3, "classification"), 8)
    cases = {
        "different models": lambda: _fit(tiny_mlp(seed=rank), data),
        "different batch order": lambda: _fit(tiny_mlp(), _shuffled(seed=rank)),
        "same seeds": lambda: _fit(tiny_mlp(), _shuffled(seed=5)),
    }
    result = {name: _outcome(case) for name, case in cases.items()}
    dist.barrier()  # a refused fit leaves the group usable
    result["barrier passed"] = True
    return result


@pytest.fixture(scope="module")
def mismatch(tmp_path_factory):
    return spawn_ranks_outcomes(_mismatch_job, tmp_path_factory.mktemp("mismatch"), WORLD)


@pytest.mark.slow
def test_distributed_fit_refuses_different_models_on_every_rank(mismatch):
    for exitcode, outcome in mismatch:
        assert exitcode == 0
        kind, message = outcome["result"]["different models"]
        assert kind == "RankMismatchError"
        assert "the model (parameters and buffers) on rank(s) [1] differ" in message
        assert "torch.manual_seed" in message
        assert "batches" not in message  # the batches agree: only what differs is named


@pytest.mark.slow
def test_distributed_fit_refuses_different_batches_on_every_rank(mismatch):
    for _, outcome in mismatch:
        kind, message = outcome["result"]["different batch order"]
        assert kind == "RankMismatchError"
        assert "the direction batches B on rank(s) [1] and the magnitude batches B̃ on rank(s) [1] differ" in message
        assert "same seed" in message and "the model" not in message


@pytest.mark.slow
def test_distributed_fit_accepts_ranks_that_agree(mismatch):
    for _, outcome in mismatch:
        assert outcome["result"]["same seeds"] == "fitted"
        assert outcome["result"]["barrier passed"]


def _fault_job(action: str, rank: int, out: Path) -> dict:
    """Fit debiased_kron; rank 1 fails (``action``) at the fit's first collective, the sum of
    its K-FAC factors (after the rank check; :class:`FaultyReducer`). Rank 1 then
    stays alive until rank 0 has its outcome, so what ends rank 0's fit is rank 1 leaving the
    group, not rank 1's process exiting."""
    data = loader(toy_data(48, (4,), 3, "classification"), 8)
    with use_reducer(FaultyReducer(1, action)):
        outcome = _outcome(lambda: _fit(tiny_mlp(), data))
    if rank == 0:
        (out / "rank0.done").touch()
    else:
        while not (out / "rank0.done").exists():
            time.sleep(0.05)
    return {"outcome": outcome, "group left": not dist.is_initialized()}


def _faulty_run(tmp_path_factory, action: str) -> list:
    out = tmp_path_factory.mktemp(f"fault_{action}")
    return spawn_ranks_outcomes(functools.partial(_fault_job, action), out, WORLD)


@pytest.mark.slow
def test_distributed_fit_rank_that_raises_ends_the_fit_on_every_rank(tmp_path_factory):
    (code0, rank0), (code1, rank1) = _faulty_run(tmp_path_factory, "raise")
    assert code0 == code1 == 0
    kind, message = rank1["result"]["outcome"]
    assert kind == "RuntimeError" and "injected fault" in message
    kind, message = rank0["result"]["outcome"]
    assert kind == "PeerRankError"
    assert "rank 1 failed in DebiasedKronLaplace.fit: RuntimeError: injected fault" in message
    assert rank0["result"]["group left"] and rank1["result"]["group left"]


@pytest.mark.slow
def test_distributed_fit_rank_killed_ends_the_fit_on_every_rank(tmp_path_factory):
    (code0, rank0), (code1, rank1) = _faulty_run(tmp_path_factory, "kill")
    assert code1 == -9 and rank1 is None
    assert code0 == 0
    kind, message = rank0["result"]["outcome"]
    assert kind == "PeerRankError"
    assert message.startswith("rank 1 stopped without reporting an error")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
