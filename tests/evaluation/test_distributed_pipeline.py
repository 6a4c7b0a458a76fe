"""The command-line pipeline under ``torchrun --nproc-per-node 2`` (gloo on CPU) against the
single-process run, and a cross-fitted ``debiased_kron`` fit on 2 local gloo processes against
the single-process fit in float64.

The pipeline runs are subprocesses (``python -m torch.distributed.run --standalone``, the module
behind ``torchrun``) on the tiny setup of ``tests/test_cli.py``, each with its own model cache,
so that rank 0 trains the MAP model and sends it to rank 1.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from _env import assert_every_rank_equals, pythonpath, spawn_ranks
from _models import loader, tiny_mlp, toy_data
from laplace_debiased import cli
from laplace_debiased.evaluation.sweep import output_lock, row_key
from laplace_debiased.kron.laplace import DebiasedKronLaplace, DebiasedKronLLLaplace

WORLD = 2
ROOT = Path(__file__).resolve().parents[2]
#: the tiny pipeline of tests/test_cli.py, with 2 repeats: 4 (method, repeat) jobs over 2 ranks
TINY = {
    "train-size": 200, "epochs": 2, "subset": "last_layer", "methods": ["kron_single", "kron_debiased"],
    "repeats": 2, "batch-size": 32, "prior-precisions": [0.1, 10.0], "links": ["probit", "mc"],
    "n-samples": 16, "quiet": True,
}
TIMINGS = ("fit_seconds", "eval_seconds")


def _cli(tmp: Path, cache: str, out: str, *args: str, world: int = 1,
         fault: str | None = None, repeats: int = TINY["repeats"],
         check_threads: bool = False) -> subprocess.CompletedProcess:
    """``python -m laplace_debiased --config tiny.json --out OUT ARGS``, under torchrun if
    ``world`` > 1, in a fresh environment (one thread, the given model cache, Python's fault
    handler on, so that a rank that aborts prints where; ``fault``: ``RANK:ACTION:COUNT`` of the
    :class:`_faults.FaultyReducer` to run it with; ``repeats`` in place of the tiny setup's;
    ``check_threads``: through ``tests/_exit_threads.py``)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=pythonpath(ROOT), OMP_NUM_THREADS="1", LAPLACE_DEBIASED_CACHE=str(tmp / cache),
               PYTHONFAULTHANDLER="1")
    launch = [sys.executable]
    if world > 1:
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    if fault:
        entry = [str(ROOT / "tests" / "_faults.py"), fault]
    elif check_threads:
        entry = [str(ROOT / "tests" / "_exit_threads.py")]
    else:
        entry = ["-m", "laplace_debiased"]
    cfg = tmp / f"tiny-{repeats}.json"
    cfg.write_text(json.dumps({**TINY, "repeats": repeats}))
    cmd = [*launch, *entry, *args, "--config", str(cfg), "--out", str(tmp / out)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)  # a hang guard only


def _said(res: subprocess.CompletedProcess) -> str:
    """A failed run's standard error for the assertion message: its start (where a rank says
    what it did) and its end (the launcher's summary)."""
    err = res.stderr
    return err if len(err) <= 6000 else f"{err[:2500]}\n[...]\n{err[-3500:]}"


