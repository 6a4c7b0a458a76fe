"""Fast linearized (GLM) predictive for a whole grid of prior precisions.

For a Laplace approximation with posterior precision ``P(δ) = s·H + δ`` (``s = 1/σ²/T``, the
``_H_factor`` of laplace-torch, and ``δ`` the prior precision), the linearized network
``f_lin(x; θ) = f(x; θ*) + J(x)(θ - θ*)`` has the Gaussian logit distribution
``N(f(x), Σ(δ))`` with ``Σ(δ) = J P(δ)⁻¹ Jᵀ``.  When ``H`` is diagonal in a known orthonormal
basis (per block ``H_k = Q_k diag(λ_k) Q_kᵀ``; for K-FAC ``Q_k = Q_G ⊗ Q_A``,
``λ_k = λ_G ⊗ λ_A``), then with the *rotated Jacobian* ``J̃_k = J_k Q_k``

    Σ(δ) = Σ_k J̃_k diag(1 / (s·λ_k + δ_k)) J̃_kᵀ,

so the expensive, prior-independent work (per-example Jacobians, rotation into the eigenbasis) is
done once per chunk of inputs and reused for every prior precision of a grid; the structures'
``covariances(rotated, grid)`` return ``Σ(δ)`` for the whole grid ``(G, n, C, C)`` reading each
rotated Jacobian once (:func:`weighted_grams`), and ``covariance(rotated, δ)`` is its one-point
case.  The full ``(batch × classes × parameters)`` Jacobian is never built: inputs are processed
in chunks, and the Jacobian of a ``Linear`` layer (2-D input) stays in its rank-one form
``g_c ⊗ a`` (output gradient ⊗ input), rotated as ``(Q_Gᵀ g_c) ⊗ (Q_Aᵀ a)``.

Link approximations on ``N(f, Σ)`` (shapes: ``f`` ``(n, C)``, ``Σ`` ``(n, C, C)``):

* ``"probit"`` -- laplace-torch's diagonal probit ``softmax(f / sqrt(1 + π/8 diag Σ))``.  It is
  fooled by the softmax-invariant all-ones direction: a large ``c`` in ``Σ + c·11ᵀ`` shrinks all
  logits although the softmax of every sample is unchanged.
* ``"probit_projected"`` -- the same probit on the distribution of the logits projected onto the
  logit-difference subspace (``Π = I - 11ᵀ/C``): ``softmax(Πf / sqrt(1 + π/8 diag(ΠΣΠ)))``.
  Exactly invariant to ``f + a·1`` and ``Σ + c·11ᵀ``.
* ``"mc"`` -- Monte-Carlo: ``mean_s softmax(f + Σ^{1/2} ε_s)``; for a GLM this equals sampling
  ``θ_s ~ N(θ*, P⁻¹)`` and evaluating the linearized network (Eq. 18 of Tatzel et al.).

:func:`sampled_linearized_predictive` does the latter literally (parameter samples + forward-mode
Jacobian-vector products), for posteriors without a cheap eigenbasis.

Supported posteriors (read from a fitted laplace-torch object, see :func:`posterior_structure`):
``KronDecomposed`` ``H`` (laplace's K-FAC and the debiased K-FAC of :mod:`laplace_debiased.structures.kron`),
dense ``H`` (full), and a low-rank eigen pair ``(U, λ)`` (prior ``δ`` on the complement of ``U``).
Per-example Jacobians are closed-form for ``nn.Linear``/``nn.Conv2d`` parameters (captured input
activations and output gradients, one batched backward pass per class) and come from
``torch.func`` (``vmap`` over ``jacrev``) otherwise.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from laplace_debiased.curvature.kfac import output_rows
from laplace_debiased.curvature.linalg import symmetric_eigh64

#: links of the sweeps and reports
LINKS = ("probit_projected", "probit", "mc")
#: every link :func:`apply_link` and :meth:`GridPredictive.grid` evaluate (adds laplace-torch's bridge)
ALL_LINKS = (*LINKS, "bridge", "bridge_norm")


# --------------------------------------------------------------------------------------------
# Link approximations: (f, Σ) -> class probabilities
# --------------------------------------------------------------------------------------------
def probit_from_variances(f: Tensor, var: Tensor) -> Tensor:
    """``softmax(f_c / sqrt(1 + π/8 var_c))``; f, var ``(n, C)``."""
    return torch.softmax(f / torch.sqrt(1.0 + math.pi / 8.0 * var), dim=-1)


def probit(f: Tensor, cov: Tensor) -> Tensor:
    """laplace-torch's probit: ``softmax(f_c / sqrt(1 + π/8 Σ_cc))``; f ``(n, C)``, cov ``(n, C, C)``."""
    return probit_from_variances(f, cov.diagonal(dim1=-2, dim2=-1))


def project_logits(f: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    """Mean and covariance of ``Πf_lin`` with ``Π = I - 11ᵀ/C`` (removes the softmax-invariant
    all-ones direction).  Returns ``(Πf, ΠΣΠ)`` with the shapes of the inputs.

    Double-centring ``Σ`` cancels when ``Σ`` is dominated by the all-ones direction; the
    structures' ``variances(..., project=True)`` project the Jacobian instead."""
    f_p = f - f.mean(-1, keepdim=True)
    cov_p = cov - cov.mean(-1, keepdim=True)
    cov_p = cov_p - cov_p.mean(-2, keepdim=True)
    return f_p, cov_p


def probit_projected(f: Tensor, cov: Tensor) -> Tensor:
    """Probit on the logit-difference subspace: :func:`probit` of :func:`project_logits`."""
    return probit(*project_logits(f, cov))


def project_classes(A: Tensor) -> Tensor:
    """``Π A`` for ``A`` ``(n, C, ...)``: centre over the class axis (``Π = I - 11ᵀ/C``)."""
    return A - A.mean(1, keepdim=True)


def mc_softmax(
    f: Tensor, cov: Tensor, n_samples: int = 100, generator: torch.Generator | None = None
) -> Tensor:
    """Monte-Carlo predictive ``1/S Σ_s softmax(f + L ε_s)``, ``L Lᵀ = Σ`` (symmetric square root
    from a float64 eigendecomposition, so rank-deficient ``Σ`` is fine).  f ``(n, C)``, cov
    ``(n, C, C)`` -> ``(n, C)`` in ``f.dtype``."""
    evals, evecs = torch.linalg.eigh(cov.double())
    root = evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)
    eps = torch.randn(n_samples, *f.shape, dtype=f.dtype, device=f.device, generator=generator)
    logits = f.double() + torch.einsum("nij,snj->sni", root, eps.double())
    return torch.softmax(logits, dim=-1).mean(0).to(f.dtype)


