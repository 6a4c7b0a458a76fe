"""MAP training with an on-disk cache.

``train_map`` trains a model by minimising the **mean** cross-entropy (or mean squared error)
over mini-batches plus an explicit ℓ² penalty ``weight_decay/2 * ||θ||²`` added to that mean loss
(AdamW-style decoupling is *not* used, so ``weight_decay`` is the prior precision per data point
of the corresponding MAP problem).  The trained weights are cached under
``cache_dir/<tag>-<key>.pt``, where ``key`` hashes the architecture, the training configuration
and a fingerprint of the data, so a changed model, data set or setting never loads stale weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from laplace_debiased._progress import progress_bar
from laplace_debiased.paths import default_cache_dir


@dataclass(frozen=True)
class TrainConfig:
    """Hyper-parameters of [`train_map`][laplace_debiased.evaluation.training.train_map] (all part of the
    cache key)."""

    epochs: int = 30
    lr: float = 1e-3
    weight_decay: float = 5e-4
    batch_size: int = 128
    seed: int = 0
    optimizer: str = "adam"  # "adam" or "sgd" (momentum 0.9)
    likelihood: str = "classification"  # or "regression"


def fingerprint_rows(n: int, n_probe: int = 16) -> list[int]:
    """The rows of a data set of ``n`` rows that its fingerprint (the cache key) reads: ``n_probe``
    evenly spaced ones."""
    return sorted({int(j * (n - 1) / max(n_probe - 1, 1)) for j in range(min(n, n_probe))})


def _fingerprint(dataset: Dataset, n_probe: int = 16) -> str:
    """Cheap hash of a data set: its length and a few evenly spaced samples."""
    h = hashlib.sha256(str(len(dataset)).encode())
    for i in fingerprint_rows(len(dataset), n_probe):
        for item in dataset[i]:
            h.update(torch.as_tensor(item).detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def cache_key(model: nn.Module, dataset: Dataset, config: TrainConfig) -> str:
    """Hash of architecture (``repr``), parameter shapes, configuration and data fingerprint."""
    h = hashlib.sha256(repr(model).encode())
    h.update(json.dumps(asdict(config), sort_keys=True).encode())
    h.update(str([tuple(p.shape) for p in model.parameters()]).encode())
    h.update(_fingerprint(dataset).encode())
    return h.hexdigest()[:16]


def model_cache_path(model: nn.Module, train_set: Dataset, config: TrainConfig, tag: str = "model",
                     cache_dir: str | Path | None = None) -> Path:
    """Where [`train_map`][laplace_debiased.evaluation.training.train_map] caches (or finds) the weights of
    ``model`` trained on ``train_set`` (reads the rows
    [`fingerprint_rows`][laplace_debiased.evaluation.training.fingerprint_rows] of ``train_set``)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"
    return cache_dir / f"{tag}-{cache_key(model, train_set, config)}.pt"


def evaluate_loss(model: nn.Module, loader: DataLoader, likelihood: str = "classification") -> dict[str, float]:
    """Mean loss (and accuracy for classification) of ``model`` over ``loader``."""
    model.eval()
    total, loss_sum, correct = 0, 0.0, 0
    loss_fn = nn.CrossEntropyLoss(reduction="sum") if likelihood == "classification" else nn.MSELoss(reduction="sum")
    with torch.no_grad():
        for X, y in loader:
            out = model(X)
            loss_sum += float(loss_fn(out, y))
            total += len(y)
            if likelihood == "classification":
                correct += int((out.argmax(-1) == y).sum())
    stats = {"loss": loss_sum / total}
    if likelihood == "classification":
        stats["accuracy"] = correct / total
    return stats


