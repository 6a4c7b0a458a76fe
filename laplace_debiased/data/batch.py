"""One loader batch: its inputs, targets, size and device.

A *batch* is whatever a loader yields: a ``(X, y)`` pair of tensors or a ``MutableMapping``
holding the input under ``dict_key_x`` and the targets under ``dict_key_y`` (laplace-torch's
convention for Huggingface-style data).
"""

from __future__ import annotations

import copy
from collections.abc import MutableMapping
from typing import Any

import torch

__all__ = ["Batch", "batch_inputs_targets", "batch_size", "input_tensor", "on_device"]

Batch = Any  # (X, y) tuple/list of tensors, or a MutableMapping (dict batches)


def batch_inputs_targets(
    batch: Batch, dict_key_x: str = "input_ids", dict_key_y: str = "labels"
) -> tuple[Any, torch.Tensor]:
    """Split a loader batch into ``(X, y)`` the way laplace-torch does.

    For a ``MutableMapping`` batch, ``X`` is the whole mapping (the model consumes it) and
    ``y = batch[dict_key_y]``; otherwise the batch must be a pair ``(X, y)``. A mapping
    without ``dict_key_x`` or ``dict_key_y`` raises ``KeyError`` (as laplace-torch does).
    """
    if isinstance(batch, MutableMapping):
        missing = [key for key in (dict_key_x, dict_key_y) if key not in batch]
        if missing:
            raise KeyError(
                f"dict batch has no key {missing[0]!r} (its keys: {sorted(batch)}); set "
                "dict_key_x / dict_key_y on the Laplace object to the input and target keys."
            )
        return batch, batch[dict_key_y]
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(
            "each loader batch must be a pair (X, y) or a dict-like batch; "
            f"got {type(batch).__name__}."
        )
    return batch[0], batch[1]


def input_tensor(X: Any, dict_key_x: str) -> torch.Tensor:
    """The input tensor of ``X``: ``X[dict_key_x]`` for a mapping, else ``X`` itself."""
    return X[dict_key_x] if isinstance(X, MutableMapping) else X


def batch_size(batch: Batch, dict_key_x: str = "input_ids", dict_key_y: str = "labels") -> int:
    """Number of samples in a batch (length of the targets' leading dimension)."""
    _, y = batch_inputs_targets(batch, dict_key_x, dict_key_y)
    return int(y.shape[0])


def _moved(t: Any, where: str, device: torch.device | str) -> Any:
    """``t.to(device)`` for a tensor (anything else unchanged); a tensor on the ``meta`` device
    has no values and is refused."""
    if not isinstance(t, torch.Tensor):
        return t
    if t.is_meta:
        raise ValueError(f"{where}: a tensor is on the meta device (shapes only, no values); load real data.")
    return t.to(device)


def on_device(batch: Batch, device: torch.device | str | None, where: str = "batch") -> Batch:
    """``batch`` with its tensors on ``device`` (``None``: unchanged), as laplace-torch's ``fit``
    moves every batch to the model's device.

    Pairs ``(X, y)`` become tuples; dict batches (and dict inputs ``X``) become shallow copies
    with every tensor value moved.  Tensors already on ``device`` are not copied.
    """
    if device is None:
        return batch

    def move_all(mapping: MutableMapping) -> MutableMapping:
        out = copy.copy(mapping)
        for key, value in mapping.items():
            out[key] = _moved(value, where, device)
        return out

    if isinstance(batch, MutableMapping):
        return move_all(batch)
    X, y = batch
    X = move_all(X) if isinstance(X, MutableMapping) else _moved(X, where, device)
    return (X, _moved(y, where, device))
