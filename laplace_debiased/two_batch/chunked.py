"""Predictive of the two-batch classes over any number of inputs in bounded memory
([`chunked`][laplace_debiased.two_batch.chunked.chunked], called by
[`TwoBatchLaplace`][laplace_debiased.two_batch.base.TwoBatchLaplace]).

``la(x)``, ``la.predictive_samples(x)`` and ``la.functional_samples(x)`` split the inputs ``x``
(a tensor; or a mapping, Hugging Face style, whose tensors with the leading size of
``x[la.dict_key_x]`` are split alike and whose other entries are kept whole) into chunks of
``la.predictive_chunk_size`` inputs along their first dimension, run laplace-torch's
predictive on each chunk and concatenate the results along the input dimension (dimension 0 of
``la(x)``, dimension 1 of the ``(S, n, ...)`` samples).  The marginal predictive of an input
depends on that input alone, so the chunked result equals the one-piece result up to float
round-off.  Random draws stay the same too: before every chunk the random generators (the
``generator`` passed, and torch's global generator of the CPU and of the Laplace object's
device) are put back to their state at the call, so every chunk draws the same ``ε`` (GLM
``link_approx="mc"``) and the same parameter samples (``pred_type="nn"``) as the one-piece call,
and after the call the generators stand where the one-piece call leaves them.

Default chunk size (``predictive_chunk_size = None``): the largest number of inputs whose
Jacobians ``(chunk, outputs, P)`` take at most ``PREDICTIVE_CHUNK_BYTES / JACOBIAN_COPIES``
(the GLM predictive holds a few arrays of that size at once), between 1 and
``MAX_AUTO_CHUNK``; [`auto_chunk_size`][laplace_debiased.two_batch.chunked.auto_chunk_size].

Not chunked: the joint regression predictive (``joint=True``, whose ``(n·C)²`` covariance couples
all inputs).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch
__all__ = ["auto_chunk_size", "checked_chunk_size", "chunked", "concat_chunks", "input_chunks", "rng_rewinder"]

PREDICTIVE_CHUNK_BYTES = 2**28
"""Memory the default chunk size allows the GLM predictive of one chunk (256 MiB)."""
JACOBIAN_COPIES = 4
"""Arrays of the Jacobians' size the GLM predictive holds at once (Jacobians, their product
with the posterior covariance factors, temporaries), for
[`auto_chunk_size`][laplace_debiased.two_batch.chunked.auto_chunk_size]."""
MAX_AUTO_CHUNK = 256
"""Largest default chunk (inputs)."""

Output = torch.Tensor | tuple[torch.Tensor, ...]


def auto_chunk_size(
    outputs_per_input: int, n_params: int, itemsize: int, budget_bytes: int = PREDICTIVE_CHUNK_BYTES
) -> int:
    """Default number of inputs per chunk: ``budget / (JACOBIAN_COPIES · outputs · P · itemsize)``
    rounded down, clipped to ``[1, MAX_AUTO_CHUNK]``.

    Args:
        outputs_per_input: outputs of one input (``C``; ``tokens · C`` for token outputs).
        n_params: ``P``, the parameters of the Laplace approximation.
        itemsize: bytes per element of the Jacobians (4 for float32).
        budget_bytes: memory allowed for one chunk's GLM predictive.

    Returns:
        The number of inputs per chunk.
    """
    per_input = JACOBIAN_COPIES * max(outputs_per_input, 1) * max(n_params, 1) * itemsize
    return max(1, min(MAX_AUTO_CHUNK, budget_bytes // per_input))


def rng_rewinder(generator: torch.Generator | None, device: torch.device) -> Callable[[], None]:
    """A function that puts the random generators back to their states now.

    Args:
        generator: A generator to rewind too (``None``: only the global ones).
        device: The device whose global generator is rewound too, if it is a CUDA device.

    Returns:
        A function without arguments that restores ``generator``, torch's global CPU generator
        and (CUDA) the device's global generator.
    """
    cpu_state = torch.get_rng_state()
    own_state = generator.get_state() if generator is not None else None
    cuda_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def rewind() -> None:
        torch.set_rng_state(cpu_state)
        if own_state is not None:
            generator.set_state(own_state)
        if cuda_state is not None:
            torch.cuda.set_rng_state(cuda_state, device)

    return rewind


def input_chunks(x: Any, size: int, dict_key_x: str) -> list[Any]:
    """``x`` split into chunks of ``size`` inputs along the first dimension.

    A tensor is split with ``Tensor.split``.  A mapping is copied per chunk (``copy.copy``, so a
    ``BatchEncoding`` stays one), with every tensor entry whose leading size is that of
    ``x[dict_key_x]`` sliced and the other entries kept whole.

    Args:
        x: The inputs: a tensor, a mapping, or anything else (not split).
        size: Inputs per chunk.
        dict_key_x: Key of the inputs in a mapping (their leading size decides what is sliced).

    Returns:
        The chunks in order; ``[x]`` for inputs of at most ``size`` rows and for what cannot be split.
    """
    if isinstance(x, torch.Tensor):
        return list(x.split(size)) if x.ndim and len(x) > size else [x]
    if not isinstance(x, MutableMapping) or not isinstance(x.get(dict_key_x), torch.Tensor):
        return [x]
    n = len(x[dict_key_x])
    if n <= size:
        return [x]
    chunks = []
    for start in range(0, n, size):
        chunk = copy.copy(x)
        for key, value in x.items():
            if isinstance(value, torch.Tensor) and value.ndim and len(value) == n:
                chunk[key] = value[start : start + size]
        chunks.append(chunk)
    return chunks


def concat_chunks(parts: Sequence[Output], dim: int) -> Output:
    """The per-chunk results concatenated.

    Args:
        parts: Per chunk, a tensor or a tuple of tensors.
        dim: The dimension to concatenate along.

    Returns:
        One tensor, or a tuple of tensors concatenated entry by entry.
    """
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column, dim=dim) for column in zip(*parts))
    return torch.cat(list(parts), dim=dim)


def checked_chunk_size(size: int | None, outputs_per_input: int, n_params: int, dtype: torch.dtype) -> int:
    """Inputs per chunk: ``size``, or [`auto_chunk_size`][laplace_debiased.two_batch.chunked.auto_chunk_size]
    where it is ``None``.

    Args:
        size: The Laplace object's ``predictive_chunk_size``.
        outputs_per_input: Outputs of one input (``C``; ``tokens · C`` for token outputs).
        n_params: ``P``, the parameters of the Laplace approximation.
        dtype: The model's dtype (the Jacobians' itemsize).

    Returns:
        The number of inputs per chunk, at least 1.

    Raises:
        ValueError: ``size`` is neither ``None`` nor a positive integer.
    """
    if size is None:
        return auto_chunk_size(outputs_per_input, n_params, torch.empty((), dtype=dtype).element_size())
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"predictive_chunk_size must be a positive integer or None (automatic), got {size!r}.")
    return size


def chunked(
    predict: Callable[[Any], Output],
    x: Any,
    size: int,
    *,
    dict_key_x: str,
    generator: torch.Generator | None,
    device: torch.device,
    dim: int,
) -> Output:
    """``predict`` over chunks of ``x``, concatenated; each chunk starts from the generators'
    states at the call (module docstring).

    Args:
        predict: The predictive of one piece of inputs.
        x: The inputs (tensor or mapping; [`input_chunks`][laplace_debiased.two_batch.chunked.input_chunks]).
        size: Inputs per chunk.
        dict_key_x: Key of the inputs in a mapping.
        generator: The generator passed to the predictive, rewound with the global ones.
        device: The Laplace object's device (its global generator is rewound too).
        dim: The input dimension of ``predict``'s results (0 for ``la(x)``, 1 for samples).

    Returns:
        ``predict(x)`` where ``x`` fits one chunk, else the chunks' results concatenated along ``dim``.
    """
    chunks = input_chunks(x, size, dict_key_x)
    if len(chunks) == 1:
        return predict(x)
    rewind = rng_rewinder(generator, device)
    parts = []
    for chunk in chunks:
        rewind()
        parts.append(predict(chunk))
    return concat_chunks(parts, dim)
