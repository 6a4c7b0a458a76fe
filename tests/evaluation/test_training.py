"""MAP training cache: reuse exactly, never reuse stale or broken files."""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from laplace_debiased.evaluation.models import digits_mlp
from laplace_debiased.evaluation.training import TrainConfig, cache_key, evaluate_loss, train_map


def _data(seed: int = 0, n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    X = torch.rand(n, 1, 8, 8, generator=g)
    return TensorDataset(X, (X.flatten(1).sum(1) > 32).long())


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return digits_mlp(hidden=(8,), n_classes=2)


def test_training_decreases_loss_and_cache_reloads_identical_weights(tmp_path):
    cfg = TrainConfig(epochs=40, lr=3e-2, batch_size=16, weight_decay=0.0)
    before = evaluate_loss(_model(), DataLoader(_data(), batch_size=64))["loss"]
    model, hist = train_map(_model(), _data(), cfg, cache_dir=tmp_path, log=None)
    assert hist[-1]["train_loss"] < 0.5 * before
    again, hist2 = train_map(_model(), _data(), cfg, cache_dir=tmp_path, log=None)
    for p, q in zip(model.parameters(), again.parameters()):
        assert torch.equal(p, q)
    assert hist2 == hist


def test_cache_key_changes_with_config_and_data():
    cfg = TrainConfig(epochs=1)
    k = cache_key(_model(), _data(), cfg)
    assert k != cache_key(_model(), _data(), TrainConfig(epochs=2))
    assert k != cache_key(_model(), _data(seed=1), cfg)
    assert k != cache_key(digits_mlp(hidden=(9,), n_classes=2), _data(), cfg)


def test_truncated_cache_file_is_reported_and_replaced(tmp_path):
    cfg = TrainConfig(epochs=2, batch_size=16)
    train_map(_model(), _data(), cfg, cache_dir=tmp_path, log=None)
    (path,) = tmp_path.glob("*.pt")
    path.write_bytes(path.read_bytes()[:50])
    with pytest.warns(UserWarning, match="unreadable model cache"):
        train_map(_model(), _data(), cfg, cache_dir=tmp_path, log=None)
    torch.load(path, weights_only=True)  # replaced by a readable file


def test_bad_settings_raise_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="optimizer"):
        train_map(_model(), _data(), TrainConfig(epochs=1, optimizer="lbfgs"), cache_dir=tmp_path, log=None)
    with pytest.raises(FloatingPointError, match="lower the learning rate"):
        train_map(_model(), _data(), TrainConfig(epochs=3, lr=1e30, optimizer="sgd"), cache_dir=tmp_path, log=None)


def test_default_digits_model_interpolates_and_is_overconfident(digits_cache, monkeypatch):
    """The main job's MAP (DIGITS_CONFIG on the default split) is converged and overconfident:
    near-zero training loss, a test NLL many times larger and a test ECE of several percent,
    the regime in which a Laplace approximation has something to fix.  The model is the one
    ``default_digits_model()`` trained into the run's shared cache (conftest.py)."""
    from laplace_debiased.evaluation.metrics import ece
    from laplace_debiased.evaluation.training import default_digits_model

    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(digits_cache))
    model, splits = default_digits_model(log=None)
    assert [len(splits[k]) for k in ("train", "val", "test")] == [300, 497, 1000]
    train = evaluate_loss(model, DataLoader(splits["train"], batch_size=1024))
    test = evaluate_loss(model, DataLoader(splits["test"], batch_size=1024))
    assert train["accuracy"] == 1.0 and train["loss"] < 1e-3
    assert test["loss"] > 100 * train["loss"]
    X, y = splits["test"].tensors
    with torch.no_grad():
        assert ece(torch.softmax(model(X), -1), y) > 0.02


def test_training_logs_one_line_never_one_per_epoch(tmp_path, monkeypatch):
    """`make run` used to print an "epoch=" line per epoch (300) into a log file; now the log gets
    one line, and the per-epoch numbers go to the progress bar, drawn only on a terminal."""
    import io
    import sys

    cfg = TrainConfig(epochs=4, lr=3e-2, batch_size=16, weight_decay=0.0)
    lines: list[str] = []
    _, hist = train_map(_model(), _data(), cfg, cache_dir=tmp_path, use_cache=False, log=lines.append)
    assert len(hist) == 4 and len(lines) == 1, lines  # stderr is not a terminal under pytest
    assert lines[0].startswith("MAP training: 4 epochs in ") and "epoch=" not in lines[0]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    lines.clear()
    train_map(_model(), _data(), cfg, cache_dir=tmp_path, use_cache=False, log=lines.append)
    assert len(lines) == 1 and "MAP training" in terminal.getvalue() and "train_loss=" in terminal.getvalue()


def test_a_concurrent_training_of_the_same_model_saving_meanwhile_loses_nothing(tmp_path, monkeypatch):
    """Two jobs training the same MAP into one cache (another process, simulated here by a second
    pid) may save in any order: each writes its own temporary file and moves it into place, so the
    later move neither fails nor leaves a partial file, and the cache holds the (identical) model."""
    import os

    from laplace_debiased.evaluation import training

    cfg = TrainConfig(epochs=3, lr=3e-2, batch_size=16, weight_decay=0.0)
    real_save, pid = torch.save, os.getpid()
    saves: list = []

    def save_then_the_other_job_saves(obj, f):
        real_save(obj, f)
        saves.append(f)
        if len(saves) == 1:  # the other job finishes its training and saves before this one moves its file
            monkeypatch.setattr(os, "getpid", lambda: pid + 1)
            train_map(_model(), _data(), cfg, cache_dir=tmp_path, use_cache=True, log=None)
            monkeypatch.setattr(os, "getpid", lambda: pid)

    monkeypatch.setattr(training.torch, "save", save_then_the_other_job_saves)
    model, _ = train_map(_model(), _data(), cfg, cache_dir=tmp_path, log=None)
    monkeypatch.setattr(training.torch, "save", real_save)
    assert len(saves) == 2
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert len(files) == 1 and files[0].endswith(".pt"), files  # no temporary file left
    cached, _ = train_map(_model(), _data(), cfg, cache_dir=tmp_path, log=None)
    for p, q in zip(model.parameters(), cached.parameters()):
        assert torch.equal(p, q)
