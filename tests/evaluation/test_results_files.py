"""Results files: malformed lines, the read-only report, options.json, the output-folder lock."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import textwrap
from argparse import Namespace
from pathlib import Path

import pytest

from _env import pythonpath
from laplace_debiased.commands import report as report_cmd
from laplace_debiased.evaluation import pipeline
from laplace_debiased.evaluation.options import DEFAULTS
from laplace_debiased.evaluation.sweep import (
    LOCK_NAME,
    OutputLockedError,
    load_rows,
    output_lock,
    row_key,
)

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"method": "map", "repeat": 0, "prior_precision": None, "eval_set": "test", "kind": "test",
        "severity": None, "link": "map", "full_batch": False, "accuracy": 1.0, "nll": 0.1, "ece": 0.0,
        "brier": 0.0}


@pytest.mark.parametrize("bad", [b"{}", b"[]", b"42", b"\0\0\0\0", b'{"method": 3, "repeat": 0, '
                                 b'"prior_precision": null, "eval_set": "t", "link": "map"}', b"\xff\xfe"])
def test_malformed_line_is_an_error_naming_file_and_line(tmp_path, bad):
    path = tmp_path / "results.jsonl"
    content = (json.dumps(GOOD) + "\n").encode() + bad + b"\n"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"{path}:2: "):
        load_rows(path)
    # the read-only report command says the same and leaves its input alone
    assert report_cmd.run(Namespace(results=path, out=tmp_path / "rep", title="t")) == 2
    assert path.read_bytes() == content


def test_truncated_last_line_is_skipped_with_a_warning_and_never_written(tmp_path):
    path = tmp_path / "results.jsonl"
    content = (json.dumps(GOOD) + "\n").encode() + b'{"method": "kr'
    path.write_bytes(content)
    with pytest.warns(UserWarning, match="incomplete last line"):
        rows = load_rows(path)
    assert [row_key(r) for r in rows] == ["map|0|map|test|map"]
    assert path.read_bytes() == content


def test_report_command_never_writes_its_input(tmp_path):
    path = tmp_path / "results.jsonl"
    content = b"\0" * 40  # a crash-extended file: NUL bytes, no newline
    path.write_bytes(content)
    with pytest.warns(UserWarning):
        assert report_cmd.run(Namespace(results=path, out=tmp_path / "rep", title="t")) == 2
    assert path.read_bytes() == content


def _opts(**kw) -> dict:
    return {**DEFAULTS, **kw}


def test_options_file_guards_resume(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    pipeline.check_settings(out, _opts())
    saved = json.loads((out / "options.json").read_text())
    assert saved["chunk_size"] == 64 and saved["n_samples"] == 100
    assert sorted(p.name for p in out.iterdir()) == ["options.json"]  # written via a temp file + rename
    pipeline.check_settings(out, _opts(prior_precisions=[1.0], links=["mc"], repeats=9))  # extends: fine
    for key, value in [("chunk_size", 32), ("n_samples", 10), ("seed", 1), ("subset", "last_layer")]:
        with pytest.raises(ValueError, match=key):
            pipeline.check_settings(out, _opts(**{key: value}))
    # truncated options.json: an error naming the file
    text = (out / "options.json").read_text()
    (out / "options.json").write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=str(out / "options.json")):
        pipeline.check_settings(out, _opts())
    (out / "options.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=str(out / "options.json")):
        pipeline.check_settings(out, _opts())


def test_results_without_options_file_are_refused(tmp_path):
    (tmp_path / "results.jsonl").write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError, match="no options.json"):
        pipeline.check_settings(tmp_path, _opts())
    assert not (tmp_path / "options.json").exists()


_HOLDER = textwrap.dedent("""
    import sys
    from laplace_debiased.evaluation.sweep import output_lock
    with output_lock(sys.argv[1]):
        print("locked", flush=True)
        sys.stdin.readline()  # holds the lock until told to let go: no timing involved
        print("releasing", flush=True)
