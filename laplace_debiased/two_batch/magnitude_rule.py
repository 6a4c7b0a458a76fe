"""``n_magnitude_batches="auto"``: enough magnitude batches to cover the widest
K-FAC factor.

A K-FAC factor of dimension ``d`` is a sum of outer products, one per *row* its batch gives it,
so a batch with ``r`` rows gives it rank at most ``r``, and B ∪ B̃ at most
``rows(B) + rows(B̃)``. The rows of a ``Linear`` / ``Conv2d`` / GPT-2 ``Conv1D`` layer's factors
(and of an ``nn.MultiheadAttention`` projection's), per pass over a batch of ``n`` samples
([`layer_positions`][laplace_debiased.curvature.kfac.layer_positions]):

* input factor ``A`` (``d = d_in``, a conv's ``C_in/groups · k_h · k_w``): ``n · T``, with ``T``
  the positions of the layer's output (a conv's output pixels, a sequence's tokens; ``T = 1`` for
  a ``Linear`` on vectors);
* output factor ``G`` (``d = d_out``): ``n · T · c``, with ``c`` the columns backpropagated per
  output row, the rank of the loss-Hessian square root: ``C - 1`` for the cross-entropy GGN
  (``diag(p) - ppᵀ`` has rank ``C - 1``), ``C`` for the MSE GGN, ``1`` for the empirical Fisher,
  ``mc_samples`` for the MC Fisher. These rows can span less than ``n · T · c`` dimensions when
  the layer feeds a narrower linear map;
  [`sample_limited`][laplace_debiased.two_batch.coverage.FactorCoverage.sample_limited] tells such saturated
  factors apart after the fit.

The rule ([`auto_magnitude_batches`][laplace_debiased.two_batch.magnitude_rule.auto_magnitude_batches]): after
B (``|B| = n_direction_batches`` batches with ``R_f`` rows for factor ``f``) is chosen, each further batch is
taken to add B's mean ``R_f / |B|`` rows, and ``k`` is the smallest integer ``>= 1`` with

``R_f + k · R_f / |B| >= d_f``  for every factor with ``d_f > R_f``,

i.e. ``k = max(1, max_f ⌈|B| (d_f - R_f) / R_f⌉)``, capped at
[`AUTO_MAGNITUDE_CAP`][laplace_debiased.two_batch.magnitude_rule.AUTO_MAGNITUDE_CAP]. For data in general
position ``rank(B ∪ B̃) = min(d_f, R_f + rows(B̃))``, so when B̃'s batches give B's mean rows this ``k`` is
the fewest batches with which B ∪ B̃ spans every factor, and no debiased eigenvalue is left at zero for lack
of samples. The fit then applies the rule to B ∪ B̃ itself: where a shorter batch left a factor short it takes
as many further batches as the rule asks, up to the cap; a factor still short (cap reached, loader exhausted)
is recorded as [`AutoMagnitude.short`][laplace_debiased.two_batch.magnitude_rule.AutoMagnitude.short] and
logged as a warning. Embedding and normalisation blocks are not counted. The limiting factor (the one needing
most batches), the uncapped need and the batches the loader could give are recorded on the fit's
[`BatchChoice`][laplace_debiased.two_batch.batches.BatchChoice] (``la.fit_batches[-1].auto``) and logged with
it.

At equal samples, the even split of B and B̃ measured better than growing B̃ alone
(docs/guide/choosing-batches.md): more samples for B̃ help until B's directions are the limit, and
"auto" only adds batches to B̃.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


__all__ = ["AUTO_MAGNITUDE_CAP", "AutoMagnitude", "FactorRowCount", "auto_magnitude_batches"]

#: most magnitude batches ``n_magnitude_batches="auto"`` takes (a wider factor gets this many and
#: the record says it was capped): the cost of a fit grows with every batch, and past a few
#: batches B's directions, not B̃'s samples, limit the estimate.
AUTO_MAGNITUDE_CAP = 8


@dataclass(frozen=True)
class FactorRowCount:
    """One K-FAC factor: ``layer`` (module name), ``factor`` ("input" / "output"), its
    ``dimension`` ``d`` and the ``rows_direction`` ``R`` that the ``n_direction_batches`` batches
    of B give it (module docstring)."""

    layer: str
    factor: str
    dimension: int
    rows_direction: int
    n_direction_batches: int

    @property
    def rows_per_batch(self) -> float:
        """B's mean rows per batch, ``R / |B|``: what each further batch is taken to add."""
        return self.rows_direction / self.n_direction_batches

    @property
    def batches_needed(self) -> int:
        """The smallest ``k >= 0`` with ``R + k · R / |B| >= d``: ``⌈|B| (d - R) / R⌉``, 0 when
        ``R >= d`` (or when B gives no row, when no batch count would help)."""
        R, d = self.rows_direction, self.dimension
        if R >= d or R == 0:
            return 0
        return math.ceil(self.n_direction_batches * (d - R) / R)


