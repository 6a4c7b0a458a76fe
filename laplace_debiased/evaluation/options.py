"""The main job's options: flags, defaults and ``--config`` files (torch-free, so ``--help`` is fast).

Shared by ``laplace-debiased main`` and ``sweep``
([`laplace_debiased.evaluation.pipeline`][laplace_debiased.evaluation.pipeline] runs them).  Defaults are
applied in [`resolve_options`][laplace_debiased.evaluation.options.resolve_options], not by argparse, so that
a config file can supply any option and explicit flags still win.
"""

from __future__ import annotations

import argparse
import json
import tomllib
from collections.abc import Sequence
from pathlib import Path

from laplace_debiased._progress import add_quiet_argument
from laplace_debiased.evaluation import methods
from laplace_debiased.prior_grid import PriorGrid

#: Default links: the projected probit (right, deterministic) and laplace-torch's diagonal
#: probit, recorded for comparison.
DEFAULT_LINKS: tuple[str, ...] = ("probit_projected", "probit")

DEFAULTS: dict = {
    "config": None,
    "out": "laplace-debiased-output",
    "seed": 0,
    "quiet": False,
    "data": "digits",
    "data_root": None,
    "eval": [],
    "eval_size": 2000,
    "train_size": None,
    "epochs": None,  # None: the default training of the chosen model
    "subset": "all",
    # low rank (k = 30 of 9,802 directions) is opt-in: it cannot help on the digits CNN and doubles the time;
    # EKFAC (debiased_ekfac) is opt-in too
    "methods": ["kron_single", "kron_debiased", "kron_corrected", "kron_full"],
    "repeats": 3,
    # both regimes on the digits (N = 300; benchmarks/results/digits_estimators.md): at b = 32 one
    # batch's bias is large and both two-batch fits track the full batch more closely than the single
    # batch; at b = 128 (43 % of N) the single batch is already close and the paper's split loses
    "batch_size": [32, 128],
    "rank": 30,
    # the paper's 14 points (tuned to CIFAR-10's N = 50k) plus 100 ... 1e5: with N = 300 digits and an
    # interpolating MAP the likelihood curvature is far smaller, so the best prior precision lies higher
    # (the digits model's validation choice is 1e3; the grid still grows if a choice lands on an edge)
    "prior_precisions": [*PriorGrid.default(), 100.0, 1000.0, 10000.0, 100000.0],
    "links": list(DEFAULT_LINKS),
    "n_samples": 100,
    "chunk_size": 64,
    "lock_timeout": 0.0,
}
def add_pipeline_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``main`` and ``sweep``.  Defaults are applied in
    [`resolve_options`][laplace_debiased.evaluation.options.resolve_options] (so that a ``--config`` file can
    supply them and explicit flags still win)."""
    S = argparse.SUPPRESS
    d = DEFAULTS
    parser.add_argument("--config", default=S, help="JSON or TOML file whose keys mirror these flags")
    parser.add_argument("--out", default=S, help=f"output folder (default: {d['out']})")
    parser.add_argument("--seed", type=int, default=S, help=f"random seed (default: {d['seed']})")
    add_quiet_argument(parser, default=S)
    parser.add_argument("--data", choices=("digits", "cifar10", "cifar100"), default=S,
                        help="digits: scikit-learn 8x8 digits (embedded, default); cifar10, cifar100: "
                             "need --data-root")
    parser.add_argument("--data-root", default=S,
                        help="CIFAR folder (official binary or python layout of CIFAR-10 or CIFAR-100)")
    parser.add_argument("--eval", action="append", default=S, metavar="SPEC",
                        help="CIFAR evaluation set, repeatable, e.g. cifar10-test, cifar10-c-generated:3 "
                             "(the first clean one is the in-distribution test set)")
    parser.add_argument("--eval-size", type=int, default=S,
                        help=f"at most this many points per CIFAR evaluation set (default: {d['eval_size']})")
    parser.add_argument("--train-size", type=int, default=S, help="use only this many training points")
    parser.add_argument("--epochs", type=int, default=S, help="MAP training epochs (default: 300 for digits, 30 for CIFAR-10)")
    parser.add_argument("--subset", choices=("all", "last_layer"), default=S,
                        help=f"weights under the Laplace approximation (default: {d['subset']})")
    parser.add_argument("--methods", nargs="+", choices=tuple(methods.METHODS), default=S,
                        help=f"approximations to sweep (default: {' '.join(d['methods'])})")
    parser.add_argument("--repeats", type=int, default=S, help=f"batch draws per method (default: {d['repeats']})")
    parser.add_argument("--batch-size", type=int, nargs="+", default=S, metavar="B",
                        help="single-batch size b, or several (each mini-batch method is fitted at each); the "
                             "two-batch methods use two halves of b/2 (default: "
                             f"{' '.join(map(str, d['batch_size']))})")
    parser.add_argument("--rank", type=int, default=S, help=f"rank of the low-rank methods (default: {d['rank']})")
    parser.add_argument("--prior-precisions", nargs="+", type=float, default=S,
                        help="prior-precision grid (default: 13 log-spaced values 1e-4..1, plus 10, 100, ..., 1e5; "
                             "grown at an edge holding a validation choice)")
    parser.add_argument("--links", nargs="+", choices=("probit_projected", "probit", "mc"), default=S,
                        help=f"link approximations (default: {' '.join(d['links'])}; the first is the main one)")
    parser.add_argument("--n-samples", type=int, default=S, help=f"MC samples (default: {d['n_samples']})")
    parser.add_argument("--chunk-size", type=int, default=S,
                        help=f"inputs per predictive chunk (memory; default: {d['chunk_size']})")
    parser.add_argument("--lock-timeout", type=float, default=S, metavar="SECONDS",
                        help="wait this long for another run writing into --out (default: 0, refuse at once)")


def load_config(path: str | Path) -> dict:
    """Read a JSON or TOML config; keys may use dashes or underscores; unknown keys are errors."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix.lower() == ".toml" else json.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as err:
        raise ValueError(f"cannot parse config {path}: {err}") from err
    if not isinstance(raw, dict):
        raise ValueError(f"config {path} must hold a table/object of options")
    cfg = {k.replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(cfg) - set(DEFAULTS) - {"config"})
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} in {path}; valid: {sorted(DEFAULTS)}")
    return cfg


