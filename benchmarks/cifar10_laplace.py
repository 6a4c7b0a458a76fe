"""Headline benchmark (paper Fig. 6): debiased vs single-batch vs full-batch Laplace on CIFAR-10.

    python benchmarks/cifar10_laplace.py [--data DIR] [--out DIR] [--quick]

What runs, in one process, single-threaded (``torch.set_num_threads(1)``):

1. the MAP network (``laplace_debiased.evaluation.models.cifar_cnn``, trained on the seeded 45k/5k split of
   the real CIFAR-10, cached on disk by :mod:`_cifar_common`);
2. the fits, all over every weight of the network (``subset_of_weights="all"``), GGN curvature
   through laplace-torch's default Curvlinops backend:

   * ``kron-b``          single-batch K-FAC LA (laplace-torch ``KronLaplace``) on one batch of b,
   * ``debiased_kron-b`` debiased K-FAC LA on the *same* b samples split 2 x b/2 (directions
     from the first half, magnitudes from the second),
   * ``lowrank-b`` / ``debiased_lowrank-b`` the rank-k eigen LA on one batch of b and its
     debiased version at 2 x b/2 (``laplace_debiased.structures.lowrank``),
   * ``kron-full``       K-FAC LA over all 45,000 training images (laplace-torch ``KronLaplace``),

   with ``repeats`` independent batch draws of the mini-batch methods.  Single-batch and debiased
   fits on the same draw are timed back to back, alternating which goes first, so machine noise
   hits both alike.  Peak memory: the peak *increase* of the process's resident set size (RSS)
   during the fit over the RSS just before it, sampled every 5 ms from ``/proc/self/statm`` after
   ``gc.collect()`` + ``malloc_trim(0)`` (tracemalloc cannot see torch's allocations and
   ``ru_maxrss`` is monotone over the process, so neither measures one fit);
3. the linearized (GLM) predictive with Monte-Carlo link (``S`` samples of the Gaussian logits,
   Eq. 18 of the paper), for the paper's prior-precision grid (13 log-spaced values in [1e-4, 1]
   plus 10), via :mod:`laplace_debiased.evaluation.predictive`: per chunk of inputs the per-example
   Jacobians are computed once and shared by all fits; each fit rotates them into its eigenbasis
   once and gets the logit covariances of the whole grid in one pass (``covariances``).  The MC noise is common across fits (same seed per
   chunk and grid point), so differences between methods are not MC noise;
4. accuracy / NLL / ECE (:mod:`laplace_debiased.evaluation.metrics`) on a validation subset (prior
   selection), a test subset, and generated CIFAR-10-C-style sets at severities 1-5 (the mixed
   sets of :func:`laplace_debiased.data.resolve_eval_set` ``"cifar10-c-mixed:S"``: each test
   image corrupted by one of the 15 standard corruptions drawn uniformly with a seed); AUROC
   test vs corrupted (predictive entropy);
5. ``results.json``, ``results.md`` (tables), ``fig6_*.png`` in ``--out``.

Fits and predictions are cached under ``~/.cache/laplace-debiased/cifar10_laplace/``
(``$LAPLACE_DEBIASED_CACHE``; the corrupted sets under its ``corrupted/``), per fit and per
(evaluation set, fit), keyed by the model and the configuration, so an interrupted run resumes
where it stopped (``--fresh`` discards the cached fits and predictions of this configuration).  Fit times in the report always come from the run
that fitted; ``results.json`` records whether anything was loaded from the cache.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import math
import os
import platform
import shutil
import sys
import threading
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cifar_common as common  # noqa: E402
from laplace import KronLaplace  # noqa: E402

from laplace_debiased.evaluation import metrics as M  # noqa: E402
from laplace_debiased.data import resolve_eval_set  # noqa: E402
from laplace_debiased.structures.kron import DebiasedKronLaplace  # noqa: E402
from laplace_debiased.evaluation.training import default_cache_dir, evaluate_loss  # noqa: E402
from laplace_debiased.evaluation.predictive import apply_link, logit_jacobians, posterior_structure  # noqa: E402

#: The paper's prior-precision grid: 13 log-spaced values from 1e-4 to 1, plus 10.
GRID = [float(v) for v in np.logspace(-4, 0, 13)] + [10.0]
SEVERITIES = (1, 2, 3, 4, 5)
#: Bumped whenever the predictive computation or the evaluation sets change (invalidates cached
#: predictions; 3: corrupted sets from ``resolve_eval_set("cifar10-c-mixed:S")``).
PREDICTIVE_VERSION = 3
#: Fits and predictions (never in the repository).
CACHE = default_cache_dir() / "cifar10_laplace"


@dataclass
class Config:
    """Everything that determines the numbers (part of the cache key)."""

    quick: bool = False
    batch_sizes: tuple[int, ...] = (64, 256, 512, 1024)
    repeats: int = 5
    lowrank_batch_sizes: tuple[int, ...] = (128,)
    lowrank_rank: int = 20
    full_batch_size: int = 500
    n_val: int = 300
    n_test: int = 1000
    n_corrupt: int = 200
    mc_samples: int = 100
    chunk_size: int = 64
    seed: int = 0

    @classmethod
    def quick_config(cls) -> Config:
        return cls(quick=True, batch_sizes=(64, 256), repeats=2, lowrank_batch_sizes=(256,),
                   lowrank_rank=20, n_val=200, n_test=300, n_corrupt=150, mc_samples=30)


    def key(self) -> str:
        return _hash(asdict(self))


def _save(obj: Any, path: Path) -> None:
    """``torch.save`` via a temporary file, so a killed run never leaves a truncated cache file."""
    tmp = path.with_name(path.name + f".{os.getpid()}.part")
    torch.save(obj, tmp)
    tmp.replace(path)


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------------------------
# Measuring one fit: wall time and peak RSS increase
# ---------------------------------------------------------------------------------------------
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * _PAGE


def _release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc: the baseline may then include freed heap
        pass


def measured(fn: Callable[[], Any], interval: float = 0.005) -> tuple[Any, float, float]:
    """Run ``fn()``; return its result, wall seconds, and peak RSS increase in MiB."""
    _release_memory()
    base = _rss_bytes()
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            done.wait(interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    try:
        result = fn()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
    peak[0] = max(peak[0], _rss_bytes())
    return result, seconds, (peak[0] - base) / 2**20


# ---------------------------------------------------------------------------------------------
# Fits
# ---------------------------------------------------------------------------------------------
@dataclass
class Fit:
    """One fitted posterior: what the predictive needs plus its cost."""

    name: str  # e.g. "debiased_kron-256"
    method: str  # "kron", "debiased_kron", "lowrank", "debiased_lowrank", "kron-full"
    b: int | None
    repeat: int | None
    seconds: float
    peak_mib: float
    structure: Any
    log_marglik: list[float] | None = None
    order: int = 0  # position in the interleaved timing sequence
    extra: dict = field(default_factory=dict)


def _log_marglik(la) -> list[float] | None:
    """``log p(D | δ)`` of a fitted laplace-torch object for every grid point (None if n/a)."""
    try:
        return [float(la.log_marginal_likelihood(prior_precision=torch.tensor([d]))) for d in GRID]
    except (NotImplementedError, AttributeError, RuntimeError, ValueError) as err:
        print(f"  (no marglik for {type(la).__name__}: {err})", flush=True)
        return None


def _subset_loader(train: TensorDataset, idx: np.ndarray, batch_size: int) -> DataLoader:
    """Loader over the samples ``idx`` of ``train`` in that order; ``len(loader.dataset)`` is the
    full training-set size N, so every fit scales its curvature to N like laplace-torch."""
    return DataLoader(train, batch_size=batch_size, sampler=idx.tolist(), shuffle=False)


def fit_kron(model, train, idx) -> KronLaplace:
    la = KronLaplace(model, "classification")
    la.fit(_subset_loader(train, idx, len(idx)))
    return la


def fit_debiased_kron(model, train, idx) -> DebiasedKronLaplace:
    la = DebiasedKronLaplace(model, "classification")
    la.fit(_subset_loader(train, idx, len(idx) // 2))  # B = first half, B̃ = second half
    return la


def _lowrank_class():
    try:
        from laplace_debiased.structures.lowrank import DebiasedLowRankLaplace
    except ImportError:
        return None
    return DebiasedLowRankLaplace


def fit_lowrank(model, train, idx, rank: int, debiased: bool):
    cls = _lowrank_class()
    la = cls(model, "classification", rank=rank)
    if debiased:
        la.fit(_subset_loader(train, idx, len(idx) // 2))
    else:  # B̃ = B: the single-batch low-rank LA on all b samples
        loader = _subset_loader(train, idx, len(idx))
        la.fit(loader, magnitude_loader=loader)
    return la


def fit_full(model, train, batch_size: int) -> KronLaplace:
    la = KronLaplace(model, "classification")
    la.fit(DataLoader(train, batch_size=batch_size, shuffle=False))
    return la


def run_fits(model, train: TensorDataset, cfg: Config, cache: Path | None = None, log=print) -> list[Fit]:
    """All fits, mini-batch pairs interleaved (alternating order), the full-batch fit last.

    With ``cache``, each finished fit is saved as ``fit-<name>-r<repeat>.pt`` and loaded
    instead of refitted on the next run (its recorded time is the one of the run that fitted it;
    ``Fit.extra["cached"]`` says so).
    """
    fits: list[Fit] = []
    rng = np.random.default_rng(cfg.seed)
    n = len(train)
    order = 0

    def record(name, method, b, r, fn) -> None:
        nonlocal order
        path = None if cache is None else cache / f"fit-{name}-r{r}.pt"
        if path is not None and path.is_file():
            fit = torch.load(path, weights_only=False)
            fit.extra["cached"] = True
            fits.append(fit)
            log(f"  fit {name:<22} repeat {r}: loaded from cache ({fit.seconds:.2f} s when fitted)")
            return
        la, sec, mib = measured(fn)
        fit = Fit(name, method, b, r, sec, mib, posterior_structure(la), _log_marglik(la), order,
                  {"cached": False, "fitted_at": time.strftime("%Y-%m-%d %H:%M:%S")})
        order += 1
        del la
        if path is not None:
            _save(fit, path)
        fits.append(fit)
        log(f"  fit {name:<22} repeat {r}: {sec:7.2f} s, peak +{mib:7.1f} MiB")

    lowrank_ok = _lowrank_class() is not None
    if not lowrank_ok:
        log("  laplace_debiased.structures.lowrank not available: low-rank fits skipped")
    low_rng = np.random.default_rng([cfg.seed, 2])  # own stream: K-FAC draws do not depend on it
    for r in range(cfg.repeats):
        for b in cfg.batch_sizes:
            idx = rng.choice(n, size=b, replace=False)
            pair = [
                (f"kron-{b}", "kron", lambda idx=idx: fit_kron(model, train, idx)),
                (f"debiased_kron-{b}", "debiased_kron", lambda idx=idx: fit_debiased_kron(model, train, idx)),
            ]
            if (r + cfg.batch_sizes.index(b)) % 2:  # alternate which method goes first
                pair.reverse()
            for name, method, fn in pair:
                record(name, method, b, r, fn)
        for i, b in enumerate(cfg.lowrank_batch_sizes if lowrank_ok else ()):
            idx = low_rng.choice(n, size=b, replace=False)
            k = cfg.lowrank_rank
            pair = [
                (f"lowrank-{b}", "lowrank", lambda idx=idx: fit_lowrank(model, train, idx, k, False)),
                (f"debiased_lowrank-{b}", "debiased_lowrank", lambda idx=idx: fit_lowrank(model, train, idx, k, True)),
            ]
            if (r + i) % 2:
                pair.reverse()
            for name, method, fn in pair:
                record(name, method, b, r, fn)
    record("kron-full", "kron-full", None, None, lambda: fit_full(model, train, cfg.full_batch_size))
    return fits


# ---------------------------------------------------------------------------------------------
# Evaluation sets
# ---------------------------------------------------------------------------------------------
def eval_sets(data: common.CifarData, cfg: Config, log=print) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"val", "test", "c1".."c5"}`` -> ``(X, y)``: seeded subsets of the validation and test
    sets, and the first ``n_corrupt`` images of the test subset taken from the package's
    generated mixed CIFAR-10-C set of each severity (``resolve_eval_set("cifar10-c-mixed:S")``:
    every test image corrupted by one of the 15 corruptions, drawn uniformly with ``cfg.seed``;
    generated for the whole test set once and cached by :mod:`laplace_debiased.data`)."""
    rng = np.random.default_rng([cfg.seed, 1])
    val_idx = rng.choice(len(data.val), size=cfg.n_val, replace=False)
    test_idx = rng.choice(len(data.test), size=cfg.n_test, replace=False)
    Xv, yv = data.val.tensors
    Xt, yt = data.test.tensors
    sets = {"val": (Xv[val_idx], yv[val_idx]), "test": (Xt[test_idx], yt[test_idx])}
    c_idx = test_idx[: cfg.n_corrupt]
    for s in SEVERITIES:
        start = time.perf_counter()
        Xc, yc = resolve_eval_set(f"cifar10-c-mixed:{s}", data.root, seed=cfg.seed).subset(c_idx).tensors()
        if not torch.equal(yc, yt[c_idx]):
            raise RuntimeError(f"the generated corrupted test set under {data.root} is not in the order "
                               "of the benchmark's test set; delete its cache (<cache>/corrupted) and rerun")
        sets[f"c{s}"] = (Xc, yc)
        log(f"  corrupted severity {s}: {len(Xc)} images ({time.perf_counter() - start:.1f} s)")
    return sets


