"""The frontier benchmark (``benchmarks/frontier.py``): its shared-Jacobian probit NLL against the
package's GridPredictive, and a smoke run of ``--setting cifar10`` on a tiny synthetic data set
written in the official CIFAR-10 binary layout (no real data)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from laplace import KronLaplace
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.cifar10.config import BASE_GRID
from benchmarks import frontier
from benchmarks.frontier import cifar10_setting, main, probit_nlls
from laplace_debiased.evaluation.metrics import nll
from laplace_debiased.posterior.from_laplace import posterior_structure
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
from tests.test_benchmark_smoke import write_cifar10_bin


@pytest.fixture
def tiny_cifar(tmp_path, monkeypatch):
    """60 training records (48 train / 12 validation after the split), 40 test records."""
    root = tmp_path / "data"
    write_cifar10_bin(root, n_per_batch=12, n_test=40)
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "cache"))
    return root


def test_shared_jacobian_nll_matches_grid_predictive(tiny_cifar):
    """One Jacobian pass for several fits gives each fit's GridPredictive probit NLL; a cross-fit
    (mixture) structure and an EKFAC structure go through the same path."""
    torch.manual_seed(0)
    s = cifar10_setting(tiny_cifar, n_test=30, epochs=1)
    grid = [1e-3, 1.0, 10.0]
    loader = DataLoader(s.train, batch_size=8, shuffle=False)
    kron = KronLaplace(s.model, "classification")
    kron.fit(DataLoader(s.train, batch_size=len(s.train)))
    cross = DebiasedEKFACLaplace(s.model, "classification", n_magnitude_batches=2, generator=torch.Generator().manual_seed(0), cross_fit=True)
    cross.fit(loader)
    got = probit_nlls(s.model, {"kron": posterior_structure(kron), "cross": posterior_structure(cross)},
                      s.X, s.y, grid, chunk_size=7)
    for name, la in (("kron", kron), ("cross", cross)):
        probs = GridPredictive(la, chunk_size=11).grid(s.X, grid, links=("probit",))["probit"]
        np.testing.assert_allclose(got[name], [nll(p.double(), s.y) for p in probs], rtol=1e-6)
    assert got["kron"] != got["cross"]


@pytest.mark.slow
def test_cifar10_setting_smoke(tiny_cifar, tmp_path, monkeypatch):
    monkeypatch.setattr(frontier, "KS", (1, 2))  # B̃ of 1 and 2 batches: the same code, fewer fits
    out = tmp_path / "out"
    args = ["--setting", "cifar10", "--data", str(tiny_cifar), "--out", str(out), "--epochs", "1",
            "--draws", "1", "--batch", "4", "--n-test", "20"]
    assert main(args) == 0
    res = json.loads((out / "frontier_cifar10.json").read_text())
    s = res["setting"]
    assert (s["model"], s["n_train"], s["n_test"], s["batch"], s["draws"]) == ("cifar_cnn", 48, 20, 4, 1)
    assert s["grid"] == list(BASE_GRID)
    assert {r["k"] for r in res["summary"]} == {0, 1, 2}
    for r in res["summary"]:
        assert r["touched"] == 4 * (1 + r["k"]) if r["k"] else r["touched"] == 4
        assert 0 <= r["gap_own_mean"] <= r["gap_own_worst"]
    for fam in ("kfac", "ekfac"):
        assert res["references"][fam]["touched"] == 48
        assert len(res["references"][fam]["nll"]) == len(BASE_GRID)
    # every draw of a method records its own tracking error against its family's reference
    for row in res["rows"].values():
        ref = res["references"][row["family"]]["nll"]
        for d in row["draws"]:
            assert d["gap"][row["family"]] == pytest.approx(max(abs(a - b) / b for a, b in zip(d["nll"], ref)))
    md = (out / "frontier_cifar10.md").read_text()
    assert "cifar_cnn" in md and "Pareto" in md and "δ of the max" in md and "at each prior precision" in md
    assert "`python benchmarks/frontier.py --setting cifar10 --draws 1 --batch 4 --n-test 20`" in md
    assert (out / "frontier_cifar10.png").stat().st_size > 0
    # --replot rewrites the table from the JSON alone
    (out / "frontier_cifar10.md").unlink()
    assert main(["--setting", "cifar10", "--out", str(out), "--replot"]) == 0
    assert (out / "frontier_cifar10.md").read_text() == md
