"""``n_magnitude_batches="auto"``: the number of magnitude batches chosen from
the K-FAC factors' dimensions and the rows B gives them.

The rule: the smallest ``k >= 1`` with ``rows(B) + k · rows(B)/|B| >= d`` for every factor of
dimension ``d`` wider than B's rows, capped at ``AUTO_MAGNITUDE_CAP``. Checked against an
independent search over ``k``, against the ranks of the fitted factors (``la.coverage``), against
the fit with the explicit ``k`` (dense posterior precision), for convolutions (rows are samples ×
spatial positions) and for the refusals.
"""

from __future__ import annotations

import logging

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from laplace import Laplace
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.two_batch.magnitude_rule import AUTO_MAGNITUDE_CAP, FactorRowCount, auto_magnitude_batches

N_OUT = 3


def _mlp(d_in: int, hidden: int = 3, seed: int = 0) -> nn.Module:
    """Linear(d_in, hidden) - ReLU - Linear(hidden, 3), float64: the input factor of layer '0' has
    dimension ``d_in``, every other factor at most ``max(hidden, 3)``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.ReLU(), nn.Linear(hidden, N_OUT)).double()


def _data(n: int, input_shape: tuple[int, ...], seed: int = 0) -> TensorDataset:
    """Gaussian inputs (in general position) with class labels."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, *input_shape, generator=g, dtype=torch.float64)
    return TensorDataset(X, torch.randint(0, N_OUT, (n,), generator=g))


def _loader(d_in: int, batch_size: int, n_batches: int) -> DataLoader:
    return DataLoader(_data(batch_size * n_batches, (d_in,)), batch_size=batch_size, shuffle=False)


def _expected_k(d: int, batch_size: int, n_dir: int) -> int:
    """Smallest ``k >= 1`` whose ``n_dir + k`` batches have at least ``d`` rows, capped."""
    k = next(k for k in range(1, 10 * d) if (n_dir + k) * batch_size >= d)
    return min(k, AUTO_MAGNITUDE_CAP)


def _fit(
    model: nn.Module, train_loader: DataLoader, structure: str = "debiased_kron",
    magnitude_loader: DataLoader | None = None, **options,
):
    if structure == "debiased_kron":
        options["null_space"] = "aligned"
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure=structure, **options)
    la.fit(train_loader, magnitude_loader=magnitude_loader)
    return la


def _input_factor(la, layer: str = "0"):
    """Layer ``layer``'s weight-block input factor record of ``la.coverage``."""
    block = next(b for b in la.coverage.blocks if b.layer == layer and b.parameter == "weight")
    return next(f for f in block.factors if f.factor == "input")


@settings(max_examples=200, deadline=None)
@given(
    dims_rows=st.lists(st.tuples(st.integers(1, 500), st.integers(1, 100)), min_size=1, max_size=5),
    n_dir=st.integers(1, 4),
    cap=st.integers(1, 10),
)
def test_the_rule_is_the_smallest_k_that_covers_every_factor(dims_rows, n_dir, cap):
    """Against a search in integers: the smallest ``k >= 1`` with ``|B| R + k R >= |B| d`` (B's
    mean ``R/|B|`` rows per further batch) for every factor, capped; the limiting factor is the
    first one that ``k - 1`` batches would not cover."""
    factors = [FactorRowCount(f"l{i}", "input", d, R, n_dir) for i, (d, R) in enumerate(dims_rows)]
    auto = auto_magnitude_batches(factors, cap)
    k = next(k for k in range(1, 10**5) if all(n_dir * R + k * R >= n_dir * d for d, R in dims_rows))
    assert (auto.needed, auto.wanted, auto.capped) == (k, min(k, cap), k > cap)
    if all(R >= d for d, R in dims_rows):
        assert auto.limiting is None
    else:
        first = next(f for f, (d, R) in zip(factors, dims_rows) if n_dir * R + (k - 1) * R < n_dir * d)
        assert auto.limiting is first