# ---------------------------------------------------------------------------------------------
# Predictive over the grid, all fits at once
# ---------------------------------------------------------------------------------------------
def fit_key(fit: Fit) -> str:
    return f"{fit.name}#{fit.repeat}"


@torch.no_grad()
def predict_all(model, fits: list[Fit], X: torch.Tensor, cfg: Config, set_id: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """MC-linearized predictive probabilities ``(G, N, C)`` per fit, and MAP ``(N, C)``.

    Jacobians per chunk once, shared by every fit; the MC draws are seeded by (set, chunk) only,
    so all fits and all grid points see the same standard-normal samples (common random
    numbers: differences between methods and along the grid are not MC noise).
    """
    params = list(model.parameters())
    out: dict[str, list[torch.Tensor]] = {fit_key(f): [] for f in fits}
    maps = []
    gen = torch.Generator()
    for ci, x in enumerate(X.split(cfg.chunk_size)):
        f, jacs = logit_jacobians(model, params, x)
        maps.append(torch.softmax(f, -1))
        for fit in fits:
            rotated = fit.structure.rotate(jacs)
            covs = fit.structure.covariances(rotated, GRID)
            if ci == 0:  # float32 on the real model: the batched grid reproduces the one-point path
                ref = fit.structure.covariance(rotated, GRID[0])
                err = float((covs[0] - ref).abs().max() / ref.abs().max())
                if err > 1e-4:
                    raise AssertionError(f"grid covariance deviates from the one-point covariance by {err:.2e}")
            per_grid = []
            for g in range(len(GRID)):
                gen.manual_seed((cfg.seed * 31 + set_id) * 100003 + ci)
                per_grid.append(apply_link("mc", f, covs[g], cfg.mc_samples, gen))
            out[fit_key(fit)].append(torch.stack(per_grid))
            del rotated, covs
        del jacs
    return {k: torch.cat(v, 1) for k, v in out.items()}, torch.cat(maps)


def predictions(model, fits: list[Fit], sets: dict, cfg: Config, cache: Path, log=print) -> tuple[dict, dict]:
    """``probs[set][fit_key]`` ``(G, N, C)`` and ``maps[set]``; cached per (set, fit) so that an
    interrupted run, or a run with more fits, recomputes only what is missing."""
    probs: dict[str, dict[str, torch.Tensor]] = {}
    maps: dict[str, torch.Tensor] = {}
    for i, (s, (X, _)) in enumerate(sets.items()):
        probs[s] = {}
        todo = []
        for fit in fits:
            path = cache / f"probs-{s}-{fit.name}-r{fit.repeat}.pt"
            if path.is_file():
                probs[s][fit_key(fit)] = torch.load(path, weights_only=True)
            else:
                todo.append(fit)
        map_path = cache / f"map-{s}.pt"
        if not todo and map_path.is_file():
            maps[s] = torch.load(map_path, weights_only=True)
            continue
        start = time.perf_counter()
        new, maps[s] = predict_all(model, todo, X, cfg, i)
        _save(maps[s], map_path)
        for fit in todo:
            _save(new[fit_key(fit)], cache / f"probs-{s}-{fit.name}-r{fit.repeat}.pt")
        probs[s].update(new)
        log(f"  predictive on {s} ({len(X)} images, {len(todo)} fits x {len(GRID)} prior precisions): "
            f"{time.perf_counter() - start:.1f} s")
    return probs, maps


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, ValueError):
        return False
    return pid > 0


