"""The tables of a calibration report, with the sentences that read them: the setting, MAP vs
each LA at its chosen δ, the batch-size table, NLL and ECE under shift, the Figure-6 criterion as
a table (each mini-batch LA's largest gap to its full-batch reference,
[`tracking`][laplace_debiased.evaluation.tracking]), the chosen prior precision per method and link,
and the coverage and correction records of the first fit.

Units: NLL in nats, accuracy, ECE and AUROC in percent (changes in percentage points).
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from laplace_debiased.evaluation import methods as method_table
from laplace_debiased.evaluation.methods import lookup
from laplace_debiased.evaluation.options import method_key, split_method_key
from laplace_debiased.evaluation.report_data import (LINK_LABELS, SETTING_NAME, BatchFit, ReportContext, ReportDoc,
                                                     TrackedFit, batch_fits, chosen_prior_precisions, fit_name,
                                                     several_structures, spread_text, tracking_rows)
from laplace_debiased.evaluation.tracking import clearly_below, mean_stderr, paired_margin, where_largest


def setting_tables(ctx: ReportContext, doc: ReportDoc, title: str) -> None:
    """The title and the setting: data, N, model, the methods and the evaluation sets in words."""
    doc.h(title, 1)
    doc.h("Setting")
    st = ctx.setting
    if st:
        weights = "all weights" if st.get("subset") == "all" else "the last layer's weights"
        doc.p(f"Data: {st['data']}, N = {st['n_train']:,} training points. Model: {st['model']} "
              f"({st['n_params']:,} parameters), trained to a MAP estimate; every Laplace approximation "
              f"(LA) covers {weights}.")
    else:
        doc.p(f"These results come without a {SETTING_NAME} (the main job writes one next to "
              "results.jsonl), so the data, N and batch sizes are not known here; methods and "
              "evaluation sets appear under their recorded names.")
    described = st.get("methods", {})
    doc.table(["method", "what it is", "draws", "key"],
              [[ctx.label(m), described.get(m, {}).get("description", "–"), str(ctx.n_repeats(m)), m]
               for m in ctx.methods])
    sets = list(dict.fromkeys(r["eval_set"] for r in ctx.rows))
    doc.table(["evaluation set", "what it is"], [[e, st.get("eval_sets", {}).get(e, "–")] for e in sets])
    doc.p(f"Main link approximation: {LINK_LABELS[ctx.main_link]}; {ctx.choice_note}. Units: NLL in "
          "nats, accuracy, ECE and AUROC in percent, their changes in percentage points (pt); the "
          "Brier score is a fraction.")


#: (metric, scale, decimals, unit of the change) of the headline and shift tables
_CELL = {"nll": (1.0, 4, ""), "ece": (100.0, 2, " pt"), "auroc": (100.0, 2, " pt"),
         "accuracy": (100.0, 2, " pt"), "brier": (1.0, 4, "")}


def _cell(ctx: ReportContext, method: str, delta: float | None, eval_set: str, metric: str) -> str:
    """Mean over repeats at ``delta`` and, for an LA, its change from the MAP."""
    scale, dec, unit = _CELL[metric]
    vals, ref = ctx.at(method, delta, eval_set, metric), ctx.at("map", None, eval_set, metric)
    if not vals:
        return "–"
    v = scale * float(np.mean(vals))
    text = f"{v:.{dec}f}"
    if method != "map" and ref:
        text += f" ({v - scale * float(np.mean(ref)):+.{dec}f}{unit})"
    return text


def _gain_row(ctx: ReportContext, label: str, method: str, delta: float | None) -> list[str]:
    """Table cells: test NLL, ECE and OOD AUROC at ``delta``, each with its change from the MAP."""
    cells = [label, "–" if delta is None else f"{delta:.3g}"]
    cells += [_cell(ctx, method, delta, ctx.test_set, "nll"), _cell(ctx, method, delta, ctx.test_set, "ece")]
    if ctx.ood_set is not None:
        cells.append(_cell(ctx, method, delta, ctx.ood_set, "auroc"))
    return cells


def headline_table(ctx: ReportContext, doc: ReportDoc) -> None:
    """The opening table: MAP vs each LA at its validation-chosen δ (and its marglik δ)."""
    doc.h("MAP vs LA at the chosen δ")
    by_nll = ctx.chosen(ctx.main_link)
    by_ml = (chosen_prior_precisions(ctx.rows, ctx.val_set, ctx.main_link, "log_marglik")
             if ctx.val_set else {})
    header = ["method", "δ", "test NLL (nats; Δ vs MAP)", "test ECE (%; Δ in pt)"]
    if ctx.ood_set is not None:
        header.append(f"AUROC {ctx.ood_set} (%; Δ in pt)")
    table = [_gain_row(ctx, "MAP", "map", None)]
    for m in ctx.methods:
        if m in by_nll:
            table.append(_gain_row(ctx, f"{ctx.label(m)}, δ by val. NLL" if ctx.val_set else ctx.label(m),
                                   m, by_nll[m]))
        if m in by_ml:
            table.append(_gain_row(ctx, f"⚠ {ctx.label(m)}, δ by marglik", m, by_ml[m]))
    doc.p(f"{ctx.choice_note}; '⚠ … marglik': δ of the highest mean log marginal likelihood of "
          f"laplace-torch (where the structure has one), shown for comparison. Link: "
          f"{LINK_LABELS[ctx.main_link]}. Mean over draws. Lower NLL and ECE and higher AUROC are "
          "better. AUROC: how well the normalised predictive entropy tells the OOD inputs from the "
          "clean test inputs (50 % is chance).")
    doc.table(header, table)
    edge = [ctx.label(m) for m, d in by_nll.items() if ctx.grid(m).on_edge(d)]
    if edge:
        doc.p(f"Chosen δ on a grid edge (the optimum may lie beyond the grid): {', '.join(edge)}.")
    doc.p(_verdict(ctx, by_nll, "validation NLL" if ctx.val_set else "test NLL (oracle)"))
    if by_ml:
        doc.p("⚠ " + _verdict(ctx, by_ml, "marginal likelihood") + _marglik_warning(ctx, by_ml))


def _marglik_warning(ctx: ReportContext, by_ml: dict[str, float]) -> str:
    """The measured cost of choosing δ by the marginal likelihood, where the LA loses to the MAP."""
    ref = ctx.at("map", None, ctx.test_set, "nll")
    worse = {m: float(np.mean(ctx.at(m, d, ctx.test_set, "nll"))) for m, d in by_ml.items()
             if ref and ctx.at(m, d, ctx.test_set, "nll")
             and np.mean(ctx.at(m, d, ctx.test_set, "nll")) > np.mean(ref)}
    if not worse:
        return ""
    who = "every LA" if len(worse) == len(by_ml) > 1 else ", ".join(ctx.label(m) for m in worse)
    deltas = ", ".join(sorted({f"{by_ml[m]:.3g}" for m in worse}))
    return (f" Warning: with δ from the marginal likelihood (δ = {deltas}) {who} is worse than the MAP "
            f"network in test NLL here ({min(worse.values()):.3f}–{max(worse.values()):.3f} nats against "
            f"the MAP's {np.mean(ref):.3f}). Choose δ by validation NLL.")


def _verdict(ctx: ReportContext, chosen: dict[str, float], how: str) -> str:
    """One sentence per method: on which metrics the LA beats the MAP at the chosen δ."""
    parts = []
    for m, d in chosen.items():
        wins, losses = [], []
        for name, metric, es, better in (("NLL", "nll", ctx.test_set, -1), ("ECE", "ece", ctx.test_set, -1),
                                         ("OOD AUROC", "auroc", ctx.ood_set, 1)):
            if es is None:
                continue
            la, ref = ctx.at(m, d, es, metric), ctx.at("map", None, es, metric)
            if la and ref:
                (wins if better * (np.mean(la) - np.mean(ref)) > 0 else losses).append(name)
        parts.append(f"{ctx.label(m)} beats the MAP on {', '.join(wins) or 'nothing'}"
                     + (f" and not on {', '.join(losses)}" if losses else ""))
    return f"At the δ chosen by {how}: " + "; ".join(parts) + "." if parts else ""


def shift_tables(ctx: ReportContext, doc: ReportDoc) -> None:
    """NLL and ECE on every labelled evaluation set (clean and corrupted) at the chosen δ."""
    sets = [e for e in dict.fromkeys(r["eval_set"] for r in ctx.rows
                                     if r.get("kind") in ("test", "corrupted")) if e in ctx.map_rows]
    if len(sets) < 2:
        return
    chosen = ctx.chosen(ctx.main_link)
    doc.h("NLL and ECE under shift")
    doc.p(f"Each method at its chosen δ ({ctx.choice_note}), {LINK_LABELS[ctx.main_link]}, mean over "
          "draws, change from the MAP in brackets. The evaluation sets are described under Setting.")
    for metric, unit in (("nll", "NLL (nats)"), ("ece", "ECE (%; Δ in pt)")):
        rows = [["MAP", "–", *[_cell(ctx, "map", None, e, metric) for e in sets]]]
        rows += [[ctx.label(m), f"{chosen[m]:.3g}", *[_cell(ctx, m, chosen[m], e, metric) for e in sets]]
                 for m in ctx.methods if m in chosen]
        doc.table([f"{unit}", "δ", *sets], rows)


_BEST_COLUMNS = (("accuracy", "accuracy (%)"), ("nll", "NLL (nats)"), ("ece", "ECE (%)"), ("brier", "Brier"))


def chosen_tables(ctx: ReportContext, doc: ReportDoc) -> None:
    """Per link: each method's chosen prior precision and its test metrics."""
    shift_sets = [e for e in dict.fromkeys(r["eval_set"] for r in ctx.rows)
                  if any(r["eval_set"] == e and "auroc" in r for r in ctx.rows)]
    doc.h("Chosen prior precision per method and link")
    for link in ctx.links:
        best = ctx.chosen(link)
        header = ["method", "δ", *(f"test {h}" for _, h in _BEST_COLUMNS)] + [f"AUROC {e} (%)" for e in shift_sets]
        scale = {"accuracy": 100.0, "ece": 100.0, "auroc": 100.0}
        pct = lambda vals, k: [scale.get(k, 1.0) * v for v in vals]  # noqa: E731
        table = []
        if ctx.test_set in ctx.map_rows:
            table.append(["MAP", "–", *[spread_text(pct(ctx.at("map", None, ctx.test_set, k), k)) for k, _ in _BEST_COLUMNS]]
                         + [spread_text(pct(ctx.at("map", None, e, "auroc"), "auroc")) for e in shift_sets])
        for m in ctx.methods:
            if m not in best:
                continue
            edge = ctx.grid(m).on_edge(best[m])
            table.append([ctx.label(m), f"{best[m]:.3g}" + (" (grid edge)" if edge else ""),
                          *[spread_text(pct(ctx.at(m, best[m], ctx.test_set, k, link), k)) for k, _ in _BEST_COLUMNS]]
                         + [spread_text(pct(ctx.at(m, best[m], e, "auroc", link), "auroc")) for e in shift_sets])
        doc.p(f"Link: {LINK_LABELS[link]}. Mean over draws [min, max]; {ctx.choice_note}.")
        doc.table(header, table)


