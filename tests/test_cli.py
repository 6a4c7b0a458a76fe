"""CLI: --help of every command of this package, config files, a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from laplace_debiased import cli
from laplace_debiased.evaluation.options import load_config, resolve_options
from laplace_debiased.evaluation.sweep import LOCK_NAME


def _help(cmd: str, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        cli.main([cmd, "--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_each_command_has_its_own_help_with_its_defaults(capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    texts = {cmd: " ".join(_help(cmd, capsys).split()) for cmd in cli.COMMANDS}
    assert len(set(texts.values())) == len(texts)  # main and sweep used to print the same text
    for cmd, text in texts.items():
        assert f"laplace-debiased {cmd}" in text and "--out" in text
    assert "(default: 32 128)" in texts["sweep"] and "(default: 3)" in texts["main"]  # batch sizes, repeats
    assert "(default: 50)" in texts["diagnose"] and "(default: ggn)" in texts["diagnose"]
    assert "cifar100" in texts["main"] and "cifar100" in texts["sweep"]
    for cmd in cli.THREADED:
        assert "--threads THREADS" in texts[cmd] and "(default: 7, from $OMP_NUM_THREADS)" in texts[cmd]


def _option_blocks(text: str) -> dict[str, str]:
    """``--flag`` -> its help, whitespace joined, from a rendered ``--help``."""
    blocks: dict[str, str] = {}
    name = None
    for line in text.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            name = line.split()[0].rstrip(",")
            blocks[name] = line
        elif name is not None:
            blocks[name] += " " + line.strip()
    return blocks


@pytest.mark.parametrize("omp", ["3", None])
def test_help_has_no_markup_and_each_default_once(capsys, monkeypatch, omp):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    for cmd in cli.COMMANDS:
        text = _help(cmd, capsys)
        for markup in ("``", "`][", ":mod:", ":func:", ":class:", ":data:", ":meth:"):
            assert markup not in text, (cmd, markup)
        for flag, block in _option_blocks(text).items():
            assert block.count("(default") <= 1, (cmd, flag, block)
    assert cli.plain_text("see [`run`][a.b.run] and [`a.b`][a.b], or ``x = 1``") == "see run and a.b, or x = 1"


def test_quiet_is_one_flag_with_one_meaning_across_commands(capsys, tmp_path):
    helps = {}
    for cmd in cli.THREADED:
        blocks = _option_blocks(_help(cmd, capsys))
        assert "--no-progress" not in blocks, cmd
        helps[cmd] = blocks["--quiet"]
    assert len(set(helps.values())) == 1, helps
    # diagnose's old spelling still works, sets the same switch and says which name to use
    parser, _ = cli.build_parser("diagnose")
    assert parser.parse_args(["--no-progress"]).quiet and not parser.parse_args([]).quiet
    assert "--no-progress is deprecated; use --quiet" in capsys.readouterr().err


def test_cli_and_every_help_import_no_torch():
    code = ("import sys, laplace_debiased.cli as cli\n"
            "for name in cli.COMMANDS: cli.build_parser(name)[0].format_help()\n"
            "heavy = sorted(m for m in ('torch', 'laplace', 'numpy', 'matplotlib') if m in sys.modules)\n"
            "print(','.join(heavy))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == ""


@pytest.mark.slow
@pytest.mark.parametrize("first", ["laplace_debiased", "laplace_debiased.two_batch.base",
                                   "laplace_debiased.eigen.laplace"])
def test_import_registers_the_debiased_structures_after_a_later_laplace_import(first):
    """A submodule that imports laplace itself (two_batch) used to meet a partly executed module."""
    lazy = "assert 'torch' not in sys.modules\n" if first == "laplace_debiased" else ""
    code = (f"import sys, {first}\n" + lazy +
            "import torch\n"
            "from laplace import Laplace\n"
            "m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
            "print(type(Laplace(m, 'classification', subset_of_weights='all', hessian_structure='debiased_kron')).__name__)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "DebiasedKronLaplace"


def test_the_cli_sets_the_wait_policy_before_torch_is_imported(tmp_path):
    """libgomp reads OMP_WAIT_POLICY once, when torch loads it: the CLI must set it first."""
    code = ("import os, sys\n"
            "from laplace_debiased import cli\n"
            "from laplace_debiased.commands import sweep\n"
            "def run(args):\n"
            "    print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)\n"
            "    return 0\n"
            "sweep.run = run\n"
            "cli.apply_threads = lambda n: None\n"
            "raise SystemExit(cli.main(['sweep', '--threads', '1', '--quiet']))\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert res.stdout.split() == ["PASSIVE", "False"]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**env, "OMP_WAIT_POLICY": "ACTIVE"})
    assert res.stdout.split() == ["ACTIVE", "False"]


def test_threads_are_applied_before_the_command_runs(monkeypatch, capsys):
    from laplace_debiased.commands import sweep

    calls = []
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a user's value stays (and the test leaks none)
    monkeypatch.setattr(cli, "apply_threads", lambda n: calls.append(("threads", n)))
    monkeypatch.setattr(sweep, "run", lambda args: calls.append(("run", hasattr(args, "threads"))) or 0)
    assert cli.main(["sweep", "--threads", "3", "--quiet"]) == 0
    assert calls == [("threads", 3), ("run", False)]
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    with pytest.raises(SystemExit):
        cli.main(["sweep", "--threads", "0"])
    assert "positive integer" in capsys.readouterr().err


def test_cifar100_is_a_data_choice_with_its_own_test_set(tmp_path, capsys):
    opts = resolve_options(argparse.Namespace(data="cifar100"))
    assert opts["eval"] == ["cifar100-test"]
    code = cli.main(["main", "--data", "cifar100", "--data-root", str(tmp_path / "nowhere"),
                     "--out", str(tmp_path / "out"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cifar-100" in err and "Traceback" not in err


def test_config_file_keys_mirror_flags_and_unknown_keys_fail(tmp_path):
    good = tmp_path / "c.toml"
    good.write_text('batch-size = 16\nrepeats = 1\nmethods = ["kron_single"]\n')
    assert load_config(good) == {"batch_size": 16, "repeats": 1, "methods": ["kron_single"]}
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"batchsize": 3}))
    with pytest.raises(ValueError, match="unknown option"):
        load_config(bad)
    assert cli.main(["sweep", "--config", str(bad)]) == 2


@pytest.mark.slow
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
    # the report states the setting: N, the batch sizes, what each evaluation set is
    setting = (out / "report" / "report.md").read_text().split("## MAP vs LA")[0]
    assert "N = 200 training points" in setting and "digits_cnn" in setting
    assert "| K-FAC, single batch of 32 | K-FAC from one batch of 32 training points" in setting
    assert "| K-FAC, debiased 16 + 16 | debiased K-FAC: directions (eigenvectors) from a batch B of 16" in setting
    assert "| noise-3 | the test images with Gaussian pixel noise σ = 0.4" in setting
    assert "| inverted (OOD) | the test images inverted, 1 − x: out of distribution" in setting
    assert not (out / LOCK_NAME).exists()  # a finished run leaves no lock file behind
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


@pytest.mark.parametrize("columns", ["40", "400"])
@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["main", "--help"], ["report", "--help"]])
def test_output_into_a_closed_pipe_is_no_traceback(argv, columns):
    """`laplace-debiased --help | head -5`: a reader that stops early closes the pipe. The
    command then stops quietly with status 1, as a tool cut off by its reader does, with no
    traceback and no "Exception ignored" from the interpreter's final flush; a command's own
    --help is argparse's, which ignores a failed write itself, and ends the same way. Here the
    pipe has no reader from the start, so every write to it fails, on any machine, at any load
    and at any help width (``COLUMNS``, which sets how much of the help fits in stdout's buffer)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([sys.executable, "-m", "laplace_debiased", *argv], stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120, env={**os.environ, "COLUMNS": columns})
    finally:
        os.close(write_end)
    assert res.stderr == "", res.stderr
    assert res.returncode == 1


def test_a_broken_pipe_that_is_not_stdout_propagates(monkeypatch, tmp_path):
    """Only standard output's lost reader is quiet: a command's own broken pipe (a worker's,
    a socket's) is an error with its traceback, here with stdout a file that is still open."""
    def broken(argv):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr(cli, "_dispatch", broken)
    with open(tmp_path / "out.txt", "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        with pytest.raises(BrokenPipeError, match="worker"):
            cli.main(["--help"])


def test_without_poll_a_finished_command_keeps_its_status(monkeypatch, capsys):
    """Where ``select.poll`` does not exist (Windows) nothing tells whether stdout lost its
    reader: a command that ran to its end keeps its own status, and only a broken pipe that
    was actually raised counts as stdout's."""
    import select

    monkeypatch.delattr(select, "poll")
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip()