def predict_helper(model, data, cfg: Config, fit_cache: Path, pred_cache: Path, pid_file: Path, log=print,
                   batch: int = 8) -> int:
    """``--predict-only``: a second process that predicts with every fit as soon as the main run
    has cached it (polling, ``batch`` new fits at a time so that the shared Jacobians are
    amortised), until the full-batch fit is predicted; the main run waits for it and then only
    loads the cached predictions."""
    pid_file.write_text(str(os.getpid()))
    try:
        sets = eval_sets(data, cfg, log)
        done: set[str] = set()
        while True:
            paths = sorted(fit_cache.glob("fit-*.pt"))
            last = any(p.name.startswith("fit-kron-full") for p in paths)
            if last or len({p.name for p in paths} - done) >= batch:  # amortise the Jacobians
                fits = [torch.load(p, weights_only=False) for p in paths]
                predictions(model, fits, sets, cfg, pred_cache, log)
                done |= {p.name for p in paths}
                if last:
                    return 0
            time.sleep(20)
    finally:
        pid_file.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# Summaries
# ---------------------------------------------------------------------------------------------
def curves(probs: dict[str, torch.Tensor], maps: dict[str, torch.Tensor], sets, fits: list[Fit]) -> dict:
    """Metrics per fit, set and grid point: ``{fit_key: {set: {metric: [G values]}}}``."""
    res: dict = {}
    for fit in fits:
        key = fit_key(fit)
        res[key] = {}
        for s, (_, y) in sets.items():
            P = probs[s][key]
            rows = [M.classification_metrics(P[g], y) for g in range(len(GRID))]
            res[key][s] = {m: [r[m] for r in rows] for m in ("accuracy", "nll", "ece", "brier", "confidence")}
            if s.startswith("c"):
                n_c = len(y)
                res[key][s]["auroc"] = [
                    M.ood_metrics(probs["test"][key][g][:n_c], P[g])["auroc"] for g in range(len(GRID))
                ]
    res["map"] = {}
    for s, (_, y) in sets.items():
        res["map"][s] = M.classification_metrics(maps[s], y)
        if s.startswith("c"):
            res["map"][s]["auroc"] = M.ood_metrics(maps["test"][: len(y)], maps[s])["auroc"]
    return res


