"""Predictive of the two-batch classes over any number of inputs in bounded memory
(:class:`ChunkedPredictiveMixin`, a base of
:class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`).

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
``MAX_AUTO_CHUNK``; :func:`auto_chunk_size`.

Not chunked: the joint regression predictive (``joint=True``, whose ``(n·C)²`` covariance couples
all inputs).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import torch
from laplace.utils.enums import LinkApprox, PredType

__all__ = ["ChunkedPredictiveMixin", "auto_chunk_size", "concat_chunks", "input_chunks", "rng_rewinder"]

PREDICTIVE_CHUNK_BYTES = 2**28
"""Memory the default chunk size allows the GLM predictive of one chunk (256 MiB)."""
JACOBIAN_COPIES = 4
"""Arrays of the Jacobians' size the GLM predictive holds at once (Jacobians, their product
with the posterior covariance factors, temporaries), for :func:`auto_chunk_size`."""
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
    """
    per_input = JACOBIAN_COPIES * max(outputs_per_input, 1) * max(n_params, 1) * itemsize
    return max(1, min(MAX_AUTO_CHUNK, budget_bytes // per_input))


def rng_rewinder(generator: torch.Generator | None, device: torch.device) -> Callable[[], None]:
    """A function that puts ``generator`` (if given), torch's global CPU generator and, for a
    CUDA ``device``, that device's global generator back to their states now."""
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
    ``x[dict_key_x]`` sliced and the other entries kept whole.  Anything else, and inputs of at
    most ``size`` rows, come back as ``[x]``.
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
    """The per-chunk results (tensors, or tuples of tensors) concatenated along ``dim``."""
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column, dim=dim) for column in zip(*parts))
    return torch.cat(list(parts), dim=dim)


class ChunkedPredictiveMixin:
    """``la(x)``, ``predictive_samples`` and ``functional_samples`` over chunks of the inputs.

    Attributes:
        predictive_chunk_size: inputs per chunk; ``None`` (default) picks
            :func:`auto_chunk_size` from the outputs and parameters of the fit.
    """

    predictive_chunk_size: int | None = None

    def __call__(
        self,
        x: Any,
        pred_type: PredType | str = PredType.GLM,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
        fitting: bool = False,
        **model_kwargs: Any,
    ) -> Output:
        """laplace-torch's ``la(x, ...)`` (same arguments), over chunks of ``x`` (module
        docstring); the joint predictive (``joint=True``) in one piece."""

        def predict(chunk: Any) -> Output:
            return super(ChunkedPredictiveMixin, self).__call__(
                chunk, pred_type, joint, link_approx, n_samples, diagonal_output, generator, fitting, **model_kwargs
            )

        return predict(x) if joint else self._chunked(predict, x, generator, dim=0)

    def predictive_samples(
        self,
        x: Any,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``predictive_samples`` ``(S, n, ...)``, over chunks of ``x``."""
        parent = super().predictive_samples
        return self._chunked(
            lambda chunk: parent(chunk, pred_type, n_samples, diagonal_output, generator), x, generator, dim=1
        )

    def functional_samples(
        self,
        x: Any,
        pred_type: PredType | str = PredType.GLM,
        n_samples: int = 100,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's ``functional_samples`` ``(S, n, ...)``, over chunks of ``x``."""
        parent = super().functional_samples
        return self._chunked(
            lambda chunk: parent(chunk, pred_type, n_samples, diagonal_output, generator), x, generator, dim=1
        )

    def chunk_size(self) -> int:
        """Inputs per chunk: ``predictive_chunk_size`` or :func:`auto_chunk_size`."""
        size = self.predictive_chunk_size
        if size is None:
            outputs = math.prod(getattr(self, "fit_output_shape", (self.n_outputs or 1,)))
            itemsize = torch.empty((), dtype=self._dtype).element_size()
            return auto_chunk_size(outputs, self.n_params, itemsize)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(
                f"predictive_chunk_size must be a positive integer or None (automatic), got {size!r}."
            )
        return size

    def _chunked(
        self, predict: Callable[[Any], Output], x: Any, generator: torch.Generator | None, dim: int
    ) -> Output:
        """``predict`` over :func:`input_chunks` of ``x``, concatenated along ``dim``; each chunk
        starts from the generators' states at the call (module docstring)."""
        chunks = input_chunks(x, self.chunk_size(), self.dict_key_x)
        if len(chunks) == 1:
            return predict(x)
        rewind = rng_rewinder(generator, self._device)
        parts = []
        for chunk in chunks:
            rewind()
            parts.append(predict(chunk))
        return concat_chunks(parts, dim)
