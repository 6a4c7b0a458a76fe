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
rotated Jacobian once ([`weighted_grams`][laplace_debiased.posterior.grams.weighted_grams]), and
``covariance(rotated, δ)`` is its one-point case.  The full ``(batch × classes × parameters)`` Jacobian is
never built: inputs are processed in chunks, and the Jacobian of a ``Linear`` layer (2-D input) stays in its
rank-one form ``g_c ⊗ a`` (output gradient ⊗ input), rotated as ``(Q_Gᵀ g_c) ⊗ (Q_Aᵀ a)``; that of a
``Conv2d`` or of a ``Linear`` on every token, a sum over positions ``Σ_t g_t a_tᵀ``, keeps the positions
that contribute and is rotated factor by factor
([`KronStructure.rotate`][laplace_debiased.posterior.kron_structure.KronStructure.rotate]).
Links: [`laplace_debiased.posterior.links`][laplace_debiased.posterior.links].
[`sampled_linearized_predictive`][laplace_debiased.evaluation.predictive.sampled_linearized_predictive]
samples parameters instead, for posteriors without a cheap eigenbasis.

Supported posteriors (read from a fitted laplace-torch object, see
[`posterior_structure`][laplace_debiased.posterior.from_laplace.posterior_structure]): ``KronDecomposed``
``H`` (laplace's K-FAC and the debiased K-FAC of
[`laplace_debiased.kron.laplace`][laplace_debiased.kron.laplace]), dense ``H`` (full), and a low-rank
eigen pair ``(U, λ)`` (prior ``δ`` on the complement of ``U``). Per-example Jacobians are closed-form for
``nn.Linear``/``nn.Conv2d`` parameters (captured input activations and output gradients, one batched backward
pass per class) and come from ``torch.func`` (``vmap`` over ``jacrev``) otherwise.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence

import torch
from torch import Tensor, nn

from laplace_debiased.curvature.kfac import labelled_rows
from laplace_debiased.posterior.from_laplace import curvature_kind, laplace_params, posterior_structure
from laplace_debiased.posterior.jacobians import LayerJacobian, logit_jacobians, logit_rows
from laplace_debiased.posterior.links import ALL_LINKS, apply_link, probit_from_variances, project_classes


#: the most bytes of per-row Jacobian parts that one piece of a chunk rotates at once: its buffers
#: then stay below glibc's largest mmap threshold (32 MiB) and are reused from the heap, where larger
#: ones are mapped and paged in afresh for every chunk (``cifar_cnn``, chunks of 64: half the
#: predictive's time went to the kernel's page faults; benchmarks/results/predictive_pieces.md)
PIECE_BYTES = 8 * 2**20


