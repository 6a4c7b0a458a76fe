"""The Laplace fits of the benchmark, each measured (wall time, peak RSS) and cached on disk.

Methods (all GGN curvature; K-FAC through laplace-torch's default Curvlinops backend):

* ``kron-b``                  K-FAC of one batch of b scaled to N (all weights): ``DebiasedKronLaplace``
                              with B̃ = B, which is laplace-torch's ``KronLaplace`` of the b samples
                              times N/b (``tests/test_benchmark_fits.py``);
* ``debiased_kron-b``         ``DebiasedKronLaplace`` on the *same* b samples: B = the first
                              b/(1+k), B̃ = the other k x b/(1+k) (k magnitude batches; k = 1 is
                              the paper's 2 x b/2), ``null_space`` as configured. The draws of
                              one repeat are nested prefixes of one draw
                              (:func:`equal_sample_draws`), so each debiased row sits next to the
                              single-batch row of the same samples;
* ``kron-full``               ``KronLaplace`` over the whole training set;
* ``lowrank_ll-b``            last-layer rank-k eigen LA on one batch of b
                              (``DebiasedLowRankLLLaplace`` with B̃ = B);
* ``debiased_lowrank_ll-b``   the same at 2 x b/2 (directions from B, eigenvalues from B̃);
* ``lowrank_ll-full``         the rank-k LA of the full-data last-layer GGN (top-k eigenpairs of
                              the GGN over all training images, with their full-data eigenvalues):
                              the fair reference of the two low-rank rows.
"""

from __future__ import annotations

import ctypes
import gc
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from laplace import KronLaplace
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.posterior.from_laplace import posterior_structure
from laplace_debiased.two_batch.coverage import numerical_rank
from laplace_debiased.kron.laplace import DebiasedKronLaplace
from laplace_debiased.eigen.laplace import DebiasedLowRankLLLaplace

from .config import WIDE_GRID, Config

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


