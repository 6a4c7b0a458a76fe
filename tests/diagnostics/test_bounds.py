"""The Eq. 7 chains (:mod:`laplace_debiased.diagnostics.bounds`): same batch ≥ full data ≥ cross
batch, strict for random batches, equal when every batch agrees."""

from __future__ import annotations

import pytest
import torch

from laplace_debiased.diagnostics.bounds import Chain, top_k_chain

pytestmark = pytest.mark.usefixtures("float64")


def bottom_chain(batch_matrices: torch.Tensor) -> Chain:
    """The mirrored statement for the smallest eigenvalue, signs flipped:
    ``mean_m λ_min(H_{B_m}) ≤ λ_min(H_D) ≤ mean_m v^{(m)ᵀ} H_D v^{(m)}``."""
    neg = top_k_chain(-batch_matrices, k=1)
    return Chain(neg.same_batch, neg.full_data, neg.cross)


def gradient_chain(batch_gradients: torch.Tensor) -> Chain:
    """Eq. 7 for slopes along the first CG direction ``-g_B/‖g_B‖`` of ``(M, P)`` gradients:
    ``mean_m ‖g_{B_m}‖ ≥ ‖g_D‖ ≥ mean_m |d^{(m)ᵀ} g_D|``."""
    full = batch_gradients.mean(0)
    norms = torch.linalg.vector_norm(batch_gradients, dim=-1)
    cross = (batch_gradients @ full).abs() / norms
    return Chain(float(norms.mean()), float(torch.linalg.vector_norm(full)), float(cross.mean()))


def _psd_batches(M: int, P: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(M, P, 3, generator=g)
    return A @ A.transpose(1, 2) + 0.01 * torch.eye(P)


def test_eq7_inequalities_hold_and_are_strict_for_random_batches():
    mats = _psd_batches(M=6, P=5, seed=0)
    for k in (1, 2):
        chain = top_k_chain(mats, k)
        assert chain.holds()
        assert chain.same_batch > chain.full_data * 1.05 and chain.full_data > chain.cross * 1.01
    assert bottom_chain(mats).holds()
    grads = torch.randn(6, 5, generator=torch.Generator().manual_seed(1)) + 0.3
    chain = gradient_chain(grads)
    assert chain.holds() and chain.same_batch > chain.full_data > chain.cross


def test_eq7_equalities_when_all_batches_agree_and_violation_detected():
    same = _psd_batches(M=1, P=4, seed=2).expand(5, 4, 4)
    chain = top_k_chain(same, 1)
    assert chain.same_batch == pytest.approx(chain.full_data) == pytest.approx(chain.cross)
    assert not Chain(1.0, 2.0, 0.5).holds() and not Chain(3.0, 2.0, 2.5).holds()