def _samples(ctx: ReportContext, method: str) -> int | None:
    return ctx.setting.get("methods", {}).get(method, {}).get("samples")


def _tracking_verdict(ctx: ReportContext, nll_gaps: dict[str, list[float]]) -> str:
    """Whether each debiased method tracks its reference more closely than the single batch of
    its structure with the same number of samples, beyond the spread over draws
    ([`clearly_below`][laplace_debiased.evaluation.tracking.clearly_below]), and what that depends on."""
    sentences, explained = [], set()
    for deb in nll_gaps:
        record = lookup(deb)
        single_record = None if record is None or record.batches != "two" else next(
            (m for m in method_table.METHODS.values() if m.structure == record.structure and m.batches == "single"), None)
        if single_record is None:
            continue
        single = method_key(single_record.name, split_method_key(deb)[1])
        if single not in nll_gaps or _samples(ctx, deb) != _samples(ctx, single):
            continue
        a, b = nll_gaps[deb], nll_gaps[single]
        means = f"{100 * np.mean(a):.1f} % against {100 * np.mean(b):.1f} %"
        closer, farther = clearly_below(a, b), clearly_below(b, a)
        if min(len(a), len(b)) < 2:
            sentences.append(f"{ctx.label(deb)} tracks the full batch {'more' if np.mean(a) < np.mean(b) else 'less'} "
                             f"closely than {ctx.label(single)} with the same samples ({means}); with a single draw "
                             "the spread over draws is unknown.")
        elif closer or farther:
            sentences.append(f"{ctx.label(deb)} tracks the full batch {'more' if closer else 'less'} closely than "
                             f"{ctx.label(single)} with the same samples ({means}), beyond the spread over draws.")
        else:
            sentences.append(f"{ctx.label(deb)} against {ctx.label(single)} with the same samples ({means}): which "
                             "tracks the full batch more closely is within the spread over draws.")
        b_size, n = _samples(ctx, single), ctx.setting.get("n_train")
        if farther and b_size and n and b_size not in explained:
            explained.add(b_size)
            sentences.append(f"Here one batch is {b_size} of N = {n:,} training points ({100 * b_size / n:.0f} %): a "
                             "single batch that large carries little bias, while B chooses the directions from half "
                             "its samples. Debiasing is for b ≪ N (the paper: 1,024 of 40,000 images); see the "
                             "CIFAR-10 results in the documentation's benchmarks page.")
    return " ".join(sentences)


