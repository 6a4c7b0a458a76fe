"""CLI: --help of every command of this package, config files, a tiny end-to-end run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from laplace_debiased import cli
from laplace_debiased.evaluation.pipeline import load_config


@pytest.mark.parametrize("cmd", ["main", "sweep", "report"])
def test_help(cmd, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--out" in out


def test_config_file_keys_mirror_flags_and_unknown_keys_fail(tmp_path):
    good = tmp_path / "c.toml"
    good.write_text('batch-size = 16\nrepeats = 1\nmethods = ["kron_single"]\n')
    assert load_config(good) == {"batch_size": 16, "repeats": 1, "methods": ["kron_single"]}
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"batchsize": 3}))
    with pytest.raises(ValueError, match="unknown option"):
        load_config(bad)
    assert cli.main(["sweep", "--config", str(bad)]) == 2


def test_tiny_end_to_end_run_and_resume(tmp_path, monkeypatch):
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({
        "train-size": 200, "epochs": 2, "subset": "last_layer", "methods": ["kron_single", "kron_debiased"],
        "repeats": 1, "batch-size": 32, "prior-precisions": [0.1, 10.0], "quiet": True,
    }))
    out = tmp_path / "out"
    assert cli.main(["--config", str(cfg), "--out", str(out), "--seed", "1"]) == 0
    rows = (out / "results.jsonl").read_text().splitlines()
    # MAP 6 sets (validation included) + 2 methods x G priors x 6 sets x 2 links, where the grid
    # of 2 grows at an edge holding a validation choice of δ
    n_grid = len({json.loads(r)["prior_precision"] for r in rows} - {None})
    assert n_grid >= 2 and len(rows) == 6 + 2 * n_grid * 6 * 2
    assert (out / "report" / "report.md").is_file() and (out / "report" / "report.html").is_file()
    # rerun: nothing new; a different setup in the same folder is refused
    assert cli.main(["sweep", "--config", str(cfg), "--out", str(out), "--seed", "1"]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)
    assert cli.main(["sweep", "--config", str(cfg), "--out", str(out), "--seed", "2"]) == 2
    assert cli.main(["report", str(out), "--out", str(tmp_path / "rep2")]) == 0
    assert (tmp_path / "rep2" / "fig6_probit_projected.png").is_file()
    assert cli.main(["report", str(tmp_path / "missing.jsonl")]) == 2


def test_python_dash_m_help():
    res = subprocess.run([sys.executable, "-m", "laplace_debiased", "--help"], capture_output=True, text=True)
    assert res.returncode == 0 and "sweep" in res.stdout


def test_missing_cifar_data_is_a_clear_error_not_a_traceback(tmp_path, capsys):
    code = cli.main(["main", "--data", "cifar10", "--data-root", str(tmp_path / "nowhere"),
                     "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cifar-10-batches-bin" in err and "Traceback" not in err