def _method_label(method: str, b: int | None) -> str:
    if method == "kron-full":
        return "K-FAC full-batch"
    half = None if b is None else b // 2
    return {
        "kron": f"K-FAC single-batch b={b}",
        "debiased_kron": f"K-FAC debiased 2x{half}",
        "lowrank": f"low-rank single-batch b={b}",
        "debiased_lowrank": f"low-rank debiased 2x{half}",
    }[method]


def summarise(fits: list[Fit], res: dict, cfg: Config) -> dict:
    """Per method (name): tracking errors vs full batch, best-prior metrics, cost, selection."""
    full = next(f for f in fits if f.method == "kron-full")
    fk = f"{full.name}#{full.repeat}"
    full_sel = _select(res[fk], full.log_marglik)
    groups: dict[str, list[Fit]] = defaultdict(list)
    for f in fits:
        groups[f.name].append(f)
    out = {}
    for name, group in groups.items():
        rows = []
        for f in group:
            key = f"{f.name}#{f.repeat}"
            r = res[key]
            track = {}
            for s in res[fk]:
                nll_gap = [abs(a - b) / b for a, b in zip(r[s]["nll"], res[fk][s]["nll"])]
                ece_gap = [abs(a - b) for a, b in zip(r[s]["ece"], res[fk][s]["ece"])]
                acc_gap = [abs(a - b) for a, b in zip(r[s]["accuracy"], res[fk][s]["accuracy"])]
                track[s] = {
                    "nll_rel_mean": float(np.mean(nll_gap)), "nll_rel_max": float(np.max(nll_gap)),
                    "ece_mean": float(np.mean(ece_gap)), "ece_max": float(np.max(ece_gap)),
                    "acc_mean": float(np.mean(acc_gap)), "acc_max": float(np.max(acc_gap)),
                    "nll_rel_gap": nll_gap,
                }
            g_best = int(np.argmin(r["test"]["nll"]))
            sel = _select(r, f.log_marglik)
            rows.append({
                "repeat": f.repeat, "seconds": f.seconds, "peak_mib": f.peak_mib, "order": f.order,
                "tracking": track,
                "best": {"prior_precision": GRID[g_best], **{m: r["test"][m][g_best] for m in ("accuracy", "nll", "ece")}},
                "selected": sel,
            })
        out[name] = {
            "method": group[0].method, "b": group[0].b, "label": _method_label(group[0].method, group[0].b),
            "repeats": rows,
        }
    for name, entry in out.items():
        sec = [r["seconds"] for r in entry["repeats"]]
        entry["seconds_mean"] = float(np.mean(sec))
        entry["seconds_rel_full"] = float(np.mean(sec) / full.seconds)
        entry["peak_mib_mean"] = float(np.mean([r["peak_mib"] for r in entry["repeats"]]))
        for crit in ("val_nll", "marglik"):
            chosen = [r["selected"].get(crit) for r in entry["repeats"] if r["selected"].get(crit)]
            ref = full_sel.get(crit)
            if chosen and ref:
                for c in chosen:
                    c["log10_dist_to_full"] = abs(math.log10(c["prior_precision"]) - math.log10(ref["prior_precision"]))
    # debiased / single fit-time ratio from the interleaved pairs on the same draw
    for name, entry in out.items():
        if entry["method"].startswith("debiased_"):
            single = out.get(name.replace("debiased_", "", 1))
            if single:
                by_rep = {r["repeat"]: r["seconds"] for r in single["repeats"]}
                ratios = [r["seconds"] / by_rep[r["repeat"]] for r in entry["repeats"] if r["repeat"] in by_rep]
                entry["time_ratio_vs_single"] = {"median": float(np.median(ratios)), "mean": float(np.mean(ratios)),
                                                 "per_repeat": ratios}
    return {"methods": out, "full_selected": full_sel}


