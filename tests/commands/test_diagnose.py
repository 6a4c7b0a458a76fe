"""The ``diagnose`` command (:mod:`laplace_debiased.commands.diagnose`) through the CLI: a report
on a tiny model, and a clear error for missing input."""

from __future__ import annotations

import json

import torch
from torch import nn

from laplace_debiased.cli import main


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