def tracking_table(ctx: ReportContext, doc: ReportDoc) -> list[TrackedFit]:
    """The Figure-6 criterion as a table: per mini-batch method the largest gap to its
    full-batch reference over the whole grid, per draw, where on the grid it lies, and whether
    debiasing helped. Returns the fits in the table (none: no section)."""
    rows = tracking_rows(ctx)
    if not rows:
        return rows
    doc.h("Tracking the full batch over the whole grid")
    doc.p(f"Per draw, the largest gap over all prior precisions between a mini-batch LA and the "
          f"full-batch LA of its structure on the test set ({LINK_LABELS[ctx.main_link]}): test NLL "
          "relative to the full batch (%), ECE in percentage points. Mean over draws [min, max]; last "
          "column: the δ at which each draw's NLL gap is largest (δ: draws).")
    doc.table(["method", "samples", "draws", "max rel. NLL gap (%)", "max ECE gap (pt)", "at δ (draws)"],
              [[ctx.label(t.method), f"{_samples(ctx, t.method) or '–'}", str(len(t.curves)),
                spread_text([100 * g for g in t.nll]), spread_text([100 * g for g in t.ece]),
                ", ".join(f"{d:.3g}: {k}" for d, k in where_largest(t.curves).items())] for t in rows])
    verdict = _tracking_verdict(ctx, {t.method: t.nll for t in rows})
    if verdict:
        doc.p(verdict)
    return rows


