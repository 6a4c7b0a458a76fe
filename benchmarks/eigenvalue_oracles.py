"""How close can any estimate that keeps the single batch's eigenvectors get? Two oracles on the digits.

    OMP_NUM_THREADS=1 python -m benchmarks.eigenvalue_oracles [--batch-sizes 32 64 128] [--repeats 16]
        [--bias-draws 64] [--folds 16] [--out DIR]

The corrected (the default) and shrunk estimates take the eigenvectors of B ∪ B̃, which are
the single batch's of ``b = |B ∪ B̃|`` samples, and change only the eigenvalues of each K-FAC
factor. Two oracles, which know the full-batch factor ``F_N``, show what such an eigenvalue
estimate can reach: the first removes all of the mean bias, the second all eigenvalue error. For one factor of the single batch, ``F̂ = U diag(λ̂) Uᵀ`` (ascending, float64)
with ``c_i = u_iᵀ F_N u_i`` its true curvature along ``u_i``:

* **bias oracle**: ``(λ̂_i - β_i)⁺`` with ``β_i = E[λ̂_i - c_i]``, the exact mean regression-to-the-mean
  bias at this ``b`` by position in the sorted spectrum, estimated over ``--bias-draws`` further
  independent draws of ``b`` (seeds that the evaluated draws do not use). It removes all of the
  bias and none of the noise: the best that the two batches' gaps can aim for;
* **eigenvalue oracle**: ``c_i`` itself, no eigenvalue error at all; what is left is the error
  of the single batch's directions, which no eigenvalue estimate removes. It is the oracle of
  rotation-equivariant covariance estimation (nonlinear shrinkage, Ledoit and Wolf), the
  Frobenius-closest matrix to ``F_N`` on the single batch's eigenvectors.

Beside them, an estimate of the eigenvalue oracle from the ``b`` samples alone, as
nonlinear-shrinkage methods make it by cross-validation (e.g. Lamrani, Bongiorno and Potters,
arXiv:2503.15186): **cross-validated** eigenvalues, ``d_i = (1/K) Σ_k u_{-k,i}ᵀ F_k u_{-k,i}``
over ``K = --folds`` equal folds of the batch (``F_k`` fold ``k``'s factor, ``u_{-k,i}`` the
eigenvectors of the other folds' mean, matched by sorted position, null runs averaged as below),
on the eigenvectors of all folds together (the single batch's).

On the null run of ``F̂`` (``λ̂_i`` at round-off, where ``b`` is below the factor's dimension and the
eigenvectors are an arbitrary basis) ``c_i`` is replaced by its mean over the run,
``tr(Pᵀ F_N P) / dim P``, so that neither oracle depends on that basis.

Each draw of the single batch, the shrunk estimate and both oracles reads the same seeded samples
as the main job's (``python -m laplace_debiased --batch-size b``), so on one machine the single and
shrunk rows reproduce ``results/digits_estimators.md``. Another CPU model rounds the MAP's training
differently, which moves the figures in their second decimal (the two committed files were written
on different machines). The sweep is the main job's (the projected probit on
the 1,000 test images, the main job's δ grid); the results are resumable in ``DIR/results.jsonl``.
Writes ``results/eigenvalue_oracles.{json,md,png}``: per b and posterior, the largest relative
test-NLL gap to the full batch over the grid, its paired difference to the single batch, and the
signed gap at each δ.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.normalisation import single_fit
from laplace_debiased.curvature.linalg import frobenius_tolerance, remeasure_eigenvalues, symmetric_eigh64
from laplace_debiased.evaluation.options import DEFAULTS
from laplace_debiased.evaluation.report_figures import save_signed_gap_figure
from laplace_debiased.evaluation.report_tables import mean_stderr_text
from laplace_debiased.evaluation.sweep import EvalSet, SweepJob, run_sweep
from laplace_debiased.evaluation.tracking import curves_from_json, curves_to_json, gap_curves, largest_gaps, where_largest
from laplace_debiased.evaluation.training import default_digits_model
from laplace_debiased.kron.laplace import DebiasedKronLaplace

HERE = Path(__file__).resolve().parent
LINK = "probit_projected"
POSTERIORS = ("single", "shrunk", "cross_validated", "bias_oracle", "eigenvalue_oracle")
LABELS = {"single": "single batch b", "shrunk": "shrunk 2 × b/2",
          "cross_validated": "cross-validated eigenvalues (K folds of b/K)",
          "bias_oracle": "bias oracle (single batch less its exact mean bias)",
          "eigenvalue_oracle": "eigenvalue oracle (true curvature along the single batch's eigenvectors)"}
COLORS = {"single": "tab:red", "shrunk": "tab:purple", "cross_validated": "tab:orange", "bias_oracle": "tab:green", "eigenvalue_oracle": "tab:gray"}
#: seeds of the draws that estimate the mean bias start here (the evaluated draws use 0 .. repeats - 1)
BIAS_SEED_OFFSET = 10_000

Factors = list[list[torch.Tensor]]  # per K-FAC block, its one or two square factors


def true_curvature(direction: torch.Tensor, truth: torch.Tensor, terms: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(λ̂, U, c)``: the eigenpairs of one factor ``direction`` (``(d,)``, ``(d, d)``, ascending,
    float64, ``λ̂`` clamped at 0) and the curvature ``c_i = u_iᵀ truth u_i`` (``(d,)`` float64) of
    ``truth`` along them, averaged over ``direction``'s null run (module docstring); ``terms`` the
    samples summed into ``truth`` (its round-off tolerance,
    :func:`~laplace_debiased.curvature.linalg.roundoff_tolerance`)."""
    L, U = symmetric_eigh64(direction)
    c = remeasure_eigenvalues(U, truth, terms, dtype=torch.float64)
    null = int((L <= frobenius_tolerance(L.numel(), direction.dtype, float(torch.linalg.matrix_norm(direction)))).sum())
    if null:
        c[:null] = c[:null].mean()
    return L.clamp(min=0.0), U, c