@dataclass(frozen=True)
class AutoMagnitude:
    """The choice of ``n_magnitude_batches="auto"`` (``la.fit_batches[-1].auto``).

    Attributes:
        needed: The rule's ``k`` before the cap (``>= 1``).
        wanted: ``min(needed, cap)``: the batches asked of the loader.
        used: The batches B̃ got (``< wanted`` when the loader had fewer left).
        cap: [`AUTO_MAGNITUDE_CAP`][laplace_debiased.two_batch.magnitude_rule.AUTO_MAGNITUDE_CAP] at the time
            of the fit.
        limiting: The factor needing most batches; ``None`` when no factor is wider than B's
            rows.
        short: A factor that B ∪ B̃ still does not span after the fit's batches were counted
            (its ``rows_direction`` counts the rows of B ∪ B̃, its ``n_direction_batches``
            their batches): B̃'s batches gave fewer rows than B's mean and the loader or the cap
            allowed no more; ``None`` when B ∪ B̃ gives every factor at least its dimension in
            rows.
    """

    needed: int
    wanted: int
    used: int
    cap: int
    limiting: FactorRowCount | None
    short: FactorRowCount | None = None

    @property
    def capped(self) -> bool:
        """Whether the limiting factor needed more than the cap."""
        return self.needed > self.cap

    def describe(self) -> str:
        """One line for the fit's log: ``k``, why, and whether it was capped or cut short."""
        f = self.limiting
        if f is None:
            text = "n_magnitude_batches='auto': k = 1 (no K-FAC factor is wider than the rows B gives it)"
        else:
            text = (
                f"n_magnitude_batches='auto': layer '{f.layer}' {f.factor} factor of dimension {f.dimension} "
                f"gets {f.rows_direction} rows from B ({f.rows_per_batch:g} per batch); the smallest k with "
                f"{f.rows_direction} + k·{f.rows_per_batch:g} >= {f.dimension} is {self.needed}"
            )
            if self.capped:
                text += f", capped at AUTO_MAGNITUDE_CAP = {self.cap}"
        if self.used > self.wanted:
            text += (f"; B̃'s batches gave fewer rows than B's mean, so 'auto' drew {self.used - self.wanted} more "
                     f"(k = {self.used})")
        if self.used < self.wanted:
            text += (f"; the loader had only {self.used} further batch(es) for B̃, so B̃ has {self.used} "
                     f"instead of {self.wanted}")
        if self.short is not None:
            f = self.short
            text += (f"; B ∪ B̃ gives layer '{f.layer}' {f.factor} factor {f.rows_direction} rows of its dimension "
                     f"{f.dimension}, so it does not span it (la.coverage counts the eigenvalues left without "
                     "samples); give B̃ more data: a loader with more batches left or larger batches")
        return text


def auto_magnitude_batches(factors: Sequence[FactorRowCount], cap: int = AUTO_MAGNITUDE_CAP) -> AutoMagnitude:
    """The rule of the module docstring: ``k = max(1, max_f batches_needed_f)``, capped at ``cap``;
    the limiting factor is the first one needing the most."""
    limited = [f for f in factors if f.batches_needed > 0]
    if not limited:
        return AutoMagnitude(needed=1, wanted=1, used=1, cap=cap, limiting=None)
    limiting = max(limited, key=lambda f: f.batches_needed)
    wanted = min(limiting.batches_needed, cap)
    return AutoMagnitude(needed=limiting.batches_needed, wanted=wanted, used=wanted, cap=cap, limiting=limiting)