def mean_stderr_text(values, digits: int = 2) -> str:
    """``+mean ± standard error`` of per-draw values
    ([`mean_stderr`][laplace_debiased.evaluation.tracking.mean_stderr]), ``digits`` decimals, the mean
    signed."""
    mean, se = mean_stderr(values)
    return f"{mean:+.{digits}f} ± {se:.{digits}f}"


def _order_rule(fits: list[BatchFit]) -> str:
    """The rule by which the sentences below the table order two fits, in words."""
    draws = min(len(f.gaps) for f in fits)
    if draws < 2:
        return "With a single draw the spread over draws is unknown, so no order below is beyond chance."
    return ("One fit is said to track the full batch more closely than another only when the mean of their "
            "paired per-draw differences (draw r of every fit uses the same samples) lies more than t standard "
            f"errors below 0, t = {paired_margin(draws):.2f} (Student's t, {draws - 1} degrees of freedom, a "
            "two-sided 95 % interval); otherwise their order is within the spread over draws.")


def _names(fits: list[BatchFit], several_kinds: bool) -> str:
    """"the A", "the A and the B", "the A, the B and the C"."""
    names = [f"the {fit_name(f, several_kinds)}" for f in fits]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


def batch_verdict(fits: list[BatchFit], n_train: int | None) -> str:
    """Per structure and b: which fit tracked the full batch best (lowest mean largest gap) where
    that order exceeds the spread over draws ([`clearly_below`][laplace_debiased.evaluation.tracking.clearly_below]
    against each other fit), else which fits it cannot tell apart; then at which b a two-batch fit,
    and at which the single batch, was clearly best."""
    sentences, outcome = [], defaultdict(list)
    several_kinds = several_structures(fits)
    for key in dict.fromkeys((f.record.structure, f.b) for f in fits):
        group = sorted((f for f in fits if (f.record.structure, f.b) == key), key=lambda f: float(np.mean(f.gaps)))
        best, others = group[0], group[1:]
        single = next((o for o in others if o.single), None)
        draws = len(best.gaps)
        over = f"on average over {draws} draw{'s' if draws > 1 else ''}"
        if not others:
            sentences.append(f"At b = {best.b}, the {fit_name(best, several_kinds)}'s largest test-NLL gap is "
                             f"{100 * np.mean(best.gaps):.2f} % {over}.")
            continue
        against = ", against " + ", ".join(f"{100 * np.mean(o.gaps):.2f} % for the {fit_name(o, several_kinds)}"
                                           for o in others)
        if any(len(f.gaps) < 2 for f in group):
            if single is not None or best.single:
                outcome["single" if best.single else "unclear"].append(best.b)
            sentences.append(f"At b = {best.b}, the {fit_name(best, several_kinds)} tracked the full batch best: its "
                             f"largest test-NLL gap is {100 * np.mean(best.gaps):.2f} % {over}{against}. With a single "
                             "draw the spread over draws is unknown, so this order may be chance.")
            continue
        tied = [best, *(o for o in others if not clearly_below(best.gaps, o.gaps))]
        behind = [o for o in others if o not in tied]
        if len(tied) == 1:
            if single is not None or best.single:
                outcome["single" if best.single else "helped"].append(best.b)
            sentences.append(f"At b = {best.b}, the {fit_name(best, several_kinds)} tracked the full batch best: its "
                             f"largest test-NLL gap is {100 * np.mean(best.gaps):.2f} % {over}{against}, a lead over "
                             "each beyond the spread over draws.")
            continue
        if single is not None or best.single:
            outcome["helped" if single in behind else "unclear"].append(best.b)
        text = (f"At b = {best.b}, the largest test-NLL gaps are "
                + ", ".join(f"{100 * np.mean(f.gaps):.2f} % for the {fit_name(f, several_kinds)}" for f in group)
                + f" {over}. The order of {_names(tied, several_kinds)} is within the spread over draws, so the "
                "report does not rank them")
        if behind:
            text += (f"; {_names(behind, several_kinds)} tracked the full batch less closely than the "
                     f"{fit_name(best, several_kinds)}, beyond that spread")
        sentences.append(text + ".")

    def share(sizes: list[int]) -> str:
        return " and ".join(f"{b} ({100 * b / n_train:.0f} % of N = {n_train:,})" if n_train else str(b)
                            for b in sorted(set(sizes)))

    parts = []
    if outcome["helped"]:
        parts.append(f"debiasing helped at b = {share(outcome['helped'])}")
    if outcome["unclear"]:
        parts.append(f"at b = {share(outcome['unclear'])} the order of the closest fits, the single batch among "
                     "them, is within the spread over draws")
    if outcome["single"]:
        parts.append(f"the single batch was closest at b = {share(outcome['single'])}, where a single batch "
                     "is already close and a split into halves costs more than the bias it removes")
    if parts:
        sentences.append("So " + "; ".join(parts) + ".")
    return " ".join(sentences)


