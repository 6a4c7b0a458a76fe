"""Choosing and computing the two-batch K-FAC estimate of ``estimator=...`` for the
debiased K-FAC Laplace classes ([`laplace_debiased.kron.laplace`][laplace_debiased.kron.laplace]).

``"paper"``: B's eigenvectors, B̃'s Rayleigh quotients (Tatzel et al., ICLR 2025), with the
null-space completion of [`laplace_debiased.curvature.completion`][laplace_debiased.curvature.completion]. ``"corrected"``: the
eigenvectors of B ∪ B̃, eigenvalues less the regression-to-the-mean gap the two batches measure
against each other ([`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected]; the
default). ``"shrunk"``: the same, with each factor's correction scaled by ``max(0, 1 - Σe²/Σx²)``
(``e`` the two orders' disagreement). ``"stein"``: the same, scaled by the minimum-MSE (James–Stein) weight from the
correction's own noise, the pooled null space filled by the smaller of the two orders' null gaps
([`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected]).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from laplace_debiased.kron.corrected import FactorCorrection, Spectra, corrected_kron
from laplace_debiased.parallel.reducer import Reducer

__all__ = ["CORRECTED", "ESTIMATORS", "Correction", "corrected_decomposition", "on_rank0", "resolve_estimator"]

logger = logging.getLogger("laplace_debiased")

#: the estimates ``estimator=...`` offers (module docstring)
ESTIMATORS = ("paper", "corrected", "shrunk", "stein")

#: the estimates on the eigenvectors of B ∪ B̃
#: ([`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected])
CORRECTED = ("corrected", "shrunk", "stein")


def resolve_estimator(estimator: str | None, offered: Sequence[str], structure: str, cross_fit: bool,
                      null_space: str = "isotropic") -> str:
    """The estimate a fit uses.

    Args:
        estimator: the one asked for, or ``None`` for the default: ``"corrected"`` where
            ``offered`` has it (chosen by a pre-registered comparison with the single batch, the
            paper's, the shrunk and the stein estimate; docs/benchmarks.md), except that
            ``cross_fit=True`` or ``null_space="aligned"`` (options of the paper's estimate) select
            ``"paper"``; ``"paper"`` elsewhere.
        offered: the estimates the structure offers
            ([`ESTIMATORS`][laplace_debiased.kron.estimators.ESTIMATORS] for ``debiased_kron``).
        structure: the structure's name, for the error message.
        cross_fit: whether the fit also swaps the roles of B and B̃.
        null_space: the fit's null-space treatment (``"isotropic"`` or ``"aligned"``).

    Returns:
        One of [`ESTIMATORS`][laplace_debiased.kron.estimators.ESTIMATORS].

    Raises:
        ValueError: ``estimator`` is not one of ``offered``, or one of [`CORRECTED`][laplace_debiased.kron.estimators.CORRECTED] is combined with
            ``cross_fit`` (the corrected estimate already uses both orders) or with
            ``null_space="aligned"`` (it completes the pooled null space its own way).
    """
    if estimator is None:
        paper_options = cross_fit or null_space != "isotropic"
        return "corrected" if "corrected" in offered and not paper_options else "paper"
    if estimator not in offered:
        raise ValueError(f"{structure} offers estimator in {tuple(offered)}, got {estimator!r}.")
    if estimator in CORRECTED and cross_fit:
        raise ValueError(f"estimator={estimator!r} already uses both orders of B and B̃; drop cross_fit=True.")
    if estimator in CORRECTED and null_space != "isotropic":
        raise ValueError(f"null_space={null_space!r} is an option of estimator='paper'; the {estimator} "
                         "estimate completes the null space of B ∪ B̃ itself. Pass estimator='paper' or drop null_space.")
    return estimator


def on_rank0(compute: Callable[[], tuple[list, list]], like: list[list[torch.Tensor]],
             reducer: Reducer) -> tuple[list, list]:
    """``compute()``'s ``(eigenvectors, eigenvalues)`` (lists of lists shaped like the square
    factors ``like``): computed on rank 0 and broadcast to the others (``reducer.broadcast_``),
    so every rank holds the same basis (``eigh`` is not reproducible across devices)."""
    if reducer.rank == 0:
        eigenvectors, eigenvalues = compute()
    else:
        eigenvectors = [[torch.empty_like(F) for F in block] for block in like]
        eigenvalues = [[F.new_empty(F.shape[0]) for F in block] for block in like]
    reducer.broadcast_([t for blocks in (eigenvectors, eigenvalues) for b in blocks for t in b])
    return eigenvectors, eigenvalues


@dataclass(frozen=True)
class Correction:
    """What a corrected fit changed, per block and factor (``la.correction``).

    Attributes:
        names: ``(layer, parameter)`` per block, in ``Kron`` block order.
        factors: per block, one [`FactorCorrection`][laplace_debiased.kron.corrected.FactorCorrection]
            per factor (output factor first, then input; one for a single-factor block).
    """

    names: list[tuple[str, str]]
    factors: list[list[FactorCorrection]]

    def rows(self) -> list[dict]:
        """One JSON-able dict per block and factor: layer, parameter, factor, change, the two
        orders' changes, the standard error and the share of the range correction kept (fractions)."""
        return [{"layer": layer, "parameter": parameter, "factor": _factor_name(i, len(fs)),
                 "change": f.change, "change_B": f.change_b, "change_B~": f.change_b_tilde, "stderr": f.stderr,
                 "kept": f.kept}
                for (layer, parameter), fs in zip(self.names, self.factors) for i, f in enumerate(fs)]

    def markdown(self) -> str:
        """A Markdown table of [`rows`][laplace_debiased.kron.estimators.Correction.rows] in
        percent."""
        lines = ["| layer | parameter | factor | change of the single-batch spectrum [%] | ± s.e. [%] "
                 "| correction kept on the range [%] |",
                 "|---|---|---|---|---|---|"]
        lines += [f"| {r['layer']} | {r['parameter']} | {r['factor']} | {100 * r['change']:.1f} | "
                  f"{100 * r['stderr']:.1f} | {100 * r['kept']:.0f} |" for r in self.rows()]
        return "\n".join(lines)

    def log(self) -> None:
        """One INFO line per block (logger ``laplace_debiased``)."""
        for (layer, parameter), fs in zip(self.names, self.factors):
            text = ", ".join(f"{_factor_name(i, len(fs))} {100 * f.change:.1f} % ± {100 * f.stderr:.1f} % "
                             f"({100 * f.kept:.0f} % of the range correction kept)"
                             for i, f in enumerate(fs))
            logger.info("corrected %s.%s: spectrum of the single batch B ∪ B̃ changed by %s", layer, parameter, text)


def _factor_name(i: int, n: int) -> str:
    return ("output", "input")[i] if n == 2 else "factor"


def corrected_decomposition(
    direction_kfacs: list[list[torch.Tensor]],
    magnitude_kfacs: list[list[torch.Tensor]],
    sizes: tuple[int, int],
    names: list[tuple[str, str]],
    n_data: int,
    reducer: Reducer,
    rows: list[list[tuple[torch.Tensor, torch.Tensor] | None]] | None = None,
    rule: str = "corrected",
    terms: list[list[int]] | None = None,
    spectra: list[list[Spectra]] | None = None,
) -> tuple[list, list, Correction | None]:
    """[`corrected_kron`][laplace_debiased.kron.corrected.corrected_kron] of B's and B̃'s K-FAC factors (``sizes`` their samples, drawn from
    ``n_data`` training data; ``rows`` per block and factor B's and B̃'s factor rows where known;
    ``rule``: one of [`CORRECTED`][laplace_debiased.kron.estimators.CORRECTED]; ``terms`` per block and factor the rank-one terms summed
    into either factor, default the samples ``max(sizes)``; ``spectra`` per block and factor a dict that receives the
    spectra of its dense decomposition, [`Spectra`][laplace_debiased.kron.corrected.Spectra]), on rank 0
    and broadcast ([`on_rank0`][laplace_debiased.kron.estimators.on_rank0]); returns ``(eigenvectors, eigenvalues, correction)`` with
    rank 0's [`Correction`][laplace_debiased.kron.estimators.Correction] (``None`` on the other ranks), logged per block (``names``)."""
    records: list[list[FactorCorrection]] = []

    def compute() -> tuple[list, list]:
        counts = terms if terms is not None else max(sizes)
        vecs, vals, recs = corrected_kron(direction_kfacs, magnitude_kfacs, *sizes, counts, n_data, rows, rule, spectra)
        records.extend(recs)
        return vecs, vals

    vecs, vals = on_rank0(compute, direction_kfacs, reducer)
    if not records:
        return vecs, vals, None
    correction = Correction(list(names), records)
    correction.log()
    return vecs, vals, correction
