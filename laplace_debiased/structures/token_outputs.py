"""laplace-torch's GLM predictive for token outputs ``(n, tokens, C)`` (:class:`TokenOutputsMixin`,
a base of :class:`~laplace_debiased.structures.two_batch.TwoBatchLaplaceMixin`).

Token outputs ``(n, tokens, C)`` (``self.fit_output_shape`` has more than one entry), every
token an output: laplace-torch's GLM predictive takes ``(n, C)`` outputs, so the mixin hands
it the token rows ``(n·tokens, C)`` with their Jacobians (:meth:`_token_jacobians`) and gives
the results the token shape back: ``la(x)`` ``(n, tokens, C)`` (regression: mean and
covariance ``(n, tokens, C, C)``; ``joint=True`` stays flat over the rows), GLM samples
``(S, n, tokens, C)``. Tokens of one input are independent under this predictive only in the
sense laplace-torch's LLM examples use: each token's marginal ``N(f_t, J_t P⁻¹ J_tᵀ)``.
The GLM functional samples come from a float64 square root (laplace-torch's float32 Cholesky
fails at small prior precision).

Outputs ``(n, C)`` of a tensor input, all weights, without ``enable_backprop``: the Jacobians are
per-example (:func:`laplace_debiased.posterior.jacobians.logit_jacobians`), so the memory of the
GLM predictive grows linearly with ``n``; laplace-torch's ``torch.func.jacrev`` over the batch
pushes all ``n·C`` cotangents through all ``n`` inputs, quadratic in ``n``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from laplace.curvature import CurvatureInterface
from laplace.lllaplace import LLLaplace
from laplace.utils.enums import LinkApprox

from laplace_debiased.curvature.inputs import backward_hooks_detached
from laplace_debiased.posterior.jacobians import logit_jacobians
from laplace_debiased.posterior.links import normal_samples


class TokenOutputsMixin:
    """GLM predictive overrides: token rows in, token shape out; float64 functional samples."""

    def _glm_functional_samples(
        self,
        f_mu: torch.Tensor,
        f_var: torch.Tensor,
        n_samples: int,
        diagonal_output: bool = False,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """laplace-torch's GLM functional samples (``link_approx="mc"``) from a float64 square
        root of ``f_var`` (:func:`laplace_debiased.posterior.links.normal_samples`);
        laplace-torch's float32 Cholesky fails at small prior precision. Token outputs:
        ``(S, n, tokens, C)``."""
        if diagonal_output:
            f_var = torch.diagonal(f_var, dim1=1, dim2=2)
        samples = normal_samples(f_mu, f_var, n_samples, generator)
        return self._token_shaped(samples, leading=1)

    def _has_token_outputs(self) -> bool:
        return len(getattr(self, "fit_output_shape", ())) > 1

    @property
    def log_likelihood(self) -> torch.Tensor:
        """laplace-torch's log likelihood; for token outputs in regression its Gaussian
        normaliser counts all ``n_data · tokens · C`` outputs (laplace-torch's counts
        ``n_data · C``): ``- (tokens - 1) · n_data · C · log(σ √(2π))`` more."""
        ll = super().log_likelihood
        if self.likelihood == "regression" and self._has_token_outputs():
            tokens = math.prod(self.fit_output_shape[:-1])
            sigma = torch.as_tensor(self.sigma_noise, device=self._device, dtype=self._dtype)
            ll = ll - (tokens - 1) * self.n_data * self.n_outputs * torch.log(sigma * math.sqrt(2 * math.pi))
        return ll

    @torch.enable_grad()
    def _glm_predictive_distribution(
        self, X: Any, joint: bool = False, diagonal_output: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """laplace-torch's GLM predictive ``(f, J P⁻¹ Jᵀ)``, from per-example Jacobians where
        :meth:`_per_example_jacobians_apply`; for token outputs over the token rows: ``f``
        ``(n·tokens, C)``, covariance ``(n·tokens, C, C)`` (``joint``: flat mean and
        ``(n·tokens·C)²`` covariance; ``diagonal_output``: ``(n·tokens, C)``)."""
        self._glm_token_shape = None
        if self._has_token_outputs():
            Js, f_mu = self._token_jacobians(X)
        elif self._per_example_jacobians_apply(X):
            Js, f_mu = self._per_example_jacobians(X)
        else:
            return super()._glm_predictive_distribution(X, joint, diagonal_output)
        if joint:
            f_mu, f_var = f_mu.flatten(), self.functional_covariance(Js)
        else:
            f_var = self.functional_variance(Js)
            if diagonal_output:
                f_var = torch.diagonal(f_var, dim1=-2, dim2=-1)
        if not self.enable_backprop:
            f_mu, f_var = f_mu.detach(), f_var.detach()
        return f_mu, f_var

    def _per_example_jacobians_apply(self, X: Any) -> bool:
        """Whether :meth:`_per_example_jacobians` replaces laplace-torch's Jacobians: a tensor
        input, all weights (not last-layer), no backpropagation through the predictive."""
        return isinstance(X, torch.Tensor) and not isinstance(self, LLLaplace) and not self.enable_backprop

    def _per_example_jacobians(self, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians ``(n, C, P)`` (in the order of ``self.params``) and outputs ``(n, C)`` from
        per-example Jacobians (:func:`laplace_debiased.posterior.jacobians.logit_jacobians`):
        memory linear in ``n``, where laplace-torch's ``torch.func.jacrev`` over the batch pushes
        all ``n·C`` cotangents through all ``n`` inputs (memory quadratic in ``n``)."""
        f, layers = logit_jacobians(self.model, self.params, X)
        Js = torch.cat([layer.full().expand(len(f), -1, -1) for layer in layers], dim=-1)
        return Js, f

    def _token_jacobians(self, X: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Jacobians ``(n·tokens, C, P)`` and outputs ``(n·tokens, C)`` of the token rows, with
        ``(n, tokens)`` kept for :meth:`_token_shaped`. Last layer: ``J = I_C ⊗ φᵀ`` (and
        ``I_C`` for a bias) per token feature ``φ``, laplace-torch's ``last_layer_jacobians``
        per row; all weights: laplace-torch's ``torch.func`` Jacobians
        (``CurvatureInterface.jacobians``, over every output entry) reshaped, whatever the
        backend: ASDL's and BackPack's ``jacobians`` differentiate ``f[:, i]`` for
        ``i < output_size``, which for outputs ``(n, tokens, C)`` is token ``i``, not class ``i``."""
        if isinstance(self, LLLaplace):
            f, phi = self.model.forward_with_features(X)
            phi = phi.reshape(-1, phi.shape[-1])
            eye = torch.eye(f.shape[-1], device=f.device, dtype=f.dtype)
            Js = torch.einsum("kp,ij->kijp", phi, eye).flatten(2)
            if self.model.last_layer.bias is not None:
                Js = torch.cat([Js, eye.expand(len(phi), -1, -1)], dim=2)
        else:
            with backward_hooks_detached(self.model):  # BackPACK's hooks defeat torch.func
                Js, f = CurvatureInterface.jacobians(self.backend, X, enable_backprop=self.enable_backprop)
        self._glm_token_shape = tuple(f.shape[:-1])
        C = f.shape[-1]
        return Js.reshape(-1, C, Js.shape[-1]), f.reshape(-1, C)

    def _token_shaped(self, t: torch.Tensor, leading: int = 0) -> torch.Tensor:
        """``t`` with its row dimension (after ``leading`` dimensions) back in the token shape
        ``(n, tokens)`` of the last GLM predictive; unchanged for ``(n, C)`` outputs and for
        ``t`` already in token shape (laplace-torch's mc link averages shaped samples)."""
        shape = getattr(self, "_glm_token_shape", None)
        if shape is None or t.shape[leading] != math.prod(shape):
            return t
        return t.reshape(*t.shape[:leading], *shape, *t.shape[leading + 1 :])

    def _glm_forward_call(
        self,
        x: Any,
        likelihood: str,
        joint: bool = False,
        link_approx: LinkApprox | str = LinkApprox.PROBIT,
        n_samples: int = 100,
        diagonal_output: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """laplace-torch's GLM ``la(x)``; token outputs come back as ``(n, tokens, C)``
        (regression: ``(n, tokens, C)`` and ``(n, tokens, C[, C])``; ``joint`` stays flat)."""
        out = super()._glm_forward_call(x, likelihood, joint, link_approx, n_samples, diagonal_output)
        if joint and likelihood == "regression":
            return out
        if isinstance(out, tuple):
            return tuple(self._token_shaped(t) for t in out)
        return self._token_shaped(out)