def batch_size_table(ctx: ReportContext, doc: ReportDoc) -> list[BatchFit]:
    """Where debiasing helps: per batch size b, each mini-batch fit's largest relative test-NLL
    gap to the full batch over the δ grid and its test NLL at the chosen δ.  Only for results with
    two or more b; returns the fits in the table (none: no section)."""
    fits = batch_fits(ctx)
    if len({f.b for f in fits}) < 2:
        return []
    chosen = ctx.chosen(ctx.main_link)
    doc.h("Batch size: where debiasing helps")
    n = ctx.setting.get("n_train")
    doc.p(f"Each mini-batch LA at each batch size b (training points per fit: one batch of b, or two of b/2) "
          f"against the full-batch LA of its structure{f' (all N = {n:,} training points)' if n else ''}, on the "
          f"test set ({LINK_LABELS[ctx.main_link]}). Gap: per draw, the largest test-NLL difference to the full "
          "batch over all prior precisions δ, relative to the full batch's NLL (%); mean over draws [min, max]. "
          f"Test NLL in nats at the chosen δ ({ctx.choice_note}); mean over draws [min, max]. "
          + _order_rule(fits))

    def nll_at(m: str) -> list[str]:
        d = chosen.get(m)
        return ["–", "–"] if d is None else [f"{d:.3g}", spread_text(ctx.at(m, d, ctx.test_set, "nll"))]

    table = []
    for structure in dict.fromkeys(f.record.structure for f in fits):
        mine = [f for f in fits if f.record.structure == structure]
        for f in mine:
            table.append([str(f.b), ctx.label(f.method), str(len(f.gaps)), spread_text([100 * g for g in f.gaps]),
                          *nll_at(f.method)])
        ref = mine[0].reference
        table.append([f"all ({n:,})" if n else "all", ctx.label(ref), str(ctx.n_repeats(ref)), "0 (the reference)",
                      *nll_at(ref)])
    doc.table(["b (training points per fit)", "fit", "draws", "max rel. test-NLL gap to the full batch (%)",
               "chosen δ", "test NLL at chosen δ (nats)"], table)
    return fits


