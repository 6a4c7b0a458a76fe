"""The prior-precision grid: parsing, checking, rounding, the default, extension and the choice.

Every prior precision δ that a sweep evaluates, a results row stores, a report chooses or the
main job adds at an edge passes through [`PriorGrid`][laplace_debiased.prior_grid.PriorGrid] and
[`round_precision`][laplace_debiased.prior_grid.round_precision], so that one rounding rule holds everywhere
and rows compare by ``==``.  Torch-free (the command-line flags import it for ``--help``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Context, Decimal

#: Significant digits a prior precision keeps (in rows, grids and extensions).
SIGNIFICANT_DIGITS = 6
#: The choice criteria: the lowest validation NLL, or the highest log marginal likelihood.
CRITERIA = ("nll", "log_marglik")


def round_precision(delta: float) -> float:
    """``delta`` rounded to [`SIGNIFICANT_DIGITS`][laplace_debiased.prior_grid.SIGNIFICANT_DIGITS] significant
    digits (idempotent).

    Args:
        delta: A prior precision (any real number; checking is
            [`PriorGrid.parse`][laplace_debiased.prior_grid.PriorGrid.parse]'s job).

    Returns:
        The nearest float to ``delta``'s decimal rounding, e.g. ``0.00215443``.
    """
    return float(f"{float(delta):.{SIGNIFICANT_DIGITS}g}")


def _rounded_beyond(edge: float, value: float) -> float:
    """``value``, a step beyond ``edge`` on either side, rounded by
    [`round_precision`][laplace_debiased.prior_grid.round_precision]; where the rounding does not leave
    ``edge`` (a step finer than the rounding), the next value with
    [`SIGNIFICANT_DIGITS`][laplace_debiased.prior_grid.SIGNIFICANT_DIGITS] significant digits beyond ``edge``
    on ``value``'s side."""
    up = value > edge
    rounded = round_precision(value)
    if (rounded > edge) if up else (rounded < edge):
        return rounded
    digits = Context(prec=SIGNIFICANT_DIGITS)
    anchor = Decimal(repr(round_precision(edge)))  # within half a unit of edge
    return float(digits.next_plus(anchor) if up else digits.next_minus(anchor))


#: The paper's 13 log-spaced prior precisions 1e-4 ... 1, plus 10 (14 points), rounded.
DEFAULT_PRIOR_PRECISIONS: tuple[float, ...] = tuple(
    round_precision(v) for v in [*(10.0 ** (-4 + k / 3) for k in range(13)), 10.0]
)


@dataclass(frozen=True)
class PriorGrid:
    """An immutable grid of prior precisions δ, each positive, finite and given once.

    [`parse`][laplace_debiased.prior_grid.PriorGrid.parse] rounds user input by
    [`round_precision`][laplace_debiased.prior_grid.round_precision] (the values rows store); the constructor
    takes values as they are (e.g. read back from rows).  The values keep the order they were given in (a
    sweep writes its rows in that order); the edges are the smallest and the largest value.

    Attributes:
        values: The prior precisions, shape ``(G,)`` as a tuple, ``G >= 1``.
    """

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(self.values))
        if not self.values:
            raise ValueError("give at least one prior precision")
        bad = [d for d in self.values if not (math.isfinite(d) and d > 0)]
        if bad:
            raise ValueError(f"prior precisions must be positive and finite, got {bad}")
        if len(set(self.values)) != len(self.values):
            raise ValueError(f"repeated prior precision in {list(self.values)} "
                             f"(rounded to {SIGNIFICANT_DIGITS} significant digits); give each once")

    @classmethod
    def parse(cls, prior_precisions: Iterable[float]) -> PriorGrid:
        """The checked grid of user input, each value rounded by
        [`round_precision`][laplace_debiased.prior_grid.round_precision].

        Args:
            prior_precisions: Numbers (floats, ints or numeric strings), in the order to sweep.

        Returns:
            The grid, in the given order.

        Raises:
            ValueError: For an empty grid, a value that is not positive and finite, or a value
                given twice (after rounding).
        """
        return cls(tuple(round_precision(d) for d in prior_precisions))

    @classmethod
    def default(cls) -> PriorGrid:
        """The paper's grid,
        [`DEFAULT_PRIOR_PRECISIONS`][laplace_debiased.prior_grid.DEFAULT_PRIOR_PRECISIONS]."""
        return cls(DEFAULT_PRIOR_PRECISIONS)

    def __iter__(self) -> Iterator[float]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def union(self, other: Iterable[float]) -> PriorGrid:
        """This grid and the (rounded) values of ``other``, each once, sorted ascending."""
        return PriorGrid(tuple(sorted({*self.values, *(round_precision(d) for d in other)})))

    def on_edge(self, delta: float) -> bool:
        """Whether ``delta`` is the smallest or the largest value of the grid."""
        return delta in (min(self.values), max(self.values))

    def n_outside(self, other: PriorGrid) -> int:
        """How many values lie outside the range ``[min(other), max(other)]``."""
        lo, hi = min(other.values), max(other.values)
        return sum(d < lo or d > hi for d in self.values)

    def choose(self, scores: Sequence[float], criterion: str = "nll") -> float | None:
        """The value that [`choose_prior_precision`][laplace_debiased.prior_grid.choose_prior_precision]
        chooses from one score per value.

        Args:
            scores: The score at each value, ``G`` numbers in the order of
                [`values`][laplace_debiased.prior_grid.PriorGrid.values].
            criterion: ``"nll"`` (lower is better) or ``"log_marglik"`` (higher is better).

        Returns:
            The chosen prior precision (non-finite scores skipped, ties to the smallest);
            ``None`` when no score is finite.

        Raises:
            ValueError: For a number of scores other than ``G``, or an unknown ``criterion``.
        """
        if len(scores) != len(self.values):
            raise ValueError(f"give one score per prior precision ({len(self.values)}), got {len(scores)}")
        return choose_prior_precision(dict(zip(self.values, scores)), criterion)

    def extension(self, chosen: Iterable[float]) -> tuple[float, ...]:
        """One new value beyond each edge that holds a chosen δ, at that edge's own log spacing.

        Below the smallest value ``d_0`` the step is ``d_0**2 / d_1``; above the largest ``d_{G-1}``
        it is ``d_{G-1}**2 / d_{G-2}`` (``d`` sorted ascending), rounded by
        [`round_precision`][laplace_debiased.prior_grid.round_precision]. Where that rounding puts it back on
        the edge (a step finer than six significant digits, as from 0.999999 to 1), the new value is the next
        six-digit one beyond the edge (1.00001). A one-point grid has no spacing and is not extended.

        Args:
            chosen: The chosen prior precisions (e.g. one per method).

        Returns:
            The new values, rounded, the lower one first; ``()`` when no edge holds a choice.

        Raises:
            ValueError: When a step leaves the positive finite floats (an absurdly wide grid).
        """
        d = sorted(self.values)
        if len(d) < 2:
            return ()
        chosen = set(chosen)
        steps = ([(d[0], d[1])] if d[0] in chosen else []) + ([(d[-1], d[-2])] if d[-1] in chosen else [])
        try:
            new = [_rounded_beyond(edge, edge ** 2 / inner) for edge, inner in steps]
        except OverflowError:
            new = [math.inf]
        if not all(math.isfinite(v) and v > 0 for v in new):
            raise ValueError(f"one log step beyond the edges of {d} leaves the positive finite floats; "
                             "give a grid that spans fewer orders of magnitude")
        return tuple(new)


def check_criterion(criterion: str) -> None:
    """Refuses a choice criterion other than [`CRITERIA`][laplace_debiased.prior_grid.CRITERIA]."""
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be 'nll' or 'log_marglik', got {criterion!r}")


def choose_prior_precision(scores: Mapping[float, float], criterion: str = "nll") -> float | None:
    """The prior precision of the best score: the lowest NLL or the highest log marginal likelihood.

    Args:
        scores: ``δ -> score``, each score a mean over repeats (NaN or infinite scores are skipped).
        criterion: ``"nll"`` (lower is better) or ``"log_marglik"`` (higher is better).

    Returns:
        The best δ; ties go to the smallest δ.  ``None`` when no score is finite.

    Raises:
        ValueError: For an unknown ``criterion``.
    """
    check_criterion(criterion)
    sign = 1.0 if criterion == "nll" else -1.0
    best: tuple[float, float] | None = None
    for delta, score in sorted(scores.items()):
        m = sign * score
        if math.isfinite(m) and (best is None or m < best[1]):
            best = (delta, m)
    return None if best is None else best[0]
