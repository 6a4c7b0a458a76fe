"""Report rendering from sweep rows."""

from __future__ import annotations

import pytest

from laplace_debiased.evaluation.report import chosen_prior_precisions, write_report


def _rows():
    rel = {"edges": [i / 15 for i in range(16)], "confidence": [None] * 15,
           "accuracy": [0.5] * 15, "count": [1.0] * 15}
    rows = []
    for es, kind, sev in [("test", "test", None), ("c1", "corrupted", 1), ("c3", "corrupted", 3)]:
        base = {"accuracy": 0.9, "nll": 0.4, "ece": 0.05, "brier": 0.2, "reliability": rel}
        if kind != "test":
            base["auroc"] = 0.6 + 0.1 * sev
        rows.append({"method": "map", "repeat": 0, "prior_precision": None, "eval_set": es,
                     "kind": kind, "severity": sev, "link": "map", "full_batch": False, **base})
        for method, fb in [("kron", False), ("kron full", True)]:
            for rep in (0, 1):
                for d in (0.01, 0.1, 1.0):
                    for link in ("probit_projected", "probit"):
                        nll = 0.3 + abs(d - 0.1) + 0.01 * rep + (0.5 if link == "probit" and d < 0.1 else 0)
                        rows.append({"method": method, "repeat": rep, "prior_precision": d,
                                     "eval_set": es, "kind": kind, "severity": sev, "link": link,
                                     "full_batch": fb, **{**base, "nll": nll}})
    return rows


def _with_validation(rows):
    """Add a validation set whose NLL optimum (δ = 1) differs from the test optimum (δ = 0.1),
    log marginal likelihoods peaking at δ = 0.01, and an OOD set."""
    out = list(rows)
    for r in rows:
        if r["eval_set"] != "test":
            continue
        d = r["prior_precision"]
        val = {**r, "eval_set": "val", "kind": "validation"}
        if d is not None:
            val["nll"] = 0.3 + abs(d - 1.0) + 0.01 * r["repeat"]
            val["log_marglik"] = -abs(d - 0.01) - (5.0 if r["method"] == "kron full" else 0.0)
        ood = {k: v for k, v in r.items() if k not in ("accuracy", "nll", "ece", "brier", "reliability")}
        ood.update(eval_set="inverted", kind="ood", auroc=0.7 if d is None else 0.75 + 0.01 * (d == 1.0))
        out += [val, ood]
    return out


def test_report_opens_with_map_vs_la_at_the_validation_choice(tmp_path):
    md = write_report(_with_validation(_rows()), tmp_path / "rep")
    text = md.read_text()
    sections = [line for line in text.splitlines() if line.startswith("## ")]
    assert sections[0] == "## MAP vs LA at the chosen δ"
    assert sections[1].startswith("## Metrics vs prior precision")
    head = text.split("## Metrics vs prior precision")[0]
    # δ = 1 on validation (never the test optimum 0.1); marglik picks 0.01
    assert "| kron, δ by val. NLL | 1 | 1.2050 (+0.8050) | 5.00 (+0.00 pt) | 76.00 (+6.00 pt) |" in head
    assert "| kron, δ by marglik | 0.01 | 0.3950 (-0.0050) |" in head
    assert "| MAP | – | 0.4000 | 5.00 | 70.00 |" in head
    assert "validation set 'val'" in head and "beats the MAP on OOD AUROC and not on NLL, ECE" in head


def test_report_renders_files_and_table(tmp_path):
    md = write_report(_rows(), tmp_path / "rep")
    files = {p.name for p in (tmp_path / "rep").iterdir()}
    assert {"report.md", "report.html", "fig6_probit_projected.png", "fig6_probit.png",
            "links.png", "reliability.png", "auroc_severity.png"} <= files
    text = md.read_text()
    assert "| kron | 0.1 |" in text and "AUROC c3" in text
    assert "oracle" in text  # no validation set: the report says its choice used test
    assert "<table>" in (tmp_path / "rep" / "report.html").read_text()
    for name in files:
        assert (tmp_path / "rep" / name).stat().st_size > 100


def test_best_prior_precision_minimises_mean_nll():
    rows = _rows()
    assert chosen_prior_precisions(rows, "test", "probit_projected") == {"kron": 0.1, "kron full": 0.1}


def test_report_refuses_empty_results(tmp_path):
    with pytest.raises(ValueError, match="no sweep results"):
        write_report([], tmp_path)