def laplace_bridge(f: Tensor, cov: Tensor, normalise: bool = False) -> Tensor:
    """laplace-torch's Laplace bridge (``link_approx="bridge"``, ``"bridge_norm"`` with
    ``normalise=True``): Dirichlet mean after the zero-mean correction of ``(f, Σ)``.
    f ``(n, C)``, cov ``(n, C, C)`` -> ``(n, C)``; same formula as laplace-torch 0.3."""
    total = cov.sum(dim=(1, 2))[:, None]
    row = cov.sum(-1)
    f = f - row * f.sum(-1, keepdim=True) / total
    var = (cov - row.unsqueeze(-1) * cov.sum(-2).unsqueeze(-2) / total[..., None]).diagonal(dim1=-2, dim2=-1)
    K = f.shape[-1]
    if normalise:
        m = var.mean(dim=1) / math.sqrt(K / 2)
        f = f / m.sqrt().unsqueeze(-1)
        var = var / m.unsqueeze(-1)
    sum_exp = torch.exp(-f).sum(dim=1, keepdim=True)
    alpha = (1 - 2 / K + f.exp() / K**2 * sum_exp) / var
    return torch.nan_to_num(alpha / alpha.sum(dim=1, keepdim=True), nan=1.0)


def normal_samples(
    mean: Tensor, var: Tensor, n_samples: int, generator: torch.Generator | None = None
) -> Tensor:
    """Samples ``(S, n, C)`` of ``N(mean, var)``, mean ``(n, C)``, var ``(n, C, C)`` or diagonal
    ``(n, C)``: laplace-torch's ``normal_samples`` (same ``ε`` draw, ``(C, S)`` in the mean's
    dtype, shared over the batch) with the symmetric square root of a float64
    eigendecomposition (round-off negative eigenvalues clamped) instead of a Cholesky factor,
    which fails for the ill-conditioned float32 ``Σ`` of a small prior precision."""
    n, C = mean.shape
    eps = torch.randn((C, n_samples), device=mean.device, dtype=mean.dtype, generator=generator).double()
    if var.shape == mean.shape:
        scaled = var.double().clamp_min(0.0).sqrt().unsqueeze(-1) * eps
    elif var.shape == (n, C, C):
        evals, evecs = torch.linalg.eigh(var.double())
        scaled = (evecs * evals.clamp_min(0.0).sqrt().unsqueeze(-2)) @ (evecs.transpose(-1, -2) @ eps)
    else:
        raise ValueError(f"var must be (n, C) or (n, C, C) for mean {tuple(mean.shape)}, got {tuple(var.shape)}")
    return (mean.double().unsqueeze(-1) + scaled).permute(2, 0, 1).to(mean.dtype)


