"""Sweep engine: rows, resume after an interruption, truncated last line."""

from __future__ import annotations

import inspect
import json

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.evaluation import options, sweep
from laplace_debiased.evaluation.sweep import EvalSet, SweepJob, load_rows, row_key, run_sweep
from laplace_debiased.prior_grid import PriorGrid


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    X, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    loader = DataLoader(TensorDataset(X, y), batch_size=10)
    fits = []

    def fit(repeat: int):
        fits.append(repeat)
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
        la.fit(loader)
        return la

    eval_sets = [
        EvalSet("test", X[:12], y[:12]),
        EvalSet("noisy", X[:12] + torch.randn(12, 4), y[:12], kind="corrupted", severity=3),
        EvalSet("ood", 5 * torch.randn(8, 4), kind="ood"),
    ]
    methods = [SweepJob("kron", fit, repeats=2)]
    return model, eval_sets, methods, fits


GRID = (1e-2, 1.0, 10.0)


def test_sweep_rows_and_metrics(tmp_path):
    model, eval_sets, methods, fits = _setup()
    rows = run_sweep(methods, eval_sets, tmp_path / "r.jsonl", prior_precisions=GRID,
                     progress=False, map_model=model)
    # MAP: 3 rows; kron: 2 repeats x 3 priors x 3 sets x 2 links
    assert len(rows) == 3 + 2 * 3 * 3 * 2
    assert fits == [0, 1]
    by = {row_key(r): r for r in rows}
    assert len(by) == len(rows)
    r = by["kron|0|1.0|noisy|probit_projected"]
    assert {"accuracy", "nll", "ece", "brier", "auroc", "aupr", "fpr95", "reliability"} <= set(r)
    assert "accuracy" not in by["kron|0|1.0|ood|probit"] and "auroc" in by["kron|0|1.0|ood|probit"]
    assert "auroc" not in by["kron|0|1.0|test|probit"]
    # MAP row equals the softmax of the model
    probs = torch.softmax(model(eval_sets[0].x), -1).detach()
    assert by["map|0|map|test|map"]["nll"] == pytest.approx(
        float(-probs.log().gather(1, eval_sets[0].y[:, None]).mean()), rel=1e-5)
    # large prior precision: Laplace predictive -> MAP
    assert by["kron|0|10.0|test|probit_projected"]["nll"] == pytest.approx(
        by["map|0|map|test|map"]["nll"], rel=0.05)


def test_interrupted_sweep_resumes_without_duplicates_or_recomputation(tmp_path, monkeypatch):
    model, eval_sets, methods, fits = _setup()
    path = tmp_path / "r.jsonl"
    real_append = sweep.append_row
    calls = {"n": 0}

    def interrupting(p, row):
        if calls["n"] == 25:  # inside repeat 1 (repeat 0 has 18 rows after 3 MAP rows)
            raise KeyboardInterrupt
        calls["n"] += 1
        real_append(p, row)

    monkeypatch.setattr(sweep, "append_row", interrupting)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(methods, eval_sets, path, prior_precisions=GRID, progress=False, map_model=model)
    assert len(load_rows(path)) == 25 and fits == [0, 1]
    # simulate a write cut in the middle of a line
    with open(path, "ab") as fh:
        fh.write(b'{"method": "kron", "rep')
    monkeypatch.setattr(sweep, "append_row", real_append)
    fits.clear()
    n_grid = {"n": 0}
    real_grid = sweep.cell_probabilities

    def counting_grid(*a, **k):
        n_grid["n"] += 1
        return real_grid(*a, **k)

    monkeypatch.setattr(sweep, "cell_probabilities", counting_grid)
    rows = run_sweep(methods, eval_sets, path, prior_precisions=GRID, progress=False, map_model=model)
    assert fits == [1]  # repeat 0 complete: not refitted
    assert n_grid["n"] == 3  # repeat 1 only, once per eval set
    keys = [row_key(r) for r in rows]
    assert len(keys) == len(set(keys)) == 3 + 36
    # a third run does nothing
    fits.clear()
    run_sweep(methods, eval_sets, path, prior_precisions=GRID, progress=False, map_model=model)
    assert fits == [] and len(load_rows(path)) == 39
    json.loads(path.read_text().splitlines()[-1])


def test_bad_results_file_and_inputs_are_refused(tmp_path):
    model, eval_sets, methods, _ = _setup()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n{}\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        run_sweep(methods, eval_sets, bad, prior_precisions=GRID, progress=False)
    with pytest.raises(ValueError, match="unknown link"):
        run_sweep(methods, eval_sets, tmp_path / "x.jsonl", links=("bridge",), progress=False)
    with pytest.raises(ValueError, match="needs labels"):
        EvalSet("t", torch.zeros(2, 4))



