"""Choosing and computing the two-batch K-FAC estimate of ``fit(estimator=...)`` for the
debiased K-FAC Laplace classes (:mod:`laplace_debiased.structures.kron`).

``"paper"``: B's eigenvectors, B̃'s Rayleigh quotients (Tatzel et al., ICLR 2025), with the
null-space completion of :mod:`laplace_debiased.curvature.completion`. ``"corrected"``: the
eigenvectors of B ∪ B̃, eigenvalues less the regression-to-the-mean gap the two batches measure
against each other (:mod:`laplace_debiased.curvature.corrected`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from laplace_debiased.curvature.corrected import FactorCorrection, corrected_kron
from laplace_debiased.structures.distributed import broadcast_, rank_world

__all__ = ["ESTIMATORS", "check_estimator", "corrected_decomposition", "on_rank0", "report_correction"]

logger = logging.getLogger("laplace_debiased")

#: the estimates ``fit(estimator=...)`` offers (module docstring)
ESTIMATORS = ("paper", "corrected")


def check_estimator(estimator: str, offered: Sequence[str], structure: str, cross_fit: bool) -> None:
    """Raise a ``ValueError`` that says what to pass if ``estimator`` is not one of ``offered``
    or is combined with ``cross_fit`` (the corrected estimate already uses both orders)."""
    if estimator not in offered:
        raise ValueError(f"{structure} offers estimator in {tuple(offered)}, got {estimator!r}.")
    if estimator == "corrected" and cross_fit:
        raise ValueError("estimator='corrected' already uses both orders of B and B̃; drop cross_fit=True.")


def on_rank0(compute: Callable[[], tuple[list, list]], like: list[list[torch.Tensor]]) -> tuple[list, list]:
    """``compute()``'s ``(eigenvectors, eigenvalues)`` (lists of lists shaped like the square
    factors ``like``): computed on rank 0 and broadcast to the others under a process group
    (:func:`laplace_debiased.structures.distributed.broadcast_`), so every rank holds the same
    basis (``eigh`` is not reproducible across devices)."""
    if rank_world()[0] == 0:
        eigenvectors, eigenvalues = compute()
    else:
        eigenvectors = [[torch.empty_like(F) for F in block] for block in like]
        eigenvalues = [[F.new_empty(F.shape[0]) for F in block] for block in like]
    broadcast_([t for blocks in (eigenvectors, eigenvalues) for b in blocks for t in b])
    return eigenvectors, eigenvalues


def report_correction(records: list[list[FactorCorrection]], names: list[tuple[str, str]]) -> None:
    """Log (INFO, logger ``laplace_debiased``) per block how much the corrected estimate moved
    each factor's single-batch (B ∪ B̃) spectrum, with the standard error from the two orders."""
    for (layer, parameter), factors in zip(names, records):
        text = ", ".join(f"{('output', 'input')[i] if len(factors) == 2 else 'factor'} "
                         f"{100 * f.change:.1f} % ± {100 * f.stderr:.1f} %" for i, f in enumerate(factors))
        logger.info("corrected %s.%s: spectrum of the single batch B ∪ B̃ changed by %s", layer, parameter, text)


def corrected_decomposition(
    direction_kfacs: list[list[torch.Tensor]],
    magnitude_kfacs: list[list[torch.Tensor]],
    sizes: tuple[int, int],
    names: list[tuple[str, str]],
) -> tuple[list, list, list[list[FactorCorrection]] | None]:
    """:func:`corrected_kron` of B's and B̃'s K-FAC factors (``sizes`` their samples), on rank 0
    and broadcast (:func:`on_rank0`); returns ``(eigenvectors, eigenvalues, records)`` with
    rank 0's records (``None`` on the other ranks), logged per block (``names``)."""
    records: list[list[FactorCorrection]] = []

    def compute() -> tuple[list, list]:
        vecs, vals, recs = corrected_kron(direction_kfacs, magnitude_kfacs, *sizes, max(sizes))
        records.extend(recs)
        return vecs, vals

    vecs, vals = on_rank0(compute, direction_kfacs)
    report_correction(records, names)
    return vecs, vals, records or None
