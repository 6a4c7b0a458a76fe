"""Suite-wide settings for runs on pytest-xdist workers (``make test``: ``-n 2 --dist loadgroup``).

* **Threads.** On an xdist worker torch gets ``cpu_count // workers`` intra-op threads (at least
  one), so two workers on two cores do not oversubscribe them. A run without xdist keeps torch's
  default.
* **Work units.** Every test is put in the ``xdist_group`` of its module, so a module runs on one
  worker and its module-scoped fixtures (spawned process groups, trained models) are built once.
  A module that sets ``XDIST_PER_TEST = True`` (independent, long tests whose shared state is
  made safe across processes) is spread test by test instead.
* **Order.** Units holding a test marked ``slow`` are collected first, in their original order,
  then the rest: xdist hands out units in collection order (``--no-loadscope-reorder``), so the
  long tests start at once and the short ones fill the gaps at the end (roughly the
  longest-first greedy schedule) instead of a long test starting last while the other worker
  idles.
* **Threads kept.** Each test starts with the worker's torch threads: a test that changes them
  (an in-process CLI run applies its ``--threads``, by default every core) does not pass the
  change on to the tests after it on that worker.
* **Shared model cache.** :func:`digits_cache` trains the default digits MAP model once per run,
  for every worker.
* **Hypothesis examples.** The ``derandomized`` profile, loaded here, draws the same examples on
  every run (seeded by each test), so that a run passes or fails whatever the machine and the
  moment, and CI judges the code, not the draw. ``pytest --hypothesis-profile=explore`` draws
  fresh random examples on each run, to look for new failures; a failure it finds becomes an
  ``@example`` of its test.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from hypothesis import settings

settings.register_profile("derandomized", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("derandomized")


def worker_threads(cores: int, workers: int) -> int:
    """Torch threads of one of ``workers`` test processes sharing ``cores``: an equal share, at
    least one."""
    return max(1, cores // workers)


def pytest_configure(config: pytest.Config) -> None:
    """One share of this process's cores (its CPU affinity) per xdist worker, as torch threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(worker_threads(cores, int(workers)))


@contextmanager
def kept_torch_threads() -> Iterator[None]:
    """Restores torch's intra-op thread count on exit to its value on entry."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _threads_kept_per_test() -> Iterator[None]:
    with kept_torch_threads():
        yield


def _module_unit(item: pytest.Item) -> str | None:
    """The module name of ``item`` as its xdist group, or None for a per-test module."""
    module = getattr(item, "module", None)
    if module is None or getattr(module, "XDIST_PER_TEST", False):
        return None
    return module.__name__


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Group by module; units with a ``slow`` test first (stable within each part)."""
    def unit(item: pytest.Item) -> str:
        return _module_unit(item) or item.nodeid

    slow_units = {unit(item) for item in items if item.get_closest_marker("slow") is not None}
    for item in items:
        group = _module_unit(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    items.sort(key=lambda item: unit(item) not in slow_units)


@pytest.fixture(scope="session")
def digits_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache folder (for ``LAPLACE_DEBIASED_CACHE``) that holds the default digits MAP
    model (``default_digits_model()``: ``digits_cnn`` trained with ``DIGITS_CONFIG``, minutes of
    CPU). The first worker to ask trains it, under a file lock, into a folder that every xdist
    worker of this run shares; the others wait and load it. Tests may add their own entries
    (each under its own key); none may change this one."""
    from laplace_debiased.evaluation.training import default_digits_model

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = shared / "digits-cache"
    with FileLock(str(shared / "digits-cache.lock")):
        trained = folder / "default-digits-model-trained"
        if not trained.exists():
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("LAPLACE_DEBIASED_CACHE", str(folder))
                default_digits_model(log=None)
            trained.touch()
    return folder