def _select(r: dict, log_marglik: list[float] | None) -> dict:
    """Prior precision chosen on the validation set by NLL, and by marglik, with test metrics."""
    sel = {}
    g = int(np.argmin(r["val"]["nll"]))
    sel["val_nll"] = {"prior_precision": GRID[g], **{m: r["test"][m][g] for m in ("accuracy", "nll", "ece")}}
    if log_marglik is not None and np.all(np.isfinite(log_marglik)):
        g = int(np.argmax(log_marglik))
        sel["marglik"] = {"prior_precision": GRID[g], **{m: r["test"][m][g] for m in ("accuracy", "nll", "ece")}}
    return sel


# ---------------------------------------------------------------------------------------------
# Report: Markdown tables, targets, figures
# ---------------------------------------------------------------------------------------------
def _agg(entry: dict, get: Callable[[dict], float]) -> tuple[float, float]:
    vals = [get(r) for r in entry["repeats"]]
    return float(np.mean(vals)), float(np.max(vals))


def targets(summary: dict, cfg: Config) -> list[dict]:
    """The issue's targets, evaluated on the measured numbers (mean over repeats; worst repeat
    reported alongside)."""
    meth = summary["methods"]
    out = []

    def tr(name, field_):
        return _agg(meth[name], lambda r: r["tracking"]["test"][field_])

    for b, nll_tol, label in ((512, 0.01, "2x256"), (64, 0.05, "2x32")):
        name = f"debiased_kron-{b}"
        if name not in meth:
            continue
        nll_mean, nll_worst = tr(name, "nll_rel_max")
        rel_time = meth[name]["seconds_rel_full"]
        checks = [("max rel. NLL gap", nll_mean, nll_worst, nll_tol)]
        if b == 512:
            checks += [("max ECE gap", *tr(name, "ece_max"), 0.01), ("max accuracy gap", *tr(name, "acc_max"), 0.01)]
        for what, m, w, tol in checks:
            out.append({"target": f"debiased K-FAC {label}: {what} <= {tol:g} over the grid (test)",
                        "measured": m, "worst_repeat": w, "met": m <= tol})
        out.append({"target": f"debiased K-FAC {label}: fit time <= 1/20 of full batch",
                    "measured": rel_time, "worst_repeat": None, "met": rel_time <= 0.05})
    for name, entry in meth.items():  # the issue asks "by how much": informational rows
        if entry["method"] == "kron":
            nll_mean, nll_worst = tr(name, "nll_rel_max")
            deb = meth.get(f"debiased_{name}")
            other = "" if deb is None else f"; debiased 2x{entry['b'] // 2}: {_agg(deb, lambda r: r['tracking']['test']['nll_rel_max'])[0]:.4g}"
            out.append({"target": f"single-batch K-FAC b={entry['b']} degrades vs full batch: max rel. NLL gap (test){other}",
                        "measured": nll_mean, "worst_repeat": nll_worst, "met": None})
    for name, entry in meth.items():
        if entry["method"].startswith("debiased_") and "time_ratio_vs_single" in entry:
            ratio = entry["time_ratio_vs_single"]["median"]
            out.append({"target": f"{entry['label']} fit time <= 1.05 x single-batch b={entry['b']} (median of paired repeats)",
                        "measured": ratio, "worst_repeat": max(entry["time_ratio_vs_single"]["per_repeat"]),
                        "met": ratio <= 1.05})
    return out


