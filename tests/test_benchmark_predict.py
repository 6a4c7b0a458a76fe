"""The CIFAR-10 benchmark's predictive (``benchmarks/cifar10/predict.py``) is checkpointed block by
block: an interrupted set resumes at the first missing block, and the blocks give the numbers of
one pass over the set (the MC draws follow the set's chunk index, not the block's)."""

import numpy as np
import pytest
import torch

import benchmarks.cifar10.predict as P
from _models import tiny_mlp, toy_data
from benchmarks.cifar10.config import Config
from benchmarks.cifar10.fits import Fit, fit_kron
from laplace_debiased.posterior.from_laplace import posterior_structure

N, GRID = 50, [1e-2, 1.0]


@pytest.fixture()
def setup(monkeypatch):
    monkeypatch.setattr(P, "BLOCK_CHUNKS", 2)
    train = toy_data(N, (4,), 3, "classification", seed=5)
    model = tiny_mlp().double()
    train = torch.utils.data.TensorDataset(train.tensors[0].double(), train.tensors[1])
    idx = np.random.default_rng(0).choice(N, size=20, replace=False)
    fits = [Fit(f"kron-{deb}", "kron", 20, 0, "all", 0.0, 0.0, posterior_structure(fit_kron(model, train, idx, deb)))
            for deb in (False, True)]
    cfg = Config(chunk_size=4, mc_samples=7)
    X = torch.randn(23, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))  # 6 chunks, 3 blocks
    return model, fits, {"test": (X, torch.zeros(23, dtype=torch.long))}, cfg


def test_blocks_give_the_numbers_of_one_pass(setup, tmp_path):
    model, fits, sets, cfg = setup
    probs, maps = P.predictions(model, fits, sets, GRID, cfg, tmp_path)
    todo = {f.key: GRID for f in fits}
    whole, whole_map = P._predict(model, fits, todo, sets["test"][0], "test", cfg)
    for f in fits:
        ref = torch.stack([whole[f.key][P._dkey(d)] for d in GRID])
        torch.testing.assert_close(probs["test"][f.key], ref, rtol=0, atol=0)
    torch.testing.assert_close(maps["test"], whole_map, rtol=0, atol=0)
    assert not list(tmp_path.glob("block-*")), "block files are removed once the set is saved"


def test_an_interrupted_set_resumes_at_the_first_missing_block(setup, tmp_path, monkeypatch):
    model, fits, sets, cfg = setup
    calls = []
    real = P._predict

    def crash_on_third_block(*args, first_chunk=0, **kw):
        calls.append(first_chunk)
        if first_chunk == 4:
            raise KeyboardInterrupt
        return real(*args, first_chunk=first_chunk, **kw)

    monkeypatch.setattr(P, "_predict", crash_on_third_block)
    with pytest.raises(KeyboardInterrupt):
        P.predictions(model, fits, sets, GRID, cfg, tmp_path)
    assert calls == [0, 2, 4] and len(list(tmp_path.glob("block-test-*"))) == 2
    calls.clear()

    def count(*args, first_chunk=0, **kw):
        calls.append(first_chunk)
        return real(*args, first_chunk=first_chunk, **kw)

    monkeypatch.setattr(P, "_predict", count)
    resumed, _ = P.predictions(model, fits, sets, GRID, cfg, tmp_path)
    assert calls == [4], "only the missing block is predicted again"
    (tmp_path / "fresh").mkdir()
    fresh, _ = P.predictions(model, fits, sets, GRID, cfg, tmp_path / "fresh")
    for f in fits:
        torch.testing.assert_close(resumed["test"][f.key], fresh["test"][f.key], rtol=0, atol=0)


def test_a_second_process_fills_blocks_from_the_end(setup, tmp_path, monkeypatch):
    """``fill_from_end`` (the ``--from-end`` helper run) predicts the last blocks; the main run
    then predicts only the first ones, and the set has the numbers of one pass."""
    model, fits, sets, cfg = setup
    calls = []
    real = P._predict

    def record(*args, first_chunk=0, **kw):
        calls.append(first_chunk)
        if first_chunk == 2:  # the helper is stopped before it reaches the main run's blocks
            raise KeyboardInterrupt
        return real(*args, first_chunk=first_chunk, **kw)

    monkeypatch.setattr(P, "_predict", record)
    with pytest.raises(KeyboardInterrupt):
        P.fill_from_end(model, fits, sets, GRID, cfg, tmp_path, names=["test"])
    assert calls == [4, 2]
    calls.clear()
    monkeypatch.setattr(P, "_predict", lambda *a, first_chunk=0, **kw: calls.append(first_chunk) or real(*a, first_chunk=first_chunk, **kw))
    probs, _ = P.predictions(model, fits, sets, GRID, cfg, tmp_path)
    assert calls == [0, 2], "the main run predicts the blocks the helper has not saved"
    whole, _ = P._predict(model, fits, {f.key: GRID for f in fits}, sets["test"][0], "test", cfg)
    for f in fits:
        torch.testing.assert_close(probs["test"][f.key], torch.stack([whole[f.key][P._dkey(d)] for d in GRID]), rtol=0, atol=0)
    calls.clear()
    P.fill_from_end(model, fits, sets, GRID, cfg, tmp_path, names=["test"])
    assert calls == [], "a set already predicted is left alone"


def test_the_helper_stops_at_the_first_block_that_exists(setup, tmp_path, monkeypatch):
    model, fits, sets, cfg = setup
    todo = {f.key: GRID for f in fits}
    paths = P._block_paths(todo, len(sets["test"][0]), "test", cfg, tmp_path)
    P._predict_block(model, fits, todo, sets["test"][0], "test", cfg, paths, 1)  # made by the main run
    calls = []
    real = P._predict
    monkeypatch.setattr(P, "_predict", lambda *a, first_chunk=0, **kw: calls.append(first_chunk) or real(*a, first_chunk=first_chunk, **kw))
    P.fill_from_end(model, fits, sets, GRID, cfg, tmp_path, names=["test"])
    assert calls == [4] and all(p.is_file() for p in paths[1:]) and not paths[0].is_file()


def test_the_helper_stops_once_the_main_run_has_assembled_the_set(setup, tmp_path, monkeypatch):
    """The main run may finish the set (and delete its blocks) while the helper predicts a block:
    the helper then stops instead of predicting the deleted blocks again."""
    model, fits, sets, cfg = setup
    done, main_run = [], []
    real_block = P._predict_block

    def block_then_main_run_finishes(*args, **kw):
        real_block(*args, **kw)
        if main_run:  # a block of the main run (the nested call below)
            return
        done.append(args[7])  # the helper's block index j
        if len(done) == 1:
            main_run.append(True)
            P.predictions(model, fits, sets, GRID, cfg, tmp_path)
            main_run.clear()

    monkeypatch.setattr(P, "_predict_block", block_then_main_run_finishes)
    P.fill_from_end(model, fits, sets, GRID, cfg, tmp_path, names=["test"])
    assert done == [2] and not list(tmp_path.glob("block-*"))
