"""The ``report`` command (:mod:`laplace_debiased.commands.report`): a results file or its folder,
the default report folder beside it, and exit status 2 on missing or bad results."""

from __future__ import annotations

from pathlib import Path

import pytest

from laplace_debiased.commands import report
from laplace_debiased.evaluation import report_page as evaluation_report


@pytest.fixture
def written(monkeypatch):
    """Calls of the report writer (``(results, out, title)``); it writes nothing."""
    calls = []

    def write_report(path: Path, out: Path, title: str) -> Path:
        calls.append((path, out, title))
        return out / "README.md"

    monkeypatch.setattr(evaluation_report, "write_report", write_report)
    return calls


def test_a_results_folder_means_its_results_file_and_the_report_goes_beside_it(tmp_path, capsys, parse_args, written):
    (tmp_path / "results.jsonl").write_text("")
    assert report.run(parse_args("report", str(tmp_path))) == 0
    assert written == [(tmp_path / "results.jsonl", tmp_path / "report", "Calibration report")]
    md = tmp_path / "report" / "README.md"
    assert capsys.readouterr().out == f"report: {md} (and {md.with_suffix('.html')})\n"


def test_a_results_file_with_an_explicit_folder_and_title(tmp_path, parse_args, written):
    results = tmp_path / "run.jsonl"
    results.write_text("")
    assert report.run(parse_args("report", str(results), "--out", str(tmp_path / "r"), "--title", "T")) == 0
    assert written == [(results, tmp_path / "r", "T")]


def test_missing_results_are_exit_status_2_with_a_hint(tmp_path, capsys, parse_args, written):
    assert report.run(parse_args("report", str(tmp_path))) == 2
    assert not written
    err = capsys.readouterr().err
    assert str(tmp_path / "results.jsonl") in err and "laplace-debiased sweep" in err


def test_unreadable_results_are_exit_status_2(tmp_path, capsys, parse_args):
    (tmp_path / "results.jsonl").write_text("not json\n")
    assert report.run(parse_args("report", str(tmp_path))) == 2
    assert capsys.readouterr().err.startswith("laplace-debiased: error: ")