def _first_records(ctx: ReportContext, key: str) -> dict[str, list[dict]]:
    """Per method, the per-factor records a sweep stored under ``key`` with its first fit."""
    fits: dict[str, list[dict]] = {}
    for r in ctx.rows:
        if r.get(key) and r["method"] not in fits:
            fits[r["method"]] = r[key]
    return fits


def coverage_tables(ctx: ReportContext, doc: ReportDoc) -> None:
    """What each debiased K-FAC fit's curvature covers (first repeat): per layer and
    factor the ranks B, B̃ and B ∪ B̃ reach, exact zeros, and the share of weights left with
    only the prior (variance 1/δ, which rules the predictive at small δ)."""
    fits = _first_records(ctx, "coverage")
    if not fits:
        return
    doc.h("Curvature coverage")
    doc.p("Per layer and K-FAC factor of each debiased fit (first repeat): the numerical rank of the "
          "factor on B, on B̃ and on B ∪ B̃, the debiased eigenvalues that are zero, those set by the "
          "isotropic completion of B's null space (B̃'s mean curvature there), the share of the "
          "block's weights whose only curvature is the prior, and the part of it that more samples would "
          "cover (the rest is the curvature's own, e.g. dead units: the full-batch fit has it too). "
          "See docs/wide-layers.md.")
    for method, rows in fits.items():
        doc.p(f"**{method}**")
        doc.table(["layer", "parameter", "factor", "dim.", "rank B", "rank B̃", "rank B ∪ B̃", "zero",
                   "completed", "prior-only weights [%]", "of which sample-limited [%]"],
                  [[str(c["layer"]), c["parameter"], c["factor"], str(c["dimension"]), str(c["rank_B"]),
                    str(c["rank_B~"]), str(c["rank_B∪B~"]), str(c["zero_eigenvalues"]), str(c["completed"]),
                    f"{100 * c['prior_only_share']:.1f}",
                    f"{100 * c['sample_limited_share']:.1f}" if "sample_limited_share" in c else "–"]
                   for c in rows])


def correction_tables(ctx: ReportContext, doc: ReportDoc) -> None:
    """What each corrected or shrunk K-FAC fit changed (first repeat): per layer and factor, how far
    the correction moved the spectrum of the single batch B ∪ B̃, with the standard error from the
    two orders of the batches and the share of the correction kept on the range."""
    fits = _first_records(ctx, "correction")
    if not fits:
        return
    doc.h("What the corrected estimate changed")
    doc.p("Per layer and K-FAC factor of each corrected or shrunk fit (first repeat): the relative change "
          "‖λ̂ − λ‖ / ‖λ‖ of the eigenvalues λ of the single batch B ∪ B̃ (the same samples) that the "
          "regression-to-the-mean correction made, its standard error from the two orders of B and "
          "B̃, and the share of the correction kept on the range of B ∪ B̃ (100 % for the corrected fit; "
          "the shrunk fit keeps less where the two orders disagree, 0 % where they disagree as much as "
          "they correct: the single batch there). Directions B ∪ B̃ does not reach keep the whole correction.")
    for method, rows in fits.items():
        doc.p(f"**{method}**")
        doc.table(["layer", "parameter", "factor", "change [%]", "± s.e. [%]", "kept [%]"],
                  [[str(c["layer"]), c["parameter"], c["factor"], f"{100 * c['change']:.1f}",
                    f"{100 * c['stderr']:.1f}", f"{100 * c.get('kept', 1.0):.0f}"] for c in rows])
