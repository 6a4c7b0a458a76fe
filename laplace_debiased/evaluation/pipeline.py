"""The main job: train (or load) a MAP model, fit Laplace approximations, sweep, report.

Shared by ``laplace-debiased main`` / ``sweep`` (and ``python -m laplace_debiased``).  Options are
command-line flags; ``--config FILE`` (JSON or TOML) supplies any of them under the same names
(``batch-size`` or ``batch_size``); flags given on the command line win over the file.

``--batch-size`` takes one batch size b or several.  Each mini-batch method below is fitted and
evaluated at each b (the full-batch methods once); with several, its rows carry the name
``method@b<b>`` (``kron_single@b32``, [`sweep_methods`][laplace_debiased.evaluation.options.sweep_methods]),
with one the method's own name.  Every mini-batch row records its ``batch_size``.

Methods (``--methods``), all over the weights chosen by ``--subset``, are the entries of
[`METHODS`][laplace_debiased.evaluation.methods.METHODS]: a structure, its fit options and a batch
rule, fitted by [`fit_laplace`][laplace_debiased.evaluation.pipeline.fit_laplace]:

* ``*_single``: one mini-batch of ``--batch-size`` samples (B̃ = B), scaled to N;
* ``*_debiased``, ``kron_corrected``, ``kron_shrunk``: two disjoint batches of ``--batch-size/2``
  samples, B choosing the eigenvectors and B̃ measuring the eigenvalues (``estimator="paper"``),
  or the eigenvectors of B ∪ B̃ with eigenvalues less the regression-to-the-mean gap the batches
  measure against each other (``"corrected"``, the default of a K-FAC fit;
  [`laplace_debiased.kron.corrected`][laplace_debiased.kron.corrected]), or that correction
  shrunk by the two orders' disagreement (``"shrunk"``);
* ``*_full``: every training point (one repeat, the reference of its structure).

The structures are K-FAC (``kron_*``), EKFAC (``ekfac_*``, the exact curvature along the K-FAC
eigenbasis of B measured on B̃) and the top-``--rank`` GGN eigenpairs (``lowrank_*``); EKFAC and
low rank are opt-in.

Each repeat draws fresh batches (seeded).  Digits evaluation sets: the validation split (for
choosing the prior precision), the test split, the test split with Gaussian pixel noise of
severity 1-3 (σ = 0.1, 0.2, 0.4, clipped to [0, 1]) and, as OOD, the inverted test images ``1 - x``.

The prior precision is chosen per method on the validation split (lowest NLL with the first
link), never on test.  When a choice lies on an edge of the grid, the grid grows by one step
beyond that edge (the edge's own log spacing) and the sweep resumes, up to
[`MAX_EXTENSIONS`][laplace_debiased.evaluation.pipeline.MAX_EXTENSIONS] times, so that the chosen value is
interior.

The output folder is locked while a run writes into it (a second run refuses, or waits up to
``--lock-timeout`` seconds).  ``options.json`` records every setting that changes the numbers
([`SETTINGS_KEYS`][laplace_debiased.evaluation.pipeline.SETTINGS_KEYS], the MAP training configuration and the
[`software_versions`][laplace_debiased.evaluation.pipeline.software_versions]); resuming with other values, or
into a folder that has results but no ``options.json``, is refused.

Under an initialised ``torch.distributed`` group (``torchrun --nproc-per-node W -m
laplace_debiased
...``; every rank runs [`run_pipeline`][laplace_debiased.evaluation.pipeline.run_pipeline] with the same options) rank 0 alone locks the folder, checks ``options.json``, trains (or loads) the MAP model and sends its weights
to the other ranks; the sweep shards its (method, repeat) jobs over the ranks
([`run_sweep`][laplace_debiased.evaluation.sweep.run_sweep]), rank 0 writes every row and the report.
Each rank loads only its rows ``shard_range(N, rank, W)`` of the training set
([`laplace_debiased.data.shards`][laplace_debiased.data.shards]) and fetches from their owners the rows its
own fits draw ([`fit_rows`][laplace_debiased.evaluation.pipeline.fit_rows],
[`fetch_rows`][laplace_debiased.parallel.distributed.fetch_rows]); rank 0 fetches every row only to train the
MAP model on a cache miss.  Of every evaluation set each rank reads and predicts only its rows
``chunk_shard(n, --chunk-size, rank, W)``, for every fitted posterior; the metrics combine the ranks' sums
([`run_sweep`][laplace_debiased.evaluation.sweep.run_sweep]). The rows equal a single-process run's up to the
round-off of adding the ranks' sums (the predictions of every row bitwise).  A failure on any rank raises on
every rank ([`gather_results`][laplace_debiased.parallel.distributed.gather_results]).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch.utils.data import DataLoader, Dataset

from laplace_debiased.evaluation import methods
from laplace_debiased.evaluation.methods import Method
from laplace_debiased.evaluation.options import batch_sizes, sweep_methods
from laplace_debiased.prior_grid import PriorGrid
from laplace_debiased.evaluation.report_data import SETTING_NAME
from laplace_debiased.evaluation.sweep import EvalSet, SweepJob, load_rows, output_lock, run_sweep
from laplace_debiased.parallel.distributed import fetch_rows, gather_results, rank_world

if TYPE_CHECKING:
    from laplace.baselaplace import BaseLaplace

#: grid extensions at most, so that every method's validation choice of δ is interior
MAX_EXTENSIONS = 4
#: Gaussian pixel-noise standard deviation of the digits' corrupted test sets, by severity
DIGITS_NOISE = {1: 0.1, 2: 0.2, 3: 0.4}


def _tensors(ds: Dataset, rows: range) -> tuple[torch.Tensor, torch.Tensor]:
    """Items ``rows`` of ``ds`` as stacked inputs and labels (no rows: empty, shaped as item 0)."""
    if not rows:
        x, _ = ds[0]
        return torch.empty((0, *torch.as_tensor(x).shape)), torch.empty(0, dtype=torch.long)
    xs, ys = zip(*(ds[i] for i in rows))
    return torch.stack([torch.as_tensor(x) for x in xs]), torch.as_tensor(ys, dtype=torch.long)


def _held_train(n_full: int, load: Callable[[range | None], Dataset], opts: dict) -> Dataset:
    """The training set of this process: ``load(None)`` (cut to ``--train-size`` rows) in one
    process; under a process group of ``W`` ranks, rank ``r`` loads only its rows
    ``shard_range(N, r, W)`` (``load(rows)``), served under their global indices as
    [`HeldRows`][laplace_debiased.data.shards.HeldRows] of length N."""
    from laplace_debiased.data.shards import HeldRows, shard_range

    rank, world = rank_world()
    n = min(opts["train_size"], n_full) if opts["train_size"] else n_full
    if world == 1:
        train = load(None)
        return torch.utils.data.Subset(train, range(n)) if opts["train_size"] else train
    own = shard_range(n, rank, world)
    return HeldRows(n, own, load(own))


def _digits(opts: dict) -> tuple[Dataset, list[EvalSet], Callable[[], torch.nn.Module], str]:
    from laplace_debiased.data.digits import digits_splits
    from laplace_debiased.data.shards import tensor_rows
    from laplace_debiased.evaluation.models import digits_cnn

    splits = digits_splits(seed=opts["seed"])
    train = _held_train(len(splits["train"]), lambda rows: splits["train"] if rows is None
                        else tensor_rows(splits["train"], rows), opts)
    x, y = splits["test"].tensors
    gen = torch.Generator().manual_seed(opts["seed"] + 1)
    sets = [EvalSet("validation", *splits["val"].tensors, "validation"), EvalSet("test", x, y, "test")]
    for sev, sigma in DIGITS_NOISE.items():
        noisy = (x + sigma * torch.randn(x.shape, generator=gen)).clamp(0, 1)
        sets.append(EvalSet(f"noise-{sev}", noisy, y, "corrupted", sev))
    sets.append(EvalSet("inverted (OOD)", 1 - x, None, "ood"))
    rank, world = rank_world()
    if world > 1:  # this rank's rows (the embedded data set is small: made whole, then cut)
        sets = [_copied_rows(es.shard(opts["chunk_size"], rank, world)) for es in sets]
    return train, sets, digits_cnn, "digits_cnn"


def _copied_rows(es: EvalSet) -> EvalSet:
    """``es`` with its rows copied (a cut is a view that would keep the whole set alive)."""
    return replace(es, x=es.x.clone(), y=None if es.y is None else es.y.clone())


def _cifar(opts: dict) -> tuple[Dataset, list[EvalSet], Callable[[], torch.nn.Module], str]:
    from laplace_debiased.data.cifar import load_cifar10, load_cifar100
    from laplace_debiased.data.eval_sets import resolve_eval_set
    from laplace_debiased.data.cifar import official_size
    from laplace_debiased.evaluation.models import cifar_cnn

    if not opts["data_root"]:
        raise ValueError(
            f"--data {opts['data']} needs --data-root DIR: a folder holding the official CIFAR archive unpacked "
            "(cifar-10-batches-py/ or cifar-10-batches-bin/; cifar-100-python/ or cifar-100-binary/), from "
            "https://www.cs.toronto.edu/~kriz/cifar.html"
        )
    load = load_cifar100 if opts["data"] == "cifar100" else load_cifar10
    train = _held_train(official_size(opts["data"], "train"),
                        lambda rows: load(opts["data_root"], "train", rows=rows), opts)
    from laplace_debiased.data.shards import chunk_shard

    rank, world = rank_world()
    sets, have_test = [], False
    for spec in opts["eval"]:
        ds = resolve_eval_set(spec, opts["data_root"], seed=opts["seed"])
        n = min(opts["eval_size"], len(ds)) if opts["eval_size"] else len(ds)
        rows = chunk_shard(n, opts["chunk_size"], rank, world)  # this rank reads only these
        x, y = _tensors(ds, rows)
        corrupted = "-c" in spec.split(":")[0]
        kind = "corrupted" if corrupted else ("ood" if have_test else "test")
        severity = int(spec.rsplit(":", 1)[1]) if corrupted and spec.rsplit(":", 1)[1].isdigit() else None
        sets.append(EvalSet(spec, x, y if kind != "ood" else None, kind, severity, size=n, offset=rows.start))
        have_test = have_test or kind == "test"
    if not have_test:
        raise ValueError("give a clean in-distribution --eval set first, e.g. --eval cifar10-test")
    n_classes = 100 if opts["data"] == "cifar100" else 10
    return train, sets, lambda: cifar_cnn(n_classes), "cifar_cnn" if n_classes == 10 else "cifar100_cnn"


def _fit_loader(method: Method, train: Dataset, opts: dict, repeat: int, b: int | None) -> tuple[DataLoader, int]:
    """The loader that ``method``'s fit of ``repeat`` at batch size ``b`` reads, and how many of
    its batches, by its batch rule: one of ``b``, two of half that, or one of every training point
    (``b=None``); the shuffling is seeded by ``--seed`` and the repeat (the same draws at every b)."""
    if method.full_batch:
        return DataLoader(train, batch_size=len(train)), 1
    gen = torch.Generator().manual_seed(opts["seed"] * 7919 + repeat)
    size, count = (b, 1) if method.batches == "single" else (b // 2, 2)
    return DataLoader(train, batch_size=size, shuffle=True, generator=gen), count


def fit_rows(opts: dict, n: int, rank: int, world: int) -> list[int]:
    """The training rows that rank ``rank`` of ``world`` reads in its fits: those of the
    (method, repeat) jobs ``k`` with ``k % world == rank``, the sweep's job order
    ([`run_sweep`][laplace_debiased.evaluation.sweep.run_sweep]; a method at each batch size,
    [`sweep_methods`][laplace_debiased.evaluation.options.sweep_methods]). Replays each job's seeded sampler
    (``_fit_loader``) over the row indices themselves: the loader's iterator draws its base
    seed from the generator before the sampler does, so the indices come from iterating the loader."""
    from itertools import islice

    jobs = [(methods.METHODS[m], b, r) for _, m, b in sweep_methods(opts)
            for r in range(1 if methods.METHODS[m].full_batch else opts["repeats"])]
    rows: set[int] = set()
    for method, b, repeat in jobs[rank::world]:
        loader, count = _fit_loader(method, range(n), opts, repeat, b)  # a range: it yields the indices
        rows.update(i for batch in islice(loader, count) for i in batch.tolist())
    return sorted(rows)


def fit_laplace(method: Method, model: torch.nn.Module, loader: DataLoader, *, subset: str, rank: int) -> BaseLaplace:
    """``method``'s Laplace approximation of ``model``, fitted on ``loader`` by its batch rule: its
    first two batches are B and B̃ for a two-batch method; else its first batch is both (B̃ = B).

    Args:
        method: The method (its structure and options).
        model: The MAP network.
        loader: The batches ([`fit_rows`][laplace_debiased.evaluation.pipeline.fit_rows] replays them).
        subset: ``subset_of_weights``, ``"all"`` or ``"last_layer"``.
        rank: The rank of a low-rank structure.

    Returns:
        The fitted Laplace object.
    """
    from laplace import Laplace

    la = Laplace(model, "classification", subset_of_weights=subset, hessian_structure=method.structure,
                 **method.options, **({"rank": rank} if method.structure == "debiased_lowrank" else {}))
    la.fit(loader, **({} if method.batches == "two" else {"magnitude_loader": loader}))
    return la


def sweep_job(key: str, method: Method, model: torch.nn.Module, train: Dataset, opts: dict,
              b: int | None) -> SweepJob:
    """``method`` at batch size ``b`` (``None`` for a full-batch method) as the sweep's job, its rows
    named ``key`` ([`sweep_methods`][laplace_debiased.evaluation.options.sweep_methods]); a grid
    extension reuses its fits."""

    @functools.cache
    def fit(repeat: int):
        loader, _ = _fit_loader(method, train, opts, repeat, b)
        return fit_laplace(method, model, loader, subset=opts["subset"], rank=opts["rank"])

    return SweepJob(key, fit, repeats=1 if method.full_batch else opts["repeats"], full_batch=method.full_batch,
                    extra={} if b is None else {"batch_size": b})


#: options that change the numbers of existing rows; resuming with other values is refused
SETTINGS_KEYS = ("seed", "data", "data_root", "eval", "eval_size", "train_size", "epochs", "subset",
                 "batch_size", "rank", "n_samples", "chunk_size")


def software_versions() -> dict[str, str]:
    """The installed versions of the packages whose code makes the numbers of a row: this one and
    laplace-torch (``"unknown"`` when run from a source tree without an installed distribution)."""
    found = {}
    for dist in ("laplace-debiased", "laplace-torch"):
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            found[dist] = "unknown"
    return found


def check_settings(out: Path, opts: dict, extra: dict | None = None) -> None:
    """Record the settings in ``out/options.json``, or refuse to resume under other ones.

    ``extra`` adds settings that are not options (the MAP training configuration).  The settings
    include [`software_versions`][laplace_debiased.evaluation.pipeline.software_versions]: another release may
    give other numbers for the same row keys, so its rows are not resumed either.  The caller holds the
    folder's lock; the file is written to a temporary name and renamed.
    """
    path = Path(out) / "options.json"
    settings = json.loads(json.dumps({**{k: opts[k] for k in SETTINGS_KEYS}, **(extra or {}),
                                      "software": software_versions()}))
    sizes = batch_sizes(opts)
    settings["batch_size"] = sizes[0] if len(sizes) == 1 else sizes  # one: recorded as before, an integer
    if path.exists():
        try:
            old = json.loads(path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{path} is not valid JSON ({err}); restore it or choose another --out") from err
        if not isinstance(old, dict):
            raise ValueError(f"{path} does not hold a settings object; restore it or choose another --out")
        changed = {k: (old.get(k), v) for k, v in settings.items() if old.get(k) != v}
        if changed:
            hint = ""
            if "software" in changed:
                hint = (f"; its rows were written by {changed['software'][0] or 'an older release'} and this is "
                        f"{changed['software'][1]}, whose numbers may differ")
            elif "batch_size" in changed:
                was, now = (" ".join(map(str, v if isinstance(v, list) else [v])) for v in changed["batch_size"])
                hint = (f"; its results are for --batch-size {was}, not {now} (each list of batch sizes is its "
                        f"own run: rerun with --batch-size {was} to resume it)")
            raise ValueError(
                f"{path.parent} holds results of a different setup {changed} (old, new){hint}; "
                "choose another --out to keep both"
            )
        return
    if load_rows(path.parent / "results.jsonl"):
        raise ValueError(
            f"{path.parent} has results but no options.json, so their settings are unknown; "
            "choose another --out (or move results.jsonl away)"
        )
    tmp = path.with_name(".options.json.tmp")
    tmp.write_text(json.dumps(settings, indent=2, allow_nan=False))
    tmp.replace(path)


def _describe_eval_set(es: EvalSet, data: str) -> str:
    n = f"{es.size:,} points"
    if data != "digits":
        return {"test": f"{es.name}, the in-distribution test set ({n})",
                "validation": f"{es.name}, used to choose δ ({n})",
                "corrupted": f"{es.name}: corrupted, severity {es.severity} ({n})",
                "ood": f"{es.name}: out of distribution ({n})"}[es.kind]
    return {"test": f"the digits test split ({n})",
            "validation": f"the digits validation split ({n}); δ is chosen here",
            "corrupted": f"the test images with Gaussian pixel noise σ = {DIGITS_NOISE.get(es.severity)}, "
                         f"clipped to [0, 1] (severity {es.severity}; {n})",
            "ood": f"the test images inverted, 1 − x: out of distribution ({n})"}[es.kind]


def describe_setting(opts: dict, n_train: int, eval_sets: list[EvalSet], tag: str, n_params: int) -> dict:
    """The run's setting in words, for the report (written to
    [`SETTING_NAME`][laplace_debiased.evaluation.report_data.SETTING_NAME])."""
    data = {"digits": "scikit-learn 8x8 digits (embedded)", "cifar10": "CIFAR-10",
            "cifar100": "CIFAR-100"}[opts["data"]]
    return {
        "data": data, "n_train": n_train, "model": tag, "n_params": n_params, "subset": opts["subset"],
        "methods": {key: methods.METHODS[m].describe(b, n_train, opts["rank"]) for key, m, b in sweep_methods(opts)},
        "eval_sets": {es.name: _describe_eval_set(es, opts["data"]) for es in eval_sets},
        "corruption": "Gaussian pixel noise" if opts["data"] == "digits" else "corruption",
        "severity_ticks": {str(k): f"σ = {v}" for k, v in DIGITS_NOISE.items()} if opts["data"] == "digits" else {},
    }


def _grid_extension(rows: list[dict], link: str) -> list[float]:
    """One new prior precision beyond each grid edge where a method's validation choice lies
    ([`extension`][laplace_debiased.prior_grid.PriorGrid.extension])."""
    from laplace_debiased.evaluation.report_data import chosen_prior_precisions

    val = next((r["eval_set"] for r in rows if r.get("kind") == "validation"), None)
    if val is None:
        return []
    deltas = sorted({r["prior_precision"] for r in rows if r["method"] != "map" and r["eval_set"] == val})
    if not deltas:
        return []
    return list(PriorGrid(tuple(deltas)).extension(chosen_prior_precisions(rows, val, link, "nll").values()))


def run_pipeline(opts: dict, *, report: bool = True) -> dict[str, Path]:
    """Train/load, fit, sweep (resumable, grid extended until the chosen δ is interior) and
    optionally report.  Returns the output paths.

    Collective under a process group (module docstring): call it on every rank."""
    out = Path(opts["out"])
    with ExitStack() as stack:
        # rank 0 alone holds the lock (the others would be refused); a refusal raises everywhere
        gather_results(lambda: stack.enter_context(output_lock(out, opts["lock_timeout"]))
                       if rank_world()[0] == 0 else None)
        return _run_locked(out, opts, report)


def _map_model(model: torch.nn.Module, train: Dataset, config, tag: str, out: Path, opts: dict,
               log: Callable[[str], None] | None) -> Dataset:
    """Rank 0 checks the settings and trains (or loads) the MAP model in place, the other ranks
    receive its weights; returns the training set as rank 0 read it.

    Under a process group rank 0 first fetches the rows that the cache key reads
    ([`fingerprint_rows`][laplace_debiased.evaluation.training.fingerprint_rows]) and, on a cache miss
    only, every row for the training (collective; the caller drops them again)."""
    from laplace_debiased.evaluation.training import fingerprint_rows, model_cache_path, train_map

    rank, world = rank_world()
    if world > 1:
        train = fetch_rows(train, fingerprint_rows(len(train)) if rank == 0 else [])

    def check() -> bool:
        check_settings(out, opts, {"train_config": asdict(config)})
        return not model_cache_path(model, train, config, tag).exists()

    if gather_results(lambda: check() if rank == 0 else None)[0] and world > 1:
        train = fetch_rows(train, range(len(train)) if rank == 0 else [])

    def trained() -> dict | None:
        """Rank 0: the MAP model trained (or loaded) in place; its weights for the other ranks."""
        train_map(model, train, config, tag=tag, log=log)
        return model.state_dict() if world > 1 else None

    state = gather_results(lambda: trained() if rank == 0 else None)[0]
    if rank != 0:
        model.load_state_dict(state)
    model.eval()
    return train


def _run_locked(out: Path, opts: dict, report: bool) -> dict[str, Path]:
    from laplace_debiased.evaluation.training import DIGITS_CONFIG, TrainConfig

    rank, world = rank_world()
    log = None if opts["quiet"] or rank != 0 else (lambda msg: print(msg, flush=True))
    torch.manual_seed(opts["seed"])
    train, eval_sets, arch, tag = _cifar(opts) if opts["data"] != "digits" else _digits(opts)
    base = DIGITS_CONFIG if opts["data"] == "digits" else TrainConfig()
    config = replace(base, seed=opts["seed"], epochs=opts["epochs"] or base.epochs)
    start = time.perf_counter()
    model = arch()
    train = _map_model(model, train, config, tag, out, opts, log)
    if world > 1:  # rank r holds its shard and the rows its own fits read, nothing more
        train = fetch_rows(train.own_only(), fit_rows(opts, len(train), rank, world))
    if log:
        log(f"MAP model ready ({time.perf_counter() - start:.1f} s); N = {len(train)}")
    if rank == 0:
        setting = describe_setting(opts, len(train), eval_sets, tag, sum(p.numel() for p in model.parameters()))
        (out / SETTING_NAME).write_text(json.dumps(setting, indent=2, ensure_ascii=False))
    jobs = [sweep_job(key, methods.METHODS[m], model, train, opts, b) for key, m, b in sweep_methods(opts)]
    keys = {job.name for job in jobs}
    results = out / "results.jsonl"
    configured = PriorGrid.parse(opts["prior_precisions"])
    grid = configured
    while True:
        rows = run_sweep(jobs, eval_sets, results, prior_precisions=list(grid), links=opts["links"],
                         n_samples=opts["n_samples"], seed=opts["seed"], chunk_size=opts["chunk_size"],
                         progress=not opts["quiet"], log=log, map_model=model)
        ours = [r for r in rows if r["method"] in keys or r["method"] == "map"]
        # a resumed run starts from the grid an earlier run already grew (counted from the rows)
        grid = grid.union(r["prior_precision"] for r in ours if r["method"] != "map")
        new = _grid_extension(ours, opts["links"][0])
        if not new or grid.n_outside(configured) >= MAX_EXTENSIONS:
            break
        if log:
            log(f"a validation choice of δ lies on the grid edge: extending the grid by {new}")
        grid = grid.union(new)
    paths = {"results": results}
    if report:
        from laplace_debiased.evaluation.report_page import write_report

        # rank 0 writes it; every rank returns its path
        paths["report"] = gather_results(
            lambda: write_report(results, out / "report", title=f"Calibration report ({tag})")
            if rank == 0 else None)[0]
    return paths
