"""Every script in examples/ runs end to end, prints its table and no debug lines (smoke tests).

The scripts share one model cache, which already holds the default digits MAP model (the
``digits_cache`` fixture of conftest.py trains it once per run), and run with one thread; each
takes more than 20 s on a busy 2-core machine, so all are marked ``slow``.  They are independent,
so xdist spreads them test by test over its workers.  Each asserts the table's point where it is
robust: finite numbers, the rows it promises.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
XDIST_PER_TEST = True  # see conftest.py: each example is its own xdist work unit


@pytest.fixture
def cache(digits_cache) -> Path:
    """The run's shared model cache: the digits MAP model is loaded, not trained again; each
    example adds the entries only it uses (other models, evaluation sets), each under its own key."""
    return digits_cache


def _dependency_notice(line: str) -> bool:
    """torch >= 2.15's deprecation notice for ``torch.jit.script``, which dependencies (asdl,
    linear_operator) print at import and no user can act on (docs: install), and its source line."""
    return "`torch.jit.script` is deprecated" in line or line.strip() == "warnings.warn("


def _run(args: list[str], cache: Path) -> str:
    env = {**os.environ, "LAPLACE_DEBIASED_CACHE": str(cache), "OMP_NUM_THREADS": "1"}
    # the timeout only guards against a hang: the quick start needs ~6 CPU-minutes, and a loaded
    # 2-core machine stretches that past 10 minutes of wall time (it hit 600 s at load 7)
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-2000:]
    stderr = "\n".join(line for line in done.stderr.splitlines() if not _dependency_notice(line))
    assert "Warning" not in stderr and "Traceback" not in stderr, done.stderr[-2000:]
    return done.stdout


def _numbers(line: str) -> list[float]:
    out = []
    for token in line.replace("/", " ").replace("±", " ").split():
        try:
            out.append(float(token))
        except ValueError:
            pass
    return out


def test_every_example_is_covered():
    assert set(EXAMPLES) == {"quickstart.py", "prior_sweep.py", "calibration_report.py", "regression.py",
                             "kron_digits.py", "eigen_digits.py", "adapter_sequence.py"}


@pytest.mark.slow
def test_quickstart(cache):
    out = _run(["examples/quickstart.py"], cache)
    lines = out.splitlines()
    assert len(lines) == 6, out  # setting, header, MAP, the two δ choices, all-data K-FAC: nothing else
    rows = {line[:38].strip(): _numbers(line[38:]) for line in lines[2:]}
    assert set(rows) == {"MAP", "debiased_kron 32 + 32, δ by val. NLL", "debiased_kron 32 + 32, δ by marglik",
                         "kron, all 300 images, val. NLL"}
    assert rows["debiased_kron 32 + 32, δ by val. NLL"][1] < rows["MAP"][0]  # test NLL: the LA helps


@pytest.mark.slow
def test_prior_sweep(cache):
    out = _run(["examples/prior_sweep.py", "--draws", "1"], cache)
    rows = [_numbers(line) for line in out.splitlines()[2:-1]]
    assert len(rows) == 7 and all(len(r) == 6 for r in rows), out
    assert "best full-batch" in out.splitlines()[-1]


@pytest.mark.slow
def test_calibration_report(cache, tmp_path):
    out = _run(["examples/calibration_report.py", "--out", str(tmp_path / "rep")], cache)
    assert "noise-3" in out and (tmp_path / "rep" / "report" / "report.md").is_file(), out


@pytest.mark.slow
def test_regression(cache):
    out = _run(["examples/regression.py"], cache)
    rows = {line.split("  ")[0]: _numbers(line) for line in out.splitlines()[2:]}
    assert len(rows) == 5, out
    map_outside = rows["MAP, σ from the training residuals"][-1]
    assert rows["debiased_kron, 2 x 32, glm"][-1] < map_outside  # less overconfident off the data


@pytest.mark.slow
def test_kron_digits(cache):
    out = _run(["examples/kron_digits.py"], cache)
    rows = {line.split("  ")[0].strip(): _numbers(line) for line in out.splitlines()[2:]}
    for name in ("MAP", "kron (single batch)", "debiased_kron", "kron (full batch)"):
        assert name in rows, out
    assert 0.0 < rows["debiased_kron"][1] < 2.31  # finite, and better than uniform (log 10)


@pytest.mark.slow
def test_eigen_digits_quick(cache):
    out = _run(["examples/eigen_digits.py", "--quick"], cache)
    assert "lowrank b+b" in out and "LL full all data" in out and "seed 0" not in out, out


@pytest.mark.slow
def test_adapter_sequence(cache):
    out = _run(["examples/adapter_sequence.py", "--samples", "20"], cache)
    rows = {line[:22].strip(): line.split() for line in out.splitlines()[2:]}
    for name in ("MAP", "kron (single batch)", "debiased_kron", "kron (full batch)"):
        assert name in rows, out
    nll = float(rows["debiased_kron"][-4])
    assert 0.0 < nll < 1.3863  # finite and better than uniform over 4 classes (log 4)
