"""Resumable prior-precision sweeps over fitted Laplace approximations.

A sweep evaluates every method (MAP, and Laplace approximations fitted lazily by a callable, one
per repeat = batch draw) on every evaluation set, for every prior precision of a grid and every
link approximation, and appends one JSON object per result to a JSON-lines file.  Rows are keyed
by ``(method, repeat, prior_precision, eval_set, link)``: rerunning the same sweep skips every key
already in the file, and a (method, repeat) whose rows are all present is neither fitted nor
evaluated again.

Reproducibility: every cell draws its Monte-Carlo samples for each chunk of ``chunk_size`` inputs
from its own generator, seeded by a hash of ``(seed, method, repeat, eval_set, prior_precision,
link)`` ([`cell_seed`][laplace_debiased.evaluation.sweep.cell_seed]) and the chunk's index ([`chunk_seed`][laplace_debiased.evaluation.sweep.chunk_seed]), so any subset of cells (a
resumed run, another eval-set order) or of chunks (another rank) recomputes bitwise-identically
for the same grid, ``n_samples`` and ``chunk_size``.

Files: the writer holds an exclusive lock on the output folder
([`output_lock`][laplace_debiased.evaluation.sweep.output_lock], an ``fcntl`` lock file), so two sweeps into
one folder never interleave; the second refuses (or waits up to ``lock_timeout`` seconds).  Each row is one
line written with a single ``write`` + ``fsync``, as strict JSON (non-finite numbers become ``null``).  A last
line without its newline is an interrupted write: readers skip it with a warning and the next sweep cuts it
before appending. Any other line that is not a row object (``{}``, ``[]``, ``42``, NUL bytes, ...) is an error
naming the file and line.

Under an initialised ``torch.distributed`` group the (method, repeat) jobs are sharded over the
ranks, each fitted locally and sent to every rank, and the rows of every evaluation set are
sharded too: each rank predicts its own chunks, the metrics come from the ranks' summed
statistics; rank 0 alone locks the folder and writes
([`run_sweep`][laplace_debiased.evaluation.sweep.run_sweep]).

Row fields: ``method, repeat, prior_precision`` (``null`` for MAP), ``eval_set, kind``
(``test``, ``validation``, ``corrupted``, ``ood``), ``severity, link, full_batch`` and the
metrics: for labelled sets accuracy/nll/ece/brier/confidence and a reliability histogram; for
``corrupted``/``ood`` sets also auroc/aupr/fpr95 of detecting them against the reference (clean
test) set; on ``validation`` rows of a Laplace method, ``log_marglik`` (laplace-torch's log
marginal likelihood at that prior precision, ``null`` where the structure has none).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch import Tensor

from laplace_debiased._progress import progress_bar
from laplace_debiased.evaluation import metrics
from laplace_debiased.prior_grid import PriorGrid
from laplace_debiased.evaluation.options import DEFAULT_LINKS, check_links
from laplace_debiased.curvature.kfac import labelled_rows
from laplace_debiased.data.shards import chunk_shard
from laplace_debiased.posterior.from_laplace import posterior_structure, predictive_parts
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import logit_rows
from laplace_debiased.parallel.distributed import gather_results, local_fits, rank_world

KINDS = ("test", "validation", "corrupted", "ood")
#: Name of the lock file a writer holds in its output folder.
LOCK_NAME = ".laplace-debiased.lock"


@dataclass
class EvalSet:
    """An evaluation set: inputs, labels and what they are scored for.

    Attributes:
        name: The set's name in results and reports.
        x: The inputs, ``(N, ...)``.
        y: The labels, ``(N,)``; ``None`` for unlabelled OOD data.
        kind: ``"test"`` (the in-distribution reference), ``"validation"`` (labelled,
            in-distribution, for choosing the prior precision), ``"corrupted"`` (labelled, also
            scored for detection against the reference) or ``"ood"`` (detection only).
        severity: The corruption severity of a ``"corrupted"`` set; ``None`` otherwise.
        size: The rows of the whole set (``None``: ``len(x)``, ``x`` is the whole set).
        offset: The global index of ``x[0]`` in the whole set (a shard holds rows
            ``offset .. offset + len(x) - 1``).
    """

    name: str
    x: Tensor
    y: Tensor | None = None
    kind: str = "test"
    severity: int | None = None
    #: rows of the whole set (``None``: ``len(x)``, ``x`` is the whole set)
    size: int | None = None
    #: global index of ``x[0]`` in the whole set (a shard holds rows ``offset .. offset + len(x) - 1``)
    offset: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"eval set kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "ood" and self.y is None:
            raise ValueError(f"eval set {self.name!r} of kind {self.kind!r} needs labels")
        if self.size is None:
            self.size = len(self.x)
        if not 0 <= self.offset <= self.offset + len(self.x) <= self.size:
            raise ValueError(f"eval set {self.name!r}: rows {self.offset}..{self.offset + len(self.x) - 1} "
                             f"do not lie within its {self.size} rows")

    def shard(self, chunk_size: int, rank: int, world: int) -> EvalSet:
        """The rows rank ``rank`` of ``world`` evaluates,
        [`chunk_shard`][laplace_debiased.data.shards.chunk_shard] ``(size, chunk_size, rank, world)``: cut
        from the whole set, or this set itself when it holds exactly those rows."""
        rows = chunk_shard(self.size, chunk_size, rank, world)
        if (self.offset, len(self.x)) == (rows.start, len(rows)):
            return self
        if self.offset == 0 and len(self.x) == self.size:
            cut = slice(rows.start, rows.stop)
            return replace(self, x=self.x[cut], y=None if self.y is None else self.y[cut], offset=rows.start)
        raise ValueError(
            f"eval set {self.name!r} holds rows {self.offset}..{self.offset + len(self.x) - 1} of {self.size}, but "
            f"rank {rank} of {world} evaluates rows {rows.start}..{rows.stop - 1} (chunk_shard(size, chunk_size, "
            "rank, world) of laplace_debiased.data.shards): give it the whole set or exactly those rows")


@dataclass
class SweepJob:
    """A posterior to sweep, its rows named ``name``.  ``fit(repeat)`` returns a fitted laplace-torch
    object, or ``None`` for the MAP baseline (evaluated once, not per prior precision); the main job
    makes one of each [`Method`][laplace_debiased.evaluation.methods.Method] at each batch size
    ([`sweep_job`][laplace_debiased.evaluation.pipeline.sweep_job])."""

    name: str
    fit: Callable[[int], object | None]
    repeats: int = 1
    full_batch: bool = False
    links: Sequence[str] | None = None
    extra: dict = field(default_factory=dict)


def _fmt_prior(delta: float | None) -> str:
    return "map" if delta is None else repr(float(delta))


def row_key(row: dict) -> str:
    """Identity of a row: ``method|repeat|prior_precision|eval_set|link``."""
    return "|".join(
        [row["method"], str(row["repeat"]), _fmt_prior(row["prior_precision"]), row["eval_set"], row["link"]]
    )


def _row_error(path: Path, lineno: int, what: str) -> ValueError:
    return ValueError(
        f"{path}:{lineno}: {what}; not a sweep results file? Repair or remove that line, "
        "or use another output folder."
    )


def _parse_row(path: Path, lineno: int, line: bytes) -> dict:
    """One complete line -> row dict, or a ValueError naming ``path:lineno``."""
    if b"\0" in line:
        raise _row_error(path, lineno, "holds NUL bytes")
    try:
        row = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _row_error(path, lineno, f"is not a JSON line ({err})") from err
    if not isinstance(row, dict):
        raise _row_error(path, lineno, f"is a JSON {type(row).__name__}, not a row object")
    missing = [k for k in ("method", "repeat", "prior_precision", "eval_set", "link") if k not in row]
    if missing:
        raise _row_error(path, lineno, f"is a row without {missing}")
    delta = row["prior_precision"]
    if not (isinstance(row["method"], str) and isinstance(row["eval_set"], str) and isinstance(row["link"], str)
            and isinstance(row["repeat"], int) and (delta is None or isinstance(delta, (int, float)))):
        raise _row_error(path, lineno, "has a key field of the wrong type")
    return row


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines results file (missing file -> ``[]``); never writes the file.

    Every row is written as one line ending in a newline, so bytes after the last newline are an
    interrupted write: they are skipped with a warning (a sweep into the folder cuts them).  A
    complete line that is not a row object is a ``ValueError`` naming the file and line.
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) != len(raw):
        warnings.warn(f"{path}: ignoring an incomplete last line ({len(raw) - len(complete)} bytes, "
                      "an interrupted write); the next sweep into this folder removes it")
    return [_parse_row(path, i + 1, line) for i, line in enumerate(complete.split(b"\n")[:-1]) if line.strip()]


def _cut_partial_line(path: Path) -> None:
    """Remove bytes after the last newline (an interrupted write); the caller holds the lock."""
    if not path.exists():
        return
    raw = path.read_bytes()
    keep = raw.rfind(b"\n") + 1
    if keep != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(keep)
            os.fsync(fh.fileno())


def strict_json(obj):
    """``obj`` with every non-finite float replaced by ``None`` (JSON ``null``), recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def append_row(path: str | Path, row: dict) -> None:
    """Append one row as a single strict-JSON line (one ``write`` + ``fsync``)."""
    data = (json.dumps(strict_json(row), allow_nan=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class OutputLockedError(RuntimeError):
    """Another process holds the output folder's lock."""


_held_locks: dict[Path, list[int]] = {}  # folder -> [fd, depth]: the lock is re-entrant per process


@contextmanager
def output_lock(folder: str | Path, timeout: float = 0.0) -> Iterator[Path]:
    """Hold an exclusive ``fcntl`` lock on ``folder`` (created if missing) while writing into it.

    Re-entrant within a process.  If another process holds it, wait up to ``timeout`` seconds,
    then raise [`OutputLockedError`][laplace_debiased.evaluation.sweep.OutputLockedError].  The lock file
    ([`LOCK_NAME`][laplace_debiased.evaluation.sweep.LOCK_NAME]) records the holder's pid; the operating
    system releases the lock when the holder exits, even if it crashes.  A holder that finishes removes the
    file before it unlocks; a waiter that then gets the lock on the removed file (``_is_current``) starts
    again on a fresh one.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    key = folder.resolve()
    if key in _held_locks:
        _held_locks[key][1] += 1
        try:
            yield folder
        finally:
            _held_locks[key][1] -= 1
        return
    fd = _acquire(key, folder, timeout)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held_locks[key] = [fd, 1]
    try:
        yield folder
    finally:
        del _held_locks[key]
        (key / LOCK_NAME).unlink(missing_ok=True)  # while still locked: no one can hold the name
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _acquire(key: Path, folder: Path, timeout: float) -> int:
    """The descriptor of ``key``'s lock file, exclusively locked (see
    [`output_lock`][laplace_debiased.evaluation.sweep.output_lock])."""
    deadline = time.monotonic() + timeout
    while True:
        fd = os.open(key / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if time.monotonic() >= deadline:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise OutputLockedError(
                    f"another run (pid {holder}) holds the lock on {folder} ({LOCK_NAME}); wait for it to "
                    "finish, pass --lock-timeout SECONDS to wait, or choose another --out"
                ) from None
            os.close(fd)
            time.sleep(0.1)
            continue
        if _is_current(fd, key / LOCK_NAME):
            return fd
        os.close(fd)  # we locked the file a finished holder removed: open the new one


def _is_current(fd: int, path: Path) -> bool:
    """Whether the open file ``fd`` is still the file at ``path`` (not removed or replaced)."""
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def cell_seed(*, seed: int, method: str, repeat: int, eval_set: str, prior_precision: float | None,
              link: str) -> int:
    """Seed of one cell: a stable hash (SHA-256, 63 bits) of the cell's key."""
    key = json.dumps([int(seed), method, int(repeat), eval_set, _fmt_prior(prior_precision), link])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def chunk_seed(cell: int, chunk: int) -> int:
    """Seed of chunk ``chunk`` (its index among the set's chunks) of the cell seeded ``cell``
    ([`cell_seed`][laplace_debiased.evaluation.sweep.cell_seed]): a stable hash (SHA-256, 63 bits) of both, so
    a chunk's draws do not depend on which process evaluates it or on the chunks before it."""
    key = json.dumps([int(cell), int(chunk)])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


@torch.no_grad()
def cell_probabilities(
    pred: GridPredictive,
    x: Tensor,
    grid: Sequence[float],
    links: Sequence[str],
    n_samples: int,
    seeds: dict[tuple[float, str], int],
    first_chunk: int = 0,
) -> dict[str, Tensor] | None:
    """``GridPredictive.grid`` chunk by chunk with one generator per cell and chunk: ``link ->
    (G, N, [tokens,] C)``; ``None`` for no rows.

    ``x`` is read in chunks of ``pred.chunk_size``, the first being chunk ``first_chunk`` of its
    set; chunk ``j`` of cell ``(δ, link)`` draws from a generator seeded ``chunk_seed(seeds[(δ,
    link)], j)``. So the rows of a chunk get the same probabilities whichever process evaluates
    it and whatever it evaluates besides (they depend on ``pred.chunk_size``).
    """
    if len(x) == 0:
        return None
    parts = []
    for j, chunk in enumerate(x.split(pred.chunk_size), start=first_chunk):
        gens = {k: torch.Generator().manual_seed(chunk_seed(v, j)) for k, v in seeds.items()}
        parts.append(pred.grid(chunk, grid, links=tuple(links), n_samples=n_samples, cell_generators=gens))
    return {link: torch.cat([p[link] for p in parts], dim=1) for link in links}


def _set_statistics(probs: Tensor | None, es: EvalSet, reference: bool) -> dict:
    """What the metrics of ``es`` need from the probabilities ``(n, [tokens,] C)`` of its rows
    held here (``None``: no rows): ``sums``
    ([`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums] of the labelled rows;
    tokens labelled -100 left out) for a labelled set, ``scores``
    ([`ood_scores`][laplace_debiased.evaluation.metrics.ood_scores]) for a corrupted or OOD set,
    ``reference_scores`` (of every row) for the reference set."""
    if probs is None:
        return {}
    out: dict = {}
    if es.y is not None:
        p, y = labelled_rows(probs, es.y)
        out["sums"] = metrics.classification_sums(p, y)
    else:
        p = logit_rows(probs)
    if es.kind in ("corrupted", "ood"):
        out["scores"] = metrics.ood_scores(p)
    if reference:
        out["reference_scores"] = metrics.ood_scores(logit_rows(probs))
    return out


def _combined(parts: Sequence[dict]) -> dict:
    """One set's statistics from those of the ranks' rows (in rank order): sums added, scores
    concatenated."""
    out: dict = {}
    sums = [p["sums"] for p in parts if "sums" in p]
    if sums:
        out["sums"] = metrics.add_sums(sums)
    for key in ("scores", "reference_scores"):
        scores = [p[key] for p in parts if key in p]
        if scores:
            out[key] = torch.cat(scores)
    return out


def _set_metrics(stats: dict, es: EvalSet, reference: dict | None) -> dict:
    """The metrics of one set from its combined statistics (``_combined``) and the
    reference set's (``None``: no reference evaluated)."""
    m: dict = {}
    if es.y is not None:
        if "sums" not in stats:
            raise ValueError(f"eval set {es.name!r} has no rows to evaluate")
        m.update(metrics.metrics_from_sums(stats["sums"]))
        m["reliability"] = metrics.reliability_from_sums(stats["sums"])
    if es.kind in ("corrupted", "ood") and reference is not None:
        m.update(metrics.ood_metrics_from_scores(reference["reference_scores"], stats["scores"]))
    return m


def _row_base(name: str, repeat: int, delta: float | None, es: EvalSet, link: str, full_batch: bool) -> dict:
    return {
        "method": name, "repeat": repeat, "prior_precision": delta, "eval_set": es.name,
        "kind": es.kind, "severity": es.severity, "link": link, "full_batch": full_batch,
    }


def _log_marglik(la, delta: float) -> float | None:
    """laplace-torch's log marginal likelihood at prior precision ``delta`` (``None`` if the
    structure has none); ``la.prior_precision`` is left as it was."""
    before = la.prior_precision
    try:
        return float(la.log_marginal_likelihood(prior_precision=torch.tensor(delta)))
    except NotImplementedError:
        return None
    finally:
        la.prior_precision = before


def _needed(names: set[str], eval_sets: Sequence[EvalSet], reference: EvalSet | None) -> list[EvalSet]:
    """The sets named in ``names``, and the reference if any of them is scored against it."""
    names = set(names)
    if reference is not None and any(es.kind in ("corrupted", "ood") for es in eval_sets if es.name in names):
        names.add(reference.name)
    return [es for es in eval_sets if es.name in names]


def _map_rows(map_model: torch.nn.Module, eval_sets: Sequence[EvalSet], shards: Sequence[EvalSet],
              reference: EvalSet | None, done: set[str], chunk_size: int) -> list[dict]:
    """The missing MAP rows (collective): every rank predicts its rows of each set, in chunks of
    ``chunk_size``; the statistics of every rank make each set's metrics."""
    todo = [es for es in eval_sets if row_key(_row_base("map", 0, None, es, "map", False)) not in done]
    if not todo:
        return []
    need = {es.name for es in _needed({es.name for es in todo}, eval_sets, reference)}

    @torch.no_grad()
    def local() -> dict[str, dict]:
        was = map_model.training
        map_model.eval()
        try:
            return {es.name: _set_statistics(
                torch.cat([torch.softmax(map_model(x), -1) for x in es.x.split(chunk_size)]) if len(es.x) else None,
                es, reference is not None and es.name == reference.name) for es in shards if es.name in need}
        finally:
            map_model.train(was)

    per_rank = gather_results(local)
    stats = {name: _combined([part[name] for part in per_rank]) for name in need}
    ref = stats.get(reference.name) if reference is not None else None
    return [{**_row_base("map", 0, None, es, "map", False), **_set_metrics(stats[es.name], es, ref)} for es in todo]


def _checked_sweep(
    methods: Sequence[SweepJob], eval_sets: Sequence[EvalSet], prior_precisions: Sequence[float], links: Sequence[str]
) -> tuple[list[float], list[str], EvalSet | None]:
    """The checked grid, the eval set names (unique) and the reference (first test) set."""
    check_links(links)
    grid = list(PriorGrid.parse(prior_precisions))
    for m in methods:
        check_links(tuple(m.links or links))
    names = [es.name for es in eval_sets]
    if len(set(names)) != len(names):
        raise ValueError(f"eval set names must be unique, got {names}")
    refs = [es for es in eval_sets if es.kind == "test"]
    return grid, names, refs[0] if refs else None


def _resume(stack: ExitStack, out_path: Path, lock_timeout: float) -> set[str]:
    """The writer's start: take the output lock for the rest of ``stack``, cut a partial last
    line; returns the keys of the rows done."""
    stack.enter_context(output_lock(out_path.parent, lock_timeout))
    _cut_partial_line(out_path)
    return {row_key(r) for r in load_rows(out_path)}


def run_sweep(
    methods: Sequence[SweepJob],
    eval_sets: Sequence[EvalSet],
    out_path: str | Path,
    *,
    prior_precisions: Sequence[float] = PriorGrid.default().values,
    links: Sequence[str] = DEFAULT_LINKS,
    n_samples: int = 100,
    seed: int = 0,
    chunk_size: int = 64,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    map_model: torch.nn.Module | None = None,
    lock_timeout: float = 0.0,
    shard_jobs: bool = True,
) -> list[dict]:
    """Run (or resume) a sweep; returns all rows of ``out_path`` afterwards.

    ``map_model`` evaluates the MAP baseline rows (method ``"map"``, link ``"map"``) when given.
    The output folder is locked for the whole run
    ([`output_lock`][laplace_debiased.evaluation.sweep.output_lock], waiting up to ``lock_timeout`` seconds
    for another writer).

    Under an initialised ``torch.distributed`` group (call it on every rank with the same
    arguments) the evaluation sets are sharded: rank ``r`` of ``W`` predicts only the rows
    [`chunk_shard`][laplace_debiased.data.shards.chunk_shard] ``(size, chunk_size, r, W)`` of each set
    (whole chunks of the single-process pass). An [`EvalSet`][laplace_debiased.evaluation.sweep.EvalSet] may
    hold the whole set or exactly those rows
    ([`EvalSet.shard`][laplace_debiased.evaluation.sweep.EvalSet.shard]), so a rank need not read the rest.
    Each set's metrics come from the sums of every rank's rows
    ([`classification_sums`][laplace_debiased.evaluation.metrics.classification_sums], ECE from summed bin
    counts) and the concatenated OOD scores; rank 0 alone holds the lock and writes the rows, in the
    single-process order. The probabilities of every row are the single-process ones bitwise (per-chunk seeds,
    [`cell_probabilities`][laplace_debiased.evaluation.sweep.cell_probabilities]), so the metrics equal a
    single-process sweep's up to the round-off of adding the ranks' sums in another order (the ranking metrics
    auroc, aupr, fpr95 and the counts exactly). Every rank returns the same rows.

    The (method, repeat) jobs: with ``shard_jobs`` job ``k`` is fitted on rank ``k % world``, in
    rounds of ``world`` jobs, inside
    [`local_fits`][laplace_debiased.parallel.distributed.local_fits] (a local fit of that rank alone,
    so ``SweepJob.fit`` must not call collectives itself); each fitted posterior (network,
    parameters and curvature: [`predictive_parts`][laplace_debiased.posterior.from_laplace.predictive_parts])
    is then sent to every rank. ``shard_jobs=False`` is for collective fits (``debiased_kron``
    sharding its batches, which every rank must call): every rank runs every job's
    ``SweepJob.fit`` under the group; the rows then equal a single-process sweep's to the
    round-off of the distributed fit. Without a group (or with one rank) both modes are the
    single-process sweep.
    """
    grid, names, reference = _checked_sweep(methods, eval_sets, prior_precisions, links)
    out_path = Path(out_path)
    rank, world = rank_world()
    writer = rank == 0
    jobs = [(m, r) for m in methods for r in range(m.repeats)]
    shards = [es.shard(chunk_size, rank, world) for es in eval_sets]
    with ExitStack() as stack:
        done = gather_results(lambda: _resume(stack, out_path, lock_timeout) if writer else None)[0]

        def write(rows: list[dict]) -> None:
            for row in rows:
                if writer:
                    append_row(out_path, row)
                done.add(row_key(row))

        if map_model is not None:
            write(_map_rows(map_model, eval_sets, shards, reference, done, chunk_size))
        kw = dict(eval_sets=eval_sets, grid=grid, done=done, links=links, log=log)
        step = world if shard_jobs else 1
        for first in progress_bar(range(0, len(jobs), step), desc="fit + sweep",
                                  unit="round" if step > 1 else "fit", quiet=not progress or not writer):
            mine: list[_Posterior | None] = [None]

            def fit() -> _Posterior | None:
                if not shard_jobs:  # collective: every rank fits the job and keeps its own posterior
                    mine[0] = _fit_job(*jobs[first], **kw)
                    return None
                if first + rank >= len(jobs):
                    return None
                with local_fits():
                    return _fit_job(*jobs[first + rank], **kw)

            sent = gather_results(fit)
            posts = [(first + r, p) for r, p in enumerate(sent) if p is not None] if shard_jobs else \
                [(first, p) for p in mine if p is not None]
            per_rank = gather_results(lambda: {k: _job_statistics(
                *jobs[k], post, shards, reference, grid, n_samples=n_samples, seed=seed, chunk_size=chunk_size,
                links=links) for k, post in posts})
            for k, post in posts:
                write(_job_rows(*jobs[k], post, [part[k] for part in per_rank], eval_sets, reference, grid, links))
        return gather_results(lambda: load_rows(out_path) if writer else None)[0]


@dataclass
class _Posterior:
    """One fitted (method, repeat) as every rank needs it to evaluate its rows: the network,
    parameters and curvature of the predictive (picklable), the keys ``(eval set, δ, link)`` of
    its missing rows, and what only the fitting rank can compute."""

    missing: set[tuple[str, float, str]]
    model: torch.nn.Module
    params: list[Tensor]
    structure: object
    fit_seconds: float
    marglik: dict[float, float | None]
    coverage: list | None
    correction: list | None


def _fit_job(method: SweepJob, repeat: int, *, eval_sets: Sequence[EvalSet], grid: list[float], done: set[str],
             links: Sequence[str], log: Callable[[str], None] | None) -> _Posterior | None:
    """Fit one (method, repeat) if any of its rows is missing (not in ``done``); ``None`` if none."""
    mlinks = tuple(method.links or links)
    keys = {
        (es.name, d, link): row_key(_row_base(method.name, repeat, d, es, link, method.full_batch))
        for es in eval_sets for d in grid for link in mlinks
    }
    missing = {k for k, v in keys.items() if v not in done}
    if not missing:
        return None
    if log:
        log(f"{method.name} repeat {repeat}: {len(missing)} rows to compute")
    start = time.perf_counter()
    la = method.fit(repeat)
    fit_seconds = time.perf_counter() - start
    validation = any(es.kind == "validation" and k[0] == es.name for es in eval_sets for k in missing)
    marglik = {d: _log_marglik(la, d) for d in grid} if validation else {}
    coverage = getattr(la, "coverage", None)  # debiased K-FAC: what the curvature covers, per factor
    correction = getattr(la, "correction", None)  # corrected K-FAC: what the correction changed
    model, params = predictive_parts(la)
    return _Posterior(missing, model, params, posterior_structure(la), fit_seconds, marglik,
                      None if coverage is None else coverage.rows(),
                      None if correction is None else correction.rows())


def _job_statistics(method: SweepJob, repeat: int, post: _Posterior, shards: Sequence[EvalSet],
                    reference: EvalSet | None, grid: list[float], *, n_samples: int, seed: int, chunk_size: int,
                    links: Sequence[str]) -> tuple[dict, float]:
    """This rank's statistics (``_set_statistics``) of one job, ``{(eval set, δ, link): ...}``
    for the sets with missing rows (and the reference they are scored against), and the
    seconds they took."""
    start = time.perf_counter()
    mlinks = tuple(method.links or links)
    pred = GridPredictive.from_parts(post.model, post.params, post.structure, chunk_size=chunk_size)
    stats = {}
    for es in _needed({k[0] for k in post.missing}, shards, reference):
        seeds = {(d, link): cell_seed(seed=seed, method=method.name, repeat=repeat, eval_set=es.name,
                                      prior_precision=d, link=link) for d in grid for link in mlinks}
        probs = cell_probabilities(pred, es.x, grid, mlinks, n_samples, seeds, first_chunk=es.offset // chunk_size)
        is_reference = reference is not None and es.name == reference.name
        for g, d in enumerate(grid):
            for link in mlinks:
                stats[(es.name, d, link)] = _set_statistics(None if probs is None else probs[link][g], es, is_reference)
    return stats, time.perf_counter() - start


def _job_rows(method: SweepJob, repeat: int, post: _Posterior, per_rank: Sequence[tuple[dict, float]],
              eval_sets: Sequence[EvalSet], reference: EvalSet | None, grid: list[float],
              links: Sequence[str]) -> list[dict]:
    """The missing rows of one job, in the single-process order, from every rank's statistics;
    ``eval_seconds`` is the slowest rank's."""
    mlinks = tuple(method.links or links)
    eval_seconds = max(seconds for _, seconds in per_rank)
    todo_sets = _needed({k[0] for k in post.missing}, eval_sets, reference)
    rows = []
    for g, delta in enumerate(grid):
        for link in mlinks:
            stats = {es.name: _combined([part[(es.name, delta, link)] for part, _ in per_rank]) for es in todo_sets}
            ref = stats.get(reference.name) if reference is not None else None
            for es in todo_sets:
                if (es.name, delta, link) not in post.missing:
                    continue
                row = _row_base(method.name, repeat, delta, es, link, method.full_batch)
                row.update(_set_metrics(stats[es.name], es, ref), fit_seconds=post.fit_seconds,
                           eval_seconds=eval_seconds, **method.extra)
                if es.kind == "validation":
                    row["log_marglik"] = post.marglik[delta]
                if es.kind == "test" and g == 0 and link == mlinks[0]:  # once per fit (its first test row)
                    if post.coverage is not None:
                        row["coverage"] = post.coverage
                    if post.correction is not None:
                        row["correction"] = post.correction
                rows.append(row)
    return rows
