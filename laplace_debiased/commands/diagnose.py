"""``laplace-debiased diagnose``: how biased are mini-batch quadratics for this model and data?

With no model/data arguments it diagnoses the default model (the digits CNN of the main job,
trained or loaded from the cache).  Otherwise pass ``--model-file`` (a whole ``nn.Module`` saved
with ``torch.save(model, path)``) and ``--data`` (``torch.save({"X": X, "y": y}, path)``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from laplace_debiased._progress import add_quiet_argument, progress_bar

if TYPE_CHECKING:  # torch is imported inside run(), so that --help stays fast
    import torch
    from torch import nn

HELP = "measure how biased mini-batch quadratics are (bias report)"

DEFAULT_BATCH_SIZE = 50


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the ``diagnose`` command."""
    parser.add_argument("--out", default="diagnose-report", help="output folder (plots, bias.json, README.md)")
    parser.add_argument("--model-file", type=Path, help="torch.save'd nn.Module (default: the digits CNN)")
    parser.add_argument("--data", type=Path, help="torch.save'd {'X': inputs, 'y': targets} (default: digits train split)")
    parser.add_argument("--likelihood", choices=("classification", "regression"), default="classification",
                        help="cross-entropy or mean squared error")
    parser.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE, help="your mini-batch size b")
    parser.add_argument("--curvature", choices=("ggn", "hessian", "ef"), default="ggn",
                        help="curvature matrix: generalized Gauss-Newton, Hessian or empirical Fisher")
    parser.add_argument("--beta", type=float, default=None,
                        help="l2 term beta of the mean-loss quadratic (default: the default model's MAP weight "
                             "decay, or 0 with --model-file)")
    parser.add_argument("--top-k", type=int, default=20, help="eigenvectors per batch")
    parser.add_argument("--cg-steps", type=int, default=10, help="CG directions per batch")
    parser.add_argument("--sources", type=int, default=2, help="direction batches (repeats)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", help="batch-size study (default b, 2b, 4b, ... <= N/2)")
    parser.add_argument("--no-kfac", action="store_true", help="skip the K-FAC batch-size study")
    parser.add_argument("--no-full-eigen", action="store_true", help="skip Lanczos on the full data set")
    parser.add_argument("--tolerance", type=float, default=0.1, help="acceptable relative bias")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="precision of the curvature products (Lanczos itself runs in float64)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (batch draws, default model)")
    add_quiet_argument(parser, deprecated=("--no-progress",))


def _fail(msg: str) -> int:
    print(f"laplace-debiased diagnose: {msg}", file=sys.stderr)
    return 2


def _load_inputs(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor, float]:
    import torch
    from torch import nn

    from laplace_debiased.evaluation.training import DIGITS_CONFIG, default_digits_model

    if (args.model_file is None) != (args.data is None):
        raise ValueError("pass both --model-file and --data, or neither (for the default digits model)")
    if args.model_file is None:
        model, splits = default_digits_model(seed=args.seed, log=None if args.quiet else print)
        X, y = splits["train"].tensors
        return model, X, y, DIGITS_CONFIG.weight_decay if args.beta is None else args.beta
    for path in (args.model_file, args.data):
        if not path.is_file():
            raise ValueError(f"{path} does not exist")
    model = torch.load(args.model_file, map_location="cpu", weights_only=False)  # a pickled module, by design
    if not isinstance(model, nn.Module):
        raise ValueError(f"{args.model_file} holds a {type(model).__name__}, not an nn.Module; save it with torch.save(model, path)")
    blob = torch.load(args.data, map_location="cpu", weights_only=True)
    if not isinstance(blob, dict) or not {"X", "y"} <= set(blob):
        raise ValueError(f"{args.data} must hold a dict with tensors 'X' and 'y' (torch.save({{'X': X, 'y': y}}, path))")
    return model, blob["X"], blob["y"], 0.0 if args.beta is None else args.beta


