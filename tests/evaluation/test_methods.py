"""The table of methods ([`laplace_debiased.evaluation.methods`][]): each entry's fit is the structure's
own fit with the entry's options and batches, and a new entry reaches the options, the sweep and
the report without other edits."""

from __future__ import annotations

import argparse
from types import MappingProxyType

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from laplace_debiased.evaluation import methods
from laplace_debiased.evaluation.methods import METHODS, Method, lookup
from laplace_debiased.evaluation.options import DEFAULTS, add_pipeline_arguments, resolve_options, sweep_methods
from laplace_debiased.evaluation.pipeline import _fit_loader, fit_laplace, fit_rows, sweep_job
from laplace_debiased.evaluation.report_page import write_report
from laplace_debiased.kron.laplace import DebiasedKronLaplace

OPTS = {**DEFAULTS, "batch_size": 8, "subset": "all", "repeats": 2}


def _model_and_data():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    return model, TensorDataset(torch.randn(24, 4), torch.randint(0, 3, (24,)))


def _predictive(la) -> torch.Tensor:
    return la(torch.linspace(-1, 1, 12).reshape(3, 4), pred_type="glm", link_approx="probit")


def test_names_are_unique_keys_without_the_batch_size_separator():
    assert all(name == m.name and "@b" not in name for name, m in METHODS.items())
    assert lookup("kron_single@b32") is METHODS["kron_single"] and lookup("map") is None
    # the two entries that a name once had to be parsed for: both are the paper's estimate
    assert METHODS["kron_debiased"].options == METHODS["ekfac_debiased"].options == {"estimator": "paper"}


def test_a_bad_entry_is_refused_with_what_is_valid():
    with pytest.raises(ValueError, match="batches must be one of"):
        Method("x", "debiased_kron", "halves", "r", "s", "d")
    with pytest.raises(ValueError, match="structure must be one of"):
        Method("x", "kron", "two", "r", "s", "d")
    with pytest.raises(TypeError):
        METHODS["kron_shrunk"].options["estimator"] = "paper"  # read-only, like the record


@pytest.mark.parametrize("name,options", [("kron_single", {}), ("kron_debiased", {"estimator": "paper"}),
                                          ("kron_shrunk", {"estimator": "shrunk"}), ("kron_full", {})])
def test_a_method_fits_its_structure_with_its_options_and_batches(name, options):
    """The table's fit equals the structure's own fit with the documented options: a two-batch
    method reads B and B̃ from its loader, a single or full batch is both (B̃ = B)."""
    model, train = _model_and_data()
    method = METHODS[name]
    b = None if method.full_batch else 8
    loader, _ = _fit_loader(method, train, OPTS, 1, b)
    la = fit_laplace(method, model, loader, subset="all", rank=30)
    direct = DebiasedKronLaplace(model, "classification", **options)
    loader, _ = _fit_loader(method, train, OPTS, 1, b)  # the same seeded draws
    direct.fit(loader, **({} if method.batches == "two" else {"magnitude_loader": loader}))
    assert type(la) is DebiasedKronLaplace
    assert torch.equal(_predictive(la), _predictive(direct))


def test_the_options_change_the_fit():
    """The paper's and the shrunk estimate from the same two batches differ (the options reach the fit)."""
    model, train = _model_and_data()
    fits = {}
    for name in ("kron_debiased", "kron_shrunk"):
        loader, _ = _fit_loader(METHODS[name], train, OPTS, 0, 8)
        fits[name] = fit_laplace(METHODS[name], model, loader, subset="all", rank=30)
    assert (fits["kron_debiased"]._estimator, fits["kron_shrunk"]._estimator) == ("paper", "shrunk")
    assert not torch.allclose(_predictive(fits["kron_debiased"]), _predictive(fits["kron_shrunk"]))