def mean_bias(draws: list[Factors], truth: Factors, terms: int = 0) -> Factors:
    """``β = E[λ̂ - c]`` per block, factor and sorted position: the mean over ``draws`` (each one
    draw's factors) of :func:`true_curvature`'s ``λ̂ - c`` (float64; ``terms`` the samples in
    ``truth``)."""
    sums = [[torch.zeros(F.shape[0], dtype=torch.float64) for F in block] for block in truth]
    for factors in draws:
        for s_block, d_block, t_block in zip(sums, factors, truth):
            for s, D, F in zip(s_block, d_block, t_block):
                L, _, c = true_curvature(D, F, terms)
                s += L - c
    return [[s / len(draws) for s in block] for block in sums]


def oracle_eigenpairs(direction: Factors, truth: Factors, bias: Factors | None, terms: int = 0
                      ) -> tuple[Factors, Factors]:
    """The oracles' ``(eigenvectors, eigenvalues)`` per block and factor, in ``direction``'s dtype:
    the single batch's eigenvectors with ``(λ̂ - β)⁺`` (``bias`` given: the bias oracle) or with
    ``c`` (``bias=None``: the eigenvalue oracle); ``terms`` the samples in ``truth``."""
    vectors, values = [], []
    for d_block, t_block, b_block in zip(direction, truth, bias or [[None] * len(b) for b in direction]):
        pairs = [true_curvature(D, F, terms) for D, F in zip(d_block, t_block)]
        vectors.append([U.to(D.dtype) for (_, U, _), D in zip(pairs, d_block)])
        values.append([((L - beta).clamp(min=0.0) if beta is not None else c).to(D.dtype)
                       for (L, _, c), beta, D in zip(pairs, b_block, d_block)])
    return vectors, values


def kronecker_eigenvalues(kfacs: Factors) -> torch.Tensor:
    """Every eigenvalue ``Λ`` of a K-FAC curvature (per block the products of its factors'
    eigenvalues, clamped at 0): ``(P,)`` float64, descending."""
    blocks = []
    for block in kfacs:
        values = [symmetric_eigh64(F)[0].clamp(min=0.0) for F in block]
        blocks.append(values[0] if len(values) == 1 else torch.kron(values[0], values[1]))
    return torch.cat(blocks).sort(descending=True).values


