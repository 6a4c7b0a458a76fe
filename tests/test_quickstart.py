"""The quick start, as the README and docs/getting-started/quickstart.md print it.

It runs as written: copied into a file and run in a fresh process with every ``UserWarning`` an
error, it exits cleanly and prints nothing on stderr (no warning a user cannot act on).

Its LA at the validation-chosen prior precision does not lose to its MAP network on held-out data.
The check is statistical, not a tuned threshold.  With d_i the LA's NLL minus the MAP's NLL on
test point i (the same points, so the difference is paired), the LA is said to lose only if the
mean of d exceeds three standard errors s_d / sqrt(n).  If the LA were in truth exactly as good as
the MAP, that happens with probability about 0.13 % (one-sided normal tail; n = 1,000 test
points).  The same check flags the LA at a small δ, where it is clearly worse, so it can fail.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
Z = 3.0  # standard errors: one-sided false-alarm probability 0.13 %


def _block(path: Path) -> str:
    """The first ```python block of the quick-start section of ``path``."""
    text = path.read_text()
    section = text[text.index("Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S)[1]


def test_readme_and_docs_show_the_same_quick_start():
    readme, docs = _block(ROOT / "README.md"), _block(ROOT / "docs/getting-started/quickstart.md")
    assert readme == docs
    assert 'method="gridsearch", val_loader=val_loader' in readme  # validation NLL is the default


@pytest.mark.slow
def test_readme_quick_start_runs_as_written_without_warnings(tmp_path):
    script = tmp_path / "quickstart.py"
    script.write_text(_block(ROOT / "README.md"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-W", "error::UserWarning", str(script)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stderr == "", f"the quick start prints warnings or errors:\n{run.stderr}"
    assert re.fullmatch(r"δ = \S+: test NLL \d\.\d{3}, MAP network \d\.\d{3}\n", run.stdout), run.stdout


def _loses(probs: torch.Tensor, map_probs: torch.Tensor, y: torch.Tensor) -> tuple[bool, float, float]:
    """Whether the LA's mean NLL exceeds the MAP's by more than Z standard errors (paired)."""
    rows = torch.arange(len(y))
    d = (map_probs[rows, y].log() - probs[rows, y].clamp_min(1e-12).log()).double()
    mean, se = float(d.mean()), float(d.std() / len(d) ** 0.5)
    return mean > Z * se, mean, se


@pytest.fixture(scope="module")
def quick_start():
    """The README's block run in this process: its names, and the MAP's test probabilities."""
    namespace = {}
    exec(compile(_block(ROOT / "README.md"), "README quick start", "exec"), namespace)  # noqa: S102
    with torch.no_grad():
        map_probs = namespace["model"](namespace["x_test"]).softmax(-1)
    return namespace, map_probs


@pytest.mark.slow
def test_quick_start_la_does_not_lose_to_the_map_on_held_out_nll(quick_start):
    namespace, map_probs = quick_start
    loses, mean, se = _loses(namespace["probs"], map_probs, namespace["y_test"])
    assert not loses, f"LA minus MAP test NLL {mean:.4f} > {Z} x {se:.4f} at δ = {float(namespace['la'].prior_precision):.3g}"


@pytest.mark.slow
def test_the_check_can_fail_at_a_small_prior_precision(quick_start):
    namespace, map_probs = quick_start
    la = namespace["la"]
    la.prior_precision = 1e-2  # far below the validation choice: broad posterior, diffuse predictive
    probs = la(namespace["x_test"], pred_type="glm", link_approx="probit")
    loses, mean, se = _loses(probs, map_probs, namespace["y_test"])
    assert loses, (mean, se)
