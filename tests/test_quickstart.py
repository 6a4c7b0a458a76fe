"""The quick start, as the README and docs/getting-started/quickstart.md print it, on a small MLP:
the LA at the validation-chosen prior precision does not lose to the MAP network on held-out data.

The check is statistical, not a tuned threshold.  With d_i the LA's NLL minus the MAP's NLL on
test point i (the same points, so the difference is paired), the LA is said to lose only if the
mean of d exceeds three standard errors s_d / sqrt(n).  If the LA were in truth exactly as good as
the MAP, that happens with probability about 0.13 % (one-sided normal tail; n = 400 points).  The
same check flags the LA at a small δ, where it is clearly worse, so it can fail.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from laplace_debiased.data.digits import digits_splits

ROOT = Path(__file__).resolve().parent.parent
N_TEST = 400
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


def _small_mlp_map(train) -> nn.Module:
    """An MLP trained to near-zero training loss without weight decay (overconfident, as the
    main job's MAP is)."""
    torch.manual_seed(0)
    x, y = train.tensors
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(300):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.eval()


def _loses(probs: torch.Tensor, map_probs: torch.Tensor, y: torch.Tensor) -> tuple[bool, float, float]:
    """Whether the LA's mean NLL exceeds the MAP's by more than Z standard errors (paired)."""
    rows = torch.arange(len(y))
    d = (map_probs[rows, y].log() - probs[rows, y].clamp_min(1e-12).log()).double()
    mean, se = float(d.mean()), float(d.std() / len(d) ** 0.5)
    return mean > Z * se, mean, se


@pytest.fixture(scope="module")
def quick_start():
    splits = digits_splits()
    model = _small_mlp_map(splits["train"])
    namespace = {
        "model": model,
        "train_loader": DataLoader(splits["train"], batch_size=32, shuffle=True,
                                   generator=torch.Generator().manual_seed(0)),
        "val_loader": DataLoader(splits["val"], batch_size=256),
        "x": splits["test"].tensors[0][:N_TEST],
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="By default `link_approx`")
        exec(compile(_block(ROOT / "README.md"), "README quick start", "exec"), namespace)  # noqa: S102
    y = splits["test"].tensors[1][:N_TEST]
    with torch.no_grad():
        map_probs = model(namespace["x"]).softmax(-1)
    return namespace, map_probs, y


@pytest.mark.slow
def test_quick_start_la_does_not_lose_to_the_map_on_held_out_nll(quick_start):
    namespace, map_probs, y = quick_start
    loses, mean, se = _loses(namespace["probs"], map_probs, y)
    assert not loses, f"LA minus MAP test NLL {mean:.4f} > {Z} x {se:.4f} at δ = {float(namespace['la'].prior_precision):.3g}"


@pytest.mark.slow
def test_the_check_can_fail_at_a_small_prior_precision(quick_start):
    namespace, map_probs, y = quick_start
    la = namespace["la"]
    la.prior_precision = 1e-2  # far below the validation choice: broad posterior, diffuse predictive
    loses, mean, se = _loses(la(namespace["x"], pred_type="glm", link_approx="probit"), map_probs, y)
    assert loses, (mean, se)
