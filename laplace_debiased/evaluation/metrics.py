"""Metrics on predictive class probabilities (stateless functions, tensors in, floats out).

All functions take ``probs`` of shape ``(N, C)`` (rows are probability vectors, e.g. the output
of a Laplace predictive or ``softmax`` of MAP logits) and integer labels ``y`` of shape ``(N,)``.
Averages are over the N examples (the NLL is the *mean* negative log-likelihood, not the sum).

Every in-distribution metric is a function of sums over the rows
([`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums],
[`metrics_from_sums`][laplace_debiased.evaluation.metrics.metrics_from_sums]), so a set evaluated in parts
(one per process) gives its metrics from the added sums; the ECE bins are torchmetrics'
(``multiclass_calibration_error``), summed in float64. The OOD-detection scores are torchmetrics' ranking
metrics; the OOD score is the predictive entropy normalised by ``log C`` into ``[0, 1]``, because
torchmetrics' binary metrics pass scores outside ``[0, 1]`` through a sigmoid, which would compress large
entropies (``log 100 ≈ 4.6``).
"""

from __future__ import annotations

import math

import torch
from torchmetrics.functional.classification import binary_auroc, binary_average_precision, binary_roc

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


def classification_sums(probs: torch.Tensor, y: torch.Tensor, n_bins: int = ECE_BINS) -> dict[str, torch.Tensor]:
    """The sufficient statistics of every in-distribution metric: sums over the rows, float64.

    Sums of disjoint row sets add ([`add_sums`][laplace_debiased.evaluation.metrics.add_sums]), so the metrics
    of a set split over several processes are
    [`metrics_from_sums`][laplace_debiased.evaluation.metrics.metrics_from_sums] of the sum of their parts,
    equal to those of the whole set up to the round-off of the order of summation. No rows give zero sums.

    Args:
        probs: ``(N, C)`` probability rows.
        y: ``(N,)`` integer labels.
        n_bins: equal-width bins of the top-class confidence.

    Returns:
        ``count`` (N), ``correct`` (top class is the label), ``nll`` (``-log p_y``, ``p_y``
        clamped at 1e-12), ``brier`` (``Σ_c (p_c - 1[y = c])²``), ``confidence`` (top-class
        probability), each a 0-d sum; ``bin_count``, ``bin_confidence``, ``bin_correct``
        ``(n_bins + 1,)``: the same sums per confidence bin, binned as torchmetrics' calibration
        error bins (``float32`` edges ``linspace(0, 1, n_bins + 1)``, bin ``k`` holds
        ``edge_k <= conf < edge_k+1``, the last bin ``conf = 1``).
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape (N, C), got {tuple(probs.shape)}")
    if len(probs):
        _check(probs, y)
    conf, pred = probs.max(-1)
    correct = (pred == y).double()
    p_y = probs.gather(1, y.long().unsqueeze(1)).squeeze(1)
    onehot = torch.nn.functional.one_hot(y.long(), probs.shape[1]).to(probs.dtype)
    edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float32)
    idx = torch.bucketize(conf.float(), edges, right=True) - 1
    return {
        "count": torch.tensor(float(len(probs)), dtype=torch.float64),
        "correct": correct.sum(),
        "nll": -p_y.double().clamp_min(_TINY).log().sum(),
        "brier": (probs - onehot).square().sum(1).double().sum(),
        "confidence": conf.double().sum(),
        "bin_count": torch.bincount(idx, minlength=n_bins + 1).double(),
        "bin_confidence": torch.bincount(idx, weights=conf.double(), minlength=n_bins + 1),
        "bin_correct": torch.bincount(idx, weights=correct, minlength=n_bins + 1),
    }


def add_sums(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The [`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums] of the union of
    disjoint row sets, from theirs (added in the order given)."""
    if not parts:
        raise ValueError("give the sums of at least one row set")
    return {key: sum((part[key] for part in parts[1:]), parts[0][key]) for key in parts[0]}


def _nonempty(sums: dict[str, torch.Tensor]) -> float:
    n = float(sums["count"])
    if n == 0:
        raise ValueError("probs is empty: evaluate on at least one example")
    return n


