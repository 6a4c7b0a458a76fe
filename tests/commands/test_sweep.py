"""The ``sweep`` command (:mod:`laplace_debiased.commands.sweep`): the pipeline without its report,
printing the results file only, and exit status 2 on a bad option."""

from __future__ import annotations

from pathlib import Path

import pytest

from laplace_debiased.commands import sweep
from laplace_debiased.evaluation import pipeline


def test_the_sweep_runs_the_pipeline_without_a_report_and_prints_the_results(monkeypatch, capsys, parse_args):
    calls = []
    paths = {"results": Path("o/results.jsonl"), "report": Path("o/report/README.md")}
    monkeypatch.setattr(pipeline, "run_pipeline", lambda opts, report: calls.append(report) or paths)
    assert sweep.run(parse_args("sweep", "--out", "o")) == 0
    assert calls == [False]
    assert capsys.readouterr().out == "results: o/results.jsonl\n"


def test_a_bad_option_is_exit_status_2(monkeypatch, capsys, parse_args):
    monkeypatch.setattr(pipeline, "run_pipeline", lambda opts, report: pytest.fail("the pipeline ran"))
    assert sweep.run(parse_args("sweep", "--methods", "kron_single", "kron_single")) == 2
    assert "repeated method" in capsys.readouterr().err