@settings(max_examples=12, deadline=None)
@given(d_in=st.integers(2, 60), batch_size=st.integers(3, 9), n_dir=st.integers(1, 3))
def test_auto_chooses_the_smallest_k_that_covers_the_widest_factor(d_in, batch_size, n_dir):
    """``k`` equals the independent search, and the record names the limiting factor."""
    train_loader = _loader(d_in, batch_size, n_dir + AUTO_MAGNITUDE_CAP + 1)
    la = _fit(_mlp(d_in), train_loader, n_direction_batches=n_dir, n_magnitude_batches="auto")
    choice = la.fit_batches[-1]
    k = _expected_k(d_in, batch_size, n_dir)
    assert len(choice.magnitude) == choice.auto.used == k
    assert choice.magnitude_size == k * batch_size
    if d_in > n_dir * batch_size:  # layer '0''s input factor is the only sample-limited one
        limiting = choice.auto.limiting
        assert (limiting.layer, limiting.factor, limiting.dimension) == ("0", "input", d_in)
        assert limiting.rows_direction == n_dir * batch_size
    else:
        assert choice.auto.limiting is None and k == 1


@pytest.mark.parametrize("d_in,batch_size", [(20, 4), (17, 4), (9, 3), (6, 8)])
def test_the_chosen_batches_reach_the_factor_and_one_fewer_would_not(d_in, batch_size):
    """Gaussian inputs: rank(B ∪ B̃) = min(d, rows) for the input factor. With the chosen ``k`` it
    is ``d`` and no eigenvalue is left at zero (``null_space="aligned"`` leaves ``d - rank(B ∪ B̃)``
    exact zeros); with ``k - 1`` batches (where ``k >= 2``) the factor is still sample-limited."""
    train_loader = _loader(d_in, batch_size, AUTO_MAGNITUDE_CAP + 2)
    la = _fit(_mlp(d_in), train_loader, n_magnitude_batches="auto")
    k = la.fit_batches[-1].auto.used
    factor = _input_factor(la)
    assert factor.rank_union == min(d_in, (1 + k) * batch_size) == d_in
    assert factor.zero_eigenvalues == factor.sample_limited_zeros == 0
    if k >= 2:
        fewer = _input_factor(_fit(_mlp(d_in), train_loader, n_magnitude_batches=k - 1))
        assert fewer.rank_union == k * batch_size < d_in
        assert fewer.sample_limited and fewer.sample_limited_zeros == d_in - k * batch_size


@pytest.mark.parametrize("structure", ["debiased_kron", "debiased_ekfac"])
@pytest.mark.parametrize("seed", [None, 3])
def test_auto_equals_the_explicit_fit_it_chose(structure, seed):
    """The posterior precision (dense, float64) of the "auto" fit equals the fit with the explicit
    ``n_magnitude_batches=k``, in loader order and with a random draw (same generator seed)."""
    d_in, batch_size = 14, 4
    train_loader = _loader(d_in, batch_size, 7)

    def fit(n_mag):
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        return _fit(_mlp(d_in), train_loader, structure, n_magnitude_batches=n_mag, generator=gen)

    auto = fit("auto")
    k = auto.fit_batches[-1].auto.used
    assert k == 3
    explicit = fit(k)
    assert auto.fit_batches[-1].magnitude == explicit.fit_batches[-1].magnitude
    P_auto, P_explicit = auto.posterior_precision.to_matrix(), explicit.posterior_precision.to_matrix()
    assert P_auto.dtype == torch.float64
    torch.testing.assert_close(P_auto, P_explicit, atol=1e-10, rtol=0)


