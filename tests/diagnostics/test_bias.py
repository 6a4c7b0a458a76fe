"""The bias diagnosis (:mod:`laplace_debiased.diagnostics.bias`) on least squares: K-FAC exactness,
product counts, the batch size for a tolerance."""

from __future__ import annotations

import torch

from laplace_debiased.diagnostics.bias import batch_size_for_tolerance


def test_kfac_of_single_output_linear_model_is_exact(diagnosis):
    # K-FAC (type-2) of a bias-free linear layer with one output is the GGN itself
    for row in diagnosis.kfac_ladder:
        torch.testing.assert_close(row.full, row.full_ggn, rtol=1e-9, atol=0)


def test_product_counts_are_accounted(diagnosis):
    eig = diagnosis.products["eigenvectors"]
    M, K, S = 160 // 8, 4, 4
    # Lanczos is dense for P = 24 (P products per source), then K per batch for every source,
    # plus K on all data for the Eq. 5 check of the first source
    assert eig == {8: S * 24 + S * M * K, 160: K}


def test_batch_size_for_tolerance():
    assert batch_size_for_tolerance([10, 20, 40], [0.5, 0.08, 0.01], 0.1) == (20, False)
    size, extrapolated = batch_size_for_tolerance([10, 20, 40], [0.8, 0.4, 0.2], 0.1)
    assert extrapolated and size == 80
    assert batch_size_for_tolerance([10, 20], [0.3, 0.5], 0.1) == (None, True)