def run(args: argparse.Namespace) -> int:
    """Run the diagnosis and write the report; exit status 0 on success, 2 on bad input."""
    import torch
    from torch import nn

    from laplace_debiased.diagnostics.bias import DiagnosisConfig, diagnose_bias, n_stages, planned_products
    from laplace_debiased.diagnostics.report import write_report

    try:
        model, X, y, beta = _load_inputs(args)
        config = DiagnosisConfig(
            batch_size=args.batch_size, curvature=args.curvature, beta=beta, top_k=args.top_k,
            cg_steps=args.cg_steps, n_sources=args.sources,
            ladder=tuple(args.batch_sizes) if args.batch_sizes else None, kfac=not args.no_kfac,
            full_eigen=not args.no_full_eigen, tolerance=args.tolerance,
            lanczos_tol=1e-5 if args.dtype == "float32" else 1e-8, seed=args.seed,
        )
        if not 1 <= args.batch_size <= X.shape[0] // 2:
            raise ValueError(f"--batch-size must be between 1 and N/2 = {X.shape[0] // 2} (N = {X.shape[0]} data points)")
    except (ValueError, FileNotFoundError) as err:
        return _fail(str(err))
    if args.likelihood == "regression" and y.ndim == 1:
        y = y.unsqueeze(-1)
    loss = nn.CrossEntropyLoss() if args.likelihood == "classification" else nn.MSELoss()
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    plan = planned_products(config, X.shape[0], n_params)
    print(f"diagnosing {n_params:,} parameters on {X.shape[0]:,} data points, batch size {config.batch_size}; "
          "planned curvature-vector products:")
    for stage, text in plan.items():
        print(f"  {stage}: {text}")

    bar = progress_bar(total=n_stages(config, X.shape[0]), desc="diagnose", quiet=args.quiet, unit="stage")

    def progress(msg: str) -> None:
        bar.set_postfix_str(msg)
        bar.update(1)

    start = time.perf_counter()
    diagnosis = diagnose_bias(model, loss, X, y, config, dtype=getattr(torch, args.dtype), progress=progress)
    bar.close()
    summary = write_report(diagnosis, args.out, plan)
    with open(Path(args.out) / "README.md", "a", encoding="utf-8") as readme:
        readme.write(coverage_section(model, X, y, args.likelihood, config.batch_size, args.seed))
        readme.write(correction_section(model, X, y, args.likelihood, config.batch_size, args.seed))
    same = summary["eigen"]["curvature_bias_same_batch"]["median"]
    other = summary["eigen"]["curvature_bias_other_batches"]["median"]
    print(f"top-{summary['top_k']} curvature at batch size {config.batch_size}: same batch {100 * same:+.0f} % "
          f"(median), independent batch {100 * other:+.0f} %; report in {Path(args.out) / 'README.md'} "
          f"({time.perf_counter() - start:.0f} s)")
    return 0


def _two_batch_kron(model: nn.Module, X: torch.Tensor, y: torch.Tensor, likelihood: str, batch_size: int,
                    seed: int, **fit_options: str):
    """A debiased K-FAC fit on two disjoint random batches of ``batch_size // 2`` (at least 2)
    samples, seeded, its warnings silenced (the sections report what they say)."""
    import warnings

    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from laplace_debiased.kron.laplace import DebiasedKronLaplace

    loader = DataLoader(TensorDataset(X, y), batch_size=max(batch_size // 2, 2), shuffle=True,
                        generator=torch.Generator().manual_seed(seed))
    la = DebiasedKronLaplace(model, likelihood, generator=torch.Generator().manual_seed(seed), **fit_options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        la.fit(loader)
    return la


def correction_section(model: nn.Module, X: torch.Tensor, y: torch.Tensor, likelihood: str, batch_size: int,
                       seed: int) -> str:
    """Markdown: what the default K-FAC fit (``estimator="corrected"``) changes at this batch
    size, per layer and factor, or why there is no such fit."""
    lines = ["", "## What debiasing changes at this batch size", "",
             f"The default debiased K-FAC fit (`estimator='corrected'`) on two disjoint random batches of "
             f"{max(batch_size // 2, 2)} samples: per layer and factor, how far the regression-to-the-mean "
             "correction moves the spectrum of the single batch B ∪ B̃, its standard error from the two "
             "orders of the batches, and the share of the correction kept on the range of B ∪ B̃ (all of it "
             "here; `estimator='shrunk'` or `'stein'` keep less). Near zero: at this batch size a single batch "
             "is already unbiased there.", ""]
    try:
        la = _two_batch_kron(model, X, y, likelihood, batch_size, seed, estimator="corrected")
    except ValueError as err:
        return "\n".join([*lines, f"No debiased K-FAC fit for this model: {err}", ""])
    return "\n".join([*lines, la.correction.markdown(), ""])


def coverage_section(model: nn.Module, X: torch.Tensor, y: torch.Tensor, likelihood: str, batch_size: int,
                     seed: int) -> str:
    """Markdown: the coverage record
    ([`laplace_debiased.two_batch.coverage`][laplace_debiased.two_batch.coverage]) of a debiased K-FAC fit at
    2 × b/2 with each null-space treatment, or why there is none."""
    lines = ["", "## Curvature coverage of a debiased K-FAC fit", "",
             f"B and B̃: two disjoint random batches of {max(batch_size // 2, 2)} samples. Per layer and "
             "factor: ranks reached, zero eigenvalues, eigenvalues set by the isotropic completion, and the "
             "share of weights whose only curvature is the prior (variance 1/δ). See docs/wide-layers.md.", ""]
    for null_space in ("isotropic", "aligned"):
        try:
            la = _two_batch_kron(model, X, y, likelihood, batch_size, seed, null_space=null_space)
        except ValueError as err:
            return "\n".join([*lines, f"No debiased K-FAC fit for this model: {err}", ""])
        lines += [f"`null_space={null_space!r}`{' (default)' if null_space == 'isotropic' else ''}:", "",
                  la.coverage.markdown(), ""]
        if la.coverage.advice():
            lines += [la.coverage.advice(), ""]
    return "\n".join(lines)
