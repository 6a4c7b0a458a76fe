"""How closely a mini-batch LA tracks its full-batch reference over a prior-precision grid.

The paper's Figure 6 criterion, as numbers. For one draw of a mini-batch method ``m`` and its
full-batch reference ``f`` (same structure, all ``N`` training points), on one evaluation set
and link approximation:

* relative NLL gap: ``max_δ |NLL_m(δ) − NLL_f(δ)| / NLL_f(δ)`` (a fraction);
* absolute gap of any other metric ``s`` (ECE, accuracy): ``max_δ |s_m(δ) − s_f(δ)|``;

the maximum over the prior precisions ``δ`` both were evaluated at. Functions here take sweep
rows (``results.jsonl`` dicts with ``method``, ``repeat``, ``prior_precision``, ``eval_set``,
``link`` and the metric) and return floats, one per draw, or with
[`gap_curves`][laplace_debiased.evaluation.tracking.gap_curves] the signed gaps at each ``δ`` (where on the
grid a method errs, and in which direction).

A percentile bootstrap interval of such a maximum is not valid: resampling adds noise to every
grid point, and the maximum of noisier values is larger, so the resampled maxima sit above the
point estimate and their percentiles can exclude it.
[`max_abs_interval`][laplace_debiased.evaluation.tracking.max_abs_interval] instead carries a simultaneous
bootstrap band of the signed gaps through the maximum.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import t as student_t

__all__ = ["clearly_below", "curves_from_json", "curves_to_json", "gap_curves", "largest_gap", "largest_gaps",
           "max_abs_interval", "max_gap_per_draw", "mean_stderr", "paired_margin", "reference_of", "signed_gap",
           "where_largest"]


def reference_of(method: str, full_batch: Sequence[str]) -> str | None:
    """The full-batch method of ``method``'s structure (``kron_debiased`` -> ``kron_full``): the
    method in ``full_batch`` with the same prefix before ``_``; ``None`` without one."""
    kind = method.split("_")[0]
    matches = [f for f in full_batch if f.split("_")[0] == kind and f != method]
    return matches[0] if len(matches) == 1 else None


def _curve(rows: Sequence[dict], method: str, eval_set: str, link: str, metric: str) -> dict[int, dict[float, float]]:
    """``{repeat: {δ: metric}}`` of ``method`` on ``eval_set`` with ``link``."""
    out: dict[int, dict[float, float]] = {}
    for r in rows:
        if (r["method"] == method and r["eval_set"] == eval_set and r["link"] == link
                and r.get("prior_precision") is not None and r.get(metric) is not None):
            out.setdefault(int(r["repeat"]), {})[float(r["prior_precision"])] = float(r[metric])
    return out


def signed_gap(value: float, reference: float, relative: bool = True) -> float:
    """The gap of one metric value to its reference at one δ: ``(value − reference) / |reference|``
    (without the division when not ``relative``); positive where ``value`` is the larger."""
    return (value - reference) / (abs(reference) if relative else 1.0)


def largest_gap(values: Sequence[float], reference: Sequence[float], relative: bool = True) -> float:
    """``max_δ |`` [`signed_gap`][laplace_debiased.evaluation.tracking.signed_gap] ``|`` over two curves given
    at the same prior precisions (``values[g]`` and ``reference[g]`` at the ``g``-th δ): one draw's tracking
    error."""
    if len(values) != len(reference) or not len(values):
        raise ValueError(f"two curves of equal, non-zero length are needed, got {len(values)} and {len(reference)}")
    return max(abs(signed_gap(v, r, relative)) for v, r in zip(values, reference))


def gap_curves(rows: Sequence[dict], method: str, reference: str, eval_set: str, link: str,
               metric: str = "nll", relative: bool = True) -> dict[int, dict[float, float]]:
    """Per draw of ``method``, its signed gap to ``reference`` at each prior precision both were
    evaluated at: ``{repeat: {δ: (s_m(δ) − s_f(δ)) / |s_f(δ)|}}`` (without the division when not
    ``relative``); positive where the method's metric is the larger.

    The reference is one draw (repeat 0 of a full-batch fit; its first repeat if it has several).
    Raises ``ValueError`` when the two share no prior precision, since there is no gap to report.
    """
    ref_draws = _curve(rows, reference, eval_set, link, metric)
    if not ref_draws:
        raise ValueError(f"no {metric!r} rows of the reference {reference!r} on {eval_set!r} with link {link!r}")
    ref = ref_draws[min(ref_draws)]
    gaps = {}
    for repeat, curve in sorted(_curve(rows, method, eval_set, link, metric).items()):
        common = sorted(set(curve) & set(ref))
        if not common:
            raise ValueError(f"{method!r} (repeat {repeat}) and {reference!r} share no prior precision")
        gaps[repeat] = {d: signed_gap(curve[d], ref[d], relative) for d in common}
    return gaps


def max_gap_per_draw(rows: Sequence[dict], method: str, reference: str, eval_set: str, link: str,
                     metric: str = "nll", relative: bool = True) -> list[float]:
    """Per draw of ``method`` (ascending repeat), the largest absolute gap to ``reference`` over the
    prior precisions both were evaluated at: the maximum over ``δ`` of ``|``
    [`gap_curves`][laplace_debiased.evaluation.tracking.gap_curves] ``|``."""
    return largest_gaps(gap_curves(rows, method, reference, eval_set, link, metric, relative))


def largest_gaps(curves: dict[int, dict[float, float]]) -> list[float]:
    """For [`gap_curves`][laplace_debiased.evaluation.tracking.gap_curves]' output: per draw (ascending
    repeat), the largest absolute gap over δ."""
    return [max(abs(g) for g in curve.values()) for _, curve in sorted(curves.items())]


def where_largest(curves: dict[int, dict[float, float]]) -> dict[float, int]:
    """For [`gap_curves`][laplace_debiased.evaluation.tracking.gap_curves]' output: ``{δ: draws}``, how many
    draws have their largest absolute gap at each prior precision (ascending δ, only those that hold one; the
    first δ on ties)."""
    counts: dict[float, int] = {}
    for curve in curves.values():
        at = max(curve, key=lambda d: abs(curve[d]))
        counts[at] = counts.get(at, 0) + 1
    return dict(sorted(counts.items()))


def curves_to_json(curves: dict[int, dict[float, float]]) -> dict[str, list[float]]:
    """[`gap_curves`][laplace_debiased.evaluation.tracking.gap_curves]' output ``{draw: {δ: gap}}`` as
    ``{repr(δ): [gap per draw]}`` (ascending draw, the prior precisions of the first draw): JSON keys are
    strings."""
    return {repr(d): [curves[r][d] for r in sorted(curves)] for d in curves[min(curves)]}


def curves_from_json(by_delta: dict[str, list[float]]) -> dict[int, dict[float, float]]:
    """The inverse of [`curves_to_json`][laplace_debiased.evaluation.tracking.curves_to_json] (draws numbered
    from 0)."""
    draws = len(next(iter(by_delta.values())))
    return {r: {float(d): gaps[r] for d, gaps in by_delta.items()} for r in range(draws)}


def mean_stderr(values: Sequence[float]) -> tuple[float, float]:
    """``(mean, s / √n)`` of ``n`` per-draw values (``s`` the standard deviation with ``n − 1``
    degrees of freedom); the standard error is NaN for one draw."""
    v = np.asarray(values, dtype=float)
    return float(v.mean()), float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else float("nan")


def paired_margin(draws: int, level: float = 0.95) -> float:
    """``t``, the ``(1 + level) / 2`` quantile of Student's t with ``draws − 1`` degrees of freedom:
    a mean of ``draws`` paired differences further than ``t`` standard errors from 0 lies outside the
    two-sided ``level`` interval of no difference (4.30 for 3 draws, 2.13 for 16, → 1.96)."""
    if draws < 2:
        raise ValueError(f"the spread over draws needs at least 2 draws, got {draws}")
    return float(student_t.ppf((1 + level) / 2, draws - 1))


def clearly_below(a: Sequence[float], b: Sequence[float], level: float = 0.95) -> bool:
    """Whether per-draw values ``a`` lie below ``b`` beyond the spread over draws.

    Draw ``r`` of both comes from the same samples (the main job seeds each draw's batches by the
    draw alone), so the differences ``d_r = a_r − b_r`` are paired: ``a`` is clearly below when
    ``mean(d) + t · s_d / √R < 0``, with ``s_d`` their standard deviation (``R − 1`` degrees of
    freedom) over the ``R`` draws and ``t`` from
    [`paired_margin`][laplace_debiased.evaluation.tracking.paired_margin]: the two-sided ``level``
    interval of the mean difference lies below 0. Fewer than 2 draws never give a clear order.

    Args:
        a: Per draw (ascending draw), the values of one fit, ``(R,)``.
        b: The other fit's, ``(R,)``, in the same draw order.
        level: Confidence level of the interval.

    Raises:
        ValueError: If ``a`` and ``b`` hold different numbers of draws (the draws are not paired).
    """
    if len(a) != len(b):
        raise ValueError(f"paired draws needed: {len(a)} values against {len(b)}; compare fits of the same draws")
    if len(a) < 2:
        return False
    d = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    mean, se = mean_stderr(d)
    return mean + paired_margin(len(d), level) * se < 0


def max_abs_interval(point: np.ndarray, boot: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap interval of ``max_g |d_kg|`` for each draw ``k``, from a simultaneous band.

    The band is the max-t band of the signed gaps: ``d̂_kg ± c · s_kg`` with ``s_kg`` the bootstrap
    standard deviation of ``d_kg`` and ``c`` the ``level`` quantile over resamples of
    ``max_kg |d*_kg − d̂_kg| / s_kg``, so that it covers all draws and grid points at once. Where
    every ``d_kg`` lies in its band, ``|d_kg|`` lies in ``[max(|d̂_kg| − c s_kg, 0), |d̂_kg| + c s_kg]``
    and the maximum over ``g`` in ``[max_g`` of the lower ends ``, max_g`` of the upper ends ``]``.
    The interval always contains the point estimate ``max_g |d̂_kg|``; the mean (worst) over
    draws lies between the mean (max) of the ends.

    Args:
        point: ``(D, G)`` signed gaps (method minus reference, relative or absolute) of ``D``
            draws at ``G`` grid points.
        boot: ``(n_boot, D, G)`` the same gaps on bootstrap resamples (the same resample for a
            method and its reference).
        level: coverage of the band, in ``(0, 1)``.

    Returns:
        ``(lower, upper)``, each ``(D,)``.
    """
    point = np.asarray(point, dtype=np.float64)
    boot = np.asarray(boot, dtype=np.float64)
    if point.ndim != 2 or boot.ndim != 3 or boot.shape[1:] != point.shape or not 0 < level < 1:
        raise ValueError(f"point must be (D, G) and boot (n_boot, D, G), level in (0, 1); got {point.shape}, "
                         f"{boot.shape}, {level}")
    dev = np.abs(boot - point)
    sd = boot.std(axis=0)
    t = np.divide(dev, sd, out=np.zeros_like(dev), where=sd > 0).reshape(len(boot), -1).max(axis=1)
    c = float(np.quantile(t, level)) if len(t) else 0.0
    half = c * sd
    lower = np.clip(np.abs(point) - half, 0.0, None).max(axis=1)
    upper = (np.abs(point) + half).max(axis=1)
    return lower, upper