def cross_validated_eigenpairs(folds: list[Factors], terms: int = 0) -> tuple[Factors, Factors]:
    """Cross-validated eigenvalues (module docstring) per block and factor, from the factors of
    ``K ≥ 2`` equal folds (each scaled as the single batch's): ``(eigenvectors, eigenvalues)`` of
    the folds' mean, the eigenvalues ``d_i = (1/K) Σ_k c_i^{(k)}`` clamped at 0, with ``c^{(k)}``
    :func:`true_curvature` of the other folds' mean measured on fold ``k`` (``terms`` the samples in
    a fold); in the folds' dtype."""
    K = len(folds)
    if K < 2:
        raise ValueError(f"cross-validation needs at least 2 folds, got {K}.")
    vectors, values = [], []
    for i, block in enumerate(folds[0]):
        v_block, l_block = [], []
        for j, F0 in enumerate(block):
            parts = [f[i][j].double() for f in folds]
            total = sum(parts)
            _, U = symmetric_eigh64(total / K)
            # in the folds' dtype, so that the null runs are found at its round-off
            d = sum(true_curvature(((total - Fk) / (K - 1)).to(F0.dtype), Fk.to(F0.dtype), terms)[2] for Fk in parts) / K
            v_block.append(U.to(F0.dtype))
            l_block.append(d.clamp(min=0.0).to(F0.dtype))
        vectors.append(v_block)
        values.append(l_block)
    return vectors, values


def with_eigenpairs(la: DebiasedKronLaplace, vectors: Factors, values: Factors) -> DebiasedKronLaplace:
    """A new Laplace object with ``la``'s fit (its MAP, factors and scaling) and the K-FAC eigenpairs
    ``vectors``, ``values`` (per block and factor) in place of its own, through its ``state_dict``."""
    new = type(la)(la.model, la.likelihood)
    new.load_state_dict({**la.state_dict(), "H_eigenvectors": vectors, "H_eigenvalues": values})
    return new