def _metrics(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipeline")
    single = _cli(tmp, "cache-single", "single", "--seed", "1")
    multi = _cli(tmp, "cache-multi", "multi", "--seed", "1", world=WORLD)
    for res in (single, multi):
        assert res.returncode == 0, _said(res)
    return tmp, single, multi


def _assert_close(got, want, where: str, tol: float) -> None:
    """Equal structure and non-float values; floats within ``tol · max(1, |want|)``."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for key in want:
            _assert_close(got[key], want[key], f"{where} {key}", tol)
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]", tol)
    elif isinstance(want, float):
        assert abs(got - want) <= tol * max(1.0, abs(want)), (where, got, want)
    else:
        assert got == want, where


@pytest.mark.slow
def test_distributed_pipeline_rows_equal_the_single_process_run(runs):
    """Same rows, same order, every field but the timings equal to the round-off of adding the
    ranks' sums of N per-row terms in another order (4 N u₆₄ · max(1, |value|), N <= 1,797 digits
    images; tests/evaluation/test_distributed_sweep.py derives it); none written twice."""
    tmp, _, _ = runs
    single, multi = _metrics(tmp / "single" / "results.jsonl"), _metrics(tmp / "multi" / "results.jsonl")
    assert len(multi) == len(single)
    for got, want in zip(multi, single):
        _assert_close(got, want, str([want[k] for k in ("method", "repeat", "prior_precision", "eval_set", "link")]),
                      4 * 1797 * 2.0**-53)
    keys = [(r["method"], r["repeat"], r["prior_precision"], r["eval_set"], r["link"]) for r in multi]
    assert len(set(keys)) == len(keys)
    assert {r["repeat"] for r in multi if r["method"] != "map"} == {0, 1}
    assert json.loads((tmp / "multi" / "options.json").read_text()) == json.loads(
        (tmp / "single" / "options.json").read_text())


@pytest.mark.slow
def test_distributed_pipeline_rank_zero_trains_writes_and_reports_once(runs):
    tmp, _, multi = runs
    assert multi.stdout.count("results: ") == 1 and multi.stdout.count("report:  ") == 1
    assert (tmp / "multi" / "report" / "report.md").is_file()
    assert (tmp / "multi" / "report" / "report.html").is_file()
    assert len(list((tmp / "cache-multi" / "models").glob("*.pt"))) == 1  # one trained model


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through Linux's /proc")
def test_distributed_pipeline_leaves_no_process_group_thread_running(runs):
    """After a command under torchrun, no rank holds its destroyed process group: no gloo thread
    outlives the command. (One held on, by a module imported after the group began, is torn down
    at interpreter exit, where it can abort the rank: "terminate called without an active
    exception".) The command imports what a sweep imports (torchmetrics among them)."""
    tmp, _, _ = runs
    done = _cli(tmp, "cache-multi", "multi", "sweep", "--seed", "1", world=WORLD, check_threads=True)
    assert done.returncode == 0, _said(done)


@pytest.mark.slow
def test_distributed_pipeline_resumes_and_refuses_other_settings_on_every_rank(runs):
    tmp, _, _ = runs
    results = tmp / "multi" / "results.jsonl"
    before = results.read_bytes()
    again = _cli(tmp, "cache-multi", "multi", "sweep", "--seed", "1", world=WORLD)
    assert again.returncode == 0, _said(again)
    assert results.read_bytes() == before  # loaded from the cache, nothing left to compute
    other = _cli(tmp, "cache-multi", "multi", "sweep", "--seed", "2", world=WORLD)
    assert other.returncode != 0
    # rank 0's error, in its own words or in rank 1's (which stops instead of waiting; torchrun
    # may end the other worker once one has exited)
    assert "holds results of a different setup" in other.stderr
    assert results.read_bytes() == before


@pytest.mark.slow
@pytest.mark.parametrize("action", ["raise", "kill"])
def test_distributed_pipeline_lost_rank_ends_every_rank_loses_nothing_and_resumes(runs, action):
    """Rank 1 raises in its second fit (the sweep's second round), or is killed (SIGKILL) at its
    third (the third round, of 3 repeats): either way after rank 0 has written the first round's
    rows. A raise is reported to rank 0 at its next collective, which it reaches after writing;
    a kill is not, and torchrun may stop rank 0 at once, so it comes a round later: rank 1 reaches
    its third fit only through the second round's gathers, which rank 0 enters after writing the
    first round's rows. Every rank ends (the run returns), rank 1 is named, the rows written are
    whole and unique, the lock is free, and a rerun resumes to the uninterrupted run's rows (in
    key order: a round cut short is appended later; the killed run's third repeat aside)."""
    tmp, _, _ = runs
    out = f"lost-{action}"
    repeats, count = (2, 2) if action == "raise" else (3, 3)
    lost = _cli(tmp, "cache-multi", out, "--seed", "1", world=WORLD, fault=f"1:{action}:{count}", repeats=repeats)
    assert lost.returncode != 0
    if action == "raise":  # rank 0 reports it before rank 1 exits (rank 1 waits for it)
        assert "laplace-debiased: error: rank 1 failed" in lost.stderr and "injected fault" in lost.stderr
    else:  # torchrun's summary names every failed rank and how it ended
        assert re.search(r"rank\s*: 1 \(local_rank: 1\)\s*\n\s*exitcode\s*: -9", lost.stderr), _said(lost)
    results = tmp / out / "results.jsonl"
    raw = results.read_bytes()
    assert raw.endswith(b"\n")  # no torn last row
    partial = _metrics(results)
    keys = [(r["method"], r["repeat"], r["prior_precision"], r["eval_set"], r["link"]) for r in partial]
    assert len(set(keys)) == len(keys) and any(r["method"] != "map" for r in partial)
    with output_lock(tmp / out, timeout=0):  # released: taking it does not raise
        pass
    again = _cli(tmp, "cache-multi", out, "--seed", "1", world=WORLD, repeats=repeats)
    assert again.returncode == 0, _said(again)
    # the same rows; a round cut short is appended later, so compare them in key order
    resumed = [r for r in _metrics(results) if r["method"] == "map" or r["repeat"] < TINY["repeats"]]
    assert sorted(resumed, key=row_key) == sorted(_metrics(tmp / "multi" / "results.jsonl"), key=row_key)


def test_distributed_refusal_of_single_process_commands_under_torchrun(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["report", str(tmp_path / "results.jsonl")]) == 2
    assert "launch it without torchrun" in capsys.readouterr().err
    assert not dist.is_initialized()


# ---------------------------------------------------------------- cross-fitting on 2 ranks

CROSS_FIT = {"all": DebiasedKronLaplace, "last_layer": DebiasedKronLLLaplace}


def _cross_fit(subset: str):
    """Cross-fitted debiased K-FAC (float64): 3 direction batches and 2 magnitude batches."""
    direction = loader(toy_data(30, (4,), 3, "classification", seed=1), 10)
    magnitude = loader(toy_data(16, (4,), 3, "classification", seed=2), 8)
    la = CROSS_FIT[subset](tiny_mlp(), "classification", prior_precision=0.5, cross_fit=True)
    la.fit(direction, magnitude_loader=magnitude)
    return la


def _cross_fit_state(la) -> dict[str, torch.Tensor]:
    """Both mixture components' factors, eigenbases and eigenvalues, the mixture covariance."""
    state = {"loss": torch.as_tensor(la.loss), "n_data": torch.as_tensor(la.n_data),
             "covariance": la.posterior_precision.to_matrix(-1)}
    for key, facs in (("direction", la.H_facs), ("magnitude", la.H_facs_magnitude)):
        state.update({f"{key} {i} {j}": F for i, block in enumerate(facs.kfacs) for j, F in enumerate(block)})
    for c, comp in enumerate(la.H.components):
        for what in ("eigenvectors", "eigenvalues"):
            state.update({f"component {c} {what} {i} {j}": t
                          for i, block in enumerate(getattr(comp, what)) for j, t in enumerate(block)})
    return state


def _cross_fit_job(rank: int, out: Path) -> dict:
    return {subset: _cross_fit_state(_cross_fit(subset)) for subset in CROSS_FIT}


@pytest.fixture(scope="module")
def cross_fit_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("cross_fit")
    return spawn_ranks(_cross_fit_job, out, WORLD, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("subset", list(CROSS_FIT))
def test_distributed_cross_fit_equals_single_process(cross_fit_ranks, subset):
    torch.set_num_threads(1)
    single = _cross_fit_state(_cross_fit(subset))
    assert_every_rank_equals([cross_fit_ranks[r][subset] for r in range(WORLD)], single,
                             lambda state: list(state.items()))
    assert single["covariance"].dtype == torch.float64


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
