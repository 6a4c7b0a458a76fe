"""Sweep engine: rows, resume after an interruption, truncated last line."""

from __future__ import annotations

import json

import pytest
import torch
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.evaluation import sweep
from laplace_debiased.evaluation.sweep import EvalSet, Method, load_rows, row_key, run_sweep


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
    methods = [Method("kron", fit, repeats=2)]
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
    real_grid = sweep.GridPredictive.grid

    def counting_grid(self, *a, **k):
        n_grid["n"] += 1
        return real_grid(self, *a, **k)

    monkeypatch.setattr(sweep.GridPredictive, "grid", counting_grid)
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
    assert len(sweep.DEFAULT_PRIOR_PRECISIONS) == 14
