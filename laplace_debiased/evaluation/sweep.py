"""Resumable prior-precision sweeps over fitted Laplace approximations.

A sweep evaluates every method (MAP, and Laplace approximations fitted lazily by a callable, one
per repeat = batch draw) on every evaluation set, for every prior precision of a grid and every
link approximation, and appends one JSON object per result to a JSON-lines file.  Rows are keyed
by ``(method, repeat, prior_precision, eval_set, link)``: rerunning the same sweep skips every key
already in the file, and a (method, repeat) whose rows are all present is neither fitted nor
evaluated again.

Reproducibility: every cell draws its Monte-Carlo samples from its own generator, seeded by a
hash of ``(seed, method, repeat, eval_set, prior_precision, link)`` (:func:`cell_seed`), so any
subset of cells (a resumed run, another eval-set order) recomputes bitwise-identically for the
same grid, ``n_samples`` and ``chunk_size``.

Files: the writer holds an exclusive lock on the output folder (:func:`output_lock`, an ``fcntl``
lock file), so two sweeps into one folder never interleave; the second refuses (or waits up to
``lock_timeout`` seconds).  Each row is one line written with a single ``write`` + ``fsync``, as
strict JSON (non-finite numbers become ``null``).  A last line without its newline is an
interrupted write: readers skip it with a warning and the next sweep cuts it before appending.
Any other line that is not a row object (``{}``, ``[]``, ``42``, NUL bytes, ...) is an error
naming the file and line.

Under an initialised ``torch.distributed`` group the (method, repeat) jobs are sharded over the
ranks, each fitted locally; rank 0 alone locks the folder and writes (:func:`run_sweep`).

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
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from laplace_debiased._progress import progress_bar
from laplace_debiased.evaluation import metrics
from laplace_debiased.prior_grid import PriorGrid
from laplace_debiased.evaluation.options import DEFAULT_LINKS, check_links
from laplace_debiased.curvature.kfac import labelled_rows
from laplace_debiased.posterior.grid import GridPredictive
from laplace_debiased.posterior.jacobians import logit_rows
from laplace_debiased.parallel.distributed import gather_results, local_fits, rank_world

KINDS = ("test", "validation", "corrupted", "ood")
#: Name of the lock file a writer holds in its output folder.
LOCK_NAME = ".laplace-debiased.lock"


@dataclass
class EvalSet:
    """Inputs ``x`` ``(N, ...)`` and labels ``y`` ``(N,)`` (``None`` for unlabelled OOD data).

    ``kind``: ``"test"`` (the in-distribution reference), ``"validation"`` (labelled,
    in-distribution, for choosing the prior precision), ``"corrupted"`` (labelled, also scored for
    detection against the reference) or ``"ood"`` (detection only).
    """

    name: str
    x: Tensor
    y: Tensor | None = None
    kind: str = "test"
    severity: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"eval set kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "ood" and self.y is None:
            raise ValueError(f"eval set {self.name!r} of kind {self.kind!r} needs labels")


@dataclass
class Method:
    """A posterior to sweep.  ``fit(repeat)`` returns a fitted laplace-torch object, or ``None``
    for the MAP baseline (evaluated once, not per prior precision)."""

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
    then raise :class:`OutputLockedError`.  The lock file (:data:`LOCK_NAME`) records the holder's
    pid; the operating system releases the lock when the holder exits, even if it crashes.  A
    holder that finishes removes the file before it unlocks; a waiter that then gets the lock on
    the removed file (:func:`_is_current`) starts again on a fresh one.
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
    """The descriptor of ``key``'s lock file, exclusively locked (see :func:`output_lock`)."""
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
    """Seed of one cell's generator: a stable hash (SHA-256, 63 bits) of the cell's key."""
    key = json.dumps([int(seed), method, int(repeat), eval_set, _fmt_prior(prior_precision), link])
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1



def _metric_rows(
    probs: dict[str, Tensor], eval_sets: Sequence[EvalSet], reference: EvalSet | None
) -> dict[str, dict]:
    """Metrics per eval set for one (method, prior, link): ``{eval name: metrics}``.

    Probabilities ``(N, [tokens, ...,] C)``: every token is one row (labels ``(N, [tokens])``),
    as for the fit, tokens labelled -100 (padded) left out
    (:func:`~laplace_debiased.curvature.kfac.labelled_rows`).
    """
    out = {}
    ref = logit_rows(probs[reference.name]) if reference is not None and reference.name in probs else None
    for es in eval_sets:
        m: dict = {}
        if es.y is None:
            p = logit_rows(probs[es.name])
        else:
            p, y = labelled_rows(probs[es.name], es.y)
            m.update(metrics.classification_metrics(p, y))
            m["reliability"] = metrics.reliability_bins(p, y)
        if es.kind in ("corrupted", "ood") and ref is not None:
            m.update(metrics.ood_metrics(ref, p))
        out[es.name] = m
    return out


