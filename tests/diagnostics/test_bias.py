"""The bias diagnosis end to end: statistics on least squares, the report, the CLI."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from laplace_debiased.cli import main
from laplace_debiased.diagnostics.bias import DiagnosisConfig, batch_size_for_tolerance, diagnose_bias
from laplace_debiased.diagnostics.report import write_report
from laplace_debiased.diagnostics.summary import summarize


def wide_least_squares(N: int = 160, P: int = 24, seed: int = 0):
    """Linear regression with more features than points per batch: batch GGNs are rank-deficient."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(N, P, generator=g, dtype=torch.float64) * torch.linspace(0.5, 1.5, P, dtype=torch.float64)
    y = X @ torch.randn(P, 1, generator=g, dtype=torch.float64) + 0.5 * torch.randn(N, 1, generator=g, dtype=torch.float64)
    model = nn.Linear(P, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.linalg.lstsq(X, y).solution.T)
    return model, X, y


@pytest.fixture(scope="module")
def diagnosis():
    model, X, y = wide_least_squares()
    config = DiagnosisConfig(batch_size=8, beta=1e-3, top_k=4, cg_steps=4, n_sources=4, ladder=(8, 32, 80),
                             tolerance=0.1, seed=0)
    return diagnose_bias(model, nn.MSELoss(), X, y, config)


def test_same_batch_overestimates_independent_batch_does_not(diagnosis):
    s = summarize(diagnosis)
    same = s["eigen"]["curvature_bias_same_batch"]
    other = s["eigen"]["curvature_bias_other_batches"]
    # rank-8 batch matrices of a 24-dimensional problem: the top is inflated far beyond noise
    assert same["q25"] > 0.3
    assert abs(other["median"]) < 0.25 < same["median"]
    # the bias shrinks with the batch size, and the ladder names a batch size for the tolerance
    medians = [r["same_batch"]["median"] for r in s["batch_size_ladder"]]
    assert medians[0] > medians[-1]
    assert s["batch_size_within_tolerance"] is None or s["batch_size_within_tolerance"] > 8
    # Eq. 5 in float64, Eq. 7 on the full data's top eigenvalue
    assert s["eq5_max_relative_residual"] < 1e-12
    assert s["eq7_top_eigenvalue"]["same_batch_mean"] > s["eq7_top_eigenvalue"]["full_data"]


def test_kfac_of_single_output_linear_model_is_exact(diagnosis):
    # K-FAC (type-2) of a bias-free linear layer with one output is the GGN itself
    for row in diagnosis.kfac_ladder:
        torch.testing.assert_close(row.full, row.full_ggn, rtol=1e-9, atol=0)


def test_product_counts_are_accounted(diagnosis):
    eig = diagnosis.products["eigenvectors"]
    M, K, S = 160 // 8, 4, 4
    # Lanczos is dense for P = 24 (P products per source), then K per batch for every source,
    # plus K on all data for the Eq. 5 check of the first source
    assert eig == {8: S * 24 + S * M * K, 160: K}


def test_report_renders(diagnosis, tmp_path):
    s = write_report(diagnosis, tmp_path, plan={"eigenvectors": "planned"})
    for name in ("slice.png", "eigen.png", "overlap.png", "cg.png", "batch_sizes.png", "README.md", "bias.json"):
        assert (tmp_path / name).stat().st_size > 0
    payload = json.loads((tmp_path / "bias.json").read_text())
    assert payload["summary"]["eigen"]["curvature_bias_same_batch"]["median"] == pytest.approx(
        s["eigen"]["curvature_bias_same_batch"]["median"])
    assert len(payload["details"]["eigen"][0]["curvatures"]) == 160 // 8
    text = (tmp_path / "README.md").read_text()
    median = s["eigen"]["curvature_bias_same_batch"]["median"]
    word = "over" if median >= 0 else "under"  # a negative median used to read "over-estimated by -10 %"
    assert f"{word}-estimated by a median of {100 * abs(median):.0f} %" in text and "Planned" in text


def test_batch_size_for_tolerance():
    assert batch_size_for_tolerance([10, 20, 40], [0.5, 0.08, 0.01], 0.1) == (20, False)
    size, extrapolated = batch_size_for_tolerance([10, 20, 40], [0.8, 0.4, 0.2], 0.1)
    assert extrapolated and size == 80
    assert batch_size_for_tolerance([10, 20], [0.3, 0.5], 0.1) == (None, True)


def test_cli_renders_report_on_tiny_model(tmp_path, capsys):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    X, y = torch.randn(48, 4), torch.randint(0, 3, (48,))
    torch.save(model, tmp_path / "model.pt")
    torch.save({"X": X, "y": y}, tmp_path / "data.pt")
    out = tmp_path / "report"
    argv = ["diagnose", "--model-file", str(tmp_path / "model.pt"), "--data", str(tmp_path / "data.pt"),
            "--out", str(out), "--batch-size", "8", "--top-k", "3", "--cg-steps", "3", "--sources", "2",
            "--batch-sizes", "8", "16", "--dtype", "float64", "--no-progress", "--beta", "0.01", "--no-kfac"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "planned curvature-vector products" in printed
    summary = json.loads((out / "bias.json").read_text())["summary"]
    assert summary["n_params"] == 51 and summary["n_batches"] == 6
    assert (out / "slice.png").stat().st_size > 0


def test_cli_bad_input_is_explained(tmp_path, capsys):
    assert main(["diagnose", "--model-file", str(tmp_path / "missing.pt")]) == 2
    assert "pass both --model-file and --data" in capsys.readouterr().err
