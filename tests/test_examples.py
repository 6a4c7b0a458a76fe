"""The examples run end to end and print a row for every posterior (smoke tests)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], tmp_path: Path) -> str:
    env = {**os.environ, "LAPLACE_DEBIASED_CACHE": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_kron_example_prints_every_posterior(tmp_path):
    out = _run(["examples/kron_digits.py", "--select", "val"], tmp_path)
    rows = {line.split("  ")[0].strip(): line.split() for line in out.splitlines()[2:]}
    for name in ("MAP", "kron (single batch)", "debiased_kron", "kron (full batch)"):
        assert name in rows, out
    nll = float(rows["debiased_kron"][-4])  # columns: prior prec, NLL, ECE, fit s, diag-probit NLL
    assert 0.0 < nll < 2.31  # finite, and better than uniform predictions (log 10)


def test_eigen_example_quick(tmp_path):
    out = _run(["examples/eigen_digits.py", "--quick"], tmp_path)
    assert "lowrank" in out and "full" in out, out
