"""Conjugate gradients on mini-batch quadratics, plain and debiased (paper Sec. 4.2.1, App. A.2).

Both solvers minimise a quadratic ``q(x) = ½ xᵀAx − bᵀx`` (equivalently solve ``Ax = b``)
with a matrix-free symmetric operator ``A`` (any callable ``[D] → [D]``, e.g. a
[`laplace_debiased.curvature.operators.CountingOperator`][laplace_debiased.curvature.operators.CountingOperator]).
For a Newton step on a [`MiniBatchQuadratic`][laplace_debiased.curvature.operators.MiniBatchQuadratic] ``m``
take ``A = m.curvature`` and ``b = −m.gradient``; the iterates ``x_p`` are then steps ``d`` from θ₀ and the
residual ``r_p = A x_p − b = ∇q(θ₀ + x_p; B)`` is the gradient of the quadratic model.

Step sizes ``τ_p`` refer to the **normalised** search directions ``d_p = p_p / ‖p_p‖``
(``x_{p+1} = x_p + τ_p d_p``), as in the paper's Fig. 4.

Non-positive curvature ``d_pᵀAd_p ≤ 0`` (possible for the Hessian, or for a singular GGN):
with ``on_nonpositive="stop"`` (default) the loop ends *before* that step and the current
iterate is returned with ``reason="nonpositive_curvature"`` (Nocedal & Wright Alg. 7.1; with
zero iterations done that is ``x0``); with ``"raise"`` a
[`NonPositiveCurvatureError`][laplace_debiased.optim.cg.NonPositiveCurvatureError] is raised. The products
spent on the rejected direction are counted by a
[`CountingOperator`][laplace_debiased.curvature.operators.CountingOperator] but belong to no completed
iteration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

Operator = Callable[[Tensor], Tensor]


class NonPositiveCurvatureError(RuntimeError):
    """A search direction has ``dᵀAd ≤ 0``: the quadratic is not strictly convex along it."""


@dataclass
class CGResult:
    """Output of [`cg`][laplace_debiased.optim.cg.cg] after ``K`` iterations (``D`` parameters).

    Attributes:
        x: final iterate ``x_K``, ``[D]``.
        directions: normalised search directions ``d_0..d_{K−1}``, ``[K, D]``.
        iterates: ``x_0..x_K``, ``[K+1, D]`` (``None`` if ``store_iterates=False``).
        step_sizes: ``τ_0..τ_{K−1}`` along the normalised directions, ``[K]``.
        curvatures: ``d_pᵀAd_p``, ``[K]``.
        residual_norms: ``‖r_0‖..‖r_K‖``, ``[K+1]``.
        reason: why it stopped: ``"max_iter"``, ``"tol"``, ``"nonpositive_curvature"``,
            ``"callback"``.
    """

    x: Tensor
    directions: Tensor
    iterates: Tensor | None
    step_sizes: Tensor
    curvatures: Tensor
    residual_norms: Tensor
    reason: str

    @property
    def n_iter(self) -> int:
        """Number ``K`` of completed iterations."""
        return self.step_sizes.shape[0]


@dataclass
class DebiasedCGResult:
    """Output of [`debiased_cg`][laplace_debiased.optim.cg.debiased_cg]: the CG run on ``B`` and the
    re-measured run on ``B̃``.

    Attributes:
        cg: the plain CG process on ``(A, b)`` (directions, its own iterates and step sizes).
        x: final debiased iterate ``x̃_K``, ``[D]``.
        iterates: ``x̃_0..x̃_K``, ``[K+1, D]`` (``None`` if ``store_iterates=False``).
        step_sizes: ``τ̃_0..τ̃_{K−1}`` along ``cg.directions``, ``[K]``.
        curvatures: ``d_pᵀÃd_p``, ``[K]``.
        slopes: ``d_pᵀ∇q̃(x̃_p) = d_pᵀr̃_p``, ``[K]``.
        residual_norms: ``‖r̃_0‖..‖r̃_K‖`` with ``r̃ = Ãx̃ − b̃``, ``[K+1]``.
    """

    cg: CGResult
    x: Tensor
    iterates: Tensor | None
    step_sizes: Tensor
    curvatures: Tensor
    slopes: Tensor
    residual_norms: Tensor

    @property
    def directions(self) -> Tensor:
        """The shared normalised directions ``[K, D]`` (from ``B``)."""
        return self.cg.directions

    @property
    def n_iter(self) -> int:
        """Number ``K`` of completed iterations."""
        return self.cg.n_iter

    @property
    def reason(self) -> str:
        """Why the joint loop stopped (see [`CGResult`][laplace_debiased.optim.cg.CGResult])."""
        return self.cg.reason


@dataclass
class CGState:
    """What a ``callback`` sees after iteration ``p`` (``p+1`` steps done); it returns ``True``
    to stop.

    Attributes:
        iteration: The iteration ``p``.
        x: The CG iterate on ``B``, shape ``(D,)``.
        r: The residual on ``B``, shape ``(D,)``.
        x_tilde: The debiased iterate on ``B̃`` (``None`` in plain [`cg`][laplace_debiased.optim.cg.cg]).
        r_tilde: The debiased residual on ``B̃`` (``None`` in plain [`cg`][laplace_debiased.optim.cg.cg]).
    """

    iteration: int
    x: Tensor
    r: Tensor
    x_tilde: Tensor | None = None
    r_tilde: Tensor | None = None


def _check(A_b: tuple[Operator, Tensor], x0: Tensor | None, max_iter: int) -> Tensor:
    _, b = A_b
    if b.ndim != 1:
        raise ValueError(f"b must be a flat vector [D], got shape {tuple(b.shape)}")
    if max_iter < 0:
        raise ValueError(f"max_iter must be >= 0, got {max_iter}")
    if x0 is not None and x0.shape != b.shape:
        raise ValueError(f"x0 has shape {tuple(x0.shape)}, b has {tuple(b.shape)}")
    return torch.zeros_like(b) if x0 is None else x0.clone()


def cg(
    A: Operator,
    b: Tensor,
    x0: Tensor | None = None,
    max_iter: int | None = None,
    rtol: float = 1e-10,
    atol: float = 0.0,
    on_nonpositive: str = "stop",
    store_iterates: bool = True,
    callback: Callable[[CGState], bool] | None = None,
) -> CGResult:
    """Conjugate gradients, Nocedal & Wright (2006) Algorithm 5.2, for ``Ax = b``.

    Stops after ``max_iter`` iterations (default ``D``), when ``‖r_p‖ ≤ max(rtol·‖r_0‖,
    atol)``, at non-positive curvature (see module docstring) or when ``callback`` returns
    ``True``. Costs one product with ``A`` per iteration (plus one for ``x0`` if given).

    Args:
        A: symmetric operator, ``[D] → [D]``.
        b: right-hand side ``[D]``.
        x0: start (default zeros).
        max_iter: iteration budget ``K``.
        rtol: relative residual tolerance (times ``‖r_0‖``).
        atol: absolute residual tolerance.
        on_nonpositive: ``"stop"`` or ``"raise"``.
        store_iterates: keep all ``x_p`` (``[K+1, D]`` memory).
        callback: called with a [`CGState`][laplace_debiased.optim.cg.CGState] after every iteration; ``True``
            stops.

    Returns:
        The iterates, directions, step sizes and residual norms
        ([`CGResult`][laplace_debiased.optim.cg.CGResult]).
    """
    return _joint_cg(A, b, None, None, x0, max_iter, rtol, atol, on_nonpositive,
                     store_iterates, callback)


def debiased_cg(
    A: Operator,
    b: Tensor,
    A_tilde: Operator,
    b_tilde: Tensor,
    x0: Tensor | None = None,
    max_iter: int | None = None,
    rtol: float = 1e-10,
    atol: float = 0.0,
    on_nonpositive: str = "stop",
    store_iterates: bool = True,
    callback: Callable[[CGState], bool] | None = None,
) -> DebiasedCGResult:
    """Debiased CG: directions from CG on ``(A, b)`` (batch B), step sizes from ``(Ã, b̃)`` (B̃).

    In one loop, CG on ``B`` produces ``d_p``; the debiased trajectory moves along them with

        τ̃_p = −d_pᵀ r̃_p / d_pᵀÃd_p,   x̃_{p+1} = x̃_p + τ̃_p d_p,   r̃_{p+1} = r̃_p + τ̃_p Ãd_p,

    where ``r̃_p = Ãx̃_p − b̃ = ∇q(θ₀ + x̃_p; B̃)``; the recursion makes every iteration cost
    exactly one product with ``A`` and one with ``Ã`` (plus one each at the start if ``x0``
    is given). With ``Ã = A, b̃ = b`` it reproduces [`cg`][laplace_debiased.optim.cg.cg] (up to rounding).
    Termination (see [`cg`][laplace_debiased.optim.cg.cg]) uses the tolerance on ``B``'s residual (no new
    direction exists once it vanishes), non-positive curvature on *either* batch, and ``callback`` sees both
    processes.

    Args:
        A: symmetric operator of batch B, ``[D] → [D]``.
        b: right-hand side ``[D]`` of batch B.
        A_tilde: symmetric operator ``Ã`` of batch B̃, ``[D] → [D]``.
        b_tilde: right-hand side ``b̃`` ``[D]`` of batch B̃.
        x0: start of both trajectories (default zeros).
        max_iter: iteration budget ``K`` (default ``D``).
        rtol: relative tolerance on B's residual (times ``‖r_0‖``).
        atol: absolute tolerance on B's residual.
        on_nonpositive: ``"stop"`` or ``"raise"``.
        store_iterates: keep all ``x_p`` and ``x̃_p`` (``[K+1, D]`` memory each).
        callback: called with a [`CGState`][laplace_debiased.optim.cg.CGState] after every iteration; ``True``
            stops.

    Returns:
        The CG trajectory on B and the debiased trajectory.
    """
    if b_tilde.shape != b.shape:
        raise ValueError(f"b_tilde has shape {tuple(b_tilde.shape)}, b has {tuple(b.shape)}")
    return _joint_cg(A, b, A_tilde, b_tilde, x0, max_iter, rtol, atol, on_nonpositive,
                     store_iterates, callback)


def _stack(ts: list[Tensor], shape: tuple[int, ...], like: Tensor) -> Tensor:
    return torch.stack(ts) if ts else torch.zeros(shape, dtype=like.dtype, device=like.device)


class _DebiasedTrack:
    """The trajectory on B̃ ([`debiased_cg`][laplace_debiased.optim.cg.debiased_cg]): along each CG direction
    ``d`` of B, the step ``τ̃ = -dᵀr̃ / dᵀÃd`` that minimises ``q(·; B̃)``, with its records."""

    def __init__(self, At: Operator, bt: Tensor, x: Tensor, warm: bool, store_iterates: bool) -> None:
        self.At, self.store = At, store_iterates
        self.x = x.clone()
        self.r = At(self.x) - bt if warm else -bt.clone()  # r̃_0 = ∇q(x̃_0; B̃)
        self.xs, self.taus, self.curvs, self.slopes, self.rnorms = [self.x.clone()], [], [], [], [self.r.norm()]

    def curvature(self, d: Tensor) -> Tensor:
        """``dᵀÃd`` (one product with ``Ã``, kept for ``step``)."""
        self.Ad = self.At(d)
        return d.dot(self.Ad)

    def step(self, d: Tensor, curv: Tensor) -> None:
        slope = d.dot(self.r)
        tau = -slope / curv
        self.x = self.x + tau * d
        self.r = self.r + tau * self.Ad
        self.taus.append(tau)
        self.curvs.append(curv)
        self.slopes.append(slope)
        self.rnorms.append(self.r.norm())
        if self.store:
            self.xs.append(self.x.clone())

    def result(self, cg_result: CGResult) -> DebiasedCGResult:
        like = cg_result.x
        return DebiasedCGResult(
            cg=cg_result,
            x=self.x,
            iterates=torch.stack(self.xs) if self.store else None,
            step_sizes=_stack(self.taus, (0,), like),
            curvatures=_stack(self.curvs, (0,), like),
            slopes=_stack(self.slopes, (0,), like),
            residual_norms=torch.stack(self.rnorms),
        )


def _stops_at_nonpositive(k: int, curv: Tensor, curv_t: Tensor | None, on_nonpositive: str) -> bool:
    """Whether iteration ``k`` meets non-positive curvature on B (or B̃); raises for ``"raise"``."""
    if not (curv <= 0 or (curv_t is not None and curv_t <= 0)):
        return False
    if on_nonpositive == "raise":
        which = "B" if curv <= 0 else "B̃"
        raise NonPositiveCurvatureError(
            f"iteration {k}: direction has non-positive curvature on {which} "
            f"(dᵀAd = {float(curv_t if which == 'B̃' else curv):.3e}); use damping or "
            "GGN curvature, or on_nonpositive='stop'"
        )
    return True


def _joint_cg(A, b, At, bt, x0, max_iter, rtol, atol, on_nonpositive, store_iterates,
              callback):
    if on_nonpositive not in ("stop", "raise"):
        raise ValueError(f"on_nonpositive must be 'stop' or 'raise', got {on_nonpositive!r}")
    x = _check((A, b), x0, 0 if max_iter is None else max_iter)
    max_iter = b.shape[0] if max_iter is None else max_iter
    track = None if At is None else _DebiasedTrack(At, bt, x, x0 is not None, store_iterates)

    r = A(x) - b if x0 is not None else -b.clone()   # r_0 = ∇q(x_0; B)
    p = -r
    rr = r.dot(r)
    tol = max(rtol * rr.sqrt().item(), atol)
    xs, ds, taus, curvs, rnorms = [x.clone()], [], [], [], [rr.sqrt()]
    reason = "max_iter"
    for k in range(max_iter):
        if rr.sqrt().item() <= tol:
            reason = "tol"
            break
        p_norm = p.norm()
        d = p / p_norm
        Ad = A(d)
        curv = d.dot(Ad)
        curv_t = None if track is None else track.curvature(d)
        if _stops_at_nonpositive(k, curv, curv_t, on_nonpositive):
            reason = "nonpositive_curvature"
            break
        # Alg. 5.2: α = rᵀr / pᵀAp; along d = p/‖p‖ the step is τ = α‖p‖ = rᵀr / (‖p‖ dᵀAd).
        tau = rr / (p_norm * curv)
        x = x + tau * d
        r = r + tau * Ad
        rr_new = r.dot(r)
        p = -r + (rr_new / rr) * p
        rr = rr_new
        ds.append(d)
        taus.append(tau)
        curvs.append(curv)
        rnorms.append(rr.sqrt())
        if store_iterates:
            xs.append(x.clone())
        if track is not None:
            track.step(d, curv_t)
        if callback is not None and callback(
            CGState(k, x, r, None if track is None else track.x, None if track is None else track.r)
        ):
            reason = "callback"
            break
    else:
        if max_iter > 0 and rr.sqrt().item() <= tol:
            reason = "tol"
    result = CGResult(
        x=x, directions=_stack(ds, (0, b.shape[0]), b), iterates=torch.stack(xs) if store_iterates else None,
        step_sizes=_stack(taus, (0,), b), curvatures=_stack(curvs, (0,), b), residual_norms=torch.stack(rnorms),
        reason=reason,
    )
    return result if track is None else track.result(result)
