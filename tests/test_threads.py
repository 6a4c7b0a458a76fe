"""Thread defaults (:mod:`laplace_debiased._threads`): OMP_NUM_THREADS, the CPU affinity, and the
OpenMP wait policy set only where absent."""

from __future__ import annotations

from laplace_debiased import _threads


def test_threads_default_respects_omp_num_threads(monkeypatch):
    monkeypatch.setattr(_threads, "available_cores", lambda: 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _threads.default_threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _threads.default_threads() == 4
    for garbage in ("garbage", "0", "-2", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", garbage)
        assert _threads.default_threads() == 4


def test_available_cores_are_the_cpu_affinity(monkeypatch):
    monkeypatch.setattr(_threads.os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    assert _threads.available_cores() == 3
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _threads.default_threads() == 3


def test_openmp_defaults_are_set_only_where_absent():
    env = {"GOMP_SPINCOUNT": "10"}
    assert _threads.set_openmp_defaults(env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"GOMP_SPINCOUNT": "10", "OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    assert _threads.set_openmp_defaults(env) == {}
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}