def apply_link(
    link: str,
    f: Tensor,
    cov: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Dispatch to :func:`probit_projected`, :func:`probit`, :func:`mc_softmax` or
    :func:`laplace_bridge` by name."""
    if link == "probit":
        return probit(f, cov)
    if link == "probit_projected":
        return probit_projected(f, cov)
    if link == "mc":
        return mc_softmax(f, cov, n_samples, generator)
    if link in ("bridge", "bridge_norm"):
        return laplace_bridge(f, cov, normalise=link == "bridge_norm")
    raise ValueError(f"unknown link approximation {link!r}; choose from {ALL_LINKS}")


# --------------------------------------------------------------------------------------------
# Per-example Jacobians of the logits, one entry per parameter tensor
# --------------------------------------------------------------------------------------------
@dataclass
class LayerJacobian:
    """Jacobian of the ``C`` logits w.r.t. one parameter tensor for a chunk of ``n`` inputs.

    Either *factored*, ``J[n, c, :] = vec(g[n, c, :] ⊗ a[n, :])`` (a ``Linear`` weight with 2-D
    input; ``g`` ``(n, C, out)`` output gradients, ``a`` ``(n, in)`` inputs; row-major like
    ``weight.flatten()``), or *dense*, ``J`` ``(n, C, numel)`` in ``param.flatten()`` order.
    A leading size 1 of ``g`` or ``dense`` means the same for every input (broadcast): the
    output layer's ``g`` is the identity, which is then never materialised per input.
    """

    g: Tensor | None = None
    a: Tensor | None = None
    dense: Tensor | None = None

    def full(self) -> Tensor:
        """The dense ``(n, C, numel)`` Jacobian (leading size 1 if shared, see above)."""
        if self.dense is not None:
            return self.dense
        return (self.g.unsqueeze(-1) * self.a[:, None, None, :]).flatten(2)

    def gram(self) -> Tensor:
        """``J Jᵀ`` of shape ``(n, C, C)``."""
        if self.dense is not None:
            return self.dense @ self.dense.transpose(1, 2)
        return (self.g @ self.g.transpose(1, 2)) * self.a.square().sum(-1)[:, None, None]

    def matmul(self, V: Tensor) -> Tensor:
        """``J V`` for ``V`` of shape ``(numel, k)`` -> ``(n, C, k)``."""
        if self.dense is not None:
            return self.dense @ V
        o, i = self.g.shape[-1], self.a.shape[-1]
        return self.g @ torch.einsum("ni,oik->nok", self.a, V.reshape(o, i, -1))


def _owners(model: nn.Module, params: Sequence[Tensor]) -> list[tuple[nn.Module, str] | None]:
    """For each parameter, its ``(module, 'weight' | 'bias')`` if the module is a supported
    ``Linear``/``Conv2d`` (closed-form Jacobian), else ``None``."""
    owner: dict[int, tuple[nn.Module, str]] = {}
    for mod in model.modules():
        supported = isinstance(mod, nn.Linear) or (
            isinstance(mod, nn.Conv2d)
            and mod.groups == 1
            and mod.padding_mode == "zeros"
            and not isinstance(mod.padding, str)
        )
        if supported:
            for name in ("weight", "bias"):
                p = getattr(mod, name)
                if p is not None:
                    owner[id(p)] = (mod, name)
    return [owner.get(id(p)) for p in params]


def logit_rows(f: Tensor) -> Tensor:
    """Outputs ``(n, [tokens, ...,] C)`` as rows ``(n·tokens, C)``, one per token
    (:func:`laplace_debiased.curvature.kfac.output_rows`, which also checks ``f.ndim ≥ 2``)."""
    return output_rows(f, f[..., 0])[0]


def _layer_jacobians(
    model: nn.Module, params: Sequence[Tensor], x: Tensor
) -> tuple[Tensor, list[LayerJacobian]]:
    """Closed-form per-example Jacobians from captured activations and output gradients.

    One forward pass with hooks on the owning modules, then one batched backward pass per
    output row and class (``is_grads_batched``; ``T·C`` cotangents for ``T`` tokens) for the
    modules before the output; the output ``Linear``'s output gradient is the identity, kept as
    one shared ``(1, C, C)``, with its input of each token as that row's input.  Returns the
    outputs ``(n, [tokens,] C)`` and Jacobians of the rows ``(n·tokens, C, ·)``.  Assumes
    examples do not interact (no BatchNorm in train mode); tokens may.
    """
    owners = _owners(model, params)
    modules = list({id(m): m for m, _ in owners}.values())
    captured: dict[int, tuple[Tensor, Tensor]] = {}

    def hook(mod: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> None:
        if id(mod) in captured:
            raise ValueError(
                f"module {mod} is called twice per forward pass (weight sharing); use "
                "sampled_linearized_predictive for such models"
            )
        captured[id(mod)] = (inputs[0].detach(), output)

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        with torch.enable_grad():
            x_in = x.detach().requires_grad_(True) if x.is_floating_point() else x
            f = model(x_in)
            n, C = len(f), f.shape[-1]
            tokens = len(logit_rows(f)) // n
            eye = torch.eye(C, dtype=f.dtype, device=f.device)
            shared = eye[None]
            out_grad = {id(m): shared for m in modules if captured[id(m)][1] is f and isinstance(m, nn.Linear)}
            inner = [m for m in modules if id(m) not in out_grad]
            if inner:  # cotangent (t, c): one-hot at token t, class c of every example
                cot = torch.eye(tokens * C, dtype=f.dtype, device=f.device)
                cot = cot.reshape(tokens * C, 1, *f.shape[1:]).expand(-1, n, *f.shape[1:])
                outs = [captured[id(m)][1] for m in inner]
                grads = torch.autograd.grad(f, outs, grad_outputs=cot, is_grads_batched=True)
                out_grad.update({  # (n·tokens, C, ...)
                    id(m): g.unflatten(0, (tokens, C)).movedim(2, 0).flatten(0, 1).detach()
                    for m, g in zip(inner, grads)
                })
    finally:
        for h in handles:
            h.remove()

    jacs: list[LayerJacobian] = []
    for mod, name in owners:
        a, _ = captured[id(mod)]
        g = out_grad[id(mod)]
        if g is shared:  # the output Linear: each token's input is its row's input
            a = a.flatten(0, -2)
        elif tokens > 1:  # an inner module: every row of an example sees the example's input
            a = a.repeat_interleave(tokens, dim=0)
        if isinstance(mod, nn.Conv2d):
            g = g.flatten(3)  # (n, C, out, T)
            if name == "bias":
                jacs.append(LayerJacobian(dense=g.sum(-1)))
            else:
                unf = F.unfold(a, mod.kernel_size, mod.dilation, mod.padding, mod.stride)
                jacs.append(LayerJacobian(dense=torch.einsum("ncot,nkt->ncok", g, unf).flatten(2)))
        elif a.ndim == 2:  # Linear on (n, in): rank-one per class
            jacs.append(LayerJacobian(dense=g) if name == "bias" else LayerJacobian(g=g, a=a))
        else:  # Linear applied to (n, ..., in): sum over the extra positions
            g = g.flatten(2, -2)  # (n, C, T, out)
            if name == "bias":
                jacs.append(LayerJacobian(dense=g.sum(2)))
            else:
                jacs.append(
                    LayerJacobian(dense=torch.einsum("ncto,nti->ncoi", g, a.flatten(1, -2)).flatten(2))
                )
    return f.detach(), jacs


def _func_jacobians(
    model: nn.Module, params: Sequence[Tensor], x: Tensor
) -> tuple[Tensor, list[LayerJacobian]]:
    """Per-example Jacobians via ``torch.func.vmap(jacrev(...))`` (any differentiable model)."""
    names = {id(p): k for k, p in model.named_parameters()}
    if any(id(p) not in names for p in params):
        raise ValueError("every Laplace parameter must be a parameter of the model")
    keys = [names[id(p)] for p in params]
    fixed = {k: v.detach() for k, v in model.named_parameters() if k not in keys}
    fixed.update(dict(model.named_buffers()))

    def single(theta: dict[str, Tensor], xi: Tensor) -> tuple[Tensor, Tensor]:
        out = torch.func.functional_call(model, {**fixed, **theta}, (xi.unsqueeze(0),)).squeeze(0)
        return out, out

    theta = {k: p.detach() for k, p in zip(keys, params)}
    jac, f = torch.func.vmap(torch.func.jacrev(single, has_aux=True), in_dims=(None, 0))(theta, x)
    C = f.shape[-1]
    return f, [LayerJacobian(dense=jac[k].reshape(-1, C, theta[k].numel())) for k in keys]


def logit_jacobians(
    model: nn.Module, params: Sequence[Tensor], x: Tensor
) -> tuple[Tensor, list[LayerJacobian]]:
    """Logits ``(n, [tokens,] C)`` and per-parameter Jacobians of the logit rows
    (:func:`logit_rows`, ``(n·tokens, C, ·)``) of ``model`` at ``x`` (closed form for
    Linear/Conv2d, ``torch.func`` otherwise)."""
    if all(o is not None for o in _owners(model, params)):
        return _layer_jacobians(model, params, x)
    return _func_jacobians(model, params, x)


# --------------------------------------------------------------------------------------------
# Posterior structures: rotate once, covariance for any prior precision
# --------------------------------------------------------------------------------------------
def _as_prior(delta: float | Tensor, n_blocks: int, dtype: torch.dtype) -> Tensor:
    d = torch.as_tensor(delta, dtype=dtype).reshape(-1)
    if len(d) not in (1, n_blocks):
        raise ValueError(
            f"prior precision must be a scalar or one value per parameter tensor ({n_blocks}), "
            f"got {len(d)} values"
        )
    if (d <= 0).any():
        raise ValueError(f"prior precision must be positive, got {d.tolist()}")
    return d.expand(n_blocks)


#: Elements of the pair-product buffer in :func:`weighted_grams` (2**22 float32 = 16 MiB).
PAIR_BUFFER = 2**22


def weighted_grams(A: Tensor, W: Tensor) -> Tensor:
    """``A diag(w_g) Aᵀ`` for every row ``w_g`` of ``W``: A ``(n, C, p)``, W ``(G, p)`` ->
    ``(G, n, C, C)``.

    For ``G ≥ 3`` ``A`` is read once for the whole grid: the upper-triangle entries are one matrix
    product of the pair products ``A_c ∘ A_d`` (``c ≤ d``) with ``Wᵀ``, computed in pieces of at
    most :data:`PAIR_BUFFER` elements (inputs × pairs × columns); about 3x faster than one batched
    matrix product per grid point at 14 points.  For ``G ≤ 2`` forming the pairs costs more than
    it saves, so it is one batched matrix product ``(A ∘ w_g) Aᵀ`` per grid point.
    """
    if len(W) < 3:
        return torch.stack([(A * w) @ A.transpose(1, 2) for w in W])
    n, C, p = A.shape
    iu, ju = torch.triu_indices(C, C, device=A.device)
    n_pairs = len(iu)
    cols = max(1, min(p, PAIR_BUFFER // n_pairs))
    rows = max(1, PAIR_BUFFER // (n_pairs * cols))
    upper = A.new_zeros(n, n_pairs, len(W))
    for r in range(0, n, rows):
        for c in range(0, p, cols):
            Ar = A[r : r + rows, :, c : c + cols]
            upper[r : r + rows] += (Ar[:, iu] * Ar[:, ju]) @ W[:, c : c + cols].T
    upper = upper.permute(2, 0, 1)
    out = A.new_zeros(len(W), n, C, C)
    out[:, :, iu, ju] = upper
    out[:, :, ju, iu] = upper
    return out


def _jacobian_float64(jac: LayerJacobian) -> LayerJacobian:
    if jac.dense is not None:
        return LayerJacobian(dense=jac.dense.double())
    return LayerJacobian(g=jac.g.double(), a=jac.a.double())


class KronStructure:
    """Posterior ``s·H + δ`` for a ``KronDecomposed`` ``H`` (one block per parameter tensor).

    ``eigenvectors[k]`` is ``[Q_G, Q_A]`` (output-side factor first, as laplace-torch orders
    ``weight.flatten()``) or ``[Q]`` for a one-factor block (biases).  With ``damping=True`` the
    block eigenvalues are ``(√s λ_G + √δ) ⊗ (√s λ_A + √δ)`` (laplace-torch's documented damping;
    note laplace-torch 0.3 itself drops the flag when it scales ``H``).  Everything is held and
    computed in float64 (round-off negative factor eigenvalues clamped to 0); rotated Jacobians, covariances and variances are float64.
    """

    def __init__(self, H, h_factor: float | Tensor, numels: Sequence[int]) -> None:
        self.Qs = [[q.double() for q in qs] for qs in H.eigenvectors]
        self.ls = [[l.double().clamp_min(0.0) for l in ls] for ls in H.eigenvalues]
        self.damping = bool(getattr(H, "damping", False))
        self.s = float(h_factor)
        sizes = [math.prod(len(l) for l in ls) for ls in self.ls]
        if list(sizes) != list(numels):
            raise ValueError(
                f"K-FAC blocks have sizes {sizes} but the Laplace parameters have {list(numels)}; "
                "the posterior and the model do not match"
            )

    def rotate(self, jacs: Sequence[LayerJacobian]) -> list[tuple[str, Tensor, Tensor | None]]:
        """Prior-independent work: Jacobians (float64) in the eigenbasis of each block."""
        out = []
        for jac, Qs in zip(map(_jacobian_float64, jacs), self.Qs):
            if len(Qs) == 2 and jac.dense is None:
                out.append(("factored", jac.g @ Qs[0], (jac.a @ Qs[1]).square()))
            elif len(Qs) == 2:
                n, C, _ = jac.dense.shape
                J = jac.dense.reshape(n, C, len(Qs[0]), len(Qs[1]))
                out.append(("dense", (Qs[0].T @ J @ Qs[1]).flatten(2), None))
            else:
                out.append(("dense", jac.full() @ Qs[0], None))
        return out

    def _inverse_eigenvalues(self, k: int, delta: Tensor) -> Tensor:
        ls = self.ls[k]
        if len(ls) == 1:
            return 1.0 / (self.s * ls[0] + delta)
        if self.damping:
            r, sd = math.sqrt(self.s), delta.sqrt()
            return 1.0 / torch.outer(r * ls[0] + sd, r * ls[1] + sd)
        return 1.0 / (self.s * torch.outer(ls[0], ls[1]) + delta)

    def _weights(self, k: int, deltas: Tensor) -> Tensor:
        """``(G, numel_k)`` inverse posterior eigenvalues of block ``k`` for every grid point."""
        return torch.stack([self._inverse_eigenvalues(k, d).reshape(-1) for d in deltas[:, k]])

    def _deltas(self, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        return torch.stack([_as_prior(d, len(self.ls), torch.float64) for d in prior_precisions])

    def covariances(self, rotated, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        """``Σ(δ_g) = Σ_k J̃_k diag(1/(s λ_k + δ_gk)) J̃_kᵀ`` for every prior precision of a grid,
        shape ``(G, n, C, C)``, float64; each rotated Jacobian is read once for the whole grid."""
        deltas = self._deltas(prior_precisions)  # (G, K)
        cov = rotated[0][1].new_zeros(len(deltas), *self._shape(rotated), rotated[0][1].shape[1])
        for k, (kind, A, B) in enumerate(rotated):
            W = self._weights(k, deltas)
            if kind == "factored":  # Σ_ab g̃_ca g̃_da ã_b² w_gab
                BW = B @ W.reshape(len(W), A.shape[-1], B.shape[-1]).transpose(1, 2)  # (G, n, a)
                cov += (A * BW.unsqueeze(2)) @ A.transpose(1, 2)
            else:
                cov += weighted_grams(A, W)
        return cov

    @staticmethod
    def _shape(rotated) -> tuple[int, int]:
        """``(n, C)`` of a chunk (a shared block has leading size 1; ``ã²`` never is)."""
        n = max(t.shape[0] for _, A, B in rotated for t in (A, B) if t is not None)
        return n, rotated[0][1].shape[1]

    def covariance(self, rotated, delta: float | Tensor) -> Tensor:
        """``Σ(δ)`` of shape ``(n, C, C)``: :meth:`covariances` at one prior precision."""
        return self.covariances(rotated, [delta])[0]

    def variances(self, rotated, prior_precisions: Sequence[float | Tensor], project: bool = False) -> Tensor:
        """``diag Σ(δ_g)`` (or ``diag ΠΣ(δ_g)Π`` with ``project=True``), shape ``(G, n, C)``,
        float64, without forming ``Σ``: ``Σ_k (ΠJ̃_k)² w_gk`` (squares of the projected rotated
        Jacobian, so no cancellation); memory ``O(n C p)`` instead of ``O(G n C²)``."""
        deltas = self._deltas(prior_precisions)
        var = rotated[0][1].new_zeros(len(deltas), *self._shape(rotated))
        for k, (kind, A, B) in enumerate(rotated):
            W = self._weights(k, deltas)
            A2 = (project_classes(A) if project else A).square()
            if kind == "factored":
                BW = B @ W.reshape(len(W), A.shape[-1], B.shape[-1]).transpose(1, 2)  # (G, n, a)
                var += (A2 @ BW.permute(1, 2, 0)).permute(2, 0, 1)
            else:
                var += (A2 @ W.T).permute(2, 0, 1)
        return var


class EigenStructure:
    """Posterior ``s·U diag(λ) Uᵀ + δ I`` with orthonormal ``U`` ``(P, k)``, scalar ``δ``.

    ``k = P`` is a full (dense) posterior; ``k < P`` a low-rank one whose complement of ``U`` has
    precision ``δ``: ``Σ(δ) = JU diag(1/(sλ+δ)) (JU)ᵀ + R Rᵀ/δ`` with the residual
    ``R = J - (JU)Uᵀ`` (a Gram of the residual, not the cancelling ``JJᵀ - JU(JU)ᵀ``).
    ``U`` and ``λ`` are re-orthonormalised and re-diagonalised in float64
    (:func:`orthonormal_eigenpairs`), round-off negative eigenvalues clamped to 0 (``H`` is PSD:
    a negative ``sλ + δ`` at small ``δ`` is what made float32 predictives non-finite);
    everything computed is float64.
    """

    def __init__(self, U: Tensor, eigenvalues: Tensor, h_factor: float | Tensor) -> None:
        if U.ndim != 2 or U.shape[1] != len(eigenvalues):
            raise ValueError(f"U must be (P, k) with k = len(eigenvalues); got {tuple(U.shape)}")
        self.U, self.lam = orthonormal_eigenpairs(U, eigenvalues)
        self.s = float(h_factor)
        self.low_rank = U.shape[1] < U.shape[0]

    @classmethod
    def from_dense(cls, H: Tensor, h_factor: float | Tensor) -> EigenStructure:
        """Eigendecompose a dense symmetric ``H`` (full Laplace) in float64."""
        lam, U = symmetric_eigh64(H)
        self = cls.__new__(cls)
        self.U, self.lam, self.s, self.low_rank = U, lam.clamp_min(0.0), float(h_factor), False
        return self

    def rotate(self, jacs: Sequence[LayerJacobian]) -> tuple[Tensor, Tensor | None]:
        """``(JU, R Rᵀ)`` (float64) with ``R = J - (JU)Uᵀ``; ``R Rᵀ`` is ``None`` for a full
        posterior.  ``R`` is formed in pieces of the parameters (:func:`_residual_gram`)."""
        jacs = [_jacobian_float64(j) for j in jacs]
        sizes = [j.dense.shape[-1] if j.dense is not None else j.g.shape[-1] * j.a.shape[-1] for j in jacs]
        if sum(sizes) != self.U.shape[0]:
            raise ValueError(f"U has {self.U.shape[0]} rows but the parameters have {sum(sizes)}")
        blocks = self.U.split(sizes)
        JU = sum(jac.matmul(U_b) for jac, U_b in zip(jacs, blocks))
        if not self.low_rank:
            return JU, None
        return JU, sum(_residual_gram(jac, JU, U_b) for jac, U_b in zip(jacs, blocks))

    def covariances(self, rotated, prior_precisions: Sequence[float | Tensor]) -> Tensor:
        """``Σ(δ_g)`` for every prior precision of a grid, shape ``(G, n, C, C)``, float64."""
        JU, rest = rotated
        d = self._deltas(prior_precisions)
        cov = weighted_grams(JU, 1.0 / (self.s * self.lam + d[:, None]))
        return cov if rest is None else cov + rest / d[:, None, None, None]

    def covariance(self, rotated, delta: float | Tensor) -> Tensor:
        """``Σ(δ)`` of shape ``(n, C, C)``: :meth:`covariances` at one prior precision."""
        return self.covariances(rotated, [delta])[0]

    def variances(self, rotated, prior_precisions: Sequence[float | Tensor], project: bool = False) -> Tensor:
        """``diag Σ(δ_g)`` (or ``diag ΠΣ(δ_g)Π``), shape ``(G, n, C)``, float64: squares of the
        (projected) ``JU`` weighted by ``1/(sλ+δ)``, plus the residual Gram's (projected) diagonal
        over ``δ``."""
        JU, rest = rotated
        d = self._deltas(prior_precisions)
        A2 = (project_classes(JU) if project else JU).square()
        var = (A2 @ (1.0 / (self.s * self.lam + d[:, None])).T).permute(2, 0, 1)
        if rest is not None:
            r = project_logits(rest.new_zeros(rest.shape[:2]), rest)[1] if project else rest
            var = var + r.diagonal(dim1=-2, dim2=-1) / d[:, None, None]
        return var

    @staticmethod
    def _deltas(prior_precisions: Sequence[float | Tensor]) -> Tensor:
        return torch.stack([_as_prior(delta, 1, torch.float64)[0] for delta in prior_precisions])


def _residual_gram(jac: LayerJacobian, JU: Tensor, U_b: Tensor) -> Tensor:
    """``R Rᵀ`` ``(n, C, C)`` of the residual ``R = J - (JU) U_bᵀ`` of one parameter tensor,
    formed in column pieces of at most :data:`PAIR_BUFFER` elements (a factored ``Linear``
    Jacobian a few weight rows at a time), never the whole ``(n, C, numel)`` Jacobian."""
    n, C = JU.shape[:2]
    if jac.dense is not None:
        step = max(1, PAIR_BUFFER // (n * C))
        pieces = ((jac.dense[..., c : c + step], slice(c, c + step)) for c in range(0, jac.dense.shape[-1], step))
    else:
        width = jac.a.shape[-1]
        rows = max(1, PAIR_BUFFER // (n * C * width))
        pieces = (
            ((jac.g[..., o : o + rows, None] * jac.a[:, None, None, :]).flatten(2), slice(o * width, (o + rows) * width))
            for o in range(0, jac.g.shape[-1], rows)
        )
    gram = JU.new_zeros(n, C, C)
    for J_piece, cols in pieces:
        R = J_piece - JU @ U_b[cols].T
        gram += R @ R.transpose(1, 2)
    return gram


def orthonormal_eigenpairs(U: Tensor, eigenvalues: Tensor) -> tuple[Tensor, Tensor]:
    """``(Q, μ)`` in float64 with ``QᵀQ = I`` to float64 round-off and ``Q diag(μ) Qᵀ =
    U diag(λ) Uᵀ`` (``U`` ``(P, k)`` orthonormal only to its own dtype's round-off).

    ``U = Q₀R`` (QR), ``R diag(λ) Rᵀ = V diag(μ) Vᵀ`` (eigh), ``Q = Q₀V``; negative ``μ``
    clamped to 0 (a float32 ``U`` makes complement formulas
    like ``I - UUᵀ`` wrong by ``1e-7``, which ``1/δ`` amplifies)."""
    Q0, R = torch.linalg.qr(U.double())
    mu, V = symmetric_eigh64((R * eigenvalues.double()) @ R.T)
    return Q0 @ V, mu.clamp_min(0.0)


# --------------------------------------------------------------------------------------------
# Functional (co)variances for laplace-torch's own predictive paths, float64, cancellation-free
# --------------------------------------------------------------------------------------------
def lowrank_functional_covariance(J: Tensor, U: Tensor, lam: Tensor, prior: Tensor) -> Tensor:
    """``J (U diag(λ) Uᵀ + diag(p))⁻¹ Jᵀ``: J ``(n, C, P)``, U ``(P, k)``, λ ``(k,)`` ``≥ 0`` (the
    scaled curvature, e.g. laplace-torch's ``posterior_precision[0]``), p ``(P,)`` ``> 0`` ->
    ``(n, C, C)`` in ``J.dtype``, computed in float64.

    With ``D = diag(p)`` and the thin SVD ``D^{-1/2} U diag(√λ) = Q diag(σ) Vᵀ`` the precision is
    ``D^{1/2} (I + Q diag(σ²) Qᵀ) D^{1/2}``, so with ``J̃ = J D^{-1/2}``, ``R = J̃ - (J̃Q)Qᵀ``:

        Σ = (J̃Q) diag(1/(1+σ²)) (J̃Q)ᵀ + R Rᵀ,

    two Gram matrices with positive weights: no "prior term minus a correction" cancellation
    (for scalar ``p = δ``: ``1/(1+σ²)/δ = 1/(λ+δ)`` along ``U``, ``1/δ`` on its complement).
    ``U`` need only be orthonormal to its dtype's round-off; negative ``λ`` are clamped to 0."""
    Jt = J.double() / prior.double().sqrt()
    W = U.double() / prior.double().sqrt()[:, None] * lam.double().clamp_min(0.0).sqrt()
    Q, sigma, _ = torch.linalg.svd(W, full_matrices=False)
    JQ = Jt @ Q
    R = Jt - JQ @ Q.T
    cov = (JQ / (1.0 + sigma.square())) @ JQ.transpose(-1, -2) + R @ R.transpose(-1, -2)
    return cov.to(J.dtype)


def dense_posterior_scale(H: Tensor, h_factor: float | Tensor, prior: Tensor) -> Tensor:
    """Float64 ``S`` ``(P, P)`` with ``S Sᵀ = (s·H + diag(p))⁻¹`` for a dense PSD ``H`` stored in
    any dtype, ``p`` ``(P,)`` ``> 0``.

    ``D^{-1/2} s H D^{-1/2} = V diag(μ) Vᵀ`` (float64 eigh, round-off negative ``μ`` clamped
    to 0) gives ``S = D^{-1/2} V diag((1+μ)^{-1/2})``; the
    functional variance ``(JS)(JS)ᵀ`` is then a Gram, finite and PSD for every ``p > 0``."""
    d = prior.double().rsqrt()
    mu, V = symmetric_eigh64(float(h_factor) * H.double() * d[:, None] * d[None, :])
    mu = mu.clamp_min(0.0)
    return d[:, None] * V * (1.0 + mu).rsqrt()


def laplace_params(la) -> list[Tensor]:
    """The parameters a laplace-torch object's posterior is over (last layer for LL variants)."""
    last = getattr(getattr(la, "model", None), "last_layer", None)
    if last is not None and la.n_params == sum(p.numel() for p in last.parameters()):
        return list(last.parameters())
    return list(la.params)


def _curvature_kind(la) -> str | None:
    """``"own"`` (a curvature with a ``grid_structure`` method), ``"kron"``, ``"dense"``,
    ``"low_rank"`` for the curvatures :func:`posterior_structure` reads, else ``None`` (cheap:
    no decomposition)."""
    from laplace.utils.matrix import KronDecomposed

    H = getattr(la, "H", None)
    if callable(getattr(H, "grid_structure", None)):
        return "own"
    if isinstance(H, KronDecomposed):
        return "kron"
    if isinstance(H, Tensor) and H.ndim == 2 and H.shape[0] == H.shape[1] == la.n_params:
        return "dense"
    if isinstance(H, (tuple, list)) and len(H) == 2 and isinstance(H[0], Tensor) and H[0].ndim == 2:
        return "low_rank"
    return None


def posterior_structure(la) -> KronStructure | EigenStructure:
    """Read the curvature ``la.H`` of a fitted laplace-torch ``ParametricLaplace``.

    ``KronDecomposed`` -> :class:`KronStructure`; a dense ``(P, P)`` tensor ->
    :class:`EigenStructure` (full); a pair ``(U, λ)`` -> :class:`EigenStructure` (low rank).
    """
    kind, H, s = _curvature_kind(la), getattr(la, "H", None), la._H_factor
    if kind == "own":  # a curvature that knows its basis (debiased EKFAC)
        return H.grid_structure(s, [p.numel() for p in laplace_params(la)])
    if kind == "kron":
        return KronStructure(H, s, [p.numel() for p in laplace_params(la)])
    if kind == "dense":
        return EigenStructure.from_dense(H, s)
    if kind == "low_rank":
        return EigenStructure(H[0], H[1], s)
    raise TypeError(
        f"no eigenbasis for curvature of type {type(H).__name__} (fit the Laplace object first; "
        "for other structures use sampled_linearized_predictive)"
    )


# --------------------------------------------------------------------------------------------
# The grid predictive
# --------------------------------------------------------------------------------------------
def _batches(data, chunk_size: int) -> Iterable[Tensor]:
    """Inputs from a tensor (split into chunks) or an iterable of ``x`` / ``(x, y, ...)``."""
    if isinstance(data, Tensor):
        yield from data.split(chunk_size)
        return
    for batch in data:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        yield from x.split(chunk_size)


class GridPredictive:
    """Linearized predictive of a fitted laplace-torch Laplace object for many prior precisions.

    >>> pred = GridPredictive(la)
    >>> out = pred.grid(x_test, [1e-4, 1e-2, 1.0], links=("probit_projected", "mc"))
    >>> out["mc"].shape        # (grid points, N, C); out["map"] is softmax of the MAP logits
    """

    def __init__(self, la, chunk_size: int = 64, structure=None) -> None:
        if getattr(la, "likelihood", "classification") != "classification":
            raise ValueError("GridPredictive is for classification Laplace objects")
        self.la = la
        self.model = la.model
        self.params = laplace_params(la)
        self.structure = structure if structure is not None else posterior_structure(la)
        self.chunk_size = int(chunk_size)
        if self.chunk_size < 1:
            raise ValueError("chunk_size must be a positive integer")

    @torch.no_grad()
    def grid(
        self,
        data,
        prior_precisions: Sequence[float | Tensor],
        links: Sequence[str] = ("probit_projected",),
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        progress: bool = False,
        cell_generators: Mapping[tuple[float, str], torch.Generator] | None = None,
    ) -> dict[str, Tensor]:
        """Predictive probabilities for each prior precision and link.

        ``data``: a tensor of inputs ``(N, ...)`` or an iterable of batches.  Returns a dict
        ``link -> (G, N, C)`` for ``G = len(prior_precisions)``, plus ``"map"`` ``(N, C)``.
        Outputs ``(N, tokens, C)``: every token's predictive is the predictive of its own row
        (:func:`logit_rows`), returned as ``(G, N, tokens, C)`` and ``"map"`` ``(N, tokens, C)``.
        MC draws come from ``generator``, or, with ``cell_generators``, from the generator of
        each cell ``(prior precision, link)`` (carried across chunks; resumable sweeps use it).
        """
        for link in links:
            if link not in ALL_LINKS:
                raise ValueError(f"unknown link approximation {link!r}; choose from {ALL_LINKS}")
        if len(set(links)) != len(links):
            raise ValueError(f"repeated link approximation in {list(links)}; give each once")
        if len(prior_precisions) == 0:
            raise ValueError("give at least one prior precision")
        from tqdm.auto import tqdm

        out: dict[str, list[Tensor]] = {link: [] for link in (*links, "map")}
        was_training = self.model.training
        self.model.eval()
        try:
            for x in tqdm(_batches(data, self.chunk_size), disable=not progress, desc="predictive", leave=False):
                f, jacs = logit_jacobians(self.model, self.params, x)
                probs = self._chunk(logit_rows(f), jacs, prior_precisions, links, n_samples, generator, cell_generators)
                for link in links:  # rows back in the token shape
                    out[link].append(probs[link].to(f.dtype).reshape(-1, *f.shape))
                out["map"].append(torch.softmax(f, -1))
        finally:
            self.model.train(was_training)
        return {k: torch.cat(v, dim=0 if k == "map" else 1) for k, v in out.items()}

    def _chunk(self, f: Tensor, jacs, prior_precisions, links, n_samples, generator, cell_generators=None) -> dict[str, Tensor]:
        """``link -> (G, n, C)`` probabilities for one chunk of logit rows ``f`` ``(n, C)``
        (tokens as rows) and their Jacobians.  The probits use the
        structure's variances (never the ``(n, C, C)`` covariance); mc and the bridge need ``Σ``."""
        rotated = self.structure.rotate(jacs)
        f64 = f.double()
        probs: dict[str, Tensor] = {}
        if "probit" in links:
            var = self.structure.variances(rotated, prior_precisions)
            probs["probit"] = probit_from_variances(f64, var)
        if "probit_projected" in links:
            var = self.structure.variances(rotated, prior_precisions, project=True)
            probs["probit_projected"] = probit_from_variances(f64 - f64.mean(-1, keepdim=True), var)
        full = [link for link in links if link in ("mc", "bridge", "bridge_norm")]
        if full:
            covs = self.structure.covariances(rotated, prior_precisions)
            for link in full:  # mc: ε drawn in f.dtype
                gens = [generator if cell_generators is None else cell_generators[(d, link)] for d in prior_precisions]
                probs[link] = torch.stack([
                    apply_link(link, f64 if link != "mc" else f, cov, n_samples, gen) for cov, gen in zip(covs, gens)
                ])
        return probs

    def __call__(self, x: Tensor, link: str = "probit_projected", prior_precision=None, **kw) -> Tensor:
        """Probabilities ``(N, [tokens,] C)`` at ``prior_precision`` (default:
        ``la.prior_precision``)."""
        delta = self.la.prior_precision if prior_precision is None else prior_precision
        return self.grid(x, [delta], links=(link,), **kw)[link][0]


@torch.no_grad()
def linearized_logit_samples(
    la,
    x: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> Tensor:
    """Samples ``f(x) + J(x)(θ_s - θ*)`` of the linearized network, ``θ_s = la.sample(S)``.

    ``J(x)(θ_s - θ*)`` is one forward-mode JVP per sample (``torch.func.jvp``), so no Jacobian is
    formed; works for any laplace-torch posterior with a ``sample`` method.  Returns ``(S, N, C)``.
    """
    model, params = la.model, laplace_params(la)
    names = {id(p): k for k, p in model.named_parameters()}
    keys = [names[id(p)] for p in params]
    fixed = {k: v.detach() for k, v in model.named_parameters() if k not in keys}
    fixed.update(dict(model.named_buffers()))
    theta = {k: p.detach() for k, p in zip(keys, params)}
    steps = la.sample(n_samples, generator=generator) - la.mean
    tangents = [
        {k: t.view_as(p).to(p.dtype) for k, t, p in zip(keys, s.split([p.numel() for p in params]), params)}
        for s in steps
    ]
    chunks = []
    for xc in x.split(chunk_size):
        def fn(th: dict[str, Tensor]) -> Tensor:
            return torch.func.functional_call(model, {**fixed, **th}, (xc,))

        chunks.append(torch.stack([sum(torch.func.jvp(fn, (theta,), (t,))) for t in tangents]))
    return torch.cat(chunks, dim=1)


def sampled_linearized_predictive(
    la,
    x: Tensor,
    n_samples: int = 100,
    generator: torch.Generator | None = None,
    chunk_size: int = 256,
) -> Tensor:
    """Eq. 18 of Tatzel et al.: ``1/S Σ_s softmax(f(x) + J(x)(θ_s - θ*))``, shape ``(N, C)``
    (see :func:`linearized_logit_samples`)."""
    return torch.softmax(linearized_logit_samples(la, x, n_samples, generator, chunk_size), -1).mean(0)


# --------------------------------------------------------------------------------------------
# Prior-precision grid search from one predictive pass
# --------------------------------------------------------------------------------------------
#: laplace-torch ``link_approx`` values the grid search can evaluate through GridPredictive.
GRIDSEARCH_LINKS = ("probit", "mc", "bridge", "bridge_norm")


def gridsearch_supported(la, pred_type: str, link_approx: str) -> bool:
    """Whether :func:`grid_validation_scores` can replace laplace-torch's per-point loop:
    a fitted classification posterior with an eigenbasis, the GLM predictive, and a link of
    :data:`GRIDSEARCH_LINKS`."""
    if getattr(la, "likelihood", None) != "classification" or pred_type != "glm":
        return False
    return link_approx in GRIDSEARCH_LINKS and _curvature_kind(la) is not None


class UnsupportedBatches(TypeError):
    """Validation batches that :func:`grid_validation_scores` cannot read (not ``(X, y)``
    tensors, e.g. dict batches): use laplace-torch's per-point ``validate`` instead."""


def grid_validation_scores(
    la, loss, prior_precisions: Tensor, val_loader, link_approx: str, n_samples: int = 100,
    chunk_size: int = 64,
) -> list[float]:
    """``laplace.utils.validate(la, val_loader, loss, "glm", link_approx)`` at every prior
    precision of the grid, from one :class:`GridPredictive` pass over ``val_loader``.

    ``loss`` is a torchmetrics ``Metric`` (one reset copy per grid point, updated batch by batch
    and ``compute().sum()``, as ``validate`` does) or a callable ``loss(probs, targets)`` on the
    concatenated predictions.  Batches are ``(X, y)`` tensors (else :class:`UnsupportedBatches`).
    Outputs ``(n, tokens, C)`` are scored with every token as one row (``y`` ``(n, tokens)``;
    other target shapes raise a ``ValueError``), so a mean metric such as laplace-torch's
    ``RunningNLLMetric`` is averaged over all tokens, as laplace-torch's LLM examples do.
    ``"mc"`` draws its own samples, so its scores are a different Monte-Carlo estimate of the
    same predictive than laplace-torch's.
    """
    from torchmetrics import Metric

    link = getattr(link_approx, "value", link_approx)  # LinkApprox enum or str
    pred = GridPredictive(la, chunk_size=chunk_size)
    grid = [d for d in prior_precisions]
    online = isinstance(loss, Metric)
    if online:
        metrics = []
        for _ in grid:
            m = copy.deepcopy(loss)
            m.reset()
            metrics.append(m)
    else:
        outputs: list[list[Tensor]] = [[] for _ in grid]
        targets: list[Tensor] = []
    for batch in val_loader:
        if not (isinstance(batch, (tuple, list)) and all(isinstance(t, Tensor) for t in batch[:2])):
            raise UnsupportedBatches("grid_validation_scores needs (X, y) tensor batches")
        X, y = batch[0].to(la._device), batch[1].to(la._device)
        probs = pred.grid(X, grid, links=(link,), n_samples=n_samples)[link]
        rows = [output_rows(p, y) for p in probs]  # tokens as rows; checks the targets' shape
        for g, (p, y_rows) in enumerate(rows):
            if online:
                metrics[g].update(p, y_rows)
            else:
                outputs[g].append(p)
        if not online:
            targets.append(rows[0][1])
    if online:
        return [m.compute().sum().item() for m in metrics]
    y_all = torch.cat(targets)
    return [loss(torch.cat(o), y_all).item() for o in outputs]