def markdown(summary: dict, res: dict, cfg: Config, meta: dict, tgt: list[dict]) -> str:
    meth = summary["methods"]
    order = sorted(meth, key=lambda n: ({"kron": 0, "debiased_kron": 1, "lowrank": 2, "debiased_lowrank": 3, "kron-full": 4}[meth[n]["method"]], meth[n]["b"] or 0))
    L = [f"# CIFAR-10 Laplace benchmark ({'quick' if cfg.quick else 'full'} mode)", ""]
    L += [f"Model: `cifar_cnn` ({meta['n_params']:,} parameters), MAP test accuracy {meta['map_test']['accuracy']:.4f}, "
          f"test NLL {meta['map_test']['nll']:.4f}, train NLL {meta['map_train_nll']:.4f} "
          f"(trained {meta['train_epochs']} epochs). Evaluation: {cfg.n_test} test images, "
          f"{cfg.n_corrupt} generated corrupted images per severity, {cfg.n_val} validation images; "
          f"MC linearized predictive with {cfg.mc_samples} samples; {cfg.repeats} batch draws per mini-batch "
          f"method; prior-precision grid {len(GRID)} points (1e-4 ... 1, 10). Device: {meta['device']}.", ""]
    L += ["## (a) Full-batch tracking error on the test set (mean over repeats; worst repeat in brackets)", "",
          "| method | NLL rel. gap mean | NLL rel. gap max | ECE gap mean | ECE gap max | acc. gap mean | acc. gap max |",
          "|---|---|---|---|---|---|---|"]
    for n in order:
        if meth[n]["method"] == "kron-full":
            continue
        e = meth[n]
        cell = lambda f, pct=True: "{:.2f} % ({:.2f} %)".format(*(100 * v for v in _agg(e, lambda r: r["tracking"]["test"][f])))
        L.append(f"| {e['label']} | {cell('nll_rel_mean')} | {cell('nll_rel_max')} | {cell('ece_mean')} | {cell('ece_max')} | {cell('acc_mean')} | {cell('acc_max')} |")
    L += ["", "ECE and accuracy gaps are absolute, in percentage points.", ""]
    L += ["### Tracking error on the corrupted sets (max over the grid of the rel. NLL gap, mean over repeats)", "",
          "| method | " + " | ".join(f"severity {s}" for s in SEVERITIES) + " |", "|---|" + "---|" * len(SEVERITIES)]
    for n in order:
        if meth[n]["method"] == "kron-full":
            continue
        e = meth[n]
        L.append(f"| {e['label']} | " + " | ".join(f"{100 * _agg(e, lambda r: r['tracking'][f'c{s}']['nll_rel_max'])[0]:.2f} %" for s in SEVERITIES) + " |")
    L += ["", "## (b) Best prior precision on the test set (by test NLL, mean over repeats)", "",
          "| method | prior prec. (median) | accuracy | NLL | ECE |", "|---|---|---|---|---|"]
    mt = meta["map_test"]
    L.append(f"| MAP | - | {mt['accuracy']:.4f} | {mt['nll']:.4f} | {mt['ece']:.4f} |")
    for n in order:
        e = meth[n]
        bp = float(np.median([r["best"]["prior_precision"] for r in e["repeats"]]))
        L.append(f"| {e['label']} | {bp:.3g} | " + " | ".join(f"{_agg(e, lambda r: r['best'][m])[0]:.4f}" for m in ("accuracy", "nll", "ece")) + " |")
    L += ["", "## (c, d) Fit cost (single thread, same run; single-batch and debiased interleaved)", "",
          "| method | fit time [s] (mean) | rel. to full batch | debiased / single (median of pairs) | peak RSS increase [MiB] (mean) |",
          "|---|---|---|---|---|"]
    for n in order:
        e = meth[n]
        ratio = e.get("time_ratio_vs_single", {}).get("median")
        L.append(f"| {e['label']} | {e['seconds_mean']:.2f} | {e['seconds_rel_full']:.4f} | "
                 f"{'-' if ratio is None else f'{ratio:.3f}'} | {e['peak_mib_mean']:.1f} |")
    L += ["", "## (e) Prior precision selected on the validation set, and test metrics there", "",
          "Selection by validation NLL (all methods) and by the Laplace marginal likelihood (where the class provides it). "
          "Distance: |log10(δ) - log10(δ_full)|, mean over repeats.", "",
          "| method | criterion | δ (median) | distance to full-batch choice [decades] | test accuracy | test NLL | test ECE |",
          "|---|---|---|---|---|---|---|"]
    for n in order:
        e = meth[n]
        for crit in ("val_nll", "marglik"):
            sels = [r["selected"][crit] for r in e["repeats"] if crit in r["selected"]]
            if not sels:
                continue
            d = [s.get("log10_dist_to_full", 0.0) for s in sels]
            L.append(f"| {e['label']} | {crit} | {np.median([s['prior_precision'] for s in sels]):.3g} | {np.mean(d):.2f} | "
                     + " | ".join(f"{np.mean([s[m] for s in sels]):.4f}" for m in ("accuracy", "nll", "ece")) + " |")
    L += ["", "## Targets (issue 8)", "", "| target | measured (mean over repeats) | worst repeat | met |", "|---|---|---|---|"]
    for t in tgt:
        w = "-" if t["worst_repeat"] is None else f"{t['worst_repeat']:.4g}"
        verdict = "(report)" if t["met"] is None else "met" if t["met"] else "**not met**"
        L.append(f"| {t['target']} | {t['measured']:.4g} | {w} | {verdict} |")
    L += ["", "## Degradation of single-batch K-FAC at small prior precision (test NLL, mean over repeats)", "",
          "| method | " + " | ".join(f"δ={d:.0e}" for d in GRID[:5]) + " |", "|---|" + "---|" * 5]
    for n in order:
        e = meth[n]
        if e["method"] not in ("kron", "debiased_kron", "kron-full"):
            continue
        keys = [f"{n}#{r['repeat']}" for r in e["repeats"]]
        vals = np.mean([res[k]["test"]["nll"][:5] for k in keys], axis=0)
        L.append(f"| {e['label']} | " + " | ".join(f"{v:.4f}" for v in vals) + " |")
    L += ["", "Figures: " + ", ".join(f"`{p}`" for p in meta.get("figures", [])), ""]
    return "\n".join(L)