def test_the_default_grids_come_from_the_grid_owner():
    """``run_sweep``'s default grid is ``PriorGrid.default()``, the main job's is that grid and
    four larger points; ``DEFAULT_PRIOR_PRECISIONS`` imports from ``prior_grid`` alone."""
    assert inspect.signature(run_sweep).parameters["prior_precisions"].default == PriorGrid.default().values
    main = options.DEFAULTS["prior_precisions"]
    assert main == [*PriorGrid.default(), 100.0, 1000.0, 10000.0, 100000.0]
    assert PriorGrid.parse(main).values == tuple(main)  # already rounded, each once
    assert not hasattr(sweep, "DEFAULT_PRIOR_PRECISIONS") and not hasattr(options, "DEFAULT_PRIOR_PRECISIONS")

def test_repeated_or_nonpositive_prior_precisions_and_links_are_refused(tmp_path):
    _, eval_sets, methods, _ = _setup()
    path = tmp_path / "r.jsonl"
    for grid, match in [((1.0, 1.0), "repeated"), ((1.0, 1.0000000001), "repeated"),
                        ((0.0, 1.0), "positive"), ((-1.0,), "positive"), ((float("nan"),), "positive"),
                        ((float("inf"),), "positive"), ((), "at least one")]:
        with pytest.raises(ValueError, match=match):
            run_sweep(methods, eval_sets, path, prior_precisions=grid, progress=False)
    with pytest.raises(ValueError, match="repeated"):
        run_sweep(methods, eval_sets, path, prior_precisions=GRID, links=("probit", "probit"), progress=False)
    with pytest.raises(ValueError, match="repeated"):
        run_sweep([SweepJob("kron", methods[0].fit, links=("mc", "mc"))], eval_sets, path,
                  prior_precisions=GRID, progress=False)
    assert not path.exists()


def test_rows_are_strict_json(tmp_path):
    """Empty reliability bins are NaN in memory; the file holds null, not the token NaN."""
    path = tmp_path / "r.jsonl"
    sweep.append_row(path, {"method": "m", "nll": float("nan"), "rel": {"acc": [float("inf"), 1.0]}})
    text = path.read_text()
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard {c}")) == {
        "method": "m", "nll": None, "rel": {"acc": [None, 1.0]}}


def _mc_rows(path, eval_sets, methods, **kw):
    return {row_key(r): r for r in run_sweep(methods, eval_sets, path, prior_precisions=GRID,
                                             links=("mc", "probit_projected"), n_samples=20,
                                             progress=False, **kw)}


def test_resumed_sweep_is_bitwise_identical_to_uninterrupted(tmp_path, monkeypatch):
    """Each cell draws its MC samples from its own key: a resumed run whose missing cells are
    scattered over several eval sets, priors and links recomputes exactly the same rows."""
    _, eval_sets, methods, _ = _setup()
    full = _mc_rows(tmp_path / "full.jsonl", eval_sets, methods)
    lines = (tmp_path / "full.jsonl").read_text().splitlines()
    kept = [line for i, line in enumerate(lines) if i % 3 != 1]  # drop every third row
    (tmp_path / "part.jsonl").write_text("\n".join(kept) + "\n")
    resumed = _mc_rows(tmp_path / "part.jsonl", eval_sets, methods)
    assert set(resumed) == set(full)
    strip = lambda r: {k: v for k, v in r.items() if not k.endswith("_seconds")}
    assert all(strip(resumed[k]) == strip(full[k]) for k in full)
    # only the MC link is random; another eval-set order still gives the same cells
    again = _mc_rows(tmp_path / "rev.jsonl", [eval_sets[0], *eval_sets[:0:-1]], methods)
    assert all(strip(again[k]) == strip(full[k]) for k in full)


def test_cell_seed_depends_on_every_key_field():
    base = dict(seed=0, method="kron", repeat=0, eval_set="test", prior_precision=1.0, link="mc")
    seeds = {sweep.cell_seed(**base)}
    for field, other in [("seed", 1), ("method", "kron2"), ("repeat", 1), ("eval_set", "noisy"),
                         ("prior_precision", 10.0), ("link", "probit")]:
        seeds.add(sweep.cell_seed(**{**base, field: other}))
    assert len(seeds) == 7
    assert sweep.cell_seed(**base) == sweep.cell_seed(**base)


