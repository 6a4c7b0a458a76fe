"""The CIFAR-10 benchmark's MAP training (``benchmarks/cifar10/train.py``): two jobs training the
same model into one cache."""

from __future__ import annotations

import os

import torch

from benchmarks.cifar10 import train as train_module
from benchmarks.cifar10.train import MapConfig, train


def test_a_concurrent_training_saving_meanwhile_loses_nothing(tmp_path, monkeypatch):
    """Another job (a second pid) trains the same model while this one is between writing its
    first checkpoint and moving it into place: each writes its own temporary files, so neither
    move fails, no temporary file is left, and the cache holds the (identical) model."""
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(24, 3, 32, 32, generator=g), torch.randint(0, 10, (24,), generator=g)
    cfg = MapConfig(n_train=24, epochs=2, batch_size=12)
    real_save, pid = torch.save, os.getpid()
    saves: list = []

    def save_then_the_other_job_trains(obj, f):
        real_save(obj, f)
        saves.append(f)
        if len(saves) == 1:
            monkeypatch.setattr(os, "getpid", lambda: pid + 1)
            train(cfg, X, y, X[:6], y[:6], cache=tmp_path, log=lambda s: None)
            monkeypatch.setattr(os, "getpid", lambda: pid)

    monkeypatch.setattr(train_module.torch, "save", save_then_the_other_job_trains)
    model, _ = train(cfg, X, y, X[:6], y[:6], cache=tmp_path, log=lambda s: None)
    monkeypatch.setattr(train_module.torch, "save", real_save)
    names = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert names == ["config.json", "last.pt", "map.pt"], names
    loaded, _ = train(cfg, X, y, X[:6], y[:6], cache=tmp_path, log=lambda s: None)
    for p, q in zip(model.parameters(), loaded.parameters()):
        assert torch.equal(p, q)