def metrics_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """Accuracy, mean NLL, ECE (l1, the bins of
    [`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums]:
    ``Σ_k |correct_k - confidence_k| / N``), mean Brier score and mean confidence from
    [`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums]."""
    n = _nonempty(sums)
    return {
        "accuracy": float(sums["correct"]) / n,
        "nll": float(sums["nll"]) / n,
        "ece": float((sums["bin_correct"] - sums["bin_confidence"]).abs().sum()) / n,
        "brier": float(sums["brier"]) / n,
        "confidence": float(sums["confidence"]) / n,
    }


def reliability_from_sums(sums: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Per-bin mean confidence, accuracy and count for a reliability diagram, from
    [`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums]: its bins, confidence 1
    in the last one; empty bins get NaN."""
    _nonempty(sums)

    def merged(t: torch.Tensor) -> torch.Tensor:  # the bin of confidence 1 into the last
        return torch.cat([t[:-2], t[-2:].sum(0, keepdim=True)])

    count, conf_sum, acc_sum = (merged(sums[k]) for k in ("bin_count", "bin_confidence", "bin_correct"))
    safe = count.clamp_min(1)
    nan = torch.full_like(count, float("nan"))
    return {
        "edges": torch.linspace(0, 1, len(count) + 1, dtype=torch.float64).tolist(),
        "confidence": torch.where(count > 0, conf_sum / safe, nan).tolist(),
        "accuracy": torch.where(count > 0, acc_sum / safe, nan).tolist(),
        "count": count.tolist(),
    }


def accuracy(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Fraction of examples whose most probable class is the label."""
    _check(probs, y)
    return metrics_from_sums(classification_sums(probs, y))["accuracy"]


def nll(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean negative log-likelihood ``-1/N Σ log p(y_n | x_n)`` (probabilities clamped at 1e-12)."""
    _check(probs, y)
    return metrics_from_sums(classification_sums(probs, y))["nll"]


def ece(probs: torch.Tensor, y: torch.Tensor, n_bins: int = ECE_BINS) -> float:
    """Expected calibration error (equal-width confidence bins, l1 norm): torchmetrics'
    ``multiclass_calibration_error``, summed in float64
    ([`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums])."""
    _check(probs, y)
    return metrics_from_sums(classification_sums(probs, y, n_bins))["ece"]


def brier(probs: torch.Tensor, y: torch.Tensor) -> float:
    """Multi-class Brier score ``1/N Σ_n Σ_c (p_nc - 1[y_n = c])²`` (range [0, 2])."""
    _check(probs, y)
    return metrics_from_sums(classification_sums(probs, y))["brier"]


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

    The bins of [`ece`][laplace_debiased.evaluation.metrics.ece] (confidence 1 in the last one); empty bins
    get NaN.
    """
    _check(probs, y)
    return reliability_from_sums(classification_sums(probs, y, n_bins))


def ood_scores(probs: torch.Tensor) -> torch.Tensor:
    """The OOD score of every row, ``(N,)`` float32:
    [`normalized_entropy`][laplace_debiased.evaluation.metrics.normalized_entropy] (no rows: empty)."""
    if probs.ndim == 2 and len(probs) == 0:
        return torch.empty(0)
    return normalized_entropy(probs).float()


def ood_metrics_from_scores(scores_in: torch.Tensor, scores_out: torch.Tensor) -> dict[str, float]:
    """[`ood_metrics`][laplace_debiased.evaluation.metrics.ood_metrics] from the
    [`ood_scores`][laplace_debiased.evaluation.metrics.ood_scores] of the in-distribution rows and the OOD
    rows (the scores of a set split over processes are the concatenation of theirs, in order)."""
    scores = torch.cat([scores_in, scores_out])
    target = torch.cat(
        [torch.zeros(len(scores_in), dtype=torch.long), torch.ones(len(scores_out), dtype=torch.long)]
    )
    fpr, tpr, _ = binary_roc(scores, target)
    fpr95 = float(fpr[torch.nonzero(tpr >= 0.95)[0, 0]])
    return {
        "auroc": float(binary_auroc(scores, target)),
        "aupr": float(binary_average_precision(scores, target)),
        "fpr95": fpr95,
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
    return ood_metrics_from_scores(ood_scores(probs_in), ood_scores(probs_out))


def classification_metrics(probs: torch.Tensor, y: torch.Tensor) -> dict[str, float]:
    """All in-distribution metrics at once: accuracy, nll, ece, brier, mean confidence."""
    _check(probs, y)
    return metrics_from_sums(classification_sums(probs, y))
