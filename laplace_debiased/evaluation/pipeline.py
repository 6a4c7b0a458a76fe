"""The main job: train (or load) a MAP model, fit Laplace approximations, sweep, report.

Shared by ``laplace-debiased main`` / ``sweep`` (and ``python -m laplace_debiased``).  Options are
command-line flags; ``--config FILE`` (JSON or TOML) supplies any of them under the same names
(``batch-size`` or ``batch_size``); flags given on the command line win over the file.

``--batch-size`` takes one batch size b or several.  Each mini-batch method below is fitted and
evaluated at each b (the full-batch methods once); with several, its rows carry the name
``method@b<b>`` (``kron_single@b32``, :func:`~laplace_debiased.evaluation.options.sweep_methods`),
with one the method's own name.  Every mini-batch row records its ``batch_size``.

Methods (``--methods``), all over the weights chosen by ``--subset``:

* ``kron_single``: K-FAC of one mini-batch of ``--batch-size`` samples (B̃ = B), scaled to N;
* ``kron_debiased``: debiased K-FAC, two disjoint batches of ``--batch-size/2`` samples
  (B chooses the eigenvectors, B̃ measures the eigenvalues);
* ``kron_corrected``: the same two batches, ``fit(estimator="corrected")``: the eigenvectors of
  B ∪ B̃ with eigenvalues less the regression-to-the-mean gap the batches measure against each
  other (:mod:`laplace_debiased.curvature.corrected`);
* ``kron_shrunk``: the same two batches, ``fit(estimator="shrunk")`` (the default of ``fit``): the
  corrected estimate with each factor's correction shrunk by its noise;
* ``kron_stein``: the same two batches, ``fit(estimator="stein")``: the corrected estimate with
  each factor's correction weighted by its minimum-MSE (James–Stein) weight;
* ``kron_full``: K-FAC over all N training points (one repeat, drawn as markers);
* ``lowrank_single`` / ``lowrank_debiased``: top-``--rank`` GGN eigenpairs of B with eigenvalues
  from B (B̃ = B) or re-measured on B̃ (:mod:`laplace_debiased.structures.lowrank`);
* ``ekfac_single`` / ``ekfac_debiased`` / ``ekfac_full``: as the ``kron_*`` methods with
  ``hessian_structure='debiased_ekfac'`` (K-FAC eigenbasis of B, the exact curvature along it
  measured on B̃; :mod:`laplace_debiased.structures.ekfac`).  Opt-in, like low rank.

Each repeat draws fresh batches (seeded).  Digits evaluation sets: the validation split (for
choosing the prior precision), the test split, the test split with Gaussian pixel noise of
severity 1-3 (σ = 0.1, 0.2, 0.4, clipped to [0, 1]) and, as OOD, the inverted test images ``1 - x``.

The prior precision is chosen per method on the validation split (lowest NLL with the first
link), never on test.  When a choice lies on an edge of the grid, the grid grows by one step
beyond that edge (the edge's own log spacing) and the sweep resumes, up to
:data:`MAX_EXTENSIONS` times, so that the chosen value is interior.

The output folder is locked while a run writes into it (a second run refuses, or waits up to
``--lock-timeout`` seconds).  ``options.json`` records every setting that changes the numbers
(:data:`SETTINGS_KEYS`, the MAP training configuration and the :func:`software_versions`);
resuming with other values, or into a folder that has results but no ``options.json``, is refused.

Under an initialised ``torch.distributed`` group (``torchrun --nproc-per-node W -m
laplace_debiased ...``; every rank runs :func:`run_pipeline` with the same options) rank 0 alone
locks the folder, checks ``options.json``, trains (or loads) the MAP model and sends its weights
to the other ranks; the sweep shards its (method, repeat) jobs over the ranks
(:func:`~laplace_debiased.evaluation.sweep.run_sweep`), rank 0 writes every row and the report.
Each rank loads only its rows ``shard_range(N, rank, W)`` of the training set
(:mod:`laplace_debiased.data.shards`) and fetches from their owners the rows its own fits draw
(:func:`fit_rows`, :func:`~laplace_debiased.parallel.distributed.fetch_rows`); rank 0 fetches
every row only to train the MAP model on a cache miss.  Of every evaluation set each rank reads
and predicts only its rows ``chunk_shard(n, --chunk-size, rank, W)``, for every fitted posterior;
the metrics combine the ranks' sums (:func:`~laplace_debiased.evaluation.sweep.run_sweep`).
The rows equal a single-process run's up to the round-off of adding the ranks' sums (the
predictions of every row bitwise).  A failure on any rank raises on every rank
(:func:`~laplace_debiased.parallel.distributed.gather_results`).
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import asdict, replace
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset

from laplace_debiased.evaluation.options import batch_sizes, sweep_methods
from laplace_debiased.prior_grid import PriorGrid
from laplace_debiased.evaluation.report import SETTING_NAME
from laplace_debiased.evaluation.sweep import EvalSet, Method, load_rows, output_lock, run_sweep
from laplace_debiased.parallel.distributed import fetch_rows, gather_results, rank_world

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
    :class:`~laplace_debiased.data.shards.HeldRows` of length N."""
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
        raise ValueError(f"--data {opts['data']} needs --data-root DIR (see /work/shared/data/SOURCES.md)")
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


