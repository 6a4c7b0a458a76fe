"""The ``main`` command (:mod:`laplace_debiased.commands.main`): the pipeline's errors become exit
status 2 with one line on stderr, rank 0 alone reports the paths, and ``run`` prints them."""

from __future__ import annotations

from pathlib import Path

import pytest

from laplace_debiased.commands import main
from laplace_debiased.evaluation import pipeline
from laplace_debiased.evaluation.sweep import OutputLockedError
from laplace_debiased.parallel import distributed

PATHS = {"results": Path("out/results.jsonl"), "report": Path("out/report/README.md")}


def test_the_pipeline_gets_the_resolved_options_and_the_report_switch(monkeypatch, parse_args):
    calls = []
    monkeypatch.setattr(pipeline, "run_pipeline", lambda opts, report: calls.append((opts, report)) or PATHS)
    args = parse_args("main", "--repeats", "3", "--methods", "kron_single", "kron_full")
    assert main.run_pipeline_command(args, report=False) == (0, PATHS)
    (opts, report), = calls
    assert report is False and opts["repeats"] == 3 and opts["methods"] == ["kron_single", "kron_full"]


@pytest.mark.parametrize("error", [ValueError("bad δ"), FileNotFoundError("no data"), OutputLockedError("held"),
                                   distributed.PeerRankError("rank 1 failed")])
def test_known_errors_are_exit_status_2_with_one_line(monkeypatch, capsys, parse_args, error):
    def fail(opts, report):
        raise error

    monkeypatch.setattr(pipeline, "run_pipeline", fail)
    assert main.run_pipeline_command(parse_args("main"), report=True) == (2, None)
    assert capsys.readouterr().err == f"laplace-debiased: error: {error}\n"


def test_a_bad_option_fails_before_the_pipeline_runs(monkeypatch, capsys, parse_args):
    monkeypatch.setattr(pipeline, "run_pipeline", lambda opts, report: pytest.fail("the pipeline ran"))
    assert main.run(parse_args("main", "--batch-size", "1")) == 2
    assert "--batch-size must be at least 2" in capsys.readouterr().err


def test_an_unexpected_error_is_not_swallowed(monkeypatch, parse_args):
    def fail(opts, report):
        raise RuntimeError("a bug")

    monkeypatch.setattr(pipeline, "run_pipeline", fail)
    with pytest.raises(RuntimeError, match="a bug"):
        main.run(parse_args("main"))


def test_only_rank_0_reports_the_paths(monkeypatch, capsys, parse_args):
    monkeypatch.setattr(pipeline, "run_pipeline", lambda opts, report: PATHS)
    monkeypatch.setattr(distributed, "rank_world", lambda: (1, 2))
    assert main.run(parse_args("main")) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(distributed, "rank_world", lambda: (0, 2))
    assert main.run(parse_args("main")) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"results: {PATHS['results']}",
                   f"report:  {PATHS['report']} (and {PATHS['report'].with_suffix('.html')})"]