def _row_base(name: str, repeat: int, delta: float | None, es: EvalSet, link: str, full_batch: bool) -> dict:
    return {
        "method": name, "repeat": repeat, "prior_precision": delta, "eval_set": es.name,
        "kind": es.kind, "severity": es.severity, "link": link, "full_batch": full_batch,
    }


@torch.no_grad()
def cell_probabilities(
    pred: GridPredictive,
    x: Tensor,
    grid: Sequence[float],
    links: Sequence[str],
    n_samples: int,
    seeds: dict[tuple[float, str], int],
) -> dict[str, Tensor]:
    """``GridPredictive.grid`` with one generator per cell: ``link -> (G, N, C)``.

    ``seeds[(δ, link)]`` seeds that cell's generator, which is carried across the input chunks
    (so the draws depend on ``pred.chunk_size``, and on nothing outside the cell).
    """
    gens = {k: torch.Generator().manual_seed(v) for k, v in seeds.items()}
    probs = pred.grid(x, grid, links=tuple(links), n_samples=n_samples, cell_generators=gens)
    return {link: probs[link] for link in links}


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


def _map_rows(map_model: torch.nn.Module, eval_sets: Sequence[EvalSet], reference: EvalSet | None,
              done: set[str]) -> list[dict]:
    todo = [es for es in eval_sets if row_key(_row_base("map", 0, None, es, "map", False)) not in done]
    if not todo:
        return []
    need = todo + ([reference] if reference is not None and reference not in todo else [])
    with torch.no_grad():
        was = map_model.training
        map_model.eval()
        probs = {es.name: torch.cat([torch.softmax(map_model(x), -1) for x in es.x.split(256)]) for es in need}
        map_model.train(was)
    mets = _metric_rows(probs, todo, reference)
    return [{**_row_base("map", 0, None, es, "map", False), **mets[es.name]} for es in todo]


