"""The CIFAR-10 benchmark's K-FAC fits (``benchmarks/cifar10/fits.py``) against dense references.

Every K-FAC row is on the scale of ``N`` training samples: the single-batch row is the K-FAC of
its ``b`` samples times ``N/b``. laplace-torch's ``KronLaplace.fit`` on a loader over ``b`` of the
``N`` samples (fit version 1 of the benchmark) is not: Curvlinops' K-FAC scales each weight
block's input factor by ``b/N``, assuming the loader covers all ``N``, which leaves weight blocks
``(b/N)²`` and bias blocks ``b/N`` of the ``N``-scaled K-FAC. On ALL-CNN-C (N = 40,000, b = 64 …
1024) that curvature is negligible against the chosen δ, so all single-batch rows coincided.
"""

import numpy as np
import pytest
import torch
from laplace import KronLaplace
from torch.utils.data import TensorDataset

from _models import dense_kfac, kfac_to_dense, tiny_mlp, toy_data
from benchmarks.cifar10.fits import _loader, coverage_rows, equal_sample_draws, fit_kron
from laplace_debiased.kron.laplace import DebiasedKronLaplace

N, B = 60, 12


def _draw() -> tuple[TensorDataset, np.ndarray]:
    return toy_data(N, (4,), 3, "classification", seed=2), np.random.default_rng(0).choice(N, size=B, replace=False)


def _block_scales(n_blocks: int, weight: float, bias: float) -> list[float]:
    """tiny_mlp's K-FAC blocks are [weight, bias] per Linear."""
    return [weight if i % 2 == 0 else bias for i in range(n_blocks)]


def test_single_batch_kron_is_the_batch_kfac_scaled_to_n():
    train, idx = _draw()
    model = tiny_mlp()
    la = fit_kron(model, train, idx, debiased=False)
    ref = kfac_to_dense(dense_kfac(model, train.tensors[0][idx], "classification")) * (N / B)
    torch.testing.assert_close(la.H.to_matrix(), ref, rtol=1e-9, atol=1e-12)
    assert la.n_data == N
    with torch.no_grad():
        summed = torch.nn.functional.cross_entropy(model(train.tensors[0][idx]), train.tensors[1][idx], reduction="sum")
    torch.testing.assert_close(torch.as_tensor(la.loss), summed * N / B, rtol=1e-12, atol=0)


def test_laplace_torch_kron_on_a_subset_loader_is_not_scaled_to_n():
    """The version-1 single-batch rows: weight blocks (b/N)², bias blocks b/N of the N-scaled K-FAC."""
    train, idx = _draw()
    model = tiny_mlp()
    la = KronLaplace(model, "classification")
    la.fit(_loader(train, idx, B))
    blocks = dense_kfac(model, train.tensors[0][idx], "classification")
    scales = _block_scales(len(blocks), weight=(B / N) ** 2, bias=B / N)
    ref = torch.block_diag(*[kfac_to_dense([F]) * (N / B) * s for F, s in zip(blocks, scales)])
    torch.testing.assert_close(la.H.to_matrix(), ref, rtol=1e-9, atol=1e-12)


def test_equal_sample_draws_are_nested_prefixes_of_distinct_samples():
    draws = equal_sample_draws(np.random.default_rng(3), N, 8, (1, 4, 8))
    assert {k: len(v) for k, v in draws.items()} == {1: 8, 4: 20, 8: 36}
    assert len(set(draws[8].tolist())) == 36 and draws[8].max() < N
    for k in (1, 4):
        np.testing.assert_array_equal(draws[k], draws[8][: len(draws[k])])


def test_debiased_kron_with_k_magnitude_batches_is_b_then_the_rest_as_one_batch():
    """The 256 + k x 256 rows: B = the first |idx|/(1+k) samples, B̃ = the other k batches,
    whose curvature is that of one batch of those samples; both scaled to N."""
    train, _ = _draw()
    idx = np.random.default_rng(1).choice(N, size=20, replace=False)
    model = tiny_mlp()
    la = fit_kron(model, train, idx, debiased=True, magnitude_batches=4)
    ref = DebiasedKronLaplace(model, "classification", estimator="paper")
    ref.fit(_loader(train, idx[:4], 4), magnitude_loader=_loader(train, idx[4:], 16))
    choice = la.fit_batches[-1]
    assert (choice.direction_size, choice.magnitude_size, choice.n_data) == (4, 16, N)
    torch.testing.assert_close(la.posterior_precision.to_matrix(), ref.posterior_precision.to_matrix(),
                               rtol=1e-9, atol=1e-12)


def test_debiased_kron_refuses_a_draw_that_does_not_split_evenly():
    train, idx = _draw()
    with pytest.raises(ValueError, match="1 \\+ 4 equal batches"):
        fit_kron(tiny_mlp(), train, idx, debiased=True, magnitude_batches=4)


def test_coverage_rows_of_stock_kron_count_the_rank_each_factor_reaches():
    """Fitted on 2 samples: the first layer's input factor (4 x 4) has rank 2; the last layer's
    output factor has the softmax-invariant null vector, rank C - 1 = 2 of 3."""
    X, y = toy_data(N, (4,), 3, "classification", seed=2).tensors
    model = tiny_mlp()
    la = KronLaplace(model, "classification")
    la.fit(_loader(TensorDataset(X[:2], y[:2]), np.arange(2), 2))
    rows = {(r["layer"], r["parameter"], r["factor"]): (r["dimension"], r["rank"]) for r in coverage_rows(la)}
    assert rows[("0", "weight", "input")] == (4, 2)
    assert rows[("2", "weight", "output")] == (3, 2)
    assert len(rows) == 6


def test_coverage_rows_of_a_debiased_fit_are_its_coverage_record():
    train, idx = _draw()
    la = fit_kron(tiny_mlp(), train, idx, debiased=True)
    assert coverage_rows(la) == la.coverage.rows()


def test_run_fits_warms_up_before_the_first_timed_fit(tmp_path, monkeypatch):
    """The first fit on a device pays one-time start-up costs (on CUDA: the context, kernel
    loading, library handles), so an untimed single-batch and debiased fit run before the first
    timed one, and no warm-up runs when every fit comes from the cache."""
    import benchmarks.cifar10.fits as fits
    from benchmarks.cifar10.config import Config

    events: list[str] = []
    real_fit, real_measured = fits.fit_kron, fits.measured

    def spy_fit(model, train, idx, debiased, *args, **kwargs):
        events.append(f"fit debiased={debiased}")
        return real_fit(model, train, idx, debiased, *args, **kwargs)

    monkeypatch.setattr(fits, "fit_kron", spy_fit)
    monkeypatch.setattr(fits, "measured", lambda fn: (events.append("timed"), real_measured(fn))[1])
    train = toy_data(N, (4,), 3, "classification", seed=2)
    cfg = Config(batch_sizes=(8,), magnitude_batches=(1,), repeats=1, lowrank_batch_sizes=(), full_batch_size=N)
    fits.run_fits(tiny_mlp(), train, cfg, tmp_path, log=lambda *_: None)
    first_timed = events.index("timed")
    assert sorted(events[:first_timed]) == ["fit debiased=False", "fit debiased=True"], events
    events.clear()
    fits.run_fits(tiny_mlp(), train, cfg, tmp_path, log=lambda *_: None)  # all cached now
    assert events == [], events
