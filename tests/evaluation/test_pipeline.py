"""The main job (:mod:`laplace_debiased.evaluation.pipeline`): the EKFAC methods (``ekfac_single``,
``ekfac_debiased``, ``ekfac_full``) are opt-in, built like the ``kron_*`` ones, and a tiny run
produces their rows; ``kron_corrected`` is described as what it is."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from laplace_debiased import cli
from laplace_debiased.evaluation.options import DEFAULTS, METHODS
from laplace_debiased.evaluation.pipeline import _method, describe_method
from laplace_debiased.structures.ekfac import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace

EKFAC = ["ekfac_single", "ekfac_debiased", "ekfac_full"]


def test_ekfac_methods_are_choices_but_not_defaults():
    assert set(EKFAC) <= set(METHODS)
    assert not set(EKFAC) & set(DEFAULTS["methods"])


def test_ekfac_methods_fit_the_debiased_ekfac_structure_with_the_kron_batches(monkeypatch):
    """single: one batch of b (B̃ = B); debiased: B and B̃ of b/2; full: every point (B̃ = B)."""
    seen = []
    fit_two_batch = DebiasedEKFACLaplace._fit_two_batch

    def spy(self, direction, magnitude, N):
        seen.append(([len(b[1]) for b in direction], [len(b[1]) for b in magnitude],
                     magnitude is direction, N))
        return fit_two_batch(self, direction, magnitude, N)

    monkeypatch.setattr(DebiasedEKFACLaplace, "_fit_two_batch", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    train = TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    opts = {**DEFAULTS, "batch_size": 8}
    expected = {"ekfac_single": ([8], [8], True, 24), "ekfac_debiased": ([4], [4], False, 24),
                "ekfac_full": ([24], [24], True, 24)}
    for subset, cls in (("last_layer", DebiasedEKFACLLLaplace), ("all", DebiasedEKFACLaplace)):
        for name, roles in expected.items():
            method = _method(name, model, train, {**opts, "subset": subset})
            la = method.fit(0)
            assert type(la) is cls and seen.pop() == roles
            assert method.fit(0) is la and not seen  # a grid extension reuses the fit
            assert method.repeats == (1 if name == "ekfac_full" else opts["repeats"])


@pytest.mark.slow
def test_tiny_end_to_end_run_with_the_ekfac_methods(tmp_path, monkeypatch):
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({
        "train-size": 200, "epochs": 2, "subset": "last_layer", "methods": EKFAC,
        "repeats": 1, "batch-size": 32, "prior-precisions": [0.1, 10.0], "quiet": True,
    }))
    out = tmp_path / "out"
    assert cli.main(["sweep", "--config", str(cfg), "--out", str(out), "--seed", "1"]) == 0
    rows = [json.loads(r) for r in (out / "results.jsonl").read_text().splitlines()]
    n_grid = len({r["prior_precision"] for r in rows} - {None})
    # MAP 6 sets (validation included) + 3 methods x 1 repeat x G priors x 6 sets x 2 links
    assert n_grid >= 2 and len(rows) == 6 + 3 * n_grid * 6 * 2
    for name in EKFAC:
        mine = [r for r in rows if r["method"] == name]
        assert len(mine) == n_grid * 6 * 2
        assert all(math.isfinite(r["nll"]) for r in mine if "nll" in r)


def test_corrected_method_is_described_as_two_halves():
    d = describe_method("kron_corrected", {"batch_size": 64, "rank": 30}, 300)
    assert d["label"] == "K-FAC, corrected 32 + 32" and d["samples"] == 64
    assert "estimator='corrected'" in d["description"]
    assert describe_method("kron_debiased", {"batch_size": 64, "rank": 30}, 300)["samples"] == 64
