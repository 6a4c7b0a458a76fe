"""The wide-layer benchmark (``benchmarks/wide_predict.py``): the decompositions its floor counts
for the default (``"corrected"``) estimate, and the shrunk and stein ones, of one factor in each
regime of rows against width, and the ratios its table derives."""

from __future__ import annotations

import pytest
import torch

from benchmarks.wide_predict import _markdown
from laplace_debiased.kron.corrected import corrected_kron


def _eigh_shapes(d: int, rows: int, rule: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the ``eigh`` calls of the ``rule`` estimate of one ``d × d`` factor whose two
    batches have ``rows`` rows each (float64 rows, ``F = XᵀX``)."""
    g = torch.Generator().manual_seed(d + rows)
    Xd, Xm = (torch.randn(rows, d, generator=g, dtype=torch.float64) for _ in range(2))
    calls: list[int] = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda A, *a, **k: calls.append(A.shape[-1]) or eigh(A, *a, **k))
    corrected_kron([[Xd.T @ Xd]], [[Xm.T @ Xm]], 8, 8, rows=[[(Xd, Xm)]], rule=rule)
    return sorted(calls)


@pytest.mark.parametrize(("d", "rows", "sizes"), [
    (12, 16, [12, 12, 12]),  # each batch's rows reach the width: the pooled factor and both orders densely
    (24, 16, [16, 16, 24]),  # the pooled rows reach it, a batch's do not: the orders through their Gram matrices
    (40, 16, [16, 16, 32]),  # neither: everything through the rows (the pooled Gram matrix of 2 × 16 rows)
])
@pytest.mark.parametrize("rule", ["corrected", "shrunk", "stein"])
def test_the_floor_counts_the_decompositions_of_the_default_estimate(d, rows, sizes, rule, monkeypatch):
    """``floor``'s premise: the pooled factor at ``min(d, 2 rows)`` and each order at ``min(d, rows)``."""
    assert _eigh_shapes(d, rows, rule, monkeypatch) == sizes
    assert sorted([min(d, 2 * rows), min(d, rows), min(d, rows)]) == sizes


def test_the_table_divides_by_stock_in_wall_clock_cpu_and_floor():
    def row(structure: str, fit: float, cpu: float) -> dict:
        return {"which": f"mlp:{structure}:64", "model": "mlp", "structure": structure, "width": 64, "fit_s": fit,
                "fit_cpu_s": cpu, "first_use_s": 0.0, "la_first_ms": 1.0, "la_later_ms": 1.0, "grid14_ms": 1.0,
                "peak_gb": 0.5}

    skipped = {"which": "mlp:debiased_full:64", "model": "mlp", "structure": "debiased_full", "width": 64,
               "skipped": "not run: reason"}
    floors = [{"which": "floor:eigh:64", "width": 64, "eigh64_s": 0.5, "eigh32_s": 0.25, "default_floor_s": 1.5,
               "paper_floor_s": 0.5}]
    text = _markdown([row("kron", 4.0, 2.0), row("debiased_kron", 1.0, 1.5), skipped], floors, "cmd", (0.25, 1.5))
    lines = text.splitlines()
    assert "1-minute load average 0.2 at the start, 1.5 at the end" in lines[0]  # the machine's state, measured
    header = next(line for line in lines if line.startswith("| model"))
    mine = next(line for line in lines if "| debiased_kron |" in line)
    assert [c.strip() for c in mine.split("|")[4:8]] == ["1.0", "0.25", "1.5", "0.75"]  # wall and CPU ratios
    assert next(line for line in lines if "not run" in line).count("|") == header.count("|")
    floor = next(line for line in lines if line.startswith("| 64 |"))
    assert [c.strip() for c in floor.split("|")[1:-1]] == ["64", "0.50", "0.25", "1.00", "1.50", "0.50", "2.00", "0.75"]
