"""K-FAC factor sums of several sample groups from one forward/backward pass.

A debiased K-FAC fit needs the factors of the direction batch B and of the magnitude batch B̃
separately. Instead of one backend call per batch (each with its fixed overhead), the rows
of B and B̃ are stacked into one input and passed through the model once; the per-sample
layer inputs ``a_n`` and output gradients ``g_n`` captured by hooks are accumulated into one
sum per group. The mathematics is Curvlinops' ``KFACLinearOperator`` (``kfac_approx="expand"``,
the convention of laplace-torch's default backend):

* output side, per trainable weight or bias: ``Σ_{n ∈ group} Σ_t Σ_c g_ntc g_ntcᵀ`` where
  ``g_ntc`` is the gradient w.r.t. the layer output at position ``t`` (conv: spatial
  positions; linear: ``t`` is void) of ``f_n · s_nc`` for the columns ``s_nc`` of a square
  root ``S_n S_nᵀ = Λ_n`` of the per-sample loss Hessian (``fisher="type2"``, exact GGN), or
  of the per-sample loss itself (``fisher="empirical"``, one column);
* input side, per trainable weight: ``Σ_{n ∈ group} (1/T) Σ_t a_nt a_ntᵀ`` with ``T`` the
  number of positions (unfolded patches for ``Conv2d``; ``T = 1`` for ``Linear`` on
  ``(n, d_in)``, the tokens for ``Linear``, ``Conv1D`` and attention projections on
  ``(n, T, d_in)``: [`laplace_debiased.curvature.attention`][laplace_debiased.curvature.attention]).

Both are *sums over the samples of a group*: dividing the input side by its weight (the group
size without padded targets, [`GroupKfacSums.input_weight`][laplace_debiased.curvature.kfac.GroupKfacSums.input_weight]) gives the factor a backend call
over that group returns, and sums from disjoint shards of a group (other passes, other processes)
simply add up.

Padded targets (class label -100) carry no loss term. Their rows add nothing to the output side;
on the input side a position ``t`` of sample ``n`` gets the weight ``w_nt`` of
[`position_weights`][laplace_debiased.curvature.kfac.position_weights] (``1/T`` without padding) and the mean divides by ``Σ_nt w_nt``. Under
the "expand" convention every output row is a data point, so a token-wise layer's mean input
factor is ``Σ_{kept (n, t)} a_nt a_ntᵀ / #kept``: that of the kept tokens as a batch without
padding, and for ``(n, C)`` outputs that of the samples whose label is not -100.

A layer may see ``k`` rows per sample, ``k · n`` rows in a pass over ``n`` samples (laplace-torch's
reward models flatten each preference pair ``(n, 2, d)`` to ``(2n, d)``): its rows are taken
sample-major, rows ``k·j … k·j + k - 1`` of sample ``j`` (the layout of ``x.reshape(-1, d)``).
As in curvlinops (laplace-torch's stock K-FAC), where such a layer's rows are as many inputs of
the pass, the input side sums them per sample, ``Σ_{n} Σ_{r=1..k} (1/T) Σ_t a_nrt a_nrtᵀ``, and
the mean divides by the samples.

With ``keep_rows=True`` a ``Linear`` / ``Conv2d`` factor keeps the rows of each group *instead of*
its sum (input side ``a_nt / √T``, output side ``g_ntc``; [`factor_rows_of`][laplace_debiased.curvature.kfac.factor_rows_of]) while
the group has fewer of them than the factor's dimension ``d``: nothing of size ``d × d`` is formed for
that group, and a factor of rank ``< d`` is decomposed through its Gram matrix
([`laplace_debiased.curvature.linalg.lowrank_debiased_factor`][laplace_debiased.curvature.linalg.lowrank_debiased_factor]).
When a group's rows reach ``d``, its sum is formed once from the rows kept so far (the same
products in the same order as without rows) and the pass continues densely for that group; the
other groups keep their rows while they are fewer than ``d`` (a small B beside a large B̃).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

import torch
from curvlinops.kfac_utils import extract_patches
from torch import nn

from laplace_debiased.curvature.attention import AttentionProjection, attention_parts
from laplace_debiased.curvature.dense_blocks import (
    NORM_LAYERS,
    block_dims,
    embedding_input_sums,
    norm_sample_grads,
    normalised_input,
)

__all__ = [
    "GroupKfacSums",
    "KeptFactor",
    "RowChunk",
    "group_kfac_sums",
    "factor_rows_of",
    "layer_positions",
    "loss_hessian_sqrt",
    "loss_hessian_sqrt_columns",
    "output_rows",
    "IGNORE_INDEX",
    "kept_rows",
    "labelled_rows",
    "padded_rows",
    "kept_positions",
    "position_weights",
    "zero_sums",
]


#: rows ``a`` ``(n, d)`` and the weight ``α`` with which ``α aᵀa`` enters a factor's sum
RowChunk = tuple[torch.Tensor, float]
#: one group's side of a module kept as rows: its row chunks, or its ``(d, d)`` sum once they reached ``d``
KeptFactor = list[RowChunk] | torch.Tensor


@dataclass
class GroupKfacSums:
    """Per-group K-FAC sums of one or more passes (module docstring conventions).

    Attributes:
        output: one ``(n_groups, d_out, d_out)`` tensor per hooked module
            (output-side sums); ``None`` while the side is kept as rows (``output_rows``).
        input: one ``(n_groups, d_in, d_in)`` tensor per hooked module
            whose weight is trainable (input-side sums), ``None`` for modules with only a trainable bias
            (then ``input_weight`` is ``None`` too) and while the side is kept as rows (``input_rows``).
        loss: ``(n_groups,)`` summed loss ``factor * lossfunc`` of each group.
        input_rows: per hooked module, ``None`` (rows not kept, or every group's rows reached the
            width: the sums are in ``input``) or per group the list of row chunks ``(a, α)`` whose
            ``Σ α aᵀa`` is the group's input-side sum (``α = k/T``, module docstring;
            [`factor_rows_of`][laplace_debiased.curvature.kfac.factor_rows_of]), or that sum
            ``(d_in, d_in)`` for a group whose rows reached the width.
        input_weight: per hooked module with an input side, ``(n_groups,)`` sums ``Σ_nt w_nt`` of
            the position weights ([`position_weights`][laplace_debiased.curvature.kfac.position_weights]; the samples, without padding), else
            ``None``.
        terms: per hooked module, ``(n_groups, 2)`` float64 counts of the rank-one terms summed
            into its output side (samples × positions × backward passes, i.e. loss-Hessian
            columns) and input side (samples × positions): what the float32 round-off of a factor
            grows with ([`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance]).
        output_rows: the same for the output side: row chunks ``(g, 1)`` (one row per position, sample
            and backward pass) whose ``Σ gᵀg`` is the group's output-side sum, or that sum.
    """

    output: list[torch.Tensor | None]
    input: list[torch.Tensor | None]
    loss: torch.Tensor
    input_rows: list[list[KeptFactor] | None] = field(default_factory=list)
    input_weight: list[torch.Tensor | None] = field(default_factory=list)
    terms: list[torch.Tensor] = field(default_factory=list)
    output_rows: list[list[KeptFactor] | None] = field(default_factory=list)

    def tensors(self) -> list[torch.Tensor]:
        """All sums as one flat list (for in-place collectives such as ``all_reduce``; no side is kept
        as rows under a process group)."""
        outputs = [G for G in self.output if G is not None]
        inputs = [A for A in self.input if A is not None]
        weights = [w for w in self.input_weight if w is not None]
        return [*outputs, *inputs, *weights, *self.terms, self.loss]

    def mean_divisor(self, module: int, group: int) -> float:
        """What the input-side sum of ``module`` in ``group`` is divided by for its mean: the sum
        ``Σ_nt w_nt`` of its position weights ([`position_weights`][laplace_debiased.curvature.kfac.position_weights]), the group's samples
        without padded targets; 1 where that is 0 (a group padded throughout, whose sums are 0)."""
        w = float(self.input_weight[module][group])
        return w if w > 0 else 1.0


def loss_hessian_sqrt_columns(f: torch.Tensor, likelihood: str) -> Iterator[torch.Tensor]:
    """The columns of a square root ``S_n`` (``S_n S_nᵀ = Λ_n``) of the Hessian of laplace-torch's
    summed loss w.r.t. each output row, one ``(n, C)`` tensor at a time (never the ``(n, C, C)``
    matrix: ``n`` counts every token of token outputs).

    Cross-entropy: ``Λ = diag(p) - ppᵀ = D^½ P D^½`` with ``D = diag(p)`` and the projector
    ``P = I - √p√pᵀ`` (uses ``Σ p = 1``) of rank ``C - 1``, so ``C - 1`` columns suffice (one backward
    pass and one K-FAC row fewer per sample): ``S = D^½ B`` for an orthonormal basis ``B`` of
    ``√p``'s complement, the columns ``j ≠ k`` of the Householder reflection ``H = I - v vᵀ / (1 +
    √p_k)``, ``v = √p + e_k``, ``k`` the largest probability (``H √p = -e_k``; no cancellation), so
    column ``j``: ``√p ∘ (e_j - v √p_j / (1 + √p_k))``. ``MSELoss(reduction="sum")``: ``Λ = 2 I``,
    ``S = √2 I``, ``C`` columns.
    """
    n, C = f.shape
    if likelihood == "classification":
        sp = torch.softmax(f.detach(), dim=-1).sqrt()
        k = sp.argmax(-1, keepdim=True)
        top = sp.gather(-1, k)
        v = sp.scatter_add(-1, k, torch.ones_like(top))
        spv = sp * v / (1.0 + top)
        for slot in range(C - 1):
            j = slot + (slot >= k).long()  # (n, 1): the slot-th column other than k
            column = -spv * sp.gather(-1, j)
            column.scatter_add_(-1, j, sp.gather(-1, j))
            yield column
        return
    for c in range(C):
        column = torch.zeros(n, C, dtype=f.dtype, device=f.device)
        column[:, c] = 2.0**0.5
        yield column


def loss_hessian_sqrt(f: torch.Tensor, likelihood: str) -> torch.Tensor:
    """The square root ``S_n`` of [`loss_hessian_sqrt_columns`][laplace_debiased.curvature.kfac.loss_hessian_sqrt_columns] as ``(n, C, C - 1)``
    (classification) or ``(n, C, C)``."""
    return torch.stack(list(loss_hessian_sqrt_columns(f, likelihood)), dim=-1)


def _rows(t: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Output gradient ``(n, d_out[, h, w])`` as ``(n, T, d_out)``."""
    if isinstance(module, nn.Conv2d):
        return t.flatten(2).transpose(1, 2)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def _patches(x: torch.Tensor, module: nn.Module) -> torch.Tensor:
    """Layer input as ``(n, T, d_in)`` (unfolded patches for ``Conv2d``)."""
    if isinstance(module, nn.Conv2d):
        return extract_patches(
            x, module.kernel_size, module.stride, module.padding, module.dilation, module.groups
        )
    return x.reshape(x.shape[0], -1, x.shape[-1])


def _segment_sums(
    rows: torch.Tensor, segments: Sequence[tuple[int, int, int]], out: torch.Tensor, scale: float
) -> None:
    """``out[group] += scale * Σ_{rows r of the segment} r rᵀ`` per ``(start, stop, group)``."""
    for start, stop, group in segments:
        r = rows[start:stop].reshape(-1, rows.shape[-1])
        out[group].addmm_(r.T, r, alpha=scale)


@torch.no_grad()
def layer_positions(model: nn.Module, modules: Sequence[nn.Module], X: object) -> list[int]:
    """Per module (``nn.Linear``, ``nn.Conv2d``, GPT-2 ``Conv1D`` or an attention's
    [`AttentionProjection`][laplace_debiased.curvature.attention.AttentionProjection]), the rows ``n · T``
    that one pass over ``X`` adds to its K-FAC sums: the samples ``n`` times the positions ``T`` of
    the layer's output (``_rows``; a convolution's output pixels, which are its unfolded
    input patches; the tokens, or any other dimensions between the batch and the feature
    dimension, of a ``Linear`` or ``Conv1D``; the tokens of the attention, for both of its
    projections, in either layout). The input-side sum of the pass is a sum of ``n · T`` outer
    products, so its rank is at most that. One forward pass of ``model`` on ``X`` without
    gradients."""
    positions = [0] * len(modules)

    def count(module: nn.Module, inputs: tuple, output: torch.Tensor | tuple, i: int) -> None:
        if isinstance(output, tuple):  # an attention's (output, weights): one row per token
            positions[i] = output[0].numel() // output[0].shape[-1]
            return
        rows = _rows(output, module)
        positions[i] = rows.shape[0] * rows.shape[1]

    hooked = [m.attention if isinstance(m, AttentionProjection) else m for m in modules]
    handles = [m.register_forward_hook(partial(count, i=i)) for i, m in enumerate(hooked)]
    try:
        model(X)
    finally:
        for h in handles:
            h.remove()
    return positions


def _add_to_factor(
    sums: list[torch.Tensor | None], kept: list[list[KeptFactor] | None], i: int, a: torch.Tensor,
    segments: Sequence[tuple[int, int, int]], alpha: float, like: torch.Tensor,
) -> None:
    """Add ``alpha Σ_{rows r of the segment} r rᵀ`` (``a`` ``(n, T, d)``) to module ``i``'s side per
    segment: to a group's kept rows (``kept[i][group]``) while they are fewer than ``d`` (else they are no
    cheaper than the sum; each group is decided on its own, so a batch narrower than the factor keeps its rows
    beside a wider one), else to the group's sum, formed once from its rows kept so far (``_sum_of_chunks``)
    when they reach ``d``. Once every group's sum is formed they move to ``sums[i]`` ``(n_groups, d, d)``.
    ``like``: a tensor of the sums' dtype and device."""
    rows = kept[i]
    if rows is None:
        _segment_sums(a, segments, sums[i], alpha)
        return
    d = a.shape[-1]
    for start, stop, group in segments:
        r = a[start:stop].reshape(-1, d)
        if isinstance(rows[group], torch.Tensor):
            rows[group].addmm_(r.T, r, alpha=alpha)
        else:
            rows[group].append((r.clone(), alpha))  # a copy, not a view
    for group, chunks in enumerate(rows):
        if not isinstance(chunks, torch.Tensor) and sum(len(r) for r, _ in chunks) >= d:
            rows[group] = _sum_of_chunks(chunks, d, like)
    if all(isinstance(chunks, torch.Tensor) for chunks in rows):
        sums[i], kept[i] = torch.stack(rows), None


def _sum_of_chunks(chunks: list[RowChunk], d: int, like: torch.Tensor) -> torch.Tensor:
    """``(d, d)``: one group's ``Σ α rᵀr`` over its chunks ``(r, α)`` in the order they were kept (the
    products and order of ``_segment_sums``, so the sum is the one a pass without rows forms, to round-off:
    BLAS may round a buffer at another memory offset differently)."""
    out = torch.zeros(d, d, dtype=like.dtype, device=like.device)
    for r, alpha in chunks:
        out.addmm_(r.T, r, alpha=alpha)
    return out


def _install_sum_hooks(
    modules: Sequence[nn.Module], segments: Sequence[tuple[int, int, int]], into: GroupKfacSums, n_rows: int,
    kept: torch.Tensor | None = None, hooked: list[torch.Tensor] | None = None,
) -> list:
    """Forward hooks on ``modules`` that add each segment's input-side sum to ``into.input``
    (or keep its rows in ``into.input_rows`` where wanted, ``_add_to_factor``) and hook the
    outputs so that every backward pass adds its output-gradient sums to ``into.output`` (or their
    rows to ``into.output_rows``);
    the projections of an ``nn.MultiheadAttention`` through one hook on the attention
    (``_install_attention_hooks``). A layer whose input holds the ``n_rows`` samples of the
    pass along its second dimension is refused (``_check_batch_first``). Returns the
    handles (remove them after the passes)."""
    x_hats: dict[int, torch.Tensor] = {}  # normalisation layers: x̂ of this pass

    def on_output_grad(grad: torch.Tensor, i: int) -> None:
        if i in x_hats:  # dense block: per-sample affine gradients as one row per sample
            rows = norm_sample_grads(modules[i], x_hats[i], grad.detach())
            rows = rows.reshape(n_rows, -1, rows.shape[-1]).sum(1, keepdim=True)  # a sample's k rows add up
        else:
            rows = _per_sample(_rows(grad.detach(), modules[i]), n_rows)
        _add_to_factor(into.output, into.output_rows, i, rows, segments, 1.0, into.loss)
        _count_terms(into.terms[i], 0, segments, rows.shape[1])

    def on_forward(
        module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor, i: int
    ) -> torch.Tensor:
        x = inputs[0]
        if isinstance(module, nn.Embedding):
            x, output = _shared_ids_per_sample(x, output, n_rows)
        _check_batch_first(module, x, n_rows)
        if isinstance(module, NORM_LAYERS):
            x_hats[i] = normalised_input(module, x.detach())
        elif isinstance(module, nn.Embedding):
            k = x.shape[0] // n_rows  # rows per sample, summed (module docstring)
            x = _per_sample(x, n_rows)
            weights = None if kept is None else position_weights(kept, x[0].numel(), into.input[i].dtype)
            if k > 1 and weights is None:
                weights = torch.full(x.reshape(n_rows, -1).shape, 1.0 / x[0].numel(), dtype=into.input[i].dtype,
                                     device=x.device)
            embedding_input_sums(module, x, segments, into.input[i], None if weights is None else k * weights)
            _count_terms(into.terms[i], 1, segments, x.reshape(n_rows, -1).shape[1])
            _add_input_weight(into, i, segments, None if kept is None else weights)
        elif into.input_weight[i] is not None:
            _input_sums(x.detach(), module, segments, into, i, n_rows, kept)
        output.register_hook(partial(on_output_grad, i=i))
        if hooked is not None:
            hooked.append(output)
        return output

    handles = [
        m.register_forward_hook(partial(on_forward, i=i))
        for i, m in enumerate(modules)
        if not isinstance(m, AttentionProjection)
    ]
    return handles + _install_attention_hooks(modules, segments, into, on_output_grad, n_rows, kept, hooked)


def _shared_ids_per_sample(
    ids: torch.Tensor, output: torch.Tensor, n_rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """An embedding's ids and output with the samples of a pass over ``n_rows`` samples first.

    Ids shared by every sample (position ids ``(T,)`` with ``T != n_rows``, or ``(1, T)`` as
    GPT-2 passes them) give an output the model broadcasts over the batch, whose gradient is
    the sum over the samples. Per sample they are the same ids, so they are expanded to
    ``(n_rows, T)`` and the output to ``(n_rows, T, D)``; the expanded output (returned by the
    forward hook in place of the module's, the same values) carries the per-sample gradients.
    Other ids and outputs are returned unchanged."""
    one_d = ids.ndim == 1 and ids.shape[0] != n_rows
    if not (one_d or (ids.ndim > 1 and ids.shape[0] == 1 and n_rows > 1)):
        return ids, output
    if one_d:
        ids, output = ids.unsqueeze(0), output.unsqueeze(0)
    return ids.expand(n_rows, *ids.shape[1:]), output.expand(n_rows, *output.shape[1:])


def _per_sample(t: torch.Tensor, n_rows: int) -> torch.Tensor:
    """``t`` ``(k·n, T, ...)`` of a layer that sees ``k`` rows per sample as ``(n, k·T, ...)``
    (sample-major rows, module docstring); unchanged for ``k = 1``."""
    if t.shape[0] == n_rows:
        return t
    return t.reshape(n_rows, -1, *t.shape[2:])


def _check_batch_first(module: nn.Module, x: torch.Tensor, n_rows: int) -> None:
    """Raise a ``ValueError`` if ``x`` (a layer's input in a pass over ``n_rows`` samples) holds
    the samples along its second dimension instead of its first (tokens first), or has a number
    of rows that is no multiple ``k · n_rows`` (``k`` rows per sample, module docstring): the sums
    are split by sample along the first dimension."""
    if x.ndim < 1 or x.shape[0] == n_rows:
        return
    no_multiple = x.shape[0] % n_rows != 0
    if x.ndim >= 2 and x.shape[1] == n_rows and (x.ndim >= 3 or no_multiple):
        raise ValueError(
            f"a {type(module).__name__} layer receives an input of shape {tuple(x.shape)} for a "
            f"pass over {n_rows} samples (tokens first); debiased_kron/debiased_ekfac need every "
            "layer's input batch first (for nn.MultiheadAttention and "
            "nn.TransformerEncoderLayer: batch_first=True). Use hessian_structure='debiased_full' "
            "or 'debiased_lowrank' otherwise."
        )
    if no_multiple:
        raise ValueError(
            f"a {type(module).__name__} layer receives an input of shape {tuple(x.shape)} for a "
            f"pass over {n_rows} samples; debiased_kron/debiased_ekfac split its rows by sample and "
            "need the samples first, each as the same number of rows. Use "
            "hessian_structure='debiased_full' or 'debiased_lowrank' otherwise."
        )


def _input_sums(
    a: torch.Tensor, module: nn.Module, segments: Sequence[tuple[int, int, int]], into: GroupKfacSums, i: int,
    n_rows: int, kept: torch.Tensor | None = None,
) -> None:
    """Add the input-side sums of module ``i``'s input ``a`` (``(n, ..., d_in)``, conv: the
    unfolded patches; ``k · n`` rows for ``k`` rows per sample) in a pass over ``n_rows`` samples
    per segment to ``into.input[i]``, keeping rows where wanted, and their weights to
    ``into.input_weight[i]``; padded positions (``kept``, [`position_weights`][laplace_debiased.curvature.kfac.position_weights])
    are left out."""
    a = _patches(a, module)
    k = a.shape[0] // n_rows  # rows per sample, summed (module docstring)
    a = _per_sample(a, n_rows)
    weights = None if kept is None else position_weights(kept, a.shape[1], a.dtype)
    if weights is not None:
        a = a * (weights > 0).unsqueeze(-1).to(a.dtype)  # w_nt = 1/T at kept positions, else 0
    _add_to_factor(into.input, into.input_rows, i, a, segments, k / a.shape[1], into.loss)
    _count_terms(into.terms[i], 1, segments, a.shape[1])
    _add_input_weight(into, i, segments, weights)


def _count_terms(terms: torch.Tensor, side: int, segments: Sequence[tuple[int, int, int]], positions: int) -> None:
    """``terms[group, side] += (samples of the segment) · positions`` per segment: the rank-one
    terms one hook call adds to a factor ([`GroupKfacSums.terms`][laplace_debiased.curvature.kfac.GroupKfacSums.terms])."""
    for start, stop, group in segments:
        terms[group, side] += (stop - start) * positions


def _add_input_weight(
    into: GroupKfacSums, i: int, segments: Sequence[tuple[int, int, int]], weights: torch.Tensor | None
) -> None:
    """``into.input_weight[i][group] += Σ_{n ∈ segment} Σ_t w_nt`` per segment; ``weights``
    ``(n, T)`` ([`position_weights`][laplace_debiased.curvature.kfac.position_weights]), ``None`` without padding (every sample weighs 1)."""
    for start, stop, group in segments:
        into.input_weight[i][group] += stop - start if weights is None else weights[start:stop].sum()


def _install_attention_hooks(
    modules: Sequence[nn.Module], segments: Sequence[tuple[int, int, int]], into: GroupKfacSums,
    on_output_grad: Callable[..., None], n_rows: int, kept: torch.Tensor | None = None,
    hooked: list[torch.Tensor] | None = None,
) -> list:
    """One forward hook per ``nn.MultiheadAttention`` whose projections are among ``modules``
    ([`AttentionProjection`][laplace_debiased.curvature.attention.AttentionProjection]): it re-evaluates the
    attention with [`attention_parts`][laplace_debiased.curvature.attention.attention_parts], adds the
    input-side sums of both projections, hooks their outputs with ``on_output_grad`` and
    returns the re-evaluated output in place of the module's."""
    slots: dict[int, dict[str, int]] = {}
    attentions: dict[int, nn.MultiheadAttention] = {}
    for i, m in enumerate(modules):
        if isinstance(m, AttentionProjection):
            slots.setdefault(id(m.attention), {})[m.part] = i
            attentions[id(m.attention)] = m.attention

    def on_attention(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> tuple:
        parts = attention_parts(module, args, kwargs)
        _check_batch_first(module, parts.inputs, n_rows)
        for part, a, out in (("in_proj", parts.inputs, parts.projections), ("out_proj", parts.heads, parts.output)):
            i = slots[id(module)].get(part)
            if i is None:
                continue
            if into.input_weight[i] is not None:
                _input_sums(a.detach(), modules[i], segments, into, i, n_rows, kept)
            out.register_hook(partial(on_output_grad, i=i))
            if hooked is not None:
                hooked.append(out)
        return parts.result

    return [a.register_forward_hook(on_attention, with_kwargs=True) for a in attentions.values()]


def _backward_passes(
    model: nn.Module, X: torch.Tensor, y: torch.Tensor, params: list[torch.Tensor], likelihood: str,
    lossfunc: nn.Module, fisher: str, hooked: list[torch.Tensor],
) -> torch.Tensor:
    """One forward pass, then the backward passes whose output gradients the hooks sum: one per
    column of the loss-Hessian square root (``"type2"``) or the loss gradient (``"empirical"``).
    The passes differentiate by the hooked layer outputs (``hooked``, filled by the forward hooks),
    not by the parameters, whose gradients nothing reads. Returns the detached outputs."""
    with torch.enable_grad():
        f = model(X)
        rows, targets = output_rows(f, y)
        wrt = hooked or params
        if fisher == "empirical":
            torch.autograd.grad(lossfunc(rows, targets), wrt, allow_unused=True)
        else:
            last = rows.shape[-1] - (2 if likelihood == "classification" else 1)  # C - 1 or C columns
            for c, column in enumerate(loss_hessian_sqrt_columns(rows, likelihood)):
                column = kept_rows(column, targets)  # padded positions: no loss term, no curvature
                torch.autograd.grad((rows * column).sum(), wrt, retain_graph=c < last, allow_unused=True)
    return f.detach()


def group_kfac_sums(
    model: nn.Module,
    modules: Sequence[nn.Module],
    X: torch.Tensor,
    y: torch.Tensor,
    segments: Sequence[tuple[int, int, int]],
    n_groups: int,
    *,
    likelihood: str,
    lossfunc: nn.Module,
    factor: float,
    fisher: Literal["type2", "empirical"] = "type2",
    into: GroupKfacSums | None = None,
    keep_rows: bool = False,
) -> GroupKfacSums:
    """Add the K-FAC sums of one pass over ``X`` to ``into`` (or to zeros).

    Args:
        model: maps ``X`` to outputs ``(n, C)``, or ``(n, tokens, C)`` with every token an output (its
            own loss term; targets ``(n, tokens)`` or ``(n, tokens, C)``); evaluated once, in its current
            mode.
        modules: the curvature layers
            ([`laplace_debiased.curvature.layer_blocks.curvature_modules`][laplace_debiased.curvature.layer_blocks.curvature_modules])
            in ``Kron`` block order; an ``Embedding``'s input side is its diagonal token-frequency sum, a
            normalisation layer's output side is its exact dense GGN block, without input side
            ([`dense_blocks`][laplace_debiased.curvature.dense_blocks]); attention projections and ``Conv1D``:
            [`attention`][laplace_debiased.curvature.attention].
        X: stacked inputs of all rows of this pass.
        y: stacked targets of all rows of this pass.
        segments: ``(start, stop, group)`` row ranges of ``X`` and the group (``0 <= group <
            n_groups``) each belongs to; rows outside every segment are ignored.
        n_groups: number of groups.
        likelihood: ``"classification"`` or ``"regression"``.
        lossfunc: laplace-torch's summed loss (``backend.lossfunc``).
        factor: its factor (``backend.factor``).
        fisher: ``"type2"``, exact GGN (loss-Hessian square root, ``C`` backward
            passes), or ``"empirical"``, empirical Fisher.
        into: sums to add to, updated in place; ``None`` starts from zeros.
        keep_rows: keep the ``Linear`` / ``Conv2d`` factors of a new ``into`` as rows, per group while
            they are fewer than the factor's dimension (module docstring).

    Returns:
        ``GroupKfacSums``: ``into`` updated in place, or a new one. The output side carries no
            ``factor``; the loss does (it is laplace-torch's loss).
    """
    params = [p for m in modules for p in m.parameters(recurse=False) if p.requires_grad]
    if into is None:
        into = zero_sums(modules, n_groups, params[0], keep_rows)
    hooked: list[torch.Tensor] = []
    handles = _install_sum_hooks(modules, segments, into, len(y), kept_positions(y, len(y)), hooked)
    try:
        f = _backward_passes(model, X, y, params, likelihood, lossfunc, fisher, hooked)
    finally:
        for h in handles:
            h.remove()
    for start, stop, group in segments:
        into.loss[group] += factor * lossfunc(*output_rows(f[start:stop], y[start:stop]))
    return into


def output_rows(f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs ``(n, [tokens, ...,] C)`` as rows ``(n·tokens, C)``, each token an output (as
    laplace-torch's ASDL backend and LLM examples treat them), with the targets to match:
    class labels ``(n, [tokens])`` or targets shaped like the outputs (regression, class
    probabilities). Other target shapes raise a ``ValueError``."""
    if f.ndim < 2:
        raise ValueError(
            f"the model output has shape {tuple(f.shape)}; K-FAC needs (batch, [tokens,] outputs)."
        )
    if y.shape not in (f.shape, f.shape[:-1]):
        raise ValueError(
            f"the targets have shape {tuple(y.shape)} but the model outputs {tuple(f.shape)}: "
            f"give class labels of shape {tuple(f.shape[:-1])} (one per token) or targets of "
            f"shape {tuple(f.shape)}."
        )
    rows = f.reshape(-1, f.shape[-1])
    return rows, y.reshape(rows.shape[0], *y.shape[f.ndim - 1 :])


#: ``torch.nn.CrossEntropyLoss``'s default ``ignore_index``: the class label of a padded position
IGNORE_INDEX = -100


def padded_rows(targets: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the rows whose target is a padded position: integer class labels equal to
    [`IGNORE_INDEX`][laplace_debiased.curvature.kfac.IGNORE_INDEX], which laplace-torch's ``CrossEntropyLoss``
    leaves out of the loss (all ``False`` for floating targets, which have no such label). Shape:
    ``targets.shape``
    for labels, ``targets.shape[:1]`` for floating targets."""
    if targets.is_floating_point():
        return torch.zeros(targets.shape[:1], dtype=torch.bool, device=targets.device)
    return targets == IGNORE_INDEX


def labelled_rows(f: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[`output_rows`][laplace_debiased.curvature.kfac.output_rows] without the rows of padded positions
    (class label -100, [`padded_rows`][laplace_debiased.curvature.kfac.padded_rows]): the rows a predictive
    metric scores, as ``CrossEntropyLoss`` does."""
    rows, targets = output_rows(f, y)
    padded = padded_rows(targets)
    if not padded.any():
        return rows, targets
    return rows[~padded], targets[~padded]


def kept_rows(values: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``values`` (leading dimension: one entry per row) with the rows of padded positions
    ([`padded_rows`][laplace_debiased.curvature.kfac.padded_rows] of ``targets``) set to zero, so that they
    add no curvature."""
    padded = padded_rows(targets)
    if not padded.any():
        return values
    return values * (~padded).reshape(-1, *[1] * (values.ndim - 1)).to(values.dtype)


def kept_positions(targets: torch.Tensor, n: int) -> torch.Tensor | None:
    """Per sample, which of its output rows carry a loss term: ``(n, K)`` booleans for targets of
    ``n`` samples with ``K`` rows each (``K = 1`` without tokens), ``None`` when no row is padded
    ([`padded_rows`][laplace_debiased.curvature.kfac.padded_rows])."""
    padded = padded_rows(targets)
    if not padded.any():
        return None
    return ~padded.reshape(n, -1)


def position_weights(kept: torch.Tensor, T: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight ``w_nt`` ``(n, T)`` of each of a layer's ``T`` positions in its input-side sum
    ``Σ_n Σ_t w_nt a_nt a_ntᵀ``, from the kept output rows ``kept`` ``(n, K)``; the mean factor
    divides that sum by ``Σ_nt w_nt``.

    Where the layer's positions are the sample's output rows (``T = K``, a layer applied token by
    token), ``w_nt = 1/T`` at kept positions and 0 at padded ones: the mean is over the kept
    positions, each one data point ("expand"), as if the padded positions were cut off. Elsewhere
    ``w_nt = 1/T`` for a sample with any kept row. A sample without one has no loss term:
    ``w_nt = 0``. Without padding this is the ``1/T`` of the module docstring."""
    kept = kept.to(dtype)
    if kept.shape[1] == T:
        return kept / T
    return kept.amax(1, keepdim=True).expand(-1, T) / T


def zero_sums(
    modules: Sequence[nn.Module], n_groups: int, like: torch.Tensor, keep_rows: bool = False
) -> GroupKfacSums:
    """Zero K-FAC sums to accumulate passes into.

    Args:
        modules: The hooked modules, one block each.
        n_groups: The number of groups (batches summed separately).
        like: A tensor whose dtype and device the sums take.
        keep_rows: Keep the input and output sides of ``nn.Linear`` / ``nn.Conv2d`` layers as rows,
            empty row lists and no sums (module docstring; the other layers' blocks are debiased from
            their sums).

    Returns:
        The sums, all zero: ``output`` ``(n_groups, d_out, d_out)``, ``input``
        ``(n_groups, d_in, d_in)`` (``None`` where kept as rows) and ``input_weight`` ``(n_groups,)``
        per module, ``loss`` ``(n_groups,)``.
    """
    def z(d: int) -> torch.Tensor:
        return torch.zeros(n_groups, d, d, dtype=like.dtype, device=like.device)

    def empty() -> list[KeptFactor]:
        return [[] for _ in range(n_groups)]

    output, inputs, out_rows, rows = [], [], [], []
    for m in modules:
        d_out, d_in = block_dims(m)
        keep = keep_rows and isinstance(m, (nn.Linear, nn.Conv2d))
        output.append(None if keep else z(d_out))
        inputs.append(None if d_in is None or keep else z(d_in))
        out_rows.append(empty() if keep else None)
        rows.append(empty() if keep and d_in is not None else None)
    loss = torch.zeros(n_groups, dtype=like.dtype, device=like.device)
    weights = [None if block_dims(m)[1] is None else torch.zeros_like(loss) for m in modules]
    terms = [torch.zeros(n_groups, 2, dtype=torch.float64, device=like.device) for _ in modules]
    return GroupKfacSums(output, inputs, loss, rows, weights, terms, out_rows)


def factor_rows_of(chunks: list[RowChunk]) -> torch.Tensor:
    """The rows ``X`` ``(n, d)`` of one group's kept chunks ``(r, α)``
    ([`GroupKfacSums.input_rows`][laplace_debiased.curvature.kfac.GroupKfacSums.input_rows]), ``XᵀX = Σ α rᵀr``
    the group's sum (``√α r`` stacked)."""
    return torch.cat([r if alpha == 1.0 else r * alpha**0.5 for r, alpha in chunks])
