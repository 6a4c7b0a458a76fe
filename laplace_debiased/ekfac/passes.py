"""Debiased EKFAC: K-FAC eigenbasis of batch B, exact curvature along it measured on B̃.

EKFAC (George et al., NeurIPS 2018) keeps K-FAC's per-layer eigenbasis ``Q = Q_G ⊗ Q_A`` but
replaces the Kronecker-factored eigenvalues ``λ_G ⊗ λ_A`` by the exact curvature along every
basis direction, ``diag(Qᵀ C Q)``.  Debiased, the basis comes from the direction batch B and the
diagonal from the independent magnitude batch B̃ (Tatzel et al., ICLR 2025, Sec. 4.2 applied to
EKFAC's eigenvectors).

The conventions are those of [`laplace_debiased.curvature.linalg`][laplace_debiased.curvature.linalg]:

* Blocks follow laplace-torch's ``Kron`` layout, one per trainable parameter tensor: a weight
  block has eigenvectors ``[Q_G, Q_A]`` (output side ``(d_out, d_out)`` first, input side
  ``(d_in, d_in)``; the block acts on the row-major flattened weight ``(d_out, d_in)``, a conv
  kernel flattened to ``(d_out, c_in·k_h·k_w)``) and eigenvalues ``Λ`` of shape
  ``(d_out, d_in)``, i.e. the block is ``(Q_G ⊗ Q_A) diag(vec Λ) (Q_G ⊗ Q_A)ᵀ``; a bias block
  has eigenvectors ``[Q_G]`` and eigenvalues ``(d_out,)``.
* For a summed loss over samples ``n`` of B̃ with per-sample output-side vectors ``g_nc``
  (``c`` over the columns of the loss-Hessian square root for the GGN, the single loss gradient
  for the empirical Fisher) and layer inputs ``a_n``, the EKFAC eigenvalue of direction
  ``(i, j)`` is ``Λ_ij = Σ_n Σ_c ((Q_Gᵀ G_nc Q_A)_ij)²`` with the per-sample weight gradient
  ``G_nc = Σ_t g_nct a_ntᵀ``: weight-shared positions ``t`` (conv patches) are summed *before*
  squaring, so ``Λ = diag(Qᵀ C_B̃ Q)`` exactly, ``C_B̃`` the GGN/EF block of B̃.
* Scaling to ``N`` data points is left to the caller (every eigenvalue is a sum over B̃'s samples).
* Token outputs ``(n, tokens, C)``, every token its own loss term: the sum runs over the
  ``n·tokens`` loss terms, each with its own per-term weight gradient ``G_ntc`` (summed over the
  positions the layer is applied at, which for a model acting on each token separately is the
  token's own position). Curvlinops' EKFAC takes ``(n, C)`` outputs only, so the correction
  runs once per token position ``t`` on the model's outputs at ``t`` and the results add up
  (``tokens`` passes over B̃).

* Implicit complements: where B's factor ``F = XᵀX`` has fewer rows ``X`` ``(n, d)`` than its
  width, its eigenvectors are ``Q`` ``(d, r)`` (those above round-off, from the rows' Gram matrix:
  [`kron_eigenbasis`][laplace_debiased.ekfac.passes.kron_eigenbasis]) and the complement
  ``N = I - QQᵀ`` (B's null space, dimension ``d - r``) is never formed. Inside it ``F`` is 0, so
  every orthonormal basis of ``N`` is an eigenbasis of ``F``, and a dense ``eigh``'s per-direction
  ``Λ`` there depends on the basis it happens to return; its sum over the complement does not (a
  trace). The complement therefore gets one value per block row or column: ``Λ`` has shape
  ``(r_G [+1], r_A [+1])`` (``(r_G [+1],)`` for a bias), the extra row / column present where that
  factor is implicit; ``Λ[i, j]`` for ``i < r_G, j < r_A`` as above, ``Λ[i, r_A]`` the mean of the
  dense ``Λ_ij`` over the complement columns ``j`` (for any basis of ``N_A``), ``Λ[r_G, j]`` and
  ``Λ[r_G, r_A]`` likewise, i.e. ``Σ_n Σ_c ‖q_Giᵀ G_nc N_A‖² / (d_A - r_A)`` and so on
  ([`complement_values`][laplace_debiased.ekfac.passes.complement_values]). Among the EKFAC diagonals
  that do not depend on the choice of basis inside ``N`` these are the Frobenius-nearest to
  ``C_B̃`` (EKFAC's criterion, George et al. 2018, Sec. 3.2, restricted to them): the block is the
  Frobenius projection of ``C_B̃`` onto the span of ``P_a ⊗ P_b``, with ``P_a`` running over
  ``q_i q_iᵀ`` and ``N`` of each factor. With B̃ = B the samples' vectors lie in the range of B's
  factors, so the complement values are 0 up to round-off, as the dense route's are.

The per-sample rotation and squaring is curvlinops' EKFAC eigenvalue correction
(``curvlinops.EKFACLinearOperator``);
[`measure_ekfac_eigenvalues`][laplace_debiased.ekfac.passes.measure_ekfac_eigenvalues] runs it on B̃ with
B's eigenvectors installed instead of the ones curvlinops would compute from B̃ (``(d, r)``
ones give the range block); the complement values come from hooks on the same backward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, MutableMapping
from typing import Any

import torch
from curvlinops import EKFACLinearOperator, FisherType
from curvlinops.kfac_utils import extract_patches
from torch import Tensor, nn

from laplace_debiased.curvature.inputs import target_rows, unpadded_samples
from laplace_debiased.curvature.linalg import (
    RowFactor,
    check_square,
    dense_factor,
    frobenius_tolerance,
    gram_eigenpairs,
    roundoff_tolerance,
    symmetric_eigh64,
)

__all__ = [
    "complement_values",
    "extended_shape",
    "implicit",
    "kron_eigenbasis",
    "measure_ekfac_eigenvalues",
    "ekfac_block_dense",
    "ekfac_to_dense",
]


def kron_eigenbasis(
    kfacs: Sequence[Sequence[Tensor]],
    rows: Sequence[Sequence[Tensor | None]] | None = None,
    terms: Sequence[Sequence[int]] | None = None,
) -> list[list[Tensor]]:
    """Eigenvectors of every factor of every K-FAC block (float64, cast back to the factor's dtype).

    A factor summed from fewer rank-one terms than its width ``d`` (rows ``X`` ``(n, d)``,
    ``F = XᵀX``, ``n < d``) keeps only its eigenvectors with eigenvalues above
    [`roundoff_tolerance`][laplace_debiased.curvature.linalg.roundoff_tolerance] ``(F)``, ``(d, r)``; the
    complement, B's null space, stays implicit (module docstring). They come from the Gram matrix
    of the rows where these are given
    ([`gram_eigenpairs`][laplace_debiased.curvature.linalg.gram_eigenpairs], ``O(d n²)``, nothing of size
    ``d × d``), else from ``eigh`` of ``F`` (e.g. under a process group, where the rows are
    spread over the ranks). Every other factor: all ``d`` eigenvectors of ``eigh``.

    Args:
        kfacs: laplace-torch ``Kron.kfacs`` (``[[G, A], [G_bias], ...]``) of batch B.
        rows: ``None``, or per block and factor the rows of B's factor where known, else ``None``.
        terms: ``None``, or per block and factor the rank-one terms summed into it.

    Returns:
        ``[[Q_G, Q_A], [Q_G_bias], ...]`` in the same layout, each ``(d, d)`` or ``(d, r)``.
    """
    basis = []
    for i, block in enumerate(kfacs):
        if len(block) not in (1, 2):
            raise ValueError(f"K-FAC block {i} has {len(block)} factors; expected 1 or 2.")
        block_rows = rows[i] if rows is not None else [None] * len(block)
        block_terms = terms[i] if terms is not None else [None] * len(block)
        try:
            basis.append([_factor_eigenvectors(*args) for args in zip(block, block_rows, block_terms)])
        except ValueError as err:
            raise ValueError(f"K-FAC block {i}: {err}") from err
    return basis


def _factor_eigenvectors(F: Tensor | RowFactor, X: Tensor | None, terms: int | None) -> Tensor:
    """One factor's eigenvectors ([`kron_eigenbasis`][laplace_debiased.ekfac.passes.kron_eigenbasis]); a
    factor held as rows ([`RowFactor`][laplace_debiased.curvature.linalg.RowFactor]) through them."""
    if isinstance(F, RowFactor):
        if not F.isfinite():
            raise ValueError("K-FAC factor contains NaN or Inf; the curvature of this batch is not finite. "
                             "Check the inputs and the model output on that batch.")
        X = F.rows
    else:
        check_square(F, "K-FAC factor")
    d = F.shape[0]
    if X is not None and len(X) < d:
        L, E = gram_eigenpairs(X)
        tol = frobenius_tolerance(d, F.dtype, float(torch.linalg.vector_norm(L)))  # ‖F‖_F from the Gram spectrum
        return E[:, L > tol].to(F.dtype)
    L, V = symmetric_eigh64(dense_factor(F))
    if terms is not None and terms < d:
        V = V[:, L > roundoff_tolerance(F)]
    return V.to(F.dtype)


def _module_bases(
    mapping: dict[str, dict[str, int]], eigenvectors: Sequence[Sequence[Tensor]]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Per-module ``(Q_G, Q_A)`` from per-parameter blocks (curvlinops' ``_mapping``); a layer's
    output side is its weight block's ``Q_G`` (its bias block's when it has no weight)."""
    out_side, in_side = {}, {}
    for name, pos in mapping.items():
        if "weight" in pos:
            Qs = eigenvectors[pos["weight"]]
            if len(Qs) != 2:
                raise ValueError(
                    f"layer '{name}': the weight block needs two eigenvector factors [Q_G, Q_A]."
                )
            out_side[name], in_side[name] = Qs
        else:
            out_side[name] = eigenvectors[pos["bias"]][0]
    return out_side, in_side


#: ``EKFACLinearOperator`` attributes this module relies on (curvlinops-for-pytorch 3.0.x; the
#: version is pinned in requirements-cpu.lock, and tests/test_ekfac.py checks the result densely).
_CURVLINOPS_INTERNALS = (
    "_mapping",
    "_gradient_covariances_eigenvectors",
    "_input_covariances_eigenvectors",
    "_corrected_eigenvalues",
)


def _check_internals(op: EKFACLinearOperator) -> None:
    missing = [a for a in _CURVLINOPS_INTERNALS if not hasattr(op, a)]
    if missing:
        raise RuntimeError(
            f"this curvlinops version's EKFACLinearOperator lacks {missing}, which the debiased "
            "EKFAC uses to install B's eigenbasis; install curvlinops-for-pytorch==3.0.1 "
            "(requirements-cpu.lock)."
        )


def measure_ekfac_eigenvalues(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[Tensor],
    batches: Sequence[tuple[Any, Tensor]],
    eigenvectors: Sequence[Sequence[Tensor]],
    fisher_type: str = FisherType.TYPE2,
    mc_samples: int = 1,
    batch_size_fn: Callable[[MutableMapping], int] | None = None,
) -> tuple[list[list[Tensor]], list[Tensor]]:
    """EKFAC eigenvalues of the batches along given Kronecker eigenbases (summed loss).

    Args:
        model: the network (its Linear/Conv2d layers own ``params``).
        loss_func: its loss with ``reduction="sum"`` (e.g. laplace-torch's ``backend.lossfunc``;
            multiply the result by ``backend.factor``).
        params: the parameters, one K-FAC block each, in block order.
        batches: the magnitude batches B̃, a sequence of ``(X, y)`` (``X`` a tensor or a mapping the
            model consumes); outputs ``(n, C)``, or ``(n, tokens, C)`` with every token a loss term
            (module docstring).
        eigenvectors: per parameter a list of blocks ``[[Q_G, Q_A], [Q_G], ...]`` (see
            [`kron_eigenbasis`][laplace_debiased.ekfac.passes.kron_eigenbasis]), e.g. from B; each
            ``(d, d)``, or ``(d, r)`` with an implicit complement (module docstring).
        fisher_type: a ``curvlinops.FisherType``: ``TYPE2`` (exact GGN), ``MC`` (sampled Fisher) or
            ``EMPIRICAL`` (empirical Fisher).
        mc_samples: samples per input for ``fisher_type=MC``.
        batch_size_fn: curvlinops' ``batch_size_fn`` for mapping inputs (number of loss terms of
            a batch); ``None`` for tensor inputs.

    Returns:
        ``(eigenvectors, eigenvalues)``: the basis used, in the model's dtype: ``eigenvectors`` with
            every bias block's ``Q_G`` replaced by its layer's weight ``Q_G`` (both come from the same
            factor ``G``, up to scale, but ``eigh`` may pick different bases of a degenerate eigenspace;
            EKFAC needs one ``Q_G`` per layer); and per block ``Λ`` ``(d_out, d_in)`` (weights) or
            ``(d_out,)`` (biases), ``Σ_{n∈batches} Σ_c ((Q_Gᵀ G_nc Q_A)_ij)²`` (module docstring), of
            [`extended_shape`][laplace_debiased.ekfac.passes.extended_shape] where a complement is implicit.
    """
    if getattr(loss_func, "reduction", None) != "sum":
        raise ValueError("the loss must use reduction='sum' (laplace-torch's convention).")
    if len(eigenvectors) != len(params):
        raise ValueError(
            f"got {len(eigenvectors)} eigenvector blocks for {len(params)} parameter tensors."
        )
    dtype = params[0].dtype
    cast = [[Q.to(dtype) for Q in Qs] for Qs in eigenvectors]
    values: list[Tensor] | None = None
    for token_model, token_batches in _per_token(model, batches):
        lams = _eigenvalue_correction(
            token_model, loss_func, params, token_batches, cast, fisher_type, mc_samples, batch_size_fn
        )
        values = lams if values is None else [v + lam for v, lam in zip(values, lams)]
    if values is None:
        raise ValueError("every target of the magnitude batches is -100 (padded), so they have no loss "
                         "term to measure curvature on; give B̃ batches with unpadded targets.")
    return cast, values


class _TokenOutput(nn.Module):
    """``model``'s outputs ``(n, tokens, C)`` at the flattened token position ``t``, ``(n, C)``."""

    def __init__(self, model: nn.Module, t: int) -> None:
        super().__init__()
        self.model, self.t = model, t

    def forward(self, x: Any) -> Tensor:
        f = self.model(x)
        return f.reshape(f.shape[0], -1, f.shape[-1])[:, self.t]


def _per_token(
    model: nn.Module, batches: Sequence[tuple[Any, Tensor]]
) -> list[tuple[nn.Module, list[tuple[Any, Tensor]]]]:
    """``[(model, batches)]`` for ``(n, C)`` outputs; for token outputs one
    ``(_TokenOutput(model, t), batches with their targets at t)`` per token position ``t``
    (batches with fewer tokens are left out of the later positions). The targets' shape is
    checked against the model's outputs ([`target_rows`][laplace_debiased.curvature.inputs.target_rows])."""
    per_batch = [(X, *target_rows(model, X, y)) for X, y in batches]
    if all(len(shape) == 1 for _, _, shape in per_batch):
        kept = unpadded_samples([(X, y) for X, y, _ in per_batch])
        return [(model, kept)] if kept else []
    tokens = [math.prod(shape[:-1]) for _, _, shape in per_batch]
    per_token = [
        (
            _TokenOutput(model, t),
            unpadded_samples([(X, rows.reshape(len(rows) // T, T, *rows.shape[1:])[:, t])
                       for (X, rows, _), T in zip(per_batch, tokens) if t < T]),
        )  # fmt: skip
        for t in range(max(tokens))
    ]
    return [(m, b) for m, b in per_token if b]  # a position padded in every sample adds nothing


def _eigenvalue_correction(
    model: nn.Module,
    loss_func: nn.Module,
    params: Sequence[Tensor],
    batches: Sequence[tuple[Any, Tensor]],
    cast: list[list[Tensor]],
    fisher_type: str,
    mc_samples: int,
    batch_size_fn: Callable[[MutableMapping], int] | None,
) -> list[Tensor]:
    """Curvlinops' EKFAC eigenvalue correction of ``(n, C)``-output ``model`` on ``batches``
    along the installed basis ``cast`` (bias blocks' ``Q_G`` replaced in place by their layer's
    weight ``Q_G``), one ``Λ`` per parameter block."""
    n_data = sum(len(y) for _, y in batches)
    op = EKFACLinearOperator(
        model,
        loss_func,
        list(params),
        list(batches),
        check_deterministic=False,
        fisher_type=fisher_type,
        mc_samples=mc_samples,
        separate_weight_and_bias=True,
        num_data=n_data,
        num_per_example_loss_terms=1,
        batch_size_fn=batch_size_fn,
    )
    _check_internals(op)
    out_side, in_side = _module_bases(op._mapping, cast)
    # install B's basis: curvlinops only computes eigenvectors when none are present (curvlinops
    # 3.0.1, ekfac.py, EKFACLinearOperator.compute_eigenvalue_correction). It has no public setter:
    # its load_state_dict sets the same two attributes, but also reloads the model's parameters and
    # needs the whole state, so they are set as it sets them; _check_internals refuses a version
    # without them.
    op._gradient_covariances_eigenvectors = out_side
    op._input_covariances_eigenvectors = in_side
    complements: dict[int, Tensor] = {}
    handles = _install_complement_hooks(model, op._mapping, out_side, in_side, 1.0 / mc_samples, complements)
    try:
        op.compute_eigenvalue_correction()
    finally:
        for handle in handles:
            handle.remove()
    values: list[Tensor | None] = [None] * len(params)
    for name, pos in op._mapping.items():
        if "bias" in pos:
            cast[pos["bias"]] = [out_side[name]]
        for p_name, i in pos.items():
            lam = op._corrected_eigenvalues[name][i]
            if i in complements:  # the range block in front of the complement's values
                full = complements[i].to(lam.dtype)
                full[tuple(slice(0, n) for n in lam.shape)] = lam
                lam = full
            if not torch.isfinite(lam).all():
                raise ValueError(
                    f"EKFAC eigenvalues of '{name}.{p_name}' contain NaN or Inf; the curvature "
                    "of the magnitude batches is not finite."
                )
            values[i] = lam
    return values


def implicit(Q: Tensor) -> bool:
    """Whether the eigenvectors ``Q`` ``(d, r)`` leave a complement implicit (``r < d``)."""
    return Q.shape[1] < Q.shape[0]


def extended_shape(Qs: Sequence[Tensor]) -> tuple[int, ...]:
    """The shape of a block's ``Λ`` (module docstring): per factor ``r``, plus one for an implicit
    complement."""
    return tuple(Q.shape[1] + implicit(Q) for Q in Qs)


def complement_values(g: Tensor, Q_G: Tensor, a: Tensor | None, Q_A: Tensor | None) -> Tensor | None:
    """The complement entries of ``Λ`` (module docstring) that one backward pass adds, in float64.

    Args:
        g: output-side vectors ``(n, S, d_out)`` of the pass (``S`` weight-sharing positions).
        Q_G: output-side eigenvectors ``(d_out, r_G)``.
        a: the layer's inputs ``(n, S, d_in)`` (unfolded patches for a convolution); ``None``
            for a bias block.
        Q_A: input-side eigenvectors ``(d_in, r_A)``; ``None`` for a bias block.

    Returns:
        ``Λ``'s shape ([`extended_shape`][laplace_debiased.ekfac.passes.extended_shape]) with zeros on
        the range block ``(r_G, r_A)``, or ``None`` when neither factor is implicit. With
        ``G_n = Σ_s g_ns a_nsᵀ``, ``N_G = I - Q_G Q_Gᵀ``, ``N_A = I - Q_A Q_Aᵀ``:
        ``Λ[i, r_A] = Σ_n ‖q_Giᵀ G_n N_A‖² / (d_in - r_A)``,
        ``Λ[r_G, j] = Σ_n ‖N_G G_n q_Aj‖² / (d_out - r_G)``,
        ``Λ[r_G, r_A] = Σ_n ‖N_G G_n N_A‖_F² / ((d_out - r_G)(d_in - r_A))``; a bias block
        (``G_n = Σ_s g_ns``): ``Λ[r_G] = Σ_n ‖N_G G_n‖² / (d_out - r_G)``. Each is computed from
        the ``S × S`` Gram matrices of the residuals ``N_G g_ns``, ``N_A a_ns``, nothing of size
        ``d²``.
    """
    Qs = [Q_G] if Q_A is None else [Q_G, Q_A]
    if not any(map(implicit, Qs)):
        return None
    g64, QG = g.double(), Q_G.double()
    rG, gaps = QG.shape[1], [Q.shape[0] - Q.shape[1] for Q in Qs]
    out = g64.new_zeros(extended_shape(Qs))
    Yr = g64 @ QG
    if a is None:
        out[rG] = (g64 - Yr @ QG.T).sum(1).square().sum() / gaps[0]
        return out
    a64, QA = a.double(), Q_A.double()
    rA = QA.shape[1]
    Xr = a64 @ QA
    if implicit(Q_A):
        Ra = a64 - Xr @ QA.T
        Ka = Ra @ Ra.mT  # (n, S, S)
        out[:rG, rA] = ((Ka @ Yr) * Yr).sum((0, 1)) / gaps[1]
    if implicit(Q_G):
        Rg = g64 - Yr @ QG.T
        Kg = Rg @ Rg.mT
        out[rG, :rA] = ((Kg @ Xr) * Xr).sum((0, 1)) / gaps[0]
        if implicit(Q_A):
            out[rG, rA] = (Kg * Ka).sum() / (gaps[0] * gaps[1])
    return out


def _install_complement_hooks(
    model: nn.Module,
    mapping: dict[str, dict[str, int]],
    out_side: dict[str, Tensor],
    in_side: dict[str, Tensor],
    scale: float,
    into: dict[int, Tensor],
) -> list:
    """Hooks on the layers whose basis leaves a complement implicit: every backward pass of the
    eigenvalue correction adds ``scale ·`` [`complement_values`][laplace_debiased.ekfac.passes.complement_values]
    of its output gradients and the layer's inputs to ``into[block]`` (the same ``g`` and ``a`` as
    curvlinops' correction, rearranged as it does). Returns the handles."""
    handles, inputs = [], {}
    for name, pos in mapping.items():
        Q_G, Q_A = out_side[name], in_side.get(name)
        if not any(implicit(Q) for Q in (Q_G, Q_A) if Q is not None):
            continue
        module = model.get_submodule(name)

        def cache(mod: nn.Module, args: tuple, name: str = name) -> None:
            inputs[name] = args[0].detach()

        def accumulate(grad: Tensor, mod: nn.Module, name: str, pos: dict[str, int], Q_G: Tensor,
                       Q_A: Tensor | None) -> None:
            g = grad.detach().movedim(1, -1) if isinstance(mod, nn.Conv2d) else grad.detach()
            g = g.reshape(g.shape[0], -1, g.shape[-1])
            for p_name, i in pos.items():
                a = None
                if p_name == "weight":
                    a = inputs[name]
                    if isinstance(mod, nn.Conv2d):
                        a = extract_patches(a, mod.kernel_size, mod.stride, mod.padding, mod.dilation, mod.groups)
                    a = a.reshape(a.shape[0], -1, a.shape[-1])
                values = complement_values(g, Q_G, a, Q_A if p_name == "weight" else None)
                if values is not None:
                    into[i] = scale * values + into[i] if i in into else scale * values

        def on_output(mod: nn.Module, args: tuple, output: Tensor, name: str = name, pos: dict = pos,
                      Q_G: Tensor = Q_G, Q_A: Tensor | None = Q_A) -> None:
            output.register_hook(lambda grad: accumulate(grad, mod, name, pos, Q_G, Q_A))

        if "weight" in pos:
            handles.append(module.register_forward_pre_hook(cache))
        handles.append(module.register_forward_hook(on_output))
    return handles


def ekfac_block_dense(Qs: Sequence[Tensor], lam: Tensor, delta: float | Tensor = 0.0, exponent: float = 1.0) -> Tensor:
    """Dense block ``Q diag((vec Λ + δ)^exponent) Qᵀ`` with ``Q = Q_G ⊗ Q_A`` (or ``Q_G``); an
    implicit complement is completed (complete QR) and every direction in it takes its
    complement entry of ``Λ`` (module docstring)."""
    full, index = [], []
    for Q in Qs:
        r, d = Q.shape[1], Q.shape[0]
        if implicit(Q):
            Q = torch.cat([Q, torch.linalg.qr(Q.double(), mode="complete").Q[:, r:].to(Q.dtype)], dim=1)
        full.append(Q.contiguous())
        index.append(torch.cat([torch.arange(r), torch.full((d - r,), r)]).to(lam.device))
    lam = lam[index[0]] if len(Qs) == 1 else lam[index[0]][:, index[1]]
    Q = torch.kron(full[0], full[1]) if len(Qs) == 2 else full[0]
    return (Q * torch.pow(lam.reshape(-1) + delta, exponent)) @ Q.T


def ekfac_to_dense(
    eigenvectors: Sequence[Sequence[Tensor]],
    eigenvalues: Sequence[Tensor],
    deltas: Tensor | None = None,
    exponent: float = 1.0,
) -> Tensor:
    """Block-diagonal dense matrix of EKFAC blocks (for tests and tiny models only)."""
    if deltas is None:
        deltas = torch.zeros(len(eigenvalues), dtype=eigenvalues[0].dtype, device=eigenvalues[0].device)
    return torch.block_diag(
        *[ekfac_block_dense(Qs, lam, d, exponent) for Qs, lam, d in zip(eigenvectors, eigenvalues, deltas)]
    )
