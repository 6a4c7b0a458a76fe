"""Per-example Jacobians of the logits, one entry per parameter tensor.

Per-example Jacobians are closed-form for ``nn.Linear``/``nn.Conv2d`` parameters (captured input
activations and output gradients, one batched backward pass per class) and come from
``torch.func`` (``vmap`` over ``jacrev``) otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from laplace_debiased.curvature.inputs import functional_model
from laplace_debiased.curvature.kfac import output_rows


@dataclass
class LayerJacobian:
    """Jacobian of the ``C`` logits w.r.t. one parameter tensor for a chunk of ``n`` inputs.

    Either *factored*, ``J[n, c, :] = vec(g[n, c, :] ⊗ a[n, :])`` (a ``Linear`` weight with 2-D
    input; ``g`` ``(n, C, out)`` output gradients, ``a`` ``(n, in)`` inputs; row-major like
    ``weight.flatten()``), *dense*, ``J`` ``(n, C, numel)`` in ``param.flatten()`` order, or a
    *sum over positions* (a ``Conv2d`` weight, a ``Linear`` weight applied to every token),
    ``positions = (g (n, C, out, T), u (n, k, T))``
    with ``J[n, c] = vec(Σ_t g[n, c, :, t] u[n, :, t]ᵀ)`` (``u`` the unfolded input), formed
    densely only by [`full`][laplace_debiased.posterior.jacobians.LayerJacobian.full].
    A leading size 1 of ``g`` or ``dense`` means the same for every input (broadcast): the
    output layer's ``g`` is the identity, which is then never materialised per input.
    """

    g: Tensor | None = None
    a: Tensor | None = None
    dense: Tensor | None = None
    positions: tuple[Tensor, Tensor] | None = None

    def full(self) -> Tensor:
        """The dense ``(n, C, numel)`` Jacobian (leading size 1 if shared, see above)."""
        if self.dense is not None:
            return self.dense
        if self.positions is not None:
            g, u = self.positions
            return torch.einsum("ncot,nkt->ncok", g, u).flatten(2)
        return (self.g.unsqueeze(-1) * self.a[:, None, None, :]).flatten(2)

    def _parts(self) -> list[Tensor]:
        return [t for t in (self.g, self.a, self.dense, *(self.positions or ())) if t is not None]

    def rows(self, start: int, stop: int) -> LayerJacobian:
        """The Jacobian of the logit rows ``start:stop`` (a shared leading size 1 stays shared)."""
        def cut(t: Tensor | None) -> Tensor | None:
            return t if t is None or t.shape[0] == 1 else t[start:stop]

        positions = None if self.positions is None else (cut(self.positions[0]), cut(self.positions[1]))
        return LayerJacobian(g=cut(self.g), a=cut(self.a), dense=cut(self.dense), positions=positions)

    def row_bytes(self, n: int) -> int:
        """Bytes held per logit row of the ``n`` rows (the parts not shared by every row)."""
        return sum(t.nbytes for t in self._parts() if t.shape[0] == n) // n

    def gram(self) -> Tensor:
        """``J Jᵀ`` of shape ``(n, C, C)``."""
        if self.g is None:
            J = self.full()
            return J @ J.transpose(1, 2)
        return (self.g @ self.g.transpose(1, 2)) * self.a.square().sum(-1)[:, None, None]

    def matmul(self, V: Tensor) -> Tensor:
        """``J V`` for ``V`` of shape ``(numel, k)`` -> ``(n, C, k)``."""
        if self.g is None:
            return self.full() @ V
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


def closed_form(model: nn.Module, params: Sequence[Tensor]) -> bool:
    """Whether [`logit_jacobians`][laplace_debiased.posterior.jacobians.logit_jacobians] takes the closed form for ``params`` (every one a
    ``Linear``/``Conv2d`` parameter), not ``torch.func``'s dense Jacobians."""
    return all(o is not None for o in _owners(model, params))