""")


def _hold(folder: Path) -> subprocess.Popen:
    """A process that holds ``folder``'s lock until a line arrives on its stdin."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env={"PYTHONPATH": pythonpath(ROOT), "PATH": ""})
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.slow
def test_a_second_process_is_refused_or_waits(tmp_path):
    holder = _hold(tmp_path)
    try:
        with pytest.raises(OutputLockedError, match=f"another run \\(pid {holder.pid}\\) holds the lock"):
            with output_lock(tmp_path):
                pass
        holder.stdin.write("let go\n")
        holder.stdin.flush()
        # waits until the holder lets go (the timeout only guards against a hang): by the time
        # this process holds the lock, the holder has printed that it is releasing it
        with output_lock(tmp_path, timeout=600):
            assert select.select([holder.stdout], [], [], 0)[0], "got the lock before the holder let go"
            assert holder.stdout.readline().strip() == "releasing"
    finally:
        holder.kill()
        holder.wait()
    with output_lock(tmp_path):
        with output_lock(tmp_path):  # re-entrant within a process
            assert (tmp_path / LOCK_NAME).exists()
        assert (tmp_path / LOCK_NAME).exists()  # the inner exit keeps the outer's lock file
    assert not (tmp_path / LOCK_NAME).exists()  # a finished writer leaves no lock file behind


def test_a_lock_on_a_removed_lock_file_is_not_current(tmp_path):
    """A waiter that locks the file a finished holder removed must not count it as held: another
    process may already hold the new file at that name."""
    from laplace_debiased.evaluation.sweep import _is_current

    path = tmp_path / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        assert _is_current(fd, path)
        path.unlink()
        assert not _is_current(fd, path)
        path.write_text("another holder\n")  # a new file at the same name
        assert not _is_current(fd, path)
    finally:
        os.close(fd)
    with output_lock(tmp_path):  # the new file is locked and then removed
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())
    assert not path.exists()


_SWEEPER = textwrap.dedent("""
    import sys, torch
    from laplace import Laplace
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from laplace_debiased.evaluation.sweep import EvalSet, SweepJob, run_sweep
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
    X, y = torch.randn(40, 4), torch.randint(0, 3, (40,))
    def fit(repeat):
        la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="kron")
        la.fit(DataLoader(TensorDataset(X, y), batch_size=10))
        return la
    sets = [EvalSet("test", X[:12], y[:12]), EvalSet("ood", 5 * X[12:20], kind="ood")]
    run_sweep([SweepJob("kron", fit, repeats=3)], sets, sys.argv[1], prior_precisions=(0.1, 1.0, 10.0),
              links=("probit_projected", "mc"), n_samples=10, progress=False, map_model=model,
              lock_timeout=120)
""")


@pytest.mark.slow
def test_two_concurrent_sweeps_write_every_row_once(tmp_path):
    path = tmp_path / "results.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", _SWEEPER, str(path)], cwd=ROOT,
                              env={"PYTHONPATH": pythonpath(ROOT), "PATH": "", "OMP_NUM_THREADS": "1"},
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
    keys = [row_key(r) for r in load_rows(path)]
    assert len(keys) == len(set(keys)) == 2 + 3 * 3 * 2 * 2  # MAP + repeats x priors x sets x links


def test_resuming_results_of_another_software_version_is_refused(tmp_path, monkeypatch):
    """Rows written by another release of this package (or of laplace-torch) hold other numbers for
    the same keys (an estimator changed, say): a resume would mix them into one report."""
    out = tmp_path / "out"
    out.mkdir()
    pipeline.check_settings(out, _opts())
    saved = json.loads((out / "options.json").read_text())
    assert set(saved["software"]) == {"laplace-debiased", "laplace-torch"}
    pipeline.check_settings(out, _opts())  # the same versions: resumes
    newer = {**saved["software"], "laplace-debiased": "9.9"}
    monkeypatch.setattr(pipeline, "software_versions", lambda: newer)
    with pytest.raises(ValueError, match=r"laplace-debiased.*9\.9.*choose another --out"):
        pipeline.check_settings(out, _opts())
    assert json.loads((out / "options.json").read_text()) == saved  # nothing rewritten
    del saved["software"]  # a folder written before the versions were recorded
    (out / "options.json").write_text(json.dumps(saved))
    with pytest.raises(ValueError, match="an older release"):
        pipeline.check_settings(out, _opts())
