"""The main job (:mod:`laplace_debiased.evaluation.pipeline`): the EKFAC methods (``ekfac_single``,
``ekfac_debiased``, ``ekfac_full``) are opt-in, built like the ``kron_*`` ones, and a tiny run
produces their rows; ``kron_corrected`` is described as what it is; several batch sizes fit each
mini-batch method at each b, and a folder's batch sizes cannot change on resume."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from laplace_debiased import cli
from laplace_debiased.evaluation.methods import METHODS
from laplace_debiased.evaluation.options import DEFAULTS
from laplace_debiased.evaluation.pipeline import check_settings, sweep_job
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace

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
            method = sweep_job(name, METHODS[name], model, train, {**opts, "subset": subset},
                               None if name == "ekfac_full" else 8)
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
    d = METHODS["kron_corrected"].describe(64, 300, 30)
    assert d["label"] == "K-FAC, corrected 32 + 32" and d["samples"] == 64
    assert "estimator='corrected'" in d["description"] and "default" in d["description"]
    assert METHODS["kron_debiased"].describe(64, 300, 30)["samples"] == 64
    d = METHODS["kron_shrunk"].describe(64, 300, 30)
    assert d["label"] == "K-FAC, shrunk 32 + 32" and d["samples"] == 64
    assert "estimator='shrunk'" in d["description"] and "default" not in d["description"]


def test_each_batch_size_draws_its_own_batches():
    """At b: the single batch reads one batch of b, the two-batch fits two of b/2; the full batch
    every point; the draws are seeded by the seed and repeat, not by b."""
    from laplace_debiased.evaluation.pipeline import _fit_loader

    opts = {**DEFAULTS, "batch_size": [8, 16]}
    for b in (8, 16):
        loader, count = _fit_loader(METHODS["kron_single"], range(48), opts, 1, b)
        assert (loader.batch_size, count) == (b, 1)
        for name in ("kron_corrected", "kron_shrunk"):
            loader, count = _fit_loader(METHODS[name], range(48), opts, 1, b)
            assert (loader.batch_size, count) == (b // 2, 2)
    assert _fit_loader(METHODS["kron_full"], range(48), opts, 0, None)[0].batch_size == 48
    single = METHODS["kron_single"]
    first = [next(iter(_fit_loader(single, range(48), opts, r, 8)[0])).tolist() for r in (0, 1)]
    assert first[0] != first[1] and first[0] == next(iter(_fit_loader(single, range(48), opts, 0, 8)[0])).tolist()


def test_a_method_at_a_batch_size_is_named_and_recorded_with_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    train = TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))
    opts = {**DEFAULTS, "batch_size": [8, 16], "subset": "last_layer"}
    m = sweep_job("kron_single@b16", METHODS["kron_single"], model, train, opts, 16)
    assert (m.name, m.extra, m.repeats) == ("kron_single@b16", {"batch_size": 16}, opts["repeats"])
    assert sweep_job("kron_full", METHODS["kron_full"], model, train, opts, None).extra == {}
    assert METHODS["kron_single"].describe(128, 300, 30)["label"] == "K-FAC, single batch of 128"
    assert METHODS["kron_single"].describe(64, 300, 30) == {
        "label": "K-FAC, single batch of 64", "samples": 64, "batch_size": 64,
        "description": "K-FAC from one batch of 64 training points (B̃ = B: the plain single-batch LA)"}


def test_one_batch_size_is_recorded_as_before_and_another_list_is_refused(tmp_path):
    opts = {**DEFAULTS, "batch_size": [64]}
    check_settings(tmp_path, opts)
    assert json.loads((tmp_path / "options.json").read_text())["batch_size"] == 64  # an integer, as before
    check_settings(tmp_path, {**opts, "batch_size": 64})  # the same setting, resumes
    with pytest.raises(ValueError, match=r"its results are for --batch-size 64, not 32 128 .*rerun with "
                                         r"--batch-size 64 to resume it"):
        check_settings(tmp_path, {**opts, "batch_size": [32, 128]})
    several = tmp_path / "several"
    several.mkdir()
    check_settings(several, {**opts, "batch_size": [32, 128]})
    assert json.loads((several / "options.json").read_text())["batch_size"] == [32, 128]
    check_settings(several, {**opts, "batch_size": [32, 128]})
    for other in ([128, 32], [32]):  # another order would rename nothing but is another run; so is a subset
        with pytest.raises(ValueError, match="its results are for --batch-size 32 128"):
            check_settings(several, {**opts, "batch_size": other})


@pytest.mark.slow
def test_tiny_run_with_two_batch_sizes_reports_both_and_refuses_another_list(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "cache"))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({
        "train-size": 200, "epochs": 2, "subset": "last_layer", "repeats": 2, "batch-size": [16, 64],
        "prior-precisions": [0.1, 10.0], "links": ["probit_projected"], "quiet": True,
    }))  # the default methods: kron_single, kron_debiased, kron_corrected, kron_full
    out = tmp_path / "out"
    assert cli.main(["--config", str(cfg), "--out", str(out), "--seed", "1"]) == 0
    rows = [json.loads(r) for r in (out / "results.jsonl").read_text().splitlines()]
    keys = [f"{m}@b{b}" for m in ("kron_single", "kron_debiased", "kron_corrected") for b in (16, 64)]
    n_grid = len({r["prior_precision"] for r in rows} - {None})
    for key in keys:
        mine = [r for r in rows if r["method"] == key]
        assert len(mine) == 2 * n_grid * 6  # 2 draws x G priors x 6 sets x 1 link
        assert {r["batch_size"] for r in mine} == {int(key.rsplit("@b", 1)[1])}
    assert len([r for r in rows if r["method"] == "kron_full"]) == n_grid * 6  # once
    assert {r["method"] for r in rows} == {"map", "kron_full", *keys}
    report = (out / "report" / "report.md").read_text()
    section = report.split("## Batch size: where debiasing helps")[1].split("\n## ")[0]
    for label in ("K-FAC, single batch of 16", "K-FAC, debiased 8 + 8", "K-FAC, corrected 32 + 32",
                  "K-FAC, full batch of 200"):
        assert f"| {label} |" in section
    assert "At b = 16, the " in section and "At b = 64, the " in section and "So " in section
    assert (out / "report" / "batch_size.png").is_file()
    # resuming with the same list computes nothing; another list is refused, naming both
    assert cli.main(["sweep", "--config", str(cfg), "--out", str(out), "--seed", "1"]) == 0
    assert len((out / "results.jsonl").read_text().splitlines()) == len(rows)
    capsys.readouterr()
    assert cli.main(["sweep", "--config", str(cfg), "--out", str(out), "--seed", "1", "--batch-size", "16"]) == 2
    err = capsys.readouterr().err
    assert "its results are for --batch-size 16 64, not 16" in err and "Traceback" not in err