def logit_rows(f: Tensor) -> Tensor:
    """Outputs ``(n, [tokens, ...,] C)`` as rows ``(n·tokens, C)``, one per token
    ([`laplace_debiased.curvature.kfac.output_rows`][laplace_debiased.curvature.kfac.output_rows], which also
    checks ``f.ndim ≥ 2``)."""
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
    f, inputs, out_grad, shared, tokens = _inputs_and_output_grads(model, modules, x)
    jacs = []
    for mod, name in owners:
        a, g = inputs[id(mod)], out_grad[id(mod)]
        if g is shared:  # the output Linear: each token's input is its row's input
            a = a.flatten(0, -2)
        elif tokens > 1:  # an inner module: every row of an example sees the example's input
            a = a.repeat_interleave(tokens, dim=0)
        jacs.append(_module_jacobian(mod, name, a, g))
    return f.detach(), jacs


def _inputs_and_output_grads(
    model: nn.Module, modules: Sequence[nn.Module], x: Tensor
) -> tuple[Tensor, dict[int, Tensor], dict[int, Tensor], Tensor, int]:
    """One forward pass with hooks on ``modules`` and one batched backward pass per output row
    and class: the outputs ``f``, each module's input and its output gradients ``(n·tokens, C,
    ...)`` by ``id``, the shared ``(1, C, C)`` identity that is the output gradient of an output
    ``Linear``, and the number of tokens per example."""
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
            f = model(x.detach().requires_grad_(True) if x.is_floating_point() else x)
            n, C = len(f), f.shape[-1]
            tokens = len(logit_rows(f)) // n
            shared = torch.eye(C, dtype=f.dtype, device=f.device)[None]
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
    return f, {k: a for k, (a, _) in captured.items()}, out_grad, shared, tokens


def _module_jacobian(mod: nn.Module, name: str, a: Tensor, g: Tensor) -> LayerJacobian:
    """Jacobian of the rows' logits w.r.t. ``mod.<name>`` from the module's input ``a`` (one per
    row) and output gradients ``g`` ``(rows, C, out, ...)``."""
    if isinstance(mod, nn.Conv2d):
        g = g.flatten(3)  # (n, C, out, T)
        if name == "bias":
            return LayerJacobian(dense=g.sum(-1))
        unf = F.unfold(a, mod.kernel_size, mod.dilation, mod.padding, mod.stride)
        return LayerJacobian(positions=(g, unf))
    if a.ndim == 2:  # Linear on (n, in): rank-one per class
        return LayerJacobian(dense=g) if name == "bias" else LayerJacobian(g=g, a=a)
    g = g.flatten(2, -2)  # Linear applied to (n, ..., in): sum over the extra positions; (n, C, T, out)
    if name == "bias":
        return LayerJacobian(dense=g.sum(2))
    return LayerJacobian(positions=(g.transpose(-1, -2), a.flatten(1, -2).transpose(1, 2)))


def _func_jacobians(
    model: nn.Module, params: Sequence[Tensor], x: Tensor
) -> tuple[Tensor, list[LayerJacobian]]:
    """Per-example Jacobians via ``torch.func.vmap(jacrev(...))`` (any differentiable model)."""
    fn, theta = functional_model(model, params)

    def single(th: dict[str, Tensor], xi: Tensor) -> tuple[Tensor, Tensor]:
        out = fn(th, xi.unsqueeze(0)).squeeze(0)
        return out, out

    jac, f = torch.func.vmap(torch.func.jacrev(single, has_aux=True), in_dims=(None, 0))(theta, x)
    C = f.shape[-1]
    return f, [LayerJacobian(dense=jac[k].reshape(-1, C, t.numel())) for k, t in theta.items()]


def logit_jacobians(
    model: nn.Module, params: Sequence[Tensor], x: Tensor
) -> tuple[Tensor, list[LayerJacobian]]:
    """Logits and per-parameter Jacobians of the logit rows of ``model`` at ``x`` (closed form for
    Linear/Conv2d, ``torch.func`` otherwise).

    Args:
        model: the network.
        params: the parameters to differentiate by, one Jacobian each.
        x: ``(n, ...)`` inputs.

    Returns:
        ``(f, jacs)``: the logits ``(n, [tokens,] C)`` and, per parameter, the Jacobian of the
        logit rows ([`logit_rows`][laplace_debiased.posterior.jacobians.logit_rows], ``(n·tokens, C, numel)``)
        as a [`LayerJacobian`][laplace_debiased.posterior.jacobians.LayerJacobian].
    """
    if closed_form(model, params):
        return _layer_jacobians(model, params, x)
    return _func_jacobians(model, params, x)
