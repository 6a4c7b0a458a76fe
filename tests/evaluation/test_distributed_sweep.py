"""The prior-precision sweep under torch.distributed: 2 local gloo processes (127.0.0.1) shard
the (method, repeat) jobs and the rows of every evaluation set, rank 0 alone writes, and the rows
equal a single-process sweep's to the round-off of adding the ranks' sums.

One spawn runs every case (starting processes costs seconds); each test checks one aspect.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from laplace import Laplace

from _env import spawn_ranks
from _models import loader, tiny_mlp, toy_data
import laplace_debiased.evaluation.sweep as sweep_module
import laplace_debiased.posterior.grid as grid_module
from laplace_debiased.data.shards import chunk_shard
from laplace_debiased.evaluation.sweep import LOCK_NAME, EvalSet, SweepJob, load_rows, row_key, run_sweep
from laplace_debiased.parallel.distributed import local_fits, rank_world

WORLD = 2
SWEEP = dict(prior_precisions=(0.1, 1.0), links=("probit", "mc"), n_samples=16, seed=3,
             chunk_size=5, progress=False)
TIMINGS = ("fit_seconds", "eval_seconds")


def _data():
    return loader(toy_data(48, (4,), 3, "classification"), 8)


def _fit_kron(repeat: int):
    """debiased_kron: under a process group it would shard and all-reduce unless fitted locally."""
    la = Laplace(tiny_mlp(), "classification", subset_of_weights="all", hessian_structure="debiased_kron", generator=torch.Generator().manual_seed(repeat))
    la.fit(_data())
    return la


def _fit_full(repeat: int):
    """debiased_full refuses to fit under a process group unless fitted locally."""
    la = Laplace(tiny_mlp(), "classification", subset_of_weights="last_layer", hessian_structure="debiased_full", generator=torch.Generator().manual_seed(10 + repeat))
    la.fit(_data())
    return la


def _fail(repeat: int):
    raise ValueError("no fit for you")


def _methods() -> list[SweepJob]:
    # jobs: kron 0, kron 1, full 0 -> rounds (kron 0 | kron 1), (full 0 | idle)
    return [SweepJob("kron", _fit_kron, repeats=2), SweepJob("full_ll", _fit_full)]


def _eval_sets() -> list[EvalSet]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(22, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (22,), generator=g)
    return [
        EvalSet("test", x[:8], y[:8]),
        EvalSet("val", x[8:15], y[8:15], kind="validation"),
        EvalSet("ood", 4 * x[15:], kind="ood"),
    ]


def _job(rank: int, out: Path) -> dict:
    result = {"pid": os.getpid(), "rank_world": rank_world(), "locked": []}
    real_lock = sweep_module.output_lock

    def recorded_lock(folder, timeout=0.0):  # which folders this rank locks
        result["locked"].append(Path(folder).name)
        return real_lock(folder, timeout)

    sweep_module.output_lock = recorded_lock
    with local_fits():
        result["local_rank_world"] = rank_world()
    ids = {row.numpy().tobytes(): (es.name, i) for es in _eval_sets() for i, row in enumerate(es.x)}
    touched = {"laplace": set(), "map": set()}

    def record(kind: str, x: torch.Tensor) -> None:  # rows of the eval sets (fits read others)
        touched[kind].update(ids[r] for r in (row.numpy().tobytes() for row in x) if r in ids)

    real_jacobians = grid_module.logit_jacobians

    def recorded_jacobians(model, params, x):
        record("laplace", x)
        return real_jacobians(model, params, x)

    grid_module.logit_jacobians = recorded_jacobians
    map_model = tiny_mlp()
    map_model.register_forward_pre_hook(lambda module, args: record("map", args[0]))
    result["rows"] = run_sweep(_methods(), _eval_sets(), out / "dist" / "r.jsonl", map_model=map_model, **SWEEP)
    grid_module.logit_jacobians = real_jacobians
    result["touched"] = touched
    result["file_after_first"] = (out / "dist" / "r.jsonl").read_bytes()
    result["rows_again"] = run_sweep(_methods(), _eval_sets(), out / "dist" / "r.jsonl",
                                     map_model=tiny_mlp(), **SWEEP)
    # collective debiased_kron fits on every rank, eval sets sharded
    result["cells"] = run_sweep([SweepJob("kron", _fit_kron, repeats=2)], _eval_sets(),
                                out / "cells" / "r.jsonl", shard_jobs=False, **SWEEP)
    try:
        run_sweep([SweepJob("kron", _fit_kron), SweepJob("broken", _fail)], _eval_sets(),
                  out / "fail" / "r.jsonl", **SWEEP)
    except Exception as err:  # noqa: BLE001 - recorded for the test
        result["error"] = (type(err).__name__, str(err))
    dist.barrier()  # the group still works after the failed sweep
    result["barrier_passed"] = True
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("distributed_sweep")
    single = run_sweep(_methods(), _eval_sets(), out / "single" / "r.jsonl", map_model=tiny_mlp(), **SWEEP)
    # a resumed sweep: repeat 0 of "kron" is already in the distributed sweep's file
    run_sweep([SweepJob("kron", _fit_kron)], _eval_sets(), out / "dist" / "r.jsonl", **SWEEP)
    ranks = spawn_ranks(_job, out, WORLD)
    return single, ranks, out


def _metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMINGS}


#: float64 unit round-off
U64 = 2.0**-53


@pytest.mark.slow
def test_distributed_sweep_rows_equal_single_process(runs):
    """Every row's probabilities are the single-process ones bitwise (whole chunks, per-chunk MC
    seeds), so the metrics differ only in the order their N per-row terms are summed (the ranks'
    partial sums, then their sum): for N non-negative terms two orders differ by at most
    2 γ_N Σ|x| ≈ 2 N u of the sum, and an ECE (bin sums adding to at most 2 N) by 4 N u; so
    4 N u · max(1, |value|) bounds every float. Counts and the ranking metrics are exact."""
    single, ranks, out = runs
    written = load_rows(out / "dist" / "r.jsonl")
    assert len(single) == 3 + 3 * (2 * 3 * 2)  # MAP: one row per set; 3 fits x 2 priors x 3 sets x 2 links
    assert sorted(map(row_key, written)) == sorted(map(row_key, single))
    want = {row_key(r): _metrics(r) for r in single}
    sizes = {es.name: len(es.x) for es in _eval_sets()}
    for row in written:
        tol = 4 * sizes[row["eval_set"]] * U64
        _assert_close(_metrics(row), want[row_key(row)], row_key(row), rel=tol, abs=tol)
        for key in ("auroc", "aupr", "fpr95", "accuracy"):
            assert row.get(key) == want[row_key(row)].get(key), (row_key(row), key)
        if "reliability" in row:
            assert row["reliability"]["count"] == want[row_key(row)]["reliability"]["count"]
    # the Monte-Carlo cells differ between repeats (their seeds do), so equality is not trivial
    by = {row_key(r): r for r in written}
    assert by["kron|0|1.0|test|mc"]["nll"] != by["kron|1|1.0|test|mc"]["nll"]


@pytest.mark.slow
def test_distributed_sweep_each_rank_evaluates_only_its_rows(runs):
    """Rank r predicts (Laplace and MAP) exactly the rows ``chunk_shard(n, chunk_size, r, W)``
    of every evaluation set: whole chunks of the single-process pass, every row on one rank."""
    _, ranks, _ = runs
    for r in range(WORLD):
        want = {(es.name, i) for es in _eval_sets() for i in chunk_shard(len(es.x), SWEEP["chunk_size"], r, WORLD)}
        assert want, r
        assert ranks[r]["touched"]["laplace"] == want, r
        assert ranks[r]["touched"]["map"] == want, r


@pytest.mark.slow
def test_distributed_sweep_writes_each_row_once_from_rank_zero(runs):
    _, ranks, out = runs
    written = load_rows(out / "dist" / "r.jsonl")
    assert len({row_key(r) for r in written}) == len(written)
    # only rank 0 took the output lock, and it removed the lock file when the sweep finished
    assert "dist" in ranks[0]["locked"] and ranks[1]["locked"] == []
    assert not (out / "dist" / LOCK_NAME).exists()
    # the resumed run neither recomputed nor rewrote the rows kron|0 already had
    assert ranks[0]["file_after_first"] == (out / "dist" / "r.jsonl").read_bytes()


@pytest.mark.slow
def test_distributed_sweep_every_rank_returns_the_written_rows(runs):
    _, ranks, out = runs
    written = load_rows(out / "dist" / "r.jsonl")
    for r in range(WORLD):
        assert ranks[r]["rows"] == written
        assert ranks[r]["rows_again"] == written


@pytest.mark.slow
def test_distributed_sweep_local_fits_hide_the_group(runs):
    _, ranks, _ = runs
    for r in range(WORLD):
        assert ranks[r]["rank_world"] == (r, WORLD)
        assert ranks[r]["local_rank_world"] == (0, 1)


@pytest.mark.slow
def test_distributed_sweep_failure_on_one_rank_raises_on_every_rank(runs):
    _, ranks, out = runs
    # job 1 ("broken") runs on rank 1
    assert ranks[1]["error"] == ("ValueError", "no fit for you")
    assert ranks[0]["error"][0] == "PeerRankError"  # a RuntimeError
    assert "rank 1 failed" in ranks[0]["error"][1] and "no fit for you" in ranks[0]["error"][1]
    assert all(ranks[r]["barrier_passed"] for r in range(WORLD))
    assert not (out / "fail" / "r.jsonl").exists()  # the round failed: nothing written


def _assert_close(got, want, where: str, rel: float = 1e-6, abs: float = 1e-9) -> None:
    """Equal structure and non-float values; floats to ``rel`` (relative) or ``abs``."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_close(got[key], want[key], f"{where} {key}", rel, abs)
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]", rel, abs)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=rel, abs=abs), where
    else:
        assert got == want, where


@pytest.mark.slow
def test_distributed_sweep_collective_fits_shard_the_eval_sets(runs):
    """shard_jobs=False: every rank fits every job with the distributed debiased_kron fit and
    evaluates its rows of every eval set; the rows equal the single-process ones to the fit's
    round-off, in the single-process order, each written once."""
    single, ranks, out = runs
    want = [r for r in single if r["method"] == "kron"]
    written = load_rows(out / "cells" / "r.jsonl")
    assert [row_key(r) for r in written] == [row_key(r) for r in want]
    for got, exp in zip(written, want):
        _assert_close(_metrics(got), _metrics(exp), row_key(exp))
    for r in range(WORLD):
        assert ranks[r]["cells"] == written


def test_distributed_local_fits_without_group_is_identity():
    assert rank_world() == (0, 1)
    with local_fits():
        assert rank_world() == (0, 1)
    assert rank_world() == (0, 1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