class Fits:
    """The fits of one run: the full batch once, each draw's single batch and shrunk estimate at
    each ``b``, the mean biases, and the oracles built from them."""

    def __init__(self, model: torch.nn.Module, train: Dataset, seed: int, bias_draws: int, folds: int) -> None:
        self.model, self.train, self.seed, self.bias_draws, self.folds = model, train, seed, bias_draws, folds
        self._full: DebiasedKronLaplace | None = None
        self._bias: dict[int, Factors] = {}

    def loader(self, size: int, repeat: int) -> DataLoader:
        """The main job's seeded loader of draw ``repeat`` (``batch_size`` ``size``)."""
        return DataLoader(self.train, batch_size=size, shuffle=True,
                          generator=torch.Generator().manual_seed(self.seed * 7919 + repeat))

    def full(self) -> DebiasedKronLaplace:
        if self._full is None:
            loader = DataLoader(self.train, batch_size=len(self.train))
            self._full = self._laplace()
            self._full.fit(loader, magnitude_loader=loader)
        return self._full

    def single(self, b: int, repeat: int) -> DebiasedKronLaplace:
        la, loader = self._laplace(), self.loader(b, repeat)
        la.fit(loader, magnitude_loader=loader)
        return la

    def shrunk(self, b: int, repeat: int) -> DebiasedKronLaplace:
        la = self._laplace(estimator="shrunk")
        la.fit(self.loader(b // 2, repeat))
        return la

    def cross_validated(self, b: int, repeat: int) -> DebiasedKronLaplace:
        """Draw ``repeat``'s single batch with its cross-validated eigenpairs over ``self.folds``
        folds of its images (in the loader's order)."""
        if b % self.folds:
            raise ValueError(f"--folds {self.folds} does not divide the batch size {b}; choose a divisor.")
        # the loader's seeded permutation, replayed over the row indices themselves
        indices = next(iter(DataLoader(range(len(self.train)), batch_size=b, shuffle=True,
                                       generator=torch.Generator().manual_seed(self.seed * 7919 + repeat))))
        folds = [single_fit(self.model, self.train, part.numpy()).H_facs.kfacs for part in indices.chunk(self.folds)]
        return with_eigenpairs(self.single(b, repeat), *cross_validated_eigenpairs(folds, b // self.folds))

    def bias(self, b: int) -> Factors:
        if b not in self._bias:
            draws = [self.single(b, BIAS_SEED_OFFSET + r).H_facs.kfacs for r in range(self.bias_draws)]
            self._bias[b] = mean_bias(draws, self.full().H_facs.kfacs, len(self.train))
        return self._bias[b]

    def oracle(self, b: int, repeat: int, with_bias: bool) -> DebiasedKronLaplace:
        """The single batch of draw ``repeat`` with the oracle's eigenpairs in place of its own."""
        single = self.single(b, repeat)
        return with_eigenpairs(single, *oracle_eigenpairs(single.H_facs.kfacs, self.full().H_facs.kfacs,
                                                          self.bias(b) if with_bias else None, len(self.train)))

    def _laplace(self, **options: str) -> DebiasedKronLaplace:
        return DebiasedKronLaplace(self.model, "classification", **options)


def methods(fits: Fits, sizes: list[int], repeats: int) -> list[SweepJob]:
    """One :class:`SweepJob` per posterior and ``b`` (rows ``<posterior>@b<b>``), and the full batch."""
    makers: dict[str, Callable[[int, int], DebiasedKronLaplace]] = {
        "single": fits.single, "shrunk": fits.shrunk, "cross_validated": fits.cross_validated,
        "bias_oracle": lambda b, r: fits.oracle(b, r, with_bias=True),
        "eigenvalue_oracle": lambda b, r: fits.oracle(b, r, with_bias=False)}
    out = [SweepJob("full", lambda _: fits.full(), full_batch=True)]
    for b in sizes:
        for name in POSTERIORS:
            out.append(SweepJob(f"{name}@b{b}", lambda r, make=makers[name], b=b: make(b, r), repeats=repeats,
                              extra={"batch_size": b}))
    return out


def summarise(rows: list[dict], sizes: list[int]) -> dict[int, dict[str, dict]]:
    """Per b and posterior: the largest relative test-NLL gap to the full batch per draw, and the
    signed gap per δ and draw."""
    out: dict[int, dict[str, dict]] = {}
    for b in sizes:
        out[b] = {}
        for name in POSTERIORS:
            curves = gap_curves(rows, f"{name}@b{b}", "full", "test", LINK, "nll")
            out[b][name] = {"nll_gap_per_draw": largest_gaps(curves),
                            "signed_nll_gap_by_delta": curves_to_json(curves)}
    return out


def markdown(results: dict[int, dict[str, dict]], command: str, meta: dict) -> str:
    lines = ["# Eigenvalue oracles on the digits: how close can an estimate on the single batch's eigenvectors get?", "",
             f"Written by `{command}` ({meta['wall_s']:.0f} s, {meta['threads']} thread(s)). The main job's "
             f"embedded digits (N = {meta['n_train']}), digits_cnn, K-FAC over all weights, {meta['repeats']} draws per b "
             f"(the main job's seeded samples), the mean bias from {meta['bias_draws']} further draws, {meta['folds']} folds; projected "
             "probit on the 1,000 test images, no MC noise. Largest relative test-NLL gap to the full batch over the "
             "δ grid (%): mean over draws [min, max]; paired: each draw's gap less the single batch's, mean ± "
             "standard error. The two oracles know the full-batch factors (the benchmark's docstring): the bias "
             "oracle removes all of the mean bias of the single batch's eigenvalues and none of their noise, the "
             "eigenvalue oracle leaves no eigenvalue error at all; the cross-validated eigenvalues estimate the "
             "latter from the b samples alone.", "",
             f"Of the full batch's {meta['n_eigenvalues']:,} Kronecker eigenvalues Λ, the number above each δ (where "
             "`1/(Λ + δ)` is far from its linearisation `1/δ − Λ/δ²`): "
             + ", ".join(f"{float(d):.3g}: {n:,}" for d, n in meta["eigenvalues_above"].items()) + ".", "",
             "| b | posterior | max rel. NLL gap (%) | − single's, paired (pt) | draws worse than single |",
             "|---|---|---|---|---|"]
    for b, res in sorted(results.items()):
        single = 100 * np.array(res["single"]["nll_gap_per_draw"])
        for name in POSTERIORS:
            gap = 100 * np.array(res[name]["nll_gap_per_draw"])
            paired, worse = ("–", "–") if name == "single" else (mean_stderr_text(gap - single), f"{int((gap > single).sum())} of {len(gap)}")
            lines.append(f"| {b} | {LABELS[name]} | {gap.mean():.2f} [{gap.min():.2f}, {gap.max():.2f}] | {paired} | {worse} |")
    sizes = sorted(results)
    lines += ["", "## Signed gap at each δ", "",
              "Relative test-NLL gap to the full batch (%), mean ± standard error over the draws (positive: a higher "
              "NLL than the full batch's). Figure: [eigenvalue_oracles.png](eigenvalue_oracles.png).", "",
              "| δ | " + " | ".join(f"b = {b}: {name.replace('_', ' ')}" for b in sizes for name in POSTERIORS) + " |",
              "|---|" + "---|" * (len(sizes) * len(POSTERIORS))]
    for key in results[sizes[0]]["single"]["signed_nll_gap_by_delta"]:
        cells = [mean_stderr_text(100 * np.array(results[b][name]["signed_nll_gap_by_delta"][key])) for b in sizes for name in POSTERIORS]
        lines.append(f"| {float(key):.3g} | " + " | ".join(cells) + " |")
    lines += ["", "The δ at which each draw's gap is largest (δ: draws):", ""]
    for b in sizes:
        for name in POSTERIORS:
            counts = where_largest(curves_from_json(results[b][name]["signed_nll_gap_by_delta"]))
            lines.append(f"- b = {b}, {LABELS[name]}: " + ", ".join(f"{d:.3g}: {k}" for d, k in counts.items()))
    return "\n".join(lines) + "\n"


def plot(results: dict[int, dict[str, dict]], path: Path) -> None:
    short = {"single": "single batch b", "shrunk": "shrunk 2 × b/2", "cross_validated": "cross-validated",
             "bias_oracle": "bias oracle", "eigenvalue_oracle": "eigenvalue oracle"}
    panels = {f"b = {b} samples": {short[n]: curves_from_json(results[b][n]["signed_nll_gap_by_delta"]) for n in POSTERIORS}
              for b in sorted(results)}
    save_signed_gap_figure(panels, "Digits (N = 300), projected probit: signed test-NLL gap to full-batch K-FAC, "
                                   "mean ± 1 s.e. over draws", path, colors={short[n]: COLORS[n] for n in POSTERIORS})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--repeats", type=int, default=16, help="evaluated draws per b")
    parser.add_argument("--bias-draws", type=int, default=64, help="further draws per b that estimate the mean bias")
    parser.add_argument("--folds", type=int, default=16, help="folds of the cross-validated eigenvalues (divides each b)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("eigenvalue-oracles-output"),
                        help="where the sweep's rows go (kept, so an interrupted run resumes)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    model, splits = default_digits_model(seed=DEFAULTS["seed"], log=None)
    fits = Fits(model, splits["train"], DEFAULTS["seed"], args.bias_draws, args.folds)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_sweep(methods(fits, args.batch_sizes, args.repeats), [EvalSet("test", *splits["test"].tensors, "test")],
                     args.out / "results.jsonl", prior_precisions=DEFAULTS["prior_precisions"], links=[LINK],
                     seed=DEFAULTS["seed"], progress=False)
    results = summarise(rows, args.batch_sizes)
    spectrum = kronecker_eigenvalues(fits.full().H_facs.kfacs)
    meta = {"wall_s": time.perf_counter() - start, "threads": args.threads, "n_train": len(splits["train"]),
            "n_eigenvalues": spectrum.numel(),
            "eigenvalues_above": {repr(d): int((spectrum > d).sum()) for d in DEFAULTS["prior_precisions"]},
            "repeats": args.repeats, "bias_draws": args.bias_draws, "folds": args.folds}
    command = (f"OMP_NUM_THREADS={args.threads} python -m benchmarks.eigenvalue_oracles --batch-sizes "
               f"{' '.join(map(str, args.batch_sizes))} --repeats {args.repeats} --bias-draws {args.bias_draws} "
               f"--folds {args.folds} --threads {args.threads}")
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "eigenvalue_oracles.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    (HERE / "results" / "eigenvalue_oracles.md").write_text(markdown(results, command, meta))
    plot(results, HERE / "results" / "eigenvalue_oracles.png")
    print(markdown(results, command, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