def _format_row(row: dict) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def _load_cached(model: nn.Module, path: Path, log: Callable[[str], None] | None) -> list[dict[str, float]] | None:
    """Load the cached weights at ``path`` into ``model`` and return their history, or ``None``
    (with a warning) for a file that cannot be read: a truncated or foreign file is never used."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
        model.load_state_dict(blob["state_dict"])
        model.eval()
        if log:
            log(f"loaded cached MAP model {path}")
        return list(blob["history"])
    except Exception as err:  # a truncated or foreign file: retrain, never use it
        warnings.warn(f"ignoring unreadable model cache {path} ({err}); retraining")
        return None


def _optimizer(params: list[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr)
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=0.9)
    raise ValueError(f"optimizer must be 'adam' or 'sgd', got {config.optimizer!r}")


def _epoch_losses(model: nn.Module, train: DataLoader, val: DataLoader | None, likelihood: str) -> dict[str, float]:
    """``train_<stat>`` (and ``val_<stat>``) of
    [`evaluate_loss`][laplace_debiased.evaluation.training.evaluate_loss] after an epoch."""
    row = {f"train_{k}": v for k, v in evaluate_loss(model, train, likelihood).items()}
    if val is not None:
        row.update({f"val_{k}": v for k, v in evaluate_loss(model, val, likelihood).items()})
    return row


def _train_epoch(model: nn.Module, loader: DataLoader, opt: torch.optim.Optimizer, loss_fn: nn.Module,
                 weight_decay: float, epoch: int) -> None:
    """One pass over ``loader``: mean loss plus ``weight_decay/2 · ||θ||²`` per step; refuses a
    non-finite loss (training diverged)."""
    model.train()
    params = list(model.parameters())
    for X, y in loader:
        opt.zero_grad()
        loss = loss_fn(model(X), y)
        if weight_decay:
            loss = loss + 0.5 * weight_decay * sum(p.square().sum() for p in params)
        if not torch.isfinite(loss.detach()):
            raise FloatingPointError(
                f"training diverged at epoch {epoch} (loss {loss.item()}); lower the learning rate"
            )
        loss.backward()
        opt.step()


def train_map(
    model: nn.Module,
    train_set: Dataset,
    config: TrainConfig = TrainConfig(),
    *,
    val_set: Dataset | None = None,
    tag: str = "model",
    cache_dir: str | Path | None = None,
    use_cache: bool = True,
    log: Callable[[str], None] | None = print,
) -> tuple[nn.Module, list[dict[str, float]]]:
    """Train ``model`` in place to a MAP estimate, or load it from the cache.

    Returns the model (in eval mode) and the per-epoch history (train loss/accuracy, and
    validation loss/accuracy if ``val_set`` is given).  ``log`` gets one line for the whole
    training (or the cache hit); the per-epoch numbers appear only in the progress bar, which is
    drawn only when stderr is a terminal.  A cache file that cannot be read is
    reported with a warning and replaced by a fresh training run; nothing is silently reused.
    """
    if config.likelihood not in ("classification", "regression"):
        raise ValueError(f"likelihood must be 'classification' or 'regression', got {config.likelihood!r}")
    path = model_cache_path(model, train_set, config, tag, cache_dir)
    cached = _load_cached(model, path, log) if use_cache and path.exists() else None
    if cached is not None:
        return model, cached

    torch.manual_seed(config.seed)
    loader = DataLoader(
        train_set, batch_size=config.batch_size, shuffle=True,
        generator=torch.Generator().manual_seed(config.seed),
    )
    eval_train = DataLoader(train_set, batch_size=1024)
    eval_val = DataLoader(val_set, batch_size=1024) if val_set is not None else None
    loss_fn = nn.CrossEntropyLoss() if config.likelihood == "classification" else nn.MSELoss()
    opt = _optimizer(list(model.parameters()), config)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(config.epochs, 1))

    history: list[dict[str, float]] = []
    bar = progress_bar(range(config.epochs), desc="MAP training", unit="epoch", quiet=log is None)
    for epoch in bar:
        start = time.perf_counter()
        _train_epoch(model, loader, opt, loss_fn, config.weight_decay, epoch)
        sched.step()
        row = {"epoch": epoch + 1, **_epoch_losses(model, eval_train, eval_val, config.likelihood)}
        row["seconds"] = time.perf_counter() - start
        history.append(row)
        bar.set_postfix_str(_format_row(row), refresh=False)  # shown only where the bar is (a terminal)
    if log and history:  # one line for the whole training, never one per epoch
        seconds = sum(r["seconds"] for r in history)
        log(f"MAP training: {len(history)} epochs in {seconds:.1f} s; last epoch: "
            + _format_row({k: v for k, v in history[-1].items() if k not in ("epoch", "seconds")}))

    model.eval()
    if use_cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.part")  # its own: another job may save the same model
        torch.save({"state_dict": model.state_dict(), "history": history, "config": asdict(config)}, tmp)
        tmp.replace(path)
    return model, history


#: Training of the README's default model (``digits_cnn`` on the 300 training digits of
#: ``digits_splits()``), used by the main job, ``diagnose`` and the examples.  No weight decay,
#: 300 epochs of batch 32: the MAP interpolates its small training set (train NLL ~1e-4) and is
#: overconfident on test (test NLL ~0.27, ECE ~4 %), the converged regime a Laplace
#: approximation assumes and where it visibly helps.  An under-trained, already calibrated MAP
#: would leave the approximation nothing to fix.
DIGITS_CONFIG = TrainConfig(epochs=300, lr=3e-3, weight_decay=0.0, batch_size=32)


def default_digits_model(
    seed: int = 0, epochs: int | None = None, log: Callable[[str], None] | None = print
) -> tuple[nn.Module, dict[str, Dataset]]:
    """The default model and data: a MAP ``digits_cnn`` trained (or loaded) on ``digits_splits(seed)``.

    Returns ``(model, splits)`` with ``splits`` the dict of ``"train"``/``"val"``/``"test"``
    datasets.  Initialisation is seeded, so the same ``seed`` gives the same weights with or
    without a cache.  ``epochs`` overrides
    [`DIGITS_CONFIG`][laplace_debiased.evaluation.training.DIGITS_CONFIG]'s.
    """
    from dataclasses import replace

    from laplace_debiased.data.digits import digits_splits
    from laplace_debiased.evaluation.models import digits_cnn

    splits = digits_splits(seed=seed)
    config = replace(DIGITS_CONFIG, seed=seed, epochs=DIGITS_CONFIG.epochs if epochs is None else epochs)
    torch.manual_seed(seed)
    model, _ = train_map(digits_cnn(), splits["train"], config, val_set=splits["val"], tag="digits_cnn", log=log)
    return model, splits