def figures(summary: dict, res: dict, out: Path, cfg: Config) -> list[str]:
    """Figure-6-style plots: metric vs prior precision, one figure per batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meth = summary["methods"]
    full = next(n for n in meth if meth[n]["method"] == "kron-full")
    fk = f"{full}#None"
    panels = [("test", "nll"), ("test", "ece"), ("test", "accuracy"),
              ("c3", "nll"), ("c5", "nll"), ("c5", "auroc")]
    families = {"kron": ("kron", "debiased_kron"), "lowrank": ("lowrank", "debiased_lowrank")}
    colors = {"kron": "tab:red", "debiased_kron": "tab:blue", "lowrank": "tab:orange", "debiased_lowrank": "tab:green"}
    paths = []
    for fam, members in families.items():
        for b in sorted({e["b"] for e in meth.values() if e["method"] in members}):
            fig, axes = plt.subplots(2, 3, figsize=(13, 7))
            for ax, (s, m) in zip(axes.flat, panels):
                for name, e in meth.items():
                    if e["method"] not in members or e["b"] != b:
                        continue
                    Y = np.array([res[f"{name}#{r['repeat']}"][s][m] for r in e["repeats"]])
                    ax.plot(GRID, Y.mean(0), color=colors[e["method"]], label=e["label"])
                    ax.fill_between(GRID, Y.min(0), Y.max(0), color=colors[e["method"]], alpha=0.2)
                ax.plot(GRID, res[fk][s][m], "kx", label="K-FAC full-batch")
                ax.axhline(res["map"][s][m], color="gray", ls="--", label="MAP")
                ax.set_xscale("log")
                ax.set_xlabel("prior precision")
                ax.set_title(f"{m} ({'test' if s == 'test' else 'corrupted, severity ' + s[1]})")
                if m == "nll":
                    ax.set_yscale("log")
            axes.flat[0].legend(fontsize=8)
            fig.suptitle(f"CIFAR-10 cifar_cnn, {fam} LA, b={b} (mean and min/max over {cfg.repeats} draws)")
            fig.tight_layout()
            p = out / f"fig6_{fam}_b{b}.png"
            fig.savefig(p, dpi=80)
            plt.close(fig)
            paths.append(p.name)
    return paths


# ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=None, help="CIFAR-10 root (else $LAPLACE_DEBIASED_DATA, else ~/.cache/laplace-debiased/data)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output folder")
    parser.add_argument("--quick", action="store_true", help="a few minutes: short training, small subsets, 2 repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--n-test", type=int, default=None)
    parser.add_argument("--n-corrupt", type=int, default=None)
    parser.add_argument("--n-val", type=int, default=None)
    parser.add_argument("--fresh", action="store_true", help="ignore cached fits and predictions")
    parser.add_argument("--predict-only", action="store_true",
                        help="helper process: compute and cache the predictions of the fits already cached "
                             "by a running benchmark of the same configuration, then exit (no fits, no report)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    cfg = Config.quick_config() if args.quick else Config()
    for a, f in (("repeats", "repeats"), ("n_test", "n_test"), ("n_corrupt", "n_corrupt"), ("n_val", "n_val")):
        if getattr(args, a) is not None:
            setattr(cfg, f, getattr(args, a))
    if args.batch_sizes:
        cfg.batch_sizes = tuple(args.batch_sizes)
    if cfg.n_corrupt > cfg.n_test:
        parser.error("--n-corrupt must not exceed --n-test (corrupted sets are copies of test images)")
    out = Path(args.out) / ("quick" if cfg.quick else "")
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()

    data = common.load_data(args.data, n_train=common.QUICK_N_TRAIN if cfg.quick else None)
    model, history = common.trained_model(data, quick=cfg.quick, log=log)
    model.eval()
    map_test = evaluate_loss(model, DataLoader(data.test, batch_size=1000))
    log(f"MAP: train NLL {history[-1]['train_loss']:.4f}, test NLL {map_test['loss']:.4f}, "
        f"test acc {map_test['accuracy']:.4f} (all 10,000 test images)")

    # cache keys: the fits depend on the model and the fit settings, the predictions also on the
    # evaluation settings
    model_id = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:12]
    fit_cfg = {k: getattr(cfg, k) for k in ("seed", "full_batch_size", "lowrank_rank")}
    fit_cache = CACHE / f"fits-{model_id}-{_hash(fit_cfg)}"
    pred_cache = CACHE / f"probs-v{PREDICTIVE_VERSION}-{model_id}-{_hash(fit_cfg)}-{cfg.key()}"
    if args.fresh:
        shutil.rmtree(fit_cache, ignore_errors=True)
        shutil.rmtree(pred_cache, ignore_errors=True)
    fit_cache.mkdir(parents=True, exist_ok=True)
    pred_cache.mkdir(parents=True, exist_ok=True)

    helper = pred_cache / "helper.pid"
    if args.predict_only:
        return predict_helper(model, data, cfg, fit_cache, pred_cache, helper, log)
    log("fitting ...")
    fits = run_fits(model, data.train, cfg, fit_cache, log)
    log("evaluation sets ...")
    sets = eval_sets(data, cfg, log)
    while helper.is_file() and _alive(int(helper.read_text() or 0)):
        log("  waiting for the --predict-only helper to finish ...")
        time.sleep(20)
    probs, maps = predictions(model, fits, sets, cfg, pred_cache, log)

    res = curves(probs, maps, sets, fits)
    summary = summarise(fits, res, cfg)
    tgt = targets(summary, cfg)
    meta = {
        "config": asdict(cfg), "grid": GRID, "n_params": sum(p.numel() for p in model.parameters()),
        "map_test": res["map"]["test"], "map_test_full_10k": map_test,
        "map_train_nll": history[-1]["train_loss"], "train_epochs": len(history), "train_history": history,
        "device": f"CPU ({platform.processor() or platform.machine()}), 1 thread; no GPU (ALL-CNN-C GPU setting not run)",
        "fits_loaded_from_cache": [fit_key(f) for f in fits if f.extra.get("cached")],
        "peak_memory_method": "peak RSS increase over pre-fit RSS, /proc/self/statm sampled every 5 ms, after gc + malloc_trim",
        "wall_seconds": time.perf_counter() - t0,
    }
    meta["figures"] = figures(summary, res, out, cfg)
    (out / "results.json").write_text(json.dumps(
        {"meta": meta, "targets": tgt, "summary": summary, "curves": res}, default=float))
    (out / "results.md").write_text(markdown(summary, res, cfg, meta, tgt))
    log(f"wrote {out / 'results.md'} and results.json ({meta['wall_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
