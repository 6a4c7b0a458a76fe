"""``n_magnitude_batches="auto"`` of the debiased K-FAC structures over all weights: the rows the
direction batches give each K-FAC factor, counted on the model (the rule and its record are in
:mod:`laplace_debiased.computers.auto_magnitude`)."""

from __future__ import annotations

from collections.abc import Callable

from laplace.curvature.curvature import EFInterface
from laplace.lllaplace import LLLaplace
from torch import nn

from laplace_debiased.computers.auto_magnitude import AutoMagnitude, FactorRowCount, auto_magnitude_batches
from laplace_debiased.curvature.dense_blocks import block_dims
from laplace_debiased.curvature.kfac import layer_positions
from laplace_debiased.data.batch import Batch, batch_inputs_targets

__all__ = ["AutoMagnitudeMixin"]


class AutoMagnitudeMixin:
    """``n_magnitude_batches="auto"`` for the debiased K-FAC structures over all weights (a base of
    :class:`~laplace_debiased.structures.kron.DebiasedKronLaplace`, before
    :class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`)."""

    def _auto_magnitude_rule(self) -> Callable[[list[Batch]], AutoMagnitude]:
        """:meth:`_auto_magnitude`; refused for the last-layer classes."""
        if isinstance(self, LLLaplace):
            raise ValueError(
                f"n_magnitude_batches='auto' is implemented for subset_of_weights='all' (debiased_kron, "
                f"debiased_ekfac), not for the last-layer {type(self).__name__}. Pass an integer "
                "n_magnitude_batches; la.coverage after a fit tells whether B ∪ B̃ reached every factor."
            )
        return self._auto_magnitude

    def _auto_magnitude(self, direction: list[Batch]) -> AutoMagnitude:
        """The rule (module docstring) on the rows the batches of B give every factor."""
        return auto_magnitude_batches(self._factor_row_counts(direction))

    def _factor_row_counts(self, direction: list[Batch]) -> list[FactorRowCount]:
        """Dimension and rows from B of the input and output factor of every ``Linear`` /
        ``Conv2d`` / GPT-2 ``Conv1D`` layer and attention projection (``"<attention>.in_proj"``,
        ``".out_proj"``) with trainable parameters (one forward pass per batch of B)."""
        from laplace_debiased.curvature.attention import AttentionProjection, is_conv1d
        from laplace_debiased.curvature.layer_blocks import named_curvature_modules

        for b in direction:
            self._check_batch_matches_model(b)
        named = [(name or type(m).__name__, m) for name, m in named_curvature_modules(self._layers())
                 if isinstance(m, (nn.Linear, nn.Conv2d, AttentionProjection)) or is_conv1d(m)]
        names = {id(m): name for name, m in named}
        modules = [m for _, m in named]
        positions = [0] * len(modules)
        for b in direction:
            X, _ = batch_inputs_targets(b, self.dict_key_x, self.dict_key_y)
            positions = [p + q for p, q in zip(positions, layer_positions(self.model, modules, X))]
        output_shape = self._output_shape(direction[0])
        columns = self._output_columns(output_shape[-1] if output_shape else 1)
        counts = []
        for m, rows in zip(modules, positions):
            d_out, d_in = block_dims(m)
            counts.append(FactorRowCount(names[id(m)], "output", d_out, rows * columns, len(direction)))
            if d_in is not None:
                counts.append(FactorRowCount(names[id(m)], "input", d_in, rows, len(direction)))
        return counts

    def _output_columns(self, n_outputs: int) -> int:
        """Rows each output row adds to an output-side factor (module docstring): ``C - 1`` for the
        cross-entropy GGN, ``C`` for the MSE GGN, 1 for the empirical Fisher, ``mc_samples`` for
        the MC Fisher."""
        if isinstance(self.backend, EFInterface):
            return 1
        if getattr(self.backend, "stochastic", False):
            return int(self._asdl_fisher_kwargs.get("mc_samples", 1))
        return max(n_outputs - 1, 1) if self.likelihood == "classification" else n_outputs
