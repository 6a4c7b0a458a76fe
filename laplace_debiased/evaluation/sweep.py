"""Resumable prior-precision sweeps over fitted Laplace approximations.

A sweep evaluates every method (MAP, and Laplace approximations fitted lazily by a callable, one
per repeat = batch draw) on every evaluation set, for every prior precision of a grid and every
link approximation, and appends one JSON object per result to a JSON-lines file.  Rows are keyed
by ``(method, repeat, prior_precision, eval_set, link)``: rerunning the same sweep skips every key
already in the file, and a (method, repeat) whose rows are all present is neither fitted nor
evaluated again.  Each row is written with a single ``write`` + ``fsync``; a truncated last line
(an interrupted write) is dropped on load.

Row fields: ``method, repeat, prior_precision`` (``null`` for MAP), ``eval_set, kind`` (``test``,
``corrupted``, ``ood``), ``severity, link, full_batch`` and the metrics: for labelled sets
accuracy/nll/ece/brier/confidence and a reliability histogram; for ``corrupted``/``ood`` sets
also auroc/aupr/fpr95 of detecting them against the reference (clean test) set.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from laplace_debiased.evaluation import metrics
from laplace_debiased.evaluation.options import DEFAULT_LINKS, DEFAULT_PRIOR_PRECISIONS
from laplace_debiased.evaluation.predictive import LINKS, GridPredictive


@dataclass
class EvalSet:
    """Inputs ``x`` ``(N, ...)`` and labels ``y`` ``(N,)`` (``None`` for unlabelled OOD data).

    ``kind``: ``"test"`` (the in-distribution reference), ``"corrupted"`` (labelled, also scored
    for detection against the reference) or ``"ood"`` (detection only).
    """

    name: str
    x: Tensor
    y: Tensor | None = None
    kind: str = "test"
    severity: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("test", "corrupted", "ood"):
            raise ValueError(f"eval set kind must be test, corrupted or ood, got {self.kind!r}")
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


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a JSON-lines results file (missing file -> ``[]``).

    Every row is written as one line ending in a newline, so bytes after the last newline are an
    interrupted write: they are dropped and cut from the file, and appending continues on a clean
    line.  A complete line that does not parse is an error (the file is not a results file).
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) != len(raw):
        with open(path, "r+b") as fh:
            fh.truncate(len(complete))
    rows = []
    for i, line in enumerate(complete.splitlines()):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{i + 1} is not a JSON line ({err}); not a sweep results file? "
                "Use another output folder or remove the file."
            ) from err
    return rows


def append_row(path: str | Path, row: dict) -> None:
    """Append one row as a single line (one ``write`` + ``fsync``)."""
    data = (json.dumps(row, allow_nan=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def _metric_rows(
    probs: dict[str, Tensor], eval_sets: Sequence[EvalSet], reference: EvalSet | None
) -> dict[str, dict]:
    """Metrics per eval set for one (method, prior, link): ``{eval name: metrics}``."""
    out = {}
    ref = probs.get(reference.name) if reference is not None else None
    for es in eval_sets:
        p = probs[es.name]
        m: dict = {}
        if es.y is not None:
            m.update(metrics.classification_metrics(p, es.y))
            m["reliability"] = metrics.reliability_bins(p, es.y)
        if es.kind != "test" and ref is not None:
            m.update(metrics.ood_metrics(ref, p))
        out[es.name] = m
    return out


def run_sweep(
    methods: Sequence[Method],
    eval_sets: Sequence[EvalSet],
    out_path: str | Path,
    *,
    prior_precisions: Sequence[float] = DEFAULT_PRIOR_PRECISIONS,
    links: Sequence[str] = DEFAULT_LINKS,
    n_samples: int = 100,
    seed: int = 0,
    chunk_size: int = 64,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
    map_model: torch.nn.Module | None = None,
) -> list[dict]:
    """Run (or resume) a sweep; returns all rows of ``out_path`` afterwards.

    ``map_model`` evaluates the MAP baseline rows (method ``"map"``, link ``"map"``) when given.
    """
    from laplace_debiased._progress import progress_bar

    for link in links:
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}; choose from {LINKS}")
    names = [es.name for es in eval_sets]
    if len(set(names)) != len(names):
        raise ValueError(f"eval set names must be unique, got {names}")
    refs = [es for es in eval_sets if es.kind == "test"]
    reference = refs[0] if refs else None
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    done = {row_key(r) for r in load_rows(out_path)}
    grid = [float(f"{d:.6g}") for d in prior_precisions]

    def base(name, repeat, delta, es, link, full_batch):
        return {
            "method": name, "repeat": repeat, "prior_precision": delta, "eval_set": es.name,
            "kind": es.kind, "severity": es.severity, "link": link, "full_batch": full_batch,
        }

    if map_model is not None:
        todo = [es for es in eval_sets if row_key(base("map", 0, None, es, "map", False)) not in done]
        if todo:
            need = todo + ([reference] if reference is not None and reference not in todo else [])
            with torch.no_grad():
                was = map_model.training
                map_model.eval()
                probs = {es.name: torch.cat([torch.softmax(map_model(x), -1) for x in es.x.split(256)]) for es in need}
                map_model.train(was)
            mets = _metric_rows(probs, todo, reference)
            for es in todo:
                append_row(out_path, {**base("map", 0, None, es, "map", False), **mets[es.name]})

    jobs = [(m, r) for m in methods for r in range(m.repeats)]
    for method, repeat in progress_bar(jobs, desc="fit + sweep", unit="fit", quiet=not progress):
        mlinks = tuple(method.links or links)
        keys = {
            (es.name, d, link): row_key(base(method.name, repeat, d, es, link, method.full_batch))
            for es in eval_sets for d in grid for link in mlinks
        }
        missing = {k for k, v in keys.items() if v not in done}
        if not missing:
            continue
        if log:
            log(f"{method.name} repeat {repeat}: {len(missing)} rows to compute")
        start = time.perf_counter()
        la = method.fit(repeat)
        fit_seconds = time.perf_counter() - start
        pred = GridPredictive(la, chunk_size=chunk_size)
        need = {es.name for es in eval_sets if any(k[0] == es.name for k in missing)}
        if reference is not None and any(es.kind != "test" for es in eval_sets if es.name in need):
            need.add(reference.name)
        gen = torch.Generator().manual_seed(seed * 1000 + repeat)
        probs = {}
        for es in eval_sets:
            if es.name in need:
                probs[es.name] = pred.grid(es.x, grid, links=mlinks, n_samples=n_samples, generator=gen)
        eval_seconds = time.perf_counter() - start - fit_seconds
        todo_sets = [es for es in eval_sets if es.name in need]
        for g, delta in enumerate(grid):
            for link in mlinks:
                mets = _metric_rows({n: p[link][g] for n, p in probs.items()}, todo_sets, reference)
                for es in todo_sets:
                    if (es.name, delta, link) not in missing:
                        continue
                    row = base(method.name, repeat, delta, es, link, method.full_batch)
                    row.update(mets[es.name], fit_seconds=fit_seconds, eval_seconds=eval_seconds, **method.extra)
                    append_row(out_path, row)
                    done.add(row_key(row))
    return load_rows(out_path)