def _checked_sweep(
    methods: Sequence[Method], eval_sets: Sequence[EvalSet], prior_precisions: Sequence[float], links: Sequence[str]
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


def _resume(
    stack: ExitStack, out_path: Path, lock_timeout: float, map_model: torch.nn.Module | None,
    eval_sets: Sequence[EvalSet], reference: EvalSet | None,
) -> set[str]:
    """The writer's start: take the output lock for the rest of ``stack``, cut a partial last
    line, append the missing MAP rows of ``map_model``; returns the keys of the rows done."""
    stack.enter_context(output_lock(out_path.parent, lock_timeout))
    _cut_partial_line(out_path)
    done = {row_key(r) for r in load_rows(out_path)}
    if map_model is not None:
        for row in _map_rows(map_model, eval_sets, reference, done):
            append_row(out_path, row)
    return done


def run_sweep(
    methods: Sequence[Method],
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
    The output folder is locked for the whole run (:func:`output_lock`, waiting up to
    ``lock_timeout`` seconds for another writer).

    Under an initialised ``torch.distributed`` group (call it on every rank with the same
    arguments) the (method, repeat) jobs are sharded: job ``k`` runs on rank ``k % world``, in
    rounds of ``world`` jobs. ``Method.fit`` then runs inside
    :func:`~laplace_debiased.parallel.distributed.local_fits`: a local fit of that rank alone,
    so it must not call collectives itself. After each round the rows are gathered and rank 0
    alone holds the lock and writes them, in the single-process order; per-cell seeds make them
    bitwise the rows of a single-process sweep. Every rank returns the same rows.

    ``shard_jobs=False`` is for collective fits (``debiased_kron`` sharding its batches, which
    every rank must call): every rank runs every job's ``Method.fit`` under the group, and the
    job's eval sets are sharded instead (set ``i`` on rank ``i % world``); the rows then equal a
    single-process sweep's to the round-off of the distributed fit. Without a group (or with one
    rank) both modes are the single-process sweep.
    """
    grid, names, reference = _checked_sweep(methods, eval_sets, prior_precisions, links)
    out_path = Path(out_path)
    rank, world = rank_world()
    writer = rank == 0
    jobs = [(m, r) for m in methods for r in range(m.repeats)]
    part = (0, 1) if shard_jobs else (rank, world)
    with ExitStack() as stack:
        done = gather_results(
            lambda: _resume(stack, out_path, lock_timeout, map_model, eval_sets, reference) if writer else None
        )[0]
        args = (eval_sets, reference, grid, done)
        kw = dict(n_samples=n_samples, seed=seed, chunk_size=chunk_size, log=log, links=links, part=part)
        step = world if shard_jobs else 1
        for first in progress_bar(range(0, len(jobs), step), desc="fit + sweep",
                                  unit="round" if step > 1 else "fit", quiet=not progress or not writer):
            k = first + rank if shard_jobs else first
            rows = [row for got in gather_results(lambda: _job_rows(jobs, k, shard_jobs, args, kw)) for row in got]
            if not shard_jobs:  # one job's cells from every rank: back to the single-process order
                rows = _single_process_order(rows, grid, tuple(jobs[first][0].links or links), names)
            for row in rows:
                if writer:
                    append_row(out_path, row)
                done.add(row_key(row))
        return gather_results(lambda: load_rows(out_path) if writer else None)[0]


def _job_rows(jobs: list[tuple[Method, int]], k: int, shard_jobs: bool, args: tuple, kw: dict) -> list[dict]:
    """The rows of job ``k`` (none past the last job): :func:`_sweep_one`, a local fit of this
    rank alone when the jobs are sharded."""
    if k >= len(jobs):
        return []
    with local_fits() if shard_jobs else nullcontext():
        return _sweep_one(*jobs[k], *args, **kw)


def _single_process_order(rows: list[dict], grid: list[float], links: tuple[str, ...], names: list[str]) -> list[dict]:
    """One job's rows from every rank in the order of a single-process sweep."""
    return sorted(rows, key=lambda r: (grid.index(r["prior_precision"]), links.index(r["link"]),
                                       names.index(r["eval_set"])))


def _sweep_one(method: Method, repeat: int, eval_sets: Sequence[EvalSet], reference: EvalSet | None,
               grid: list[float], done: set[str], *, n_samples: int, seed: int,
               chunk_size: int, log: Callable[[str], None] | None, links: Sequence[str],
               part: tuple[int, int] = (0, 1)) -> list[dict]:
    """Fit one (method, repeat) if any of its rows is missing (not in ``done``), and return the
    missing rows of the eval sets of part ``(rank, world)``: set ``i`` where ``i % world == rank``
    (the fit runs whenever any set has missing rows, so a collective fit runs on every rank)."""
    mlinks = tuple(method.links or links)
    keys = {
        (es.name, d, link): row_key(_row_base(method.name, repeat, d, es, link, method.full_batch))
        for es in eval_sets for d in grid for link in mlinks
    }
    missing = {k for k, v in keys.items() if v not in done}
    if not missing:
        return []
    if log:
        log(f"{method.name} repeat {repeat}: {len(missing)} rows to compute")
    start = time.perf_counter()
    la = method.fit(repeat)
    fit_seconds = time.perf_counter() - start
    mine = {es.name for i, es in enumerate(eval_sets) if i % part[1] == part[0]}
    missing = {k for k in missing if k[0] in mine}
    pred = GridPredictive(la, chunk_size=chunk_size)
    need = {es.name for es in eval_sets if any(k[0] == es.name for k in missing)}
    if reference is not None and any(es.kind not in ("test", "validation") for es in eval_sets if es.name in need):
        need.add(reference.name)
    probs = {}
    for es in eval_sets:
        if es.name in need:
            seeds = {(d, link): cell_seed(seed=seed, method=method.name, repeat=repeat, eval_set=es.name,
                                          prior_precision=d, link=link) for d in grid for link in mlinks}
            probs[es.name] = cell_probabilities(pred, es.x, grid, mlinks, n_samples, seeds)
    marglik = ({d: _log_marglik(la, d) for d in grid}
               if any(es.kind == "validation" and es.name in need for es in eval_sets) else {})
    eval_seconds = time.perf_counter() - start - fit_seconds
    todo_sets = [es for es in eval_sets if es.name in need]
    coverage = getattr(la, "coverage", None)  # debiased K-FAC: what the curvature covers, per factor
    correction = getattr(la, "correction", None)  # corrected K-FAC: what the correction changed
    rows = []
    for g, delta in enumerate(grid):
        for link in mlinks:
            mets = _metric_rows({n: p[link][g] for n, p in probs.items()}, todo_sets, reference)
            for es in todo_sets:
                if (es.name, delta, link) not in missing:
                    continue
                row = _row_base(method.name, repeat, delta, es, link, method.full_batch)
                row.update(mets[es.name], fit_seconds=fit_seconds, eval_seconds=eval_seconds, **method.extra)
                if es.kind == "validation":
                    row["log_marglik"] = marglik[delta]
                if es.kind == "test" and g == 0 and link == mlinks[0]:  # once per fit (its first test row)
                    if coverage is not None:
                        row["coverage"] = coverage.rows()
                    if correction is not None:
                        row["correction"] = correction.rows()
                rows.append(row)
    return rows