def _fit_loader(name: str, train: Dataset, opts: dict, repeat: int, b: int | None) -> tuple[DataLoader, int]:
    """The loader that method ``name``'s fit of ``repeat`` at batch size ``b`` reads, and how many
    of its batches: one of ``b`` (``*_single``), two of half that (``*_debiased``, ``*_corrected``, ``*_shrunk``, ``*_stein``),
    or one of every training point (``*_full``, ``b=None``); the shuffling is seeded by ``--seed``
    and the repeat (the same draws at every b)."""
    if name.endswith("_full"):
        return DataLoader(train, batch_size=len(train)), 1
    gen = torch.Generator().manual_seed(opts["seed"] * 7919 + repeat)
    size, count = (b, 1) if name.endswith("_single") else (b // 2, 2)
    return DataLoader(train, batch_size=size, shuffle=True, generator=gen), count


def fit_rows(opts: dict, n: int, rank: int, world: int) -> list[int]:
    """The training rows that rank ``rank`` of ``world`` reads in its fits: those of the
    (method, repeat) jobs ``k`` with ``k % world == rank``, the sweep's job order
    (:func:`~laplace_debiased.evaluation.sweep.run_sweep`; a method at each batch size,
    :func:`~laplace_debiased.evaluation.options.sweep_methods`). Replays each job's seeded sampler
    (:func:`_fit_loader`) over the row indices themselves: the loader's iterator draws its base
    seed from the generator before the sampler does, so the indices come from iterating the loader."""
    from itertools import islice

    jobs = [(m, b, r) for _, m, b in sweep_methods(opts) for r in range(1 if m.endswith("_full") else opts["repeats"])]
    rows: set[int] = set()
    for name, b, repeat in jobs[rank::world]:
        loader, count = _fit_loader(name, range(n), opts, repeat, b)  # a range: it yields the indices
        rows.update(i for batch in islice(loader, count) for i in batch.tolist())
    return sorted(rows)


def _method(name: str, model, train: Dataset, opts: dict, b: int | None = None, key: str | None = None) -> Method:
    """Method ``name`` at batch size ``b`` (``None``: the first of ``opts["batch_size"]``; unused
    by the full-batch methods), its rows named ``key`` (default ``name``)."""
    from laplace_debiased.structures.ekfac import DebiasedEKFACLaplace, DebiasedEKFACLLLaplace
    from laplace_debiased.structures.kron import DebiasedKronLaplace, DebiasedKronLLLaplace
    from laplace_debiased.structures.lowrank import DebiasedLowRankLaplace, DebiasedLowRankLLLaplace

    ll = opts["subset"] == "last_layer"

    def make(kind: str):
        if kind == "kron":
            return (DebiasedKronLLLaplace if ll else DebiasedKronLaplace)(model, "classification")
        if kind == "ekfac":
            return (DebiasedEKFACLLLaplace if ll else DebiasedEKFACLaplace)(model, "classification")
        return (DebiasedLowRankLLLaplace if ll else DebiasedLowRankLaplace)(
            model, "classification", rank=opts["rank"])

    fitted: dict[int, object] = {}  # a grid extension reuses the fits of the same run

    def fit(repeat: int):
        if repeat in fitted:
            return fitted[repeat]
        la = make(name.split("_")[0])
        loader, _ = _fit_loader(name, train, opts, repeat, b)
        if name == "kron_debiased":  # its first two batches: B and B̃, the paper's estimate
            la.fit(loader, estimator="paper")
        elif name.endswith("_debiased"):
            la.fit(loader)
        elif name.endswith(("_corrected", "_shrunk", "_stein")):
            la.fit(loader, estimator=name.split("_")[1])
        else:  # one batch of b, or every training point, B̃ = B
            la.fit(loader, magnitude_loader=loader)
        fitted[repeat] = la
        return la

    full = name.endswith("_full")
    if full:
        b = None
    elif b is None:
        b = batch_sizes(opts)[0]
    return Method(key or name, fit, repeats=1 if full else opts["repeats"], full_batch=full,
                  extra={} if full else {"batch_size": b})


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
    include :func:`software_versions`: another release may give other numbers for the same row
    keys, so its rows are not resumed either.  The caller holds the folder's lock; the file is
    written to a temporary name and renamed.
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


_STRUCTURES = {"kron": "K-FAC", "ekfac": "EKFAC", "lowrank": "low-rank"}


def describe_method(name: str, opts: dict, n_train: int, b: int | None = None) -> dict[str, str | int]:
    """A method in words, with its batch sizes, and the number of training points its curvature
    reads.

    Args:
        name: The method, ``"<structure>_<batches>"`` (module docstring), e.g.
            ``"kron_debiased"``.
        opts: The run's options; ``"batch_size"`` and, for a low-rank method, ``"rank"`` are
            read.
        n_train: The number of training points N.
        b: The batch size of a mini-batch method (``None``: the first of ``opts["batch_size"]``).

    Returns:
        ``{"label", "description", "samples"}``, and ``"batch_size"`` for a mini-batch method.
    """
    kind, batches = name.split("_")
    structure = _STRUCTURES[kind] + (f" (rank {opts['rank']})" if kind == "lowrank" else "")
    if batches == "full":
        return {"label": f"{structure}, full batch of {n_train}", "samples": n_train,
                "description": f"{structure} over all N = {n_train} training points (the reference)"}
    b = batch_sizes(opts)[0] if b is None else b
    return {**_describe_batches(structure, batches, b), "batch_size": b}


def _describe_batches(structure: str, batches: str, b: int) -> dict[str, str | int]:
    """``describe_method`` of a mini-batch method at batch size ``b``."""
    if batches == "single":
        return {"label": f"{structure}, single batch of {b}", "samples": b,
                "description": f"{structure} from one batch of {b} training points (B̃ = B: the plain "
                               "single-batch LA)"}
    if batches == "debiased":
        return {"label": f"{structure}, debiased {b // 2} + {b // 2}", "samples": 2 * (b // 2),
                "description": f"debiased {structure}: directions (eigenvectors) from a batch B of {b // 2} "
                               f"training points, magnitudes re-measured on an independent batch B̃ of "
                               f"{b // 2}"}
    if batches in ("corrected", "shrunk", "stein"):
        shrunk = {"shrunk": (" (the default fit)", ", that correction shrunk per factor by how much the two batches "
                             "disagree on it"),
                  "stein": ("", ", that correction weighted per factor by its minimum-MSE (James-Stein) weight")
                  }.get(batches, ("", ""))
        return {"label": f"{structure}, {batches} {b // 2} + {b // 2}", "samples": 2 * (b // 2),
                "description": f"{batches} {structure}{shrunk[0]}: eigenvectors of both batches of {b // 2} training "
                               "points together, eigenvalues less the regression-to-the-mean bias the two batches "
                               f"measure against each other{shrunk[1]} (fit(estimator='{batches}'))"}
    raise ValueError(f"unknown mini-batch method kind {batches!r}")


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
    """The run's setting in words, for the report (written to :data:`SETTING_NAME`)."""
    data = {"digits": "scikit-learn 8x8 digits (embedded)", "cifar10": "CIFAR-10",
            "cifar100": "CIFAR-100"}[opts["data"]]
    return {
        "data": data, "n_train": n_train, "model": tag, "n_params": n_params, "subset": opts["subset"],
        "methods": {key: describe_method(m, opts, n_train, b) for key, m, b in sweep_methods(opts)},
        "eval_sets": {es.name: _describe_eval_set(es, opts["data"]) for es in eval_sets},
        "corruption": "Gaussian pixel noise" if opts["data"] == "digits" else "corruption",
        "severity_ticks": {str(k): f"σ = {v}" for k, v in DIGITS_NOISE.items()} if opts["data"] == "digits" else {},
    }


def _grid_extension(rows: list[dict], link: str) -> list[float]:
    """One new prior precision beyond each grid edge where a method's validation choice lies
    (:meth:`~laplace_debiased.prior_grid.PriorGrid.extension`)."""
    from laplace_debiased.evaluation.report import chosen_prior_precisions

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
    (:func:`~laplace_debiased.evaluation.training.fingerprint_rows`) and, on a cache miss
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
    methods = [_method(m, model, train, opts, b, key) for key, m, b in sweep_methods(opts)]
    keys = {m.name for m in methods}
    results = out / "results.jsonl"
    configured = PriorGrid.parse(opts["prior_precisions"])
    grid = configured
    while True:
        rows = run_sweep(methods, eval_sets, results, prior_precisions=list(grid), links=opts["links"],
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
        from laplace_debiased.evaluation.report import write_report

        # rank 0 writes it; every rank returns its path
        paths["report"] = gather_results(
            lambda: write_report(results, out / "report", title=f"Calibration report ({tag})")
            if rank == 0 else None)[0]
    return paths