def test_a_factor_needing_more_than_the_cap_gets_the_cap(caplog):
    """d = 200 with 4 rows per batch needs 49 further batches; the fit takes the cap and says so."""
    d_in, batch_size = 200, 4
    with caplog.at_level(logging.INFO, logger="laplace_debiased"):
        la = _fit(_mlp(d_in), _loader(d_in, batch_size, AUTO_MAGNITUDE_CAP + 3), n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    assert (auto.needed, auto.wanted, auto.used, auto.capped) == (49, AUTO_MAGNITUDE_CAP, AUTO_MAGNITUDE_CAP, True)
    assert "capped" in auto.describe() and "AUTO_MAGNITUDE_CAP" in auto.describe()
    assert auto.describe() in caplog.text
    assert _input_factor(la).rank_union == (1 + AUTO_MAGNITUDE_CAP) * batch_size


def test_a_loader_with_fewer_batches_gives_what_it_has():
    """k = 4 wanted, two batches left after B: both are used, and the record says so."""
    la = _fit(_mlp(20), _loader(20, 4, 3), n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    assert (auto.wanted, auto.used) == (4, 2)
    assert "2 further batch" in auto.describe()
    assert len(la.fit_batches[-1].magnitude) == 2


def test_a_loader_with_no_batch_after_b_is_refused():
    with pytest.raises(ValueError, match="no batch left for B̃"):
        _fit(_mlp(20), _loader(20, 4, 2), n_direction_batches=2, n_magnitude_batches="auto")


def test_a_magnitude_loader_supplies_the_auto_batches():
    """B from train_loader, the k = 4 batches of B̃ from another loader."""
    other = DataLoader(_data(40, (20,), seed=1), batch_size=4)
    la = _fit(_mlp(20), _loader(20, 4, 1), n_magnitude_batches="auto", magnitude_loader=other)
    choice = la.fit_batches[-1]
    assert choice.magnitude_source == "magnitude_loader" and choice.magnitude == (0, 1, 2, 3)
    assert _input_factor(la).rank_union == 20


@pytest.mark.parametrize("structure", ["debiased_full", "debiased_lowrank"])
def test_auto_is_refused_without_kfac_factors(structure):
    with pytest.raises(ValueError, match="has no K-FAC factors.*integer n_magnitude_batches"):
        Laplace(_mlp(4), "classification", subset_of_weights="all", hessian_structure=structure, n_magnitude_batches="auto")


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"split": "halves"}, "split='halves'"),
        ({"magnitude_loader": "train"}, "B̃ = B"),
        ({"n_magnitude_batches": "automatic"}, "positive integer or 'auto'"),
    ],
)
def test_auto_refusals(kwargs, message):
    train_loader = _loader(4, 4, 4)
    if kwargs.get("magnitude_loader") == "train":
        kwargs = {"magnitude_loader": train_loader}
    options = {"n_magnitude_batches": "auto", **kwargs}
    magnitude_loader = options.pop("magnitude_loader", None)
    with pytest.raises(ValueError, match=message):
        la = Laplace(_mlp(4), "classification", subset_of_weights="all", hessian_structure="debiased_kron", **options)
        la.fit(train_loader, magnitude_loader=magnitude_loader)


def _uneven_loader(d_in: int, sizes: list[int]) -> DataLoader:
    """Batches of the given sizes, in order (Gaussian inputs of dimension ``d_in``)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    batches = [list(range(s, s + n)) for s, n in zip(starts, sizes)]
    return DataLoader(_data(sum(sizes), (d_in,)), batch_sampler=batches)


def test_a_short_last_batch_that_leaves_a_factor_unspanned_is_reported(caplog):
    """40 samples in batches 16, 16, 8 and an input factor of dimension 48: B's 16 rows per batch
    ask for k = 2, whose 24 rows leave B ∪ B̃ at rank 40 of 48. The record, its line and a warning
    in the log say so."""
    with caplog.at_level(logging.INFO, logger="laplace_debiased"):
        la = _fit(_mlp(48), _uneven_loader(48, [16, 16, 8]), n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    assert (auto.wanted, auto.used) == (2, 2)
    assert (auto.short.layer, auto.short.factor, auto.short.dimension, auto.short.rows_direction) == ("0", "input", 48, 40)
    assert "B ∪ B̃ gives layer '0' input factor 40 rows of its dimension 48" in auto.describe()
    assert any(r.levelname == "WARNING" and "does not span" in r.getMessage() for r in caplog.records)
    assert _input_factor(la).rank_union == 40


def test_a_short_batch_is_made_up_by_drawing_one_more():
    """Batches 16, 16, 8, 16: k = 2 would give B ∪ B̃ 40 rows of 48, so "auto" takes the next
    batch too (k = 3, the batches of the explicit n_magnitude_batches=3) and B ∪ B̃ spans."""
    train_loader = _uneven_loader(48, [16, 16, 8, 16])
    la = _fit(_mlp(48), train_loader, n_magnitude_batches="auto")
    auto = la.fit_batches[-1].auto
    assert (auto.wanted, auto.used, auto.short) == (2, 3, None)
    assert "drew 1 more" in auto.describe()
    assert la.fit_batches[-1].magnitude == (1, 2, 3)
    assert _input_factor(la).rank_union == 48