def _synchronize() -> None:
    """Wait for queued CUDA work (a timed fit ends when its kernels do); nothing on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def warm_up(model, train: TensorDataset, cfg: Config, log=print) -> None:
    """One untimed single-batch and one debiased K-FAC fit of the first batch size, before the
    first timed fit: the first fit in a process pays one-time start-up costs that are not the
    method's (on CUDA: the context, kernel loading, cuBLAS/cuSOLVER handles), and would carry
    them into the fit-cost table."""
    b = (*cfg.batch_sizes, *cfg.lowrank_batch_sizes, cfg.full_batch_size)[0]
    idx = np.arange(min(b, len(train)) // 2 * 2)
    start = time.perf_counter()
    fit_kron(model, train, idx, debiased=False)
    fit_kron(model, train, idx, debiased=True, null_space=cfg.null_space)
    _synchronize()
    log(f"  warm-up (untimed single-batch and debiased K-FAC at b = {len(idx)}): {time.perf_counter() - start:.2f} s")


def measured(fn: Callable[[], Any], interval: float = 0.005) -> tuple[Any, float, float]:
    """Run ``fn()``; return its result, wall seconds, and the peak RSS increase in MiB over the RSS
    just before it (sampled every ``interval`` s from ``/proc/self/statm`` after ``gc.collect()`` +
    ``malloc_trim(0)``; tracemalloc cannot see torch's allocations)."""
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
        _synchronize()
    finally:
        seconds = time.perf_counter() - start
        done.set()
        thread.join()
    peak[0] = max(peak[0], _rss_bytes())
    return result, seconds, (peak[0] - base) / 2**20


@dataclass
class Fit:
    """One fitted posterior: what the predictive needs, its marginal likelihood, its cost.

    ``subset``: ``"all"`` (every weight) or ``"last_layer"`` (the last ``nn.Linear``; its
    structure is over ``[weight, bias]`` of that layer, the model's last two parameters).
    ``log_marglik``: ``log p(D | δ)`` on :data:`config.WIDE_GRID` (None if the class has none).
    """

    name: str
    method: str
    b: int | None
    repeat: int | None
    subset: str
    seconds: float
    peak_mib: float
    structure: Any
    log_marglik: list[float] | None = None
    extra: dict = field(default_factory=dict)
    magnitude_batches: int = 1  # k of a debiased K-FAC fit at b/(1+k) + k x b/(1+k)

    @property
    def key(self) -> str:
        return f"{self.name}#{self.repeat}"


def coverage_rows(la) -> list[dict] | None:
    """What a K-FAC fit's curvature covers, one dict per factor: a debiased fit's
    ``la.coverage.rows()``; for stock ``KronLaplace`` (B = B̃ = the data it was fitted on) each
    factor's dimension and numerical rank (:func:`numerical_rank`); None for other fits."""
    if getattr(la, "coverage", None) is not None:
        return la.coverage.rows()
    if not isinstance(la, KronLaplace) or getattr(la, "H_facs", None) is None:
        return None
    names = [n for n, m in la.model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    rows, blocks = [], iter(la.H_facs.kfacs)
    for name in names:
        module = la.model.get_submodule(name)
        for parameter in ("weight", "bias")[: 1 + (module.bias is not None)]:
            factors = next(blocks)
            kinds = ("output", "input") if len(factors) == 2 else ("bias",)
            rows += [{"layer": name, "parameter": parameter, "factor": kind, "dimension": int(F.shape[0]),
                      "rank": numerical_rank(F)} for kind, F in zip(kinds, factors)]
    return rows


def log_marglik(la) -> list[float] | None:
    """``log p(D | δ)`` of a fitted laplace-torch object on :data:`WIDE_GRID` (None if n/a)."""
    try:
        return [float(la.log_marginal_likelihood(prior_precision=torch.tensor([d]))) for d in WIDE_GRID]
    except (NotImplementedError, AttributeError, RuntimeError, ValueError, TypeError) as err:
        print(f"  (no marglik for {type(la).__name__}: {err})", flush=True)
        return None


#: Bumped when a fit's definition changes; part of the fit and prediction cache keys. 2: the
#: single-batch K-FAC is scaled to N (version 1 was laplace-torch's ``KronLaplace.fit`` on a loader
#: over b of the N samples, whose Curvlinops K-FAC scales each weight block's input factor by
#: b/N for a loader that covers all N: weight blocks (b/N)² and bias blocks b/N of the N-scaled K-FAC).
#: 3: debiased K-FAC rows at b/(1+k) + k x b/(1+k) next to single-batch K-FAC of the same samples
#: (nested draws), ``null_space`` explicit (before the package default became "isotropic").
#: 4: the isotropic completion averages only over tied runs of B's eigenvalues
#: (``curvature.linalg.tied_groups``), which changes every debiased K-FAC fit with a wide factor.
#: 5: single-batch K-FAC (B̃ = B) is stock K-FAC again (main c7d8aa6; under version 4 the
#: completion's group mean flattened B's small eigenvalues over its null space, e.g. 0.94 on all
#: 1,024 input directions of cifar_cnn's ``Linear(1024, 32)`` at b = 512).
FIT_VERSION = 5


def _loader(train: TensorDataset, idx: np.ndarray, batch_size: int) -> DataLoader:
    """Loader over the samples ``idx`` of ``train`` in that order; ``len(loader.dataset)`` is the
    training-set size N, which the debiased classes scale their curvature to.  laplace-torch's
    ``KronLaplace.fit`` does not: it assumes the loader covers all N samples."""
    return DataLoader(train, batch_size=batch_size, sampler=idx.tolist(), shuffle=False)


def fit_kron(model, train, idx, debiased: bool, magnitude_batches: int = 1, null_space: str = "isotropic",
             estimator: str = "paper"):
    """Debiased K-FAC on ``idx``: B = its first ``|idx| / (1 + k)`` samples, B̃ = the other
    ``k`` x that many (``k = magnitude_batches`` loader batches; ``k = 1``: halves, the paper's
    2 x b/2) with ``estimator``, B's null space treated by ``null_space``; or single-batch K-FAC on all of ``idx``
    (B̃ = B). Both scaled to ``N = len(train)``."""
    if debiased:
        size, rest = divmod(len(idx), 1 + magnitude_batches)
        if rest or not size:
            raise ValueError(f"{len(idx)} samples do not split into 1 + {magnitude_batches} equal batches.")
        la = DebiasedKronLaplace(model, "classification", n_magnitude_batches=magnitude_batches,
                                 null_space=null_space, estimator=estimator)
        la.fit(_loader(train, idx, size))
    else:
        la = DebiasedKronLaplace(model, "classification")
        loader = _loader(train, idx, len(idx))
        la.fit(loader, magnitude_loader=loader)
    return la


def equal_sample_draws(rng: np.random.Generator, n: int, b: int, magnitude_batches: tuple[int, ...]) -> dict[int, np.ndarray]:
    """One draw per ``k`` in ``magnitude_batches``: ``(1 + k) b/2`` distinct indices of ``range(n)``,
    each a prefix of one draw of ``(1 + max k) b/2`` (so B, the first b/2, is shared and each B̃
    extends the smaller ones, as ``benchmarks/wide_layers.py`` combines chunks of 256)."""
    half = b // 2
    idx = rng.choice(n, size=half * (1 + max(magnitude_batches)), replace=False)
    return {k: idx[: half * (1 + k)] for k in magnitude_batches}


def fit_kron_full(model, train, batch_size: int):
    la = KronLaplace(model, "classification")
    la.fit(DataLoader(train, batch_size=batch_size, shuffle=False))
    return la


def fit_lowrank_ll(model, train, idx, rank: int, debiased: bool):
    """Last-layer rank-``rank`` LA: debiased at 2 x |idx|/2, else B̃ = B on all of ``idx``."""
    la = DebiasedLowRankLLLaplace(model, "classification", rank=rank)
    if debiased:
        la.fit(_loader(train, idx, len(idx) // 2))
    else:
        loader = _loader(train, idx, len(idx))
        la.fit(loader, magnitude_loader=loader)
    return la


def fit_lowrank_ll_full(model, train, rank: int, batch_size: int):
    """Top-``rank`` eigenpairs of the full-data last-layer GGN, with full-data eigenvalues."""
    la = DebiasedLowRankLLLaplace(model, "classification", rank=rank)
    loader = DataLoader(train, batch_size=batch_size, shuffle=False)
    la.fit(loader, magnitude_loader=loader)
    return la


def run_fits(model, train: TensorDataset, cfg: Config, cache: Path, log=print) -> list[Fit]:
    """Every fit, after :func:`warm_up` (if any fit is not cached); single-batch and debiased fits
    of the same draw back to back, alternating which goes first.  Each finished fit is saved as ``cache/fit-<name>-r<repeat>.pt`` and loaded on the
    next run (its time is then the one of the run that fitted it; ``extra["cached"]`` says so)."""
    fits: list[Fit] = []
    n = len(train)
    warmed = []

    def record(name, method, b, r, subset, fn, k: int = 1) -> None:
        path = cache / f"fit-{name}-r{r}.pt"
        if path.is_file():
            fit = torch.load(path, weights_only=False)
            fit.extra["cached"] = True
            fits.append(fit)
            return
        if not warmed:
            warm_up(model, train, cfg, log)
            warmed.append(True)
        la, sec, mib = measured(fn)
        fit = Fit(name, method, b, r, subset, sec, mib, posterior_structure(la), log_marglik(la),
                  {"cached": False, "fitted_at": time.strftime("%Y-%m-%d %H:%M:%S"), "coverage": coverage_rows(la)}, k)
        del la
        tmp = path.with_name(path.name + f".{os.getpid()}.part")
        torch.save(fit, tmp)
        tmp.replace(path)
        fits.append(fit)
        log(f"  fit {name:<26} repeat {r}: {sec:7.2f} s, peak +{mib:7.1f} MiB")

    rng = np.random.default_rng(cfg.seed)
    low_rng = np.random.default_rng([cfg.seed, 2])  # own stream: K-FAC draws do not depend on it
    for r in range(cfg.repeats):
        for i, b in enumerate(cfg.batch_sizes):
            for j, (k, idx) in enumerate(equal_sample_draws(rng, n, b, cfg.magnitude_batches).items()):
                m = len(idx)
                pair = [(f"kron-{m}", "kron", False, 1, "paper"), (f"debiased_kron-{m}", "debiased_kron", True, k, "paper")]
                pair += [(f"{est}_kron-{m}", f"{est}_kron", True, k, est) for est in ("corrected", "shrunk", "stein")
                         if est in cfg.estimators]
                for name, method, deb, kk, est in pair[:: -1 if (r + i + j) % 2 else 1]:
                    record(name, method, m, r, "all", lambda idx=idx, deb=deb, kk=kk, est=est:
                           fit_kron(model, train, idx, deb, kk, cfg.null_space, est), kk)
        for i, b in enumerate(cfg.lowrank_batch_sizes):
            idx = low_rng.choice(n, size=b, replace=False)
            k = cfg.lowrank_rank
            pair = [(f"lowrank_ll-{b}", "lowrank_ll", False), (f"debiased_lowrank_ll-{b}", "debiased_lowrank_ll", True)]
            for name, method, deb in pair[:: -1 if (r + i) % 2 else 1]:
                record(name, method, b, r, "last_layer",
                       lambda idx=idx, deb=deb: fit_lowrank_ll(model, train, idx, k, deb))
    if cfg.lowrank_batch_sizes:
        record("lowrank_ll-full", "lowrank_ll-full", None, None, "last_layer",
               lambda: fit_lowrank_ll_full(model, train, cfg.lowrank_rank, cfg.full_batch_size))
    record("kron-full", "kron-full", None, None, "all", lambda: fit_kron_full(model, train, cfg.full_batch_size))
    return fits