NEW = Method("kron_crossfit", "debiased_kron", "two", "cross-fitted split", "cross-fitted",
             "cross-fitted {structure}: the paper's estimate from B and B̃ of {half} and its mirror",
             {"estimator": "paper", "cross_fit": True})


@pytest.fixture
def with_new_method(monkeypatch):
    """The table with one more entry, and nothing else changed."""
    monkeypatch.setattr(methods, "METHODS", MappingProxyType({**METHODS, NEW.name: NEW}))


def test_a_new_entry_is_a_choice_swept_at_each_batch_size_and_fitted(with_new_method):
    parser = argparse.ArgumentParser()
    add_pipeline_arguments(parser)
    opts = resolve_options(parser.parse_args(["--methods", "kron_crossfit", "kron_full", "--batch-size", "8", "16"]))
    assert sweep_methods(opts) == [("kron_crossfit@b8", "kron_crossfit", 8), ("kron_crossfit@b16", "kron_crossfit", 16),
                                   ("kron_full", "kron_full", None)]
    model, train = _model_and_data()
    opts = {**opts, "subset": "all"}
    job = sweep_job("kron_crossfit@b8", NEW, model, train, opts, 8)
    assert (job.repeats, job.full_batch, job.extra) == (opts["repeats"], False, {"batch_size": 8})
    la = job.fit(0)
    assert type(la) is DebiasedKronLaplace and la._estimator == "paper"
    loader, _ = _fit_loader(METHODS["kron_debiased"], train, opts, 0, 8)  # the same batches, no mirror
    paper = fit_laplace(METHODS["kron_debiased"], model, loader, subset="all", rank=30)
    assert not torch.allclose(_predictive(la), _predictive(paper))
    assert fit_rows(opts, len(train), 0, 1) == list(range(len(train)))  # its jobs are replayed like any other's


def _rows() -> list[dict]:
    """Synthetic rows: at b = 8 and 16 a single batch and the new fit against the full batch; the
    new fit's gap is a tenth of the single batch's."""
    metrics = {"accuracy": 0.9, "ece": 0.05, "brier": 0.2}
    rows = [{"method": "map", "repeat": 0, "prior_precision": None, "eval_set": "test", "kind": "test",
             "severity": None, "link": "map", "full_batch": False, "nll": 0.5, **metrics}]
    fits = [("kron_full", None, 0.0, 1)] + [(f"{name}@b{b}", b, gap, 3) for b in (8, 16)
                                            for name, gap in (("kron_single", 0.2), ("kron_crossfit", 0.02))]
    for name, b, gap, repeats in fits:
        for repeat in range(repeats):
            for delta in (0.1, 1.0, 10.0):
                rows.append({"method": name, "repeat": repeat, "prior_precision": delta, "eval_set": "test",
                             "kind": "test", "severity": None, "link": "probit_projected",
                             "full_batch": b is None, **({"batch_size": b} if b else {}), **metrics,
                             "nll": 0.4 + abs(delta - 1.0) / 100 + gap * (1 + 0.1 * repeat) / (1 + delta)})
    return rows


def test_a_new_entry_is_reported_by_its_role_against_its_structure_s_full_batch(with_new_method, tmp_path):
    text = write_report(_rows(), tmp_path).read_text()
    batch = text.split("## Batch size: where debiasing helps")[1].split("\n## ")[0]
    assert "| 8 | kron_crossfit@b8 | 3 |" in batch and "| 16 | kron_crossfit@b16 | 3 |" in batch
    assert "the cross-fitted split tracked the full batch best" in batch and "debiasing helped at b = 8 and 16" in batch
    tracking = text.split("## Tracking the full batch over the whole grid")[1].split("\n## ")[0]
    assert "kron_crossfit@b8 tracks the full batch more closely than kron_single@b8" in tracking


def test_without_the_entry_its_rows_are_reported_under_their_names_only(tmp_path):
    text = write_report(_rows(), tmp_path).read_text()
    assert "cross-fitted split" not in text and "| kron_crossfit@b8 |" in text
