"""What the quick start's debiased K-FAC fit covers in digits_cnn's ``Linear(256, 32)`` (docs/wide-layers.md).

    OMP_NUM_THREADS=1 python -m benchmarks.digits_coverage [--threads 1]

The quick start's fit (``examples/quickstart.py``): the main job's cached MAP ``digits_cnn``
(``default_digits_model``), B and B̃ the first two batches of 32 of its seeded training loader,
``fit`` with its defaults (``null_space="isotropic"``, the default estimator, ``"corrected"``; ``"shrunk"`` when its results were written). Beside
it the same batches with ``estimator="paper"`` (B's eigenvectors, B̃'s Rayleigh quotients: the
isotropic completion of B's null group that the doc describes), and the full-batch fit (B̃ = B =
all 300 training images, stock K-FAC). For the layer's output factor ``G`` (32) and input factor
``A`` (256), per factor of B, B̃, B ∪ B̃ (their sum, as ``la.coverage`` holds it) and all 300
images: the round-off tolerance (:func:`~laplace_debiased.curvature.linalg.roundoff_tolerance`),
the largest eigenvalue, the rank at the factor's own tolerance
(:func:`~laplace_debiased.two_batch.coverage.numerical_rank`) and the rank the coverage record
gives (B, B̃, B ∪ B̃ all at the union's tolerance, :func:`~laplace_debiased.two_batch.coverage.factor_ranks`).
Then B's null group of ``A`` (:func:`~laplace_debiased.curvature.linalg.tied_groups` of B's
spectrum, zeros and Gram eigenvalues of its rows, at B's tolerance), the completion's value on
it, and each fit's zero counts and prior-only shares (``la.coverage``).
Writes ``results/digits_coverage.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from laplace import Laplace
from torch.utils.data import DataLoader, Dataset

import laplace_debiased  # noqa: F401  registers hessian_structure="debiased_kron"
from laplace_debiased.two_batch.coverage import BlockCoverage, Coverage, numerical_rank
from laplace_debiased.kron.estimators import ESTIMATORS, resolve_estimator
from laplace_debiased.curvature.linalg import roundoff_tolerance, symmetric_eigh64, tied_groups
from laplace_debiased.evaluation.training import default_digits_model
from laplace_debiased.kron.laplace import DebiasedKronLaplace

HERE = Path(__file__).resolve().parent
LAYER = "6"  # digits_cnn's Linear(256, 32): its input is the pooled features model[:6], its ReLU model[7]
BATCH = 32


def laplace_fit(model: torch.nn.Module, loader: DataLoader, magnitude_loader: DataLoader | None = None,
                estimator: str | None = None) -> DebiasedKronLaplace:
    """The quick start's ``Laplace(...)`` and ``fit`` (``estimator=None``: the default)."""
    la = Laplace(model, "classification", subset_of_weights="all", hessian_structure="debiased_kron", estimator=estimator)
    la.fit(loader, magnitude_loader=magnitude_loader)
    return la


def weight_block(coverage: Coverage) -> tuple[int, BlockCoverage]:
    """The index and record of :data:`LAYER`'s weight block."""
    return next((i, b) for i, b in enumerate(coverage.blocks) if (b.layer, b.parameter) == (LAYER, "weight"))


def factor_rows(fit: DebiasedKronLaplace, full: DebiasedKronLaplace, j: int) -> dict[str, dict]:
    """Factor ``j`` (0 output, 1 input) of :data:`LAYER`'s weight block on B, B̃, B ∪ B̃ and all images."""
    i, block = weight_block(fit.coverage)
    Fd, Fm, Ff = fit.H_facs.kfacs[i][j], fit.H_facs_magnitude.kfacs[i][j], full.H_facs.kfacs[i][j]
    record, full_record = block.factors[j], weight_block(full.coverage)[1].factors[j]
    ranks = {"B": record.rank_direction, "B~": record.rank_magnitude, "B∪B~": record.rank_union,
             "all": full_record.rank_direction}
    out = {}
    for name, F in {"B": Fd, "B~": Fm, "B∪B~": Fd + Fm, "all": Ff}.items():
        tol, top = roundoff_tolerance(F), float(symmetric_eigh64(F)[0][-1])
        out[name] = {"tolerance": tol, "largest_eigenvalue": top, "tolerance_relative": tol / top,
                     "rank_own_tolerance": numerical_rank(F), "rank_coverage_record": ranks[name]}
    return out


def null_group(fit: DebiasedKronLaplace) -> dict:
    """B's null group of the input factor, as the rows route of the fit forms it (its tied run at 0
    of B's spectrum at B's tolerance), and the isotropic completion's value on it. A ``Linear``
    layer's input factor has one row per sample, so B's factor has rank at most :data:`BATCH`: its
    spectrum is ``d - BATCH`` exact zeros below the top :data:`BATCH` eigenvalues of the dense factor."""
    i, block = weight_block(fit.coverage)
    Ad, Am = fit.H_facs.kfacs[i][1], fit.H_facs_magnitude.kfacs[i][1]
    L = symmetric_eigh64(Ad)[0][-BATCH:]
    zeros = Ad.shape[0] - BATCH
    group = tied_groups(torch.cat([L.new_zeros(zeros), L]), roundoff_tolerance(Ad))[0]
    inside = L[: group.stop - zeros]
    Q, lam = fit.H.eigenvectors[i][1], fit.H.eigenvalues[i][1]
    return {"tolerance_B": roundoff_tolerance(Ad), "exact_zeros": zeros, "size": group.stop,
            "nonzero_inside": inside.numel(), "nonzero_min": float(inside.min()), "nonzero_max": float(inside.max()),
            "fit_implicit_null_dimension": Q.shape[0] - Q.shape[1], "completion_value": float(lam[-1]),
            "zero_threshold": roundoff_tolerance(Am)}


