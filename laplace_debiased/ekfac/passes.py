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

The per-sample rotation and squaring is curvlinops' EKFAC eigenvalue correction
(``curvlinops.EKFACLinearOperator``);
[`measure_ekfac_eigenvalues`][laplace_debiased.ekfac.passes.measure_ekfac_eigenvalues] runs it on B̃ with
B's eigenvectors installed instead of the ones curvlinops would compute from B̃.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence, MutableMapping
from typing import Any

import torch
from curvlinops import EKFACLinearOperator, FisherType
from torch import Tensor, nn

from laplace_debiased.curvature.inputs import target_rows, unpadded_samples
from laplace_debiased.curvature.linalg import check_square, symmetric_eigh64

__all__ = [
    "kron_eigenbasis",
    "measure_ekfac_eigenvalues",
    "ekfac_block_dense",
    "ekfac_to_dense",
]


def kron_eigenbasis(kfacs: Sequence[Sequence[Tensor]]) -> list[list[Tensor]]:
    """Eigenvectors (float64 ``eigh``, cast back) of every factor of every K-FAC block.

    Args:
        kfacs: laplace-torch ``Kron.kfacs`` (``[[G, A], [G_bias], ...]``) of batch B.

    Returns:
        ``[[Q_G, Q_A], [Q_G_bias], ...]`` in the same layout.
    """
    basis = []
    for i, block in enumerate(kfacs):
        if len(block) not in (1, 2):
            raise ValueError(f"K-FAC block {i} has {len(block)} factors; expected 1 or 2.")
        try:
            for F in block:
                check_square(F, "K-FAC factor")
            basis.append([symmetric_eigh64(F)[1].to(F.dtype) for F in block])
        except ValueError as err:
            raise ValueError(f"K-FAC block {i}: {err}") from err
    return basis


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
            [`kron_eigenbasis`][laplace_debiased.ekfac.passes.kron_eigenbasis]), e.g. from B.
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
            ``(d_out,)`` (biases), ``Σ_{n∈batches} Σ_c ((Q_Gᵀ G_nc Q_A)_ij)²`` (module docstring).
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
    op.compute_eigenvalue_correction()
    values: list[Tensor | None] = [None] * len(params)
    for name, pos in op._mapping.items():
        if "bias" in pos:
            cast[pos["bias"]] = [out_side[name]]
        for p_name, i in pos.items():
            lam = op._corrected_eigenvalues[name][i]
            if not torch.isfinite(lam).all():
                raise ValueError(
                    f"EKFAC eigenvalues of '{name}.{p_name}' contain NaN or Inf; the curvature "
                    "of the magnitude batches is not finite."
                )
            values[i] = lam
    return values


def ekfac_block_dense(Qs: Sequence[Tensor], lam: Tensor, delta: float | Tensor = 0.0, exponent: float = 1.0) -> Tensor:
    """Dense block ``Q diag((vec Λ + δ)^exponent) Qᵀ`` with ``Q = Q_G ⊗ Q_A`` (or ``Q_G``)."""
    Q = torch.kron(Qs[0], Qs[1]) if len(Qs) == 2 else Qs[0]
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
