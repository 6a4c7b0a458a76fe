"""Directional statistics (:mod:`laplace_debiased.diagnostics.directional`): relative bias and
quartiles."""

from __future__ import annotations

import torch

from laplace_debiased.diagnostics.directional import quartiles, relative_bias


def test_relative_bias_and_quartiles():
    torch.testing.assert_close(relative_bias(torch.tensor([10.0, 1.0]), torch.tensor([1.0, -2.0])), torch.tensor([9.0, 1.5]))
    q = quartiles(torch.arange(1.0, 6.0))
    assert (q["median"], q["q25"], q["q75"], q["min"], q["max"]) == (3.0, 2.0, 4.0, 1.0, 5.0)