def zeros(fit: DebiasedKronLaplace) -> dict:
    """:data:`LAYER`'s weight block in ``fit.coverage``: zero eigenvalues per factor, shares."""
    block = weight_block(fit.coverage)[1]
    return {"output_zeros": block.factors[0].zero_eigenvalues, "input_zeros": block.factors[1].zero_eigenvalues,
            "prior_only_share": block.prior_only_share, "sample_limited_share": block.sample_limited_share}


def figures(model: torch.nn.Module, train: Dataset) -> dict:
    """Every figure of the module docstring."""
    def quickstart_loader() -> DataLoader:  # B, B̃: its first two batches
        return DataLoader(train, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))

    everything = DataLoader(train, batch_size=len(train))
    default, paper = laplace_fit(model, quickstart_loader()), laplace_fit(model, quickstart_loader(), estimator="paper")
    full = laplace_fit(model, everything, magnitude_loader=everything)
    x = train.tensors[0]
    with torch.no_grad():
        features, hidden = model[:6](x), model[:8](x)
    i = weight_block(full.coverage)[0]
    return {
        "default_estimator": resolve_estimator(None, ESTIMATORS, "debiased_kron", cross_fit=False),
        "dead_units": int((hidden == 0).all(0).sum()), "zero_features": int((features == 0).all(0).sum()),
        "input_rank_float64_all": int(torch.linalg.matrix_rank(full.H_facs.kfacs[i][1].double())),
        "output": factor_rows(paper, full, 0), "input": factor_rows(paper, full, 1),
        "null_group": null_group(paper),
        "coverage": {"default": zeros(default), "paper": zeros(paper), "full": zeros(full)},
    }


def markdown(f: dict, command: str, meta: dict) -> str:
    """The figures as tables, ``command`` and the wall time on top."""
    lines = ["# Coverage of the quick start's debiased K-FAC fit in digits_cnn's Linear(256, 32)", "",
             f"Written by `{command}` ({meta['wall_s']:.1f} s after the imports, {meta['threads']} thread(s)). The main job's MAP "
             f"digits_cnn, N = {meta['n_train']} training images; B, B̃: the quick start's first two batches of "
             f"{BATCH}; `null_space=\"isotropic\"`; default estimator: `{f['default_estimator']}`. "
             f"B ∪ B̃ is the sum of the two factors, as `la.coverage` holds it. Ranks: at each factor's own "
             "round-off tolerance (`numerical_rank`), and as the coverage record counts them (B, B̃, B ∪ B̃ at "
             "the union's tolerance; all images: the full-batch fit's record).", ""]
    for side, d in (("output", 32), ("input", 256)):
        lines += [f"## {side.capitalize()} factor ({d})", "",
                  "| factor of | tolerance | largest eigenvalue | tolerance / largest | rank (own tolerance) "
                  "| rank (coverage record) |", "|---|---|---|---|---|---|"]
        for name, r in f[side].items():
            lines.append(f"| {name.replace('~', '̃')} | {r['tolerance']:.3g} | {r['largest_eigenvalue']:.4g} "
                         f"| {r['tolerance_relative']:.2e} | {r['rank_own_tolerance']} | {r['rank_coverage_record']} |")
        lines.append("")
    g = f["null_group"]
    lines += [f"Hidden units 0 on every training image (dead): {f['dead_units']} of 32. Pooled features 0 on every "
              f"training image: {f['zero_features']} of 256. Rank of the 300-image input factor in float64 "
              f"(`torch.linalg.matrix_rank`): {f['input_rank_float64_all']}.", "",
              "## B's null group of the input factor (`estimator=\"paper\"`)", "",
              f"At B's tolerance {g['tolerance_B']:.3g}: {g['exact_zeros']} exact zeros and {g['nonzero_inside']} "
              f"nonzero eigenvalues ({g['nonzero_min']:.3f} – {g['nonzero_max']:.3f}), {g['size']} dimensions "
              f"(the fit's implicit null space: {g['fit_implicit_null_dimension']}). The isotropic completion's value "
              f"on it: {g['completion_value']:.3g}; the record's zero threshold (B̃'s tolerance): "
              f"{g['zero_threshold']:.3g}.", "",
              "## Zeros in `la.coverage` (block weight)", "",
              "| fit | output zeros | input zeros | prior-only share | sample-limited share |", "|---|---|---|---|---|"]
    names = {"default": f"quick start (32 + 32, `{f['default_estimator']}`)", "paper": "32 + 32, `paper`",
             "full": "full batch (B̃ = B = 300, stock K-FAC)"}
    for key, z in f["coverage"].items():
        lines.append(f"| {names[key]} | {z['output_zeros']} | {z['input_zeros']} | {100 * z['prior_only_share']:.1f} % "
                     f"| {100 * z['sample_limited_share']:.1f} % |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    torch.manual_seed(0)
    model, splits = default_digits_model(log=None)  # as examples/quickstart.py
    result = figures(model, splits["train"])
    meta = {"wall_s": time.perf_counter() - start, "threads": args.threads, "n_train": len(splits["train"])}
    command = f"OMP_NUM_THREADS={args.threads} python -m benchmarks.digits_coverage --threads {args.threads}"
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "digits_coverage.json").write_text(
        json.dumps({"command": command, "meta": meta, "figures": result}, indent=1, ensure_ascii=False) + "\n")
    (HERE / "results" / "digits_coverage.md").write_text(markdown(result, command, meta))
    print(markdown(result, command, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
