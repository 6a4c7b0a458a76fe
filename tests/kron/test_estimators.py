"""estimator="corrected" of debiased_kron against dense formulas, its reductions and its
refusals (laplace_debiased.kron.estimators)."""

import logging

import pytest
import torch
from laplace import KronLaplace

from _models import dense_kfac, kfac_to_dense, loader, tiny_cnn, tiny_mlp, toy_data
from laplace_debiased.kron.decompose import decompose_two_batch
from laplace_debiased.kron.corrected import corrected_kron
from laplace_debiased.parallel.reducer import Reducer
from laplace_debiased.ekfac.laplace import DebiasedEKFACLaplace
from laplace_debiased.kron.laplace import DebiasedKronLaplace

EPS64 = torch.finfo(torch.float64).eps
MODELS = {"mlp": (tiny_mlp, (4,)), "cnn": (tiny_cnn, (1, 5, 5))}


def _dense(vecs, vals):
    blocks = []
    for Us, ls in zip(vecs, vals):
        mats = [U @ torch.diag(lam) @ U.T for U, lam in zip(Us, ls)]
        blocks.append(torch.kron(mats[0], mats[1]) if len(mats) == 2 else mats[0])
    return torch.block_diag(*blocks)


@pytest.mark.parametrize("estimator", ["corrected", "shrunk", "stein"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_corrected_fit_equals_the_dense_formula(name, likelihood, estimator, caplog):
    make, shape = MODELS[name]
    model = make()
    N, m = 72, 24
    ds = toy_data(N, shape, 3, likelihood)
    X = ds.tensors[0]
    la = DebiasedKronLaplace(model, likelihood, estimator=estimator)
    with caplog.at_level(logging.INFO, logger="laplace_debiased"):
        la.fit(loader(ds, m))
    ref_B = [[F[0] * (N / m), *F[1:]] for F in dense_kfac(model, X[:m], likelihood)]
    ref_Bt = [[F[0] * (N / m), *F[1:]] for F in dense_kfac(model, X[m:2 * m], likelihood)]
    vecs, vals, _ = corrected_kron(ref_B, ref_Bt, m, m, n_data=N, rule=estimator)
    torch.testing.assert_close(la.H.to_matrix(), _dense(vecs, vals), atol=1e-9, rtol=1e-8)
    # it is neither the paper's estimate nor the single batch B ∪ B̃
    pooled = [[(a + b) / 2 for a, b in zip(FB, FM)] for FB, FM in zip(ref_B, ref_Bt)]
    assert not torch.allclose(la.H.to_matrix(), kfac_to_dense(pooled), atol=1e-6)
    paper = DebiasedKronLaplace(model, likelihood, estimator="paper")
    paper.fit(loader(ds, m))
    assert not torch.allclose(la.H.to_matrix(), paper.H.to_matrix(), atol=1e-6)
    assert len(la.correction.factors) == len(la.H_facs.kfacs)
    rows = la.correction.rows()
    assert len(rows) == sum(len(b) for b in la.H_facs.kfacs)
    assert all(0 <= r["change"] and r["stderr"] >= 0 and 0 <= r["kept"] <= 1 for r in rows)
    assert all(r["kept"] == 1 for r in rows) == (estimator == "corrected")
    assert la.correction.markdown().count("\n") == len(rows) + 1
    assert any("corrected" in r.getMessage() and "changed by" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("estimator", ["corrected", "shrunk", "stein"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_corrected_with_the_same_batch_is_kron_laplace(name, estimator):
    """B̃ = B through the corrected code: the decomposition of a model's K-FAC factors against an
    equal copy (a distinct list, so the corrected route runs and records its correction) is each
    factor's own eigendecomposition, stock K-FAC, to round-off: every gap is zero. (Passing the same
    loader object to ``fit`` takes the stock path by design and never reaches this code; a second
    loader over the same samples is refused as dependent batches.)"""
    make, shape = MODELS[name]
    model = make()
    X = toy_data(8, shape, 3, "classification").tensors[0]
    F = dense_kfac(model, X, "classification")
    out = decompose_two_batch(F, [[f.clone() for f in block] for block in F], null_space="isotropic",
                              estimator=estimator, cross_fit=False, sizes=(8, 8), n_data=100,
                              names=[("m", str(i)) for i in range(len(F))], reducer=Reducer())
    assert out.correction is not None
    assert max(r["change"] for r in out.correction.rows()) < 1e-10
    for Fs, Qs, lams in zip(F, out.eigenvectors, out.eigenvalues):
        for Fi, Q, lam in zip(Fs, Qs, lams):
            tol = 1e3 * len(Q) * EPS64 * float(torch.linalg.matrix_norm(Fi))
            torch.testing.assert_close(Q @ torch.diag(lam) @ Q.T, Fi.double(), atol=tol, rtol=0)


@pytest.mark.parametrize("estimator", ["corrected", "shrunk", "stein"])
def test_the_same_loader_object_is_stock_kron_laplace(estimator):
    """``magnitude_loader=train_loader`` (one object) is B̃ = B on purpose: stock KronLaplace
    whatever the estimator, without a correction record."""
    dl = loader(toy_data(8, (4,), 3, "classification"), 8)
    la = DebiasedKronLaplace(tiny_mlp(), "classification", prior_precision=0.7, estimator=estimator)
    la.fit(dl, magnitude_loader=dl)
    ref = KronLaplace(tiny_mlp(), "classification", prior_precision=0.7)
    ref.fit(dl)
    torch.testing.assert_close(la.H.to_matrix(), ref.H.to_matrix(), atol=1e-12, rtol=1e-10)
    assert la.correction is None


def test_the_default_is_the_corrected_estimate_unless_a_paper_option_is_asked_for():
    ds = toy_data(16, (4,), 3, "classification")
    for options, expected in (({}, "corrected"), ({"cross_fit": True}, "paper"), ({"null_space": "aligned"}, "paper")):
        la = DebiasedKronLaplace(tiny_mlp(), "classification", **options)
        la.fit(loader(ds, 8))
        assert la._estimator == expected
    fits, ds = {}, toy_data(32, (4,), 3, "classification")  # here the shrunk weight is below 1 in two factors
    for estimator in (None, "corrected", "shrunk"):
        fits[estimator] = DebiasedKronLaplace(tiny_mlp(), "classification",
                                              **({} if estimator is None else {"estimator": estimator}))
        fits[estimator].fit(loader(ds, 8))
    torch.testing.assert_close(fits[None].H.to_matrix(), fits["corrected"].H.to_matrix(), atol=0, rtol=0)
    assert not torch.allclose(fits[None].H.to_matrix(), fits["shrunk"].H.to_matrix())  # the weight matters here


def test_refusals_say_what_to_pass():
    with pytest.raises(ValueError, match=r"offers estimator in \('paper', 'corrected', 'shrunk', 'stein'\)"):
        DebiasedKronLaplace(tiny_mlp(), "classification", estimator="median")
    for estimator in ("corrected", "shrunk", "stein"):
        with pytest.raises(ValueError, match="drop cross_fit=True"):
            DebiasedKronLaplace(tiny_mlp(), "classification", estimator=estimator, cross_fit=True)
        with pytest.raises(ValueError, match="Pass estimator='paper'"):
            DebiasedKronLaplace(tiny_mlp(), "classification", estimator=estimator, null_space="aligned")
    with pytest.raises(ValueError, match=r"debiased_ekfac offers estimator in \('paper',\)"):
        DebiasedEKFACLaplace(tiny_mlp(), "classification", estimator="corrected")


def test_coverage_log_says_how_many_directions_the_completion_filled(caplog):
    """A Linear(12, ...) layer fitted on 2 × 4 samples: B's input factor has rank ≤ 4, so the
    isotropic completion fills at least 8 of its 12 directions, and the log line says how many."""
    ds = toy_data(8, (12,), 3, "classification")
    la = DebiasedKronLaplace(tiny_mlp(n_in=12), "classification")
    with caplog.at_level(logging.INFO, logger="laplace_debiased"):
        la.fit(loader(ds, 4))
    first = la.coverage.blocks[0].factors
    completed = [f.completed for f in first]
    assert max(completed) >= 8
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("coverage"))
    assert all(f"completed {c}" in line for c in completed)


def _wide_model_data():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(32, 24, generator=g), torch.randint(0, 3, (32,), generator=g)


def test_diagnose_says_what_debiasing_changes_per_layer():
    from laplace_debiased.commands.diagnose import correction_section

    model, X, y = _wide_model_data()
    text = correction_section(model, X, y, "classification", 8, 0)
    assert "## What debiasing changes at this batch size" in text
    # one row per block and factor: two weight blocks (output, input) and two bias blocks
    assert text.count("| 0 | weight | ") == 2 and text.count("| 2 | bias | factor |") == 1


def test_report_has_the_correction_table(tmp_path):
    from laplace_debiased.evaluation.report_page import write_report

    model, X, y = _wide_model_data()
    la = DebiasedKronLaplace(model, "classification", estimator="corrected")
    la.fit(loader(torch.utils.data.TensorDataset(X, y), 8))
    metrics = {"nll": 1.0, "ece": 0.1, "accuracy": 0.5, "brier": 0.5, "n": 32}
    rows = [{"method": "kron_corrected", "repeat": 0, "prior_precision": d, "eval_set": "test", "kind": "test",
             "severity": None, "link": "probit_projected", "full_batch": False, **metrics,
             **({"correction": la.correction.rows()} if d == 0.1 else {})} for d in (0.1, 1.0)]
    text = write_report(rows, tmp_path / "rep").read_text()
    assert "## What the corrected estimate changed" in text
    first = la.correction.rows()[0]
    assert f"| {first['layer']} | weight | output | {100 * first['change']:.1f} | {100 * first['stderr']:.1f} |" in text