def test_cell_probabilities_match_grid_predictive():
    """The per-cell loop is GridPredictive.grid with one generator per cell."""
    _, eval_sets, methods, _ = _setup()
    pred = sweep.GridPredictive(methods[0].fit(0), chunk_size=5)
    x = eval_sets[0].x
    seeds = {(d, link): 7 for d in GRID for link in ("probit_projected", "mc")}
    ours = sweep.cell_probabilities(pred, x, GRID, ("probit_projected", "mc"), 30, seeds)
    ref = pred.grid(x, GRID, links=("probit_projected",))
    torch.testing.assert_close(ours["probit_projected"], ref["probit_projected"], rtol=0, atol=0)
    # one chunk, one generator: MC equals grid's MC for a one-point grid with the chunk's seed
    one = sweep.GridPredictive(pred.la, chunk_size=100)
    mc = sweep.cell_probabilities(one, x, [1.0], ("mc",), 30, {(1.0, "mc"): 7})["mc"]
    torch.testing.assert_close(mc, one.grid(x, [1.0], links=("mc",), n_samples=30,
                                            generator=torch.Generator().manual_seed(sweep.chunk_seed(7, 0)))["mc"])


def test_cell_probabilities_of_later_chunks_do_not_depend_on_earlier_ones():
    """Rows 5.. read as chunks 1.. (first_chunk=1, as the rank holding them reads them) get the
    probabilities of the whole pass bitwise, MC included; another seed changes the MC draws."""
    _, eval_sets, methods, _ = _setup()
    pred = sweep.GridPredictive(methods[0].fit(0), chunk_size=5)
    x, links = eval_sets[0].x, ("probit_projected", "mc")
    seeds = {(d, link): 7 for d in GRID for link in links}
    whole = sweep.cell_probabilities(pred, x, GRID, links, 30, seeds)
    tail = sweep.cell_probabilities(pred, x[5:], GRID, links, 30, seeds, first_chunk=1)
    for link in links:
        assert torch.equal(tail[link], whole[link][:, 5:]), link
    other = sweep.cell_probabilities(pred, x[5:], GRID, links, 30, seeds, first_chunk=2)
    assert not torch.equal(other["mc"], whole["mc"][:, 5:])
    assert sweep.cell_probabilities(pred, x[:0], GRID, links, 30, seeds) is None


def _val_rows(nll_by_delta: dict[float, float], method: str = "kron") -> list[dict]:
    return [{"method": method, "repeat": 0, "prior_precision": d, "eval_set": "val", "kind": "validation",
             "link": "probit_projected", "nll": v} for d, v in nll_by_delta.items()]


def test_grid_grows_beyond_the_edge_holding_a_validation_choice():
    from laplace_debiased.evaluation.pipeline import _grid_extension

    assert _grid_extension(_val_rows({1.0: 0.3, 10.0: 0.2, 100.0: 0.1}), "probit_projected") == [1000.0]
    assert _grid_extension(_val_rows({1e-3: 0.1, 1e-2: 0.2, 1.0: 0.3}), "probit_projected") == [1e-4]
    assert _grid_extension(_val_rows({1.0: 0.3, 10.0: 0.1, 100.0: 0.2}), "probit_projected") == []
    both = _val_rows({1.0: 0.1, 10.0: 0.2, 100.0: 0.3}) + _val_rows({1.0: 0.3, 10.0: 0.2, 100.0: 0.1}, "m2")
    assert _grid_extension(both, "probit_projected") == [0.1, 1000.0]
    # a test-set optimum on the edge does not count: δ is chosen on validation only
    test_rows = [{**r, "eval_set": "test", "kind": "test", "nll": -r["nll"]}
                 for r in _val_rows({1.0: 0.3, 10.0: 0.1, 100.0: 0.2})]
    assert _grid_extension(_val_rows({1.0: 0.3, 10.0: 0.1, 100.0: 0.2}) + test_rows, "probit_projected") == []


def test_pipeline_options_refuse_repeats_and_nonpositive_values():
    import argparse

    from laplace_debiased.evaluation.options import add_pipeline_arguments, resolve_options

    parser = argparse.ArgumentParser()
    add_pipeline_arguments(parser)
    for argv, match in [("--prior-precisions 1 1", "repeated"), ("--links probit probit", "repeated"),
                        ("--prior-precisions 0 1", "positive"), ("--methods kron_full kron_full", "repeated"),
                        ("--lock-timeout -1", "lock-timeout")]:
        with pytest.raises(ValueError, match=match):
            resolve_options(parser.parse_args(argv.split()))
