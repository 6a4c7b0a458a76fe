"""Linearized (GLM) predictive of every fit over a prior-precision grid, cached per (set, fit, δ).

Per chunk of inputs the per-example Jacobians are computed once and shared by every fit; each fit
rotates them into its eigenbasis once and gets the logit covariances of all requested prior
precisions in one pass (``laplace_debiased.evaluation.predictive``).  Link: Monte Carlo, ``S``
samples of the Gaussian logits (Eq. 18 of the paper).  The standard-normal draws depend only on
(set, chunk, MC stream), so every fit and every δ sees the same draws (common random numbers:
differences between methods and along the grid are not MC noise).  The full-batch K-FAC fit is
predicted a second time with an independent MC stream: the gap between its two predictions is the
MC noise floor.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zlib
from pathlib import Path

import torch

from laplace_debiased.posterior.jacobians import logit_jacobians
from laplace_debiased.posterior.links import apply_link

from .config import Config
from .fits import Fit

#: Bumped whenever the predictive computation changes (invalidates cached predictions).
PREDICTIVE_VERSION = 4
#: Chunks per checkpoint block: a set's predictive is saved block by block, so an interrupted run
#: (the 10,000 test images take an hour on one CPU core) resumes at the first missing block.
BLOCK_CHUNKS = 16


def mc_streams(fit: Fit) -> tuple[int, ...]:
    """MC streams predicted for a fit: the common one (0), plus an independent one (1) for the
    full-batch K-FAC reference (the noise floor)."""
    return (0, 1) if fit.method == "kron-full" else (0,)


def probs_key(fit: Fit, stream: int) -> str:
    return fit.key if stream == 0 else f"{fit.key}@mc{stream}"


def _seed(cfg: Config, set_name: str, chunk: int, stream: int) -> int:
    return ((cfg.seed * 7919 + stream) * 1_000_003 + zlib.crc32(set_name.encode())) * 100_003 + chunk


def _dkey(delta: float) -> str:
    return f"{delta:.6e}"


@torch.no_grad()
def _predict(model, fits: list[Fit], todo: dict[str, list[float]], X: torch.Tensor, set_name: str,
             cfg: Config, first_chunk: int = 0) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """``out[probs_key][δ]`` ``(N, C)`` for the prior precisions ``todo[fit.key]``, and the MAP.

    ``X`` starts at chunk ``first_chunk`` of its set: the MC draws depend on the set's chunk
    index, so predicting a set block by block gives the same numbers as predicting it at once."""
    params = list(model.parameters())
    dev = params[0].device
    n_ll = 2  # the last nn.Linear's weight and bias are the model's last two parameters
    out: dict[str, dict[str, list[torch.Tensor]]] = {}
    maps = []
    gen = torch.Generator(device=dev)
    for ci, x in enumerate(X.split(cfg.chunk_size), start=first_chunk):
        f, jacs = logit_jacobians(model, params, x.to(dev))
        maps.append(torch.softmax(f, -1).cpu())
        for fit in fits:
            deltas = todo.get(fit.key)
            if not deltas:
                continue
            rotated = fit.structure.rotate(jacs if fit.subset == "all" else jacs[-n_ll:])
            covs = fit.structure.covariances(rotated, deltas)
            for stream in mc_streams(fit):
                slot = out.setdefault(probs_key(fit, stream), {})
                for delta, cov in zip(deltas, covs):
                    gen.manual_seed(_seed(cfg, set_name, ci, stream))
                    slot.setdefault(_dkey(delta), []).append(apply_link("mc", f, cov, cfg.mc_samples, gen).cpu())
            del rotated, covs
        del jacs
    return ({k: {d: torch.cat(v) for d, v in slot.items()} for k, slot in out.items()}, torch.cat(maps))


def _atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + f".{os.getpid()}.part")
    torch.save(obj, tmp)
    tmp.replace(path)


def _block_paths(todo: dict[str, list[float]], n: int, set_name: str, cfg: Config, cache: Path) -> list[Path]:
    """The checkpoint files of a set's ``n`` images for the work ``todo``, one per block."""
    tag = hashlib.sha256(json.dumps(todo, sort_keys=True).encode()).hexdigest()[:12]
    return [cache / f"block-{set_name}-{tag}-{j}.pt" for j in range(-(-n // (BLOCK_CHUNKS * cfg.chunk_size)))]


def _predict_block(model, fits: list[Fit], todo: dict[str, list[float]], X: torch.Tensor, set_name: str,
                   cfg: Config, paths: list[Path], j: int, log=print) -> None:
    """Predict block ``j`` of the set and save it as ``paths[j]``."""
    step = BLOCK_CHUNKS * cfg.chunk_size
    start = time.perf_counter()
    _atomic_save(_predict(model, fits, todo, X[j * step:(j + 1) * step], set_name, cfg, first_chunk=j * BLOCK_CHUNKS),
                 paths[j])
    log(f"    {set_name}: block {j + 1}/{len(paths)} ({time.perf_counter() - start:.0f} s)")


def _predict_blocks(model, fits: list[Fit], todo: dict[str, list[float]], X: torch.Tensor, set_name: str,
                    cfg: Config, cache: Path, log=print) -> tuple[dict[str, dict[str, torch.Tensor]], torch.Tensor]:
    """:func:`_predict` over blocks of ``BLOCK_CHUNKS`` chunks, each saved in ``cache`` when done
    and reused by a later call with the same ``todo`` (or made by :func:`fill_from_end` in another
    process); returns the whole set's output and deletes the block files."""
    paths = _block_paths(todo, len(X), set_name, cfg, cache)
    parts = []
    for j, path in enumerate(paths):
        if not path.is_file():
            _predict_block(model, fits, todo, X, set_name, cfg, paths, j, log)
        parts.append(torch.load(path, weights_only=True))
    out = {k: {d: torch.cat([p[0][k][d] for p in parts]) for d in slot} for k, slot in parts[0][0].items()}
    maps = torch.cat([p[1] for p in parts])
    for path in paths:
        path.unlink()
    return out, maps


def _stored_and_todo(fits: list[Fit], grid: list[float], set_name: str, cache: Path) -> tuple[dict, dict[str, list[float]]]:
    """The cached ``{δ: probs}`` of every (fit, MC stream) on a set, and the δ each fit still needs."""
    stored: dict[str, dict[str, torch.Tensor]] = {}
    todo: dict[str, list[float]] = {}
    for fit in fits:
        for stream in mc_streams(fit):
            k = probs_key(fit, stream)
            path = cache / f"probs-{set_name}-{k.replace('#', '-r')}.pt"
            stored[k] = torch.load(path, weights_only=True) if path.is_file() else {}
            missing = [d for d in grid if _dkey(d) not in stored[k]]
            if missing:
                todo[fit.key] = sorted(set(todo.get(fit.key, [])) | set(missing))
    return stored, todo


def fill_from_end(model, fits: list[Fit], sets: dict, grid: list[float], cfg: Config, cache: Path,
                  names: list[str], log=print) -> None:
    """A second process's share of :func:`predictions`: the missing blocks of each set in
    ``names``, from the last block backwards, until it meets a block that exists (made by the
    main run, which goes forwards, loads these blocks and assembles the set), or until the set is
    assembled (the main run deletes the blocks then).  Two processes meet in the middle; at worst
    both predict the block they meet on, with the same numbers."""
    for s in names:
        X, _ = sets[s]
        _, todo = _stored_and_todo(fits, grid, s, cache)
        if not todo:
            continue
        paths = _block_paths(todo, len(X), s, cfg, cache)
        for j in reversed(range(len(paths))):
            if paths[j].is_file() or not _stored_and_todo(fits, grid, s, cache)[1]:
                break
            _predict_block(model, fits, todo, X, s, cfg, paths, j, log)


def predictions(model, fits: list[Fit], sets: dict, grid: list[float], cfg: Config, cache: Path,
                names: list[str] | None = None, log=print) -> tuple[dict, dict]:
    """``probs[set][probs_key]`` ``(G, N, C)`` on ``grid`` and ``maps[set]`` ``(N, C)``.

    Cached per (set, fit) as ``{δ: probs}``: an interrupted run, a run with more fits or a longer
    grid computes only what is missing.  ``names``: the sets to predict (default: all).
    """
    probs: dict[str, dict[str, torch.Tensor]] = {}
    maps: dict[str, torch.Tensor] = {}
    for s in names or list(sets):
        X, _ = sets[s]
        stored, todo = _stored_and_todo(fits, grid, s, cache)
        map_path = cache / f"map-{s}.pt"
        if todo or not map_path.is_file():
            start = time.perf_counter()
            new, maps[s] = _predict_blocks(model, fits, todo, X, s, cfg, cache, log)
            for k, slot in new.items():
                stored[k].update(slot)
                _atomic_save(stored[k], cache / f"probs-{s}-{k.replace('#', '-r')}.pt")
            _atomic_save(maps[s], map_path)
            n_pts = sum(len(v) for v in todo.values())
            log(f"  predictive on {s} ({len(X)} images, {len(todo)} fits, {n_pts} (fit, δ) pairs): "
                f"{time.perf_counter() - start:.1f} s")
        else:
            maps[s] = torch.load(map_path, weights_only=True)
        probs[s] = {k: torch.stack([slot[_dkey(d)] for d in grid]) for k, slot in stored.items()}
    return probs, maps
