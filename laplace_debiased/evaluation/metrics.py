"""Metrics on predictive class probabilities (stateless functions, tensors in, floats out).

All functions take ``probs`` of shape ``(N, C)`` (rows are probability vectors, e.g. the output
of a Laplace predictive or ``softmax`` of MAP logits) and integer labels ``y`` of shape ``(N,)``.
Averages are over the N examples (the NLL is the *mean* negative log-likelihood, not the sum).

Calibration (ECE) and the OOD-detection scores are torchmetrics'; the OOD score is the predictive
entropy normalised by ``log C`` into ``[0, 1]``, because torchmetrics' binary metrics pass scores
outside ``[0, 1]`` through a sigmoid, which would compress large entropies (``log 100 ≈ 4.6``).
"""

from __future__ import annotations

import math

import torch
from torchmetrics.functional.classification import (
    binary_auroc,
    binary_average_precision,
    binary_roc,
    multiclass_calibration_error,
)

ECE_BINS = 15
_TINY = 1e-12


def _check(probs: torch.Tensor, y: torch.Tensor | None = None) -> None:
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape (N, C), got {tuple(probs.shape)}")
    if probs.shape[0] == 0:
        raise ValueError("probs is empty: evaluate on at least one example")
    if not torch.isfinite(probs).all():
        raise ValueError("probs contains NaN or inf; check the predictive that produced it")
    if y is not None and (y.ndim != 1 or len(y) != len(probs)):
        raise ValueError(f"labels must have shape ({len(probs)},), got {tuple(y.shape)}")


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of examples whose most probable class is the label."""
    _check(probs, y)
    return float((probs.argmax(-1) == y).double().mean())


def nll(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log-likelihood ``-1/N Σ log p(y_n | x_n)`` (probabilities clamped at 1e-12)."""
    _check(probs, y)
    p = probs.gather(1, y.long().unsqueeze(1)).squeeze(1)
    return float(-p.double().clamp_min(_TINY).log().mean())


def ece(probs: torch.Tensor, y: torch.Tensor, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error (torchmetrics, equal-width confidence bins, l1 norm)."""
    _check(probs, y)
    return float(
        multiclass_calibration_error(
            probs.float(), y.long(), num_classes=probs.shape[1], n_bins=n_bins, norm="l1"
        )
    )


def brier(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Multi-class Brier score ``1/N Σ_n Σ_c (p_nc - 1[y_n = c])²`` (range [0, 2])."""
    _check(probs, y)
    onehot = torch.nn.functional.one_hot(y.long(), probs.shape[1]).to(probs.dtype)
    return float((probs - onehot).square().sum(1).double().mean())


def normalized_entropy(probs: torch.Tensor) -> torch.Tensor:
    """Predictive entropy divided by ``log C``, shape ``(N,)``, values in ``[0, 1]``."""
    _check(probs)
    p = probs.double().clamp_min(_TINY)
    ent = -(probs.double() * p.log()).sum(-1)
    return (ent / math.log(probs.shape[1])).clamp(0.0, 1.0)


def reliability_bins(
    probs: torch.Tensor, y: torch.Tensor, n_bins: int = ECE_BINS
) -> dict[str, list[float]]:
    """Per-bin mean confidence, accuracy and count for a reliability diagram.

    Same equal-width bins on the top-class confidence as :func:`ece`; empty bins get NaN.
    """
    _check(probs, y)
    conf, pred = probs.max(-1)
    correct = (pred == y).double()
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64)
    idx = (torch.bucketize(conf.double(), edges[1:-1], right=True)).clamp(0, n_bins - 1)
    count = torch.bincount(idx, minlength=n_bins).double()
    conf_sum = torch.bincount(idx, weights=conf.double(), minlength=n_bins)
    acc_sum = torch.bincount(idx, weights=correct, minlength=n_bins)
    safe = count.clamp_min(1)
    nan = torch.full_like(count, float("nan"))
    return {
        "edges": edges.tolist(),
        "confidence": torch.where(count > 0, conf_sum / safe, nan).tolist(),
        "accuracy": torch.where(count > 0, acc_sum / safe, nan).tolist(),
        "count": count.tolist(),
    }


def ood_metrics(probs_in: torch.Tensor, probs_out: torch.Tensor) -> dict[str, float]:
    """OOD detection with the normalised predictive entropy as score (OOD = positive class).

    Returns ``auroc``, ``aupr`` (average precision, OOD positive) and ``fpr95`` (false-positive
    rate on in-distribution data at the first threshold detecting ≥ 95 % of OOD examples).
    """
    if probs_in.shape[1] != probs_out.shape[1]:
        raise ValueError(
            f"in- and out-of-distribution predictions have {probs_in.shape[1]} and "
            f"{probs_out.shape[1]} classes; evaluate both with the same model"
        )
    scores = torch.cat([normalized_entropy(probs_in), normalized_entropy(probs_out)]).float()
    target = torch.cat(
        [torch.zeros(len(probs_in), dtype=torch.long), torch.ones(len(probs_out), dtype=torch.long)]
    )
    fpr, tpr, _ = binary_roc(scores, target)
    fpr95 = float(fpr[torch.nonzero(tpr >= 0.95)[0, 0]])
    return {
        "auroc": float(binary_auroc(scores, target)),
        "aupr": float(binary_average_precision(scores, target)),
        "fpr95": fpr95,
    }


def classification_metrics(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """All in-distribution metrics at once: accuracy, nll, ece, brier, mean confidence."""
    return {
        "accuracy": accuracy(probs, y),
        "nll": nll(probs, y),
        "ece": ece(probs, y),
        "brier": brier(probs, y),
        "confidence": float(probs.max(-1).values.double().mean()),
    }