def piece_rows(jacs: Sequence[LayerJacobian], n: int) -> int:
    """How many of a chunk's ``n`` logit rows one piece holds: as many as fit
    [`PIECE_BYTES`][laplace_debiased.posterior.grid.PIECE_BYTES] of the Jacobians' per-row parts (at
    least 1, at most ``n``)."""
    per_row = sum(j.row_bytes(n) for j in jacs)
    return n if per_row == 0 else max(1, min(n, PIECE_BYTES // per_row))


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

    @classmethod
    def from_parts(cls, model: nn.Module, params: Sequence[Tensor], structure, chunk_size: int = 64) -> GridPredictive:
        """The predictive of a classification posterior ``structure``
        ([`posterior_structure`][laplace_debiased.posterior.from_laplace.posterior_structure]) over the
        parameters ``params`` of ``model``, without its laplace-torch object (e.g. one fitted in another
        process: [`predictive_parts`][laplace_debiased.posterior.from_laplace.predictive_parts]). Calling it
            needs an explicit ``prior_precision``."""
        pred = cls.__new__(cls)
        pred.la, pred.model, pred.params, pred.structure = None, model, list(params), structure
        pred.chunk_size = int(chunk_size)
        if pred.chunk_size < 1:
            raise ValueError("chunk_size must be a positive integer")
        return pred

    @torch.no_grad()
    def grid(
        self,
        data: Tensor | Iterable,
        prior_precisions: Sequence[float | Tensor],
        links: Sequence[str] = ("probit_projected",),
        n_samples: int = 100,
        generator: torch.Generator | None = None,
        progress: bool = False,
        cell_generators: Mapping[tuple[float, str], torch.Generator] | None = None,
    ) -> dict[str, Tensor]:
        """Predictive probabilities for each prior precision and link.

        Outputs ``(N, tokens, C)``: every token's predictive is the predictive of its own row
        ([`logit_rows`][laplace_debiased.posterior.jacobians.logit_rows]), returned as ``(G, N, tokens, C)``
        and ``"map"`` ``(N, tokens, C)``.

        Args:
            data: A tensor of inputs ``(N, ...)``, or an iterable of input tensors or of
                ``(x, y, ...)`` batches.
            prior_precisions: The prior precisions, ``G`` of them.
            links: The link approximations, each once.
            n_samples: The MC draws of a sampling link.
            generator: The source of the MC draws.
            progress: Show a progress bar over the chunks.
            cell_generators: One generator per cell ``(prior precision, link)``, used instead of
                ``generator`` and carried across chunks (resumable sweeps use it).

        Returns:
            A dict ``link -> (G, N, C)`` for ``G = len(prior_precisions)``, plus ``"map"``
            ``(N, C)``.

        Raises:
            ValueError: For an unknown or repeated link, or no prior precision.
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
        structure's variances (never the ``(n, C, C)`` covariance); mc and the bridge need ``Σ``.
        The variances and covariances are computed in pieces of rows
        ([`piece_rows`][laplace_debiased.posterior.grid.piece_rows]); the links see the whole chunk."""
        f64 = f.double()
        full = [link for link in links if link in ("mc", "bridge", "bridge_norm")]
        parts: dict[str, list[Tensor]] = {"probit": [], "probit_projected": [], "covs": []}
        for rotated in self._rotated_pieces(jacs, len(f)):
            if "probit" in links:
                parts["probit"].append(self.structure.variances(rotated, prior_precisions))
            if "probit_projected" in links:
                parts["probit_projected"].append(self.structure.variances(rotated, prior_precisions, project=True))
            if full:
                parts["covs"].append(self.structure.covariances(rotated, prior_precisions))
        probs: dict[str, Tensor] = {}
        if "probit" in links:
            probs["probit"] = probit_from_variances(f64, torch.cat(parts["probit"], dim=1))
        if "probit_projected" in links:
            probs["probit_projected"] = probit_from_variances(project_classes(f64, -1),
                                                              torch.cat(parts["probit_projected"], dim=1))
        if full:
            covs = torch.cat(parts["covs"], dim=1)
            for link in full:  # mc: ε drawn in f.dtype
                gens = [generator if cell_generators is None else cell_generators[(d, link)] for d in prior_precisions]
                probs[link] = torch.stack([
                    apply_link(link, f64 if link != "mc" else f, cov, n_samples, gen) for cov, gen in zip(covs, gens)
                ])
        return probs

    def _rotated_pieces(self, jacs: Sequence[LayerJacobian], n: int) -> Iterator:
        """The structure's rotated Jacobians of a chunk's ``n`` logit rows, piece by piece
        ([`piece_rows`][laplace_debiased.posterior.grid.piece_rows])."""
        step = piece_rows(jacs, n)
        for start in range(0, n, step):
            yield self.structure.rotate([j.rows(start, start + step) for j in jacs])

    def covariance(self, x: Tensor, prior_precision: float | Tensor) -> tuple[Tensor, Tensor]:
        """The logits and the GLM covariance ``J P(δ)⁻¹ Jᵀ`` at one prior precision, in the model's
        current mode.

        Args:
            x: Inputs ``(N, ...)``, processed in chunks of ``chunk_size``.
            prior_precision: ``δ``, a scalar or one value per parameter tensor.

        Returns:
            ``(f, Σ)``: the logits ``(N, [tokens,] C)`` and the covariance ``(N·tokens, C, C)`` of the logit
            rows ([`logit_rows`][laplace_debiased.posterior.jacobians.logit_rows]), float64.
        """
        fs, covs = [], []
        for chunk in x.split(self.chunk_size):
            f, jacs = logit_jacobians(self.model, self.params, chunk)
            covs += [self.structure.covariance(r, prior_precision) for r in self._rotated_pieces(jacs, len(logit_rows(f)))]
            fs.append(f)
        return torch.cat(fs), torch.cat(covs)

    def __call__(self, x: Tensor, link: str = "probit_projected", prior_precision=None, **kw) -> Tensor:
        """Probabilities ``(N, [tokens,] C)`` at ``prior_precision`` (default:
        ``la.prior_precision``)."""
        delta = self.la.prior_precision if prior_precision is None else prior_precision
        return self.grid(x, [delta], links=(link,), **kw)[link][0]


# --------------------------------------------------------------------------------------------
# Prior-precision grid search from one predictive pass
# --------------------------------------------------------------------------------------------
#: laplace-torch ``link_approx`` values the grid search can evaluate through GridPredictive.
GRIDSEARCH_LINKS = ("probit", "mc", "bridge", "bridge_norm")


def gridsearch_supported(la, pred_type: str, link_approx: str) -> bool:
    """Whether [`grid_validation_scores`][laplace_debiased.posterior.grid.grid_validation_scores] can replace
    laplace-torch's per-point loop: a fitted classification posterior with an eigenbasis, the GLM predictive,
    and a link of [`GRIDSEARCH_LINKS`][laplace_debiased.posterior.grid.GRIDSEARCH_LINKS]."""
    if getattr(la, "likelihood", None) != "classification" or pred_type != "glm":
        return False
    return link_approx in GRIDSEARCH_LINKS and curvature_kind(la) is not None


class UnsupportedBatches(TypeError):
    """Validation batches that
    [`grid_validation_scores`][laplace_debiased.posterior.grid.grid_validation_scores] cannot read (not
    ``(X, y)`` tensors, e.g. dict batches): use laplace-torch's per-point ``validate`` instead."""


def grid_validation_scores(
    la, loss, prior_precisions: Tensor, val_loader, link_approx: str, n_samples: int = 100,
    chunk_size: int = 64,
) -> list[float]:
    """``laplace.utils.validate(la, val_loader, loss, "glm", link_approx)`` at every prior
    precision of the grid, from one [`GridPredictive`][laplace_debiased.posterior.grid.GridPredictive] pass
    over ``val_loader``.

    ``loss`` is a torchmetrics ``Metric`` (one reset copy per grid point, updated batch by batch
    and ``compute().sum()``, as ``validate`` does) or a callable ``loss(probs, targets)`` on the
    concatenated predictions.  Batches are ``(X, y)`` tensors (else
    [`UnsupportedBatches`][laplace_debiased.posterior.grid.UnsupportedBatches]). Outputs ``(n, tokens, C)``
    are scored with every token as one row (``y`` ``(n, tokens)``; other target shapes raise a
    ``ValueError``), so a mean metric such as laplace-torch's ``RunningNLLMetric`` is averaged over all
    tokens, as laplace-torch's LLM examples do; tokens whose label is -100 (padded) are left out, as
    ``CrossEntropyLoss`` leaves them out. ``"mc"`` draws its own samples, so its scores are a different
    Monte-Carlo estimate of the same predictive than laplace-torch's.
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
        rows = [labelled_rows(p, y) for p in probs]  # tokens as rows, padded ones left out
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
