"""The structures check (``benchmarks/digits_structure_estimates.py``): its candidates reduce to the
single batch for B̃ = B, and its summary applies the decision rule of ``benchmarks/PROTOCOL_STRUCTURES.md``."""

from __future__ import annotations

import json

import torch

from benchmarks.digits_structure_estimates import CANDIDATES, DELTAS, candidates, summary


def _dense(basis) -> torch.Tensor:
    Q, h, c = basis
    return (Q * h) @ Q.T + c * (torch.eye(Q.shape[0], dtype=Q.dtype) - Q @ Q.T)


def test_every_candidate_with_the_same_batch_is_the_single_batch():
    """B̃ = B: no gap, no difference, so every estimate is the pooled (= B's) matrix, and the low-rank
    ones its top k."""
    V = torch.randn(12, 3, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ests, _ = candidates(V, V)
    single = _dense(ests["single"])
    for c in ("paper", "corrected", "shrunk", "stein"):
        assert (_dense(ests[c]) - single).abs().max() < 1e-10 * single.abs().max(), c
    lr = _dense(ests["lr-single"])
    assert (_dense(ests["lr-paper"]) - lr).abs().max() < 1e-8 * lr.abs().max()
    assert (_dense(ests["lr-corrected"]) - lr).abs().max() < 1e-8 * lr.abs().max()


def _write(cache, b: int, seed: int, gaps: dict[str, float]) -> None:
    """A cached draw whose candidate ``c`` has the largest relative gap ``gaps[c]`` points."""
    ref = [1.0] * len(DELTAS)
    record = {"b": b, "seed": seed, "reference": {"full": ref, "lowrank": ref}, "kept": {"shrunk": 0.5, "stein": 1.0},
              "nll": {c: [1.0 + gaps[c] / 100] + [1.0] * (len(DELTAS) - 1) for c in CANDIDATES}}
    (cache / f"b{b}").mkdir(parents=True, exist_ok=True)
    (cache / f"b{b}" / f"seed{seed}.json").write_text(json.dumps(record))


def test_summary_offers_only_what_improves_on_the_present_estimate(tmp_path):
    """Full: ``stein`` 3 points better than ``paper`` at every b (noise 1 point) is offered, ``corrected``
    (worse at b = 256) and ``shrunk`` (no better) are not. Low rank: ``lr-corrected`` is worse than the single
    batch by 2 points at b = 32 (non-inferiority fails) and is not offered."""
    g = torch.Generator().manual_seed(1)
    for b in (32, 64, 128, 256):
        for seed in range(16):
            e = float(torch.randn((), generator=g))
            gaps = {"single": 30 + e, "paper": 20 + e, "stein": 17 + e + 0.5 * float(torch.randn((), generator=g)),
                    "corrected": 17 + e + (6 if b == 256 else 0), "shrunk": 20 + e + 0.5 * (-1) ** seed,
                    "lr-single": 10 + e, "lr-paper": 15 + e, "lr-corrected": 10 + e + (2 if b == 32 else -1)}
            _write(tmp_path, b, seed, gaps)
    result = summary(tmp_path)
    full, low = result["debiased_full"], result["debiased_lowrank"]
    assert full["offered"] == "stein"
    assert not full["decision"]["corrected"]["non_inferior_to_present"]
    assert full["decision"]["shrunk"]["better_than_present_at"] == [] and not full["decision"]["shrunk"]["improves"]
    assert low["decision"]["lr-corrected"]["better_than_present_at"] == [32, 64, 128, 256]
    assert not low["decision"]["lr-corrected"]["non_inferior_to_single"] and low["offered"] is None