def resolve_options(args: argparse.Namespace) -> dict:
    """Defaults < config file < explicit command-line flags; validated."""
    given = vars(args)
    opts = dict(DEFAULTS)
    if given.get("config"):
        opts.update(load_config(given["config"]))
    opts.update(given)
    bad = [m for m in opts["methods"] if m not in methods.METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; choose from {tuple(methods.METHODS)}")
    for key in ("repeats", "rank", "n_samples", "chunk_size", "epochs", "eval_size"):
        if opts[key] is not None and int(opts[key]) < 1:
            raise ValueError(f"--{key.replace('_', '-')} must be a positive integer, got {opts[key]}")
    opts["batch_size"] = batch_sizes(opts)
    check_links(opts["links"])
    PriorGrid.parse(opts["prior_precisions"])
    if len(set(opts["methods"])) != len(opts["methods"]):
        raise ValueError(f"repeated method in --methods {opts['methods']}; give each once")
    if opts["lock_timeout"] < 0:
        raise ValueError("--lock-timeout must be >= 0 seconds")
    if opts["data"] != "digits" and not opts["eval"]:
        opts["eval"] = [f"{opts['data']}-test"]
    return opts


def batch_sizes(opts: dict) -> list[int]:
    """The batch sizes of ``opts["batch_size"]`` (one integer or a list of them), checked.

    Raises:
        ValueError: for an empty list, a value that is not an integer or below 2 (the two-batch
            methods split b in halves), or a value given twice.
    """
    given = opts["batch_size"]
    sizes = list(given) if isinstance(given, (list, tuple)) else [given]
    if not sizes:
        raise ValueError("--batch-size needs at least one value")
    for b in sizes:
        if isinstance(b, bool) or not isinstance(b, int):
            raise ValueError(f"--batch-size takes integers, got {b!r}")
        if b < 2:
            raise ValueError(f"--batch-size must be at least 2 (the debiased methods split it in halves), got {b}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"repeated batch size in --batch-size {sizes}; give each once")
    return sizes


def sweep_methods(opts: dict) -> list[tuple[str, str, int | None]]:
    """The methods a run sweeps, as ``(key, method, b)``: ``method`` from ``opts["methods"]``
    (in its order) and its batch size ``b`` (``None`` for the full-batch methods, fitted once).

    With one batch size the key is the method's name (``kron_single``); with several, each
    mini-batch method is swept once per b under the key ``method@b<b>`` (``kron_single@b32``,
    [`method_key`][laplace_debiased.evaluation.options.method_key]), the name its rows carry.
    """
    sizes = batch_sizes(opts)
    out: list[tuple[str, str, int | None]] = []
    for m in opts["methods"]:
        if methods.METHODS[m].full_batch:
            out.append((m, m, None))
        else:
            out += [(method_key(m, b if len(sizes) > 1 else None), m, b) for b in sizes]
    return out


def method_key(method: str, b: int | None) -> str:
    """The name the rows of ``method`` at batch size ``b`` carry: ``method@b<b>``, or ``method``
    itself for ``b=None`` (a run of one batch size, or a full-batch method)."""
    return method if b is None else f"{method}@b{b}"


def split_method_key(key: str) -> tuple[str, int | None]:
    """The inverse of [`method_key`][laplace_debiased.evaluation.options.method_key]: ``"kron_single@b32"`` ->
    ``("kron_single", 32)``, ``"kron_single"`` -> ``("kron_single", None)``."""
    method, sep, b = key.partition("@b")
    return (method, int(b)) if sep and b.isdigit() else (key, None)


def check_links(links: Sequence[str]) -> None:
    """Refuses unknown link approximations and a link given twice (it would duplicate rows)."""
    from laplace_debiased.posterior.links import LINKS  # imports torch: only when validating

    for link in links:
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; choose from {LINKS}")
    if len(set(links)) != len(links):
        raise ValueError(f"repeated link approximation in {list(links)}; give each once")
