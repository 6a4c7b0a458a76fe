"""Smoke test of the CIFAR-10 benchmark (``python -m benchmarks.cifar10 --quick``) on a tiny
synthetic data set written in the official CIFAR-10 binary layout (no real data)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from benchmarks.cifar10.__main__ import main
from benchmarks.cifar10.config import BASE_GRID, extended_grid
from benchmarks.cifar10.data import scrambled
from benchmarks.cifar10.evaluate import per_image, stats
from laplace_debiased.evaluation import metrics as M

RECORD = 1 + 3072


def write_cifar10_bin(root, n_per_batch: int, n_test: int, seed: int = 0) -> None:
    """``root/cifar-10-batches-bin/{data_batch_1..5,test_batch}.bin``: label byte + R, G, B planes.

    Each class has its own mean colour plus noise, so a network can learn something."""
    rng = np.random.default_rng(seed)
    folder = root / "cifar-10-batches-bin"
    folder.mkdir(parents=True)
    means = rng.integers(40, 216, size=(10, 3))
    for name, n in [*((f"data_batch_{i}.bin", n_per_batch) for i in range(1, 6)), ("test_batch.bin", n_test)]:
        labels = rng.integers(0, 10, size=n).astype(np.uint8)
        planes = means[labels][:, :, None] + rng.normal(0, 30, size=(n, 3, 1024))
        records = np.empty((n, RECORD), dtype=np.uint8)
        records[:, 0] = labels
        records[:, 1:] = planes.clip(0, 255).astype(np.uint8).reshape(n, 3072)
        (folder / name).write_bytes(records.tobytes())
    (folder / "batches.meta.txt").write_text("\n".join(
        ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]) + "\n")


@pytest.fixture
def tiny_cifar(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_cifar10_bin(root, n_per_batch=60, n_test=80)
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "cache"))
    return root


@pytest.mark.slow
def test_quick_run_writes_report(tiny_cifar, tmp_path):
    out = tmp_path / "out"
    # 30 validation images (of 60), 40 test images (of 80), 10 corrupted images per severity and
    # 10 OOD images: the predictive of these sets is most of the run's time, and a few images
    # exercise every step (the bootstrap, the grid choice and the targets see every set)
    args = ["--data", str(tiny_cifar), "--out", str(out), "--quick", "--threads", "1", "--n-val", "30",
            "--n-test", "40", "--n-corrupt", "10", "--n-ood", "10"]
    assert main(args) == 0
    res = json.loads((out / "quick" / "results.json").read_text())
    grid = res["meta"]["grid"]
    assert set(BASE_GRID) <= {round(g, 12) for g in grid} or all(
        any(abs(g - b) < 1e-12 for g in grid) for b in BASE_GRID)
    # every method has a tracking row with bootstrap intervals around its point estimate
    tr = res["summary"]["tracking_paper_grid"]
    for name in ("kron-64", "debiased_kron-64", "shrunk_kron-64", "stein_kron-64", "lowrank_ll-64", "debiased_lowrank_ll-64",
                 "noise_floor"):
        for metric in ("nll_rel", "ece", "accuracy"):
            row = tr[name][metric]
            assert row["mean"] <= row["worst"] + 1e-12
            assert row["mean_ci"][0] <= row["mean"] <= row["mean_ci"][1]
            assert row["worst_ci"][0] <= row["worst"] <= row["worst_ci"][1]
    # δ chosen on validation, never on test; the noise floor is two MC streams of one posterior
    assert all("val_nll" in s for s in res["summary"]["selected"].values())
    assert "kron-full#None@mc1" in res["curves"]
    assert {t["met"] for t in res["targets"]} <= {True, False}
    md = (out / "quick" / "results.md").read_text()
    assert "Targets" in md and "noise floor" in md
    for png in res["meta"]["figures"]:
        assert (out / "quick" / png).stat().st_size > 0
    # a second run resumes from the caches: same numbers
    assert main(args) == 0
    again = json.loads((out / "quick" / "results.json").read_text())
    assert again["curves"]["kron-full#None"]["test"]["nll"] == res["curves"]["kron-full#None"]["test"]["nll"]
    assert len(again["meta"]["fits_loaded_from_cache"]) == len(res["summary"]["selected"])


def test_bootstrappable_stats_match_package_metrics():
    gen = torch.Generator().manual_seed(0)
    P = torch.softmax(3 * torch.randn(4, 500, 10, generator=gen), -1)
    y = torch.randint(0, 10, (500,), generator=gen)
    s = stats(per_image(P, y))
    for g in range(4):
        assert s["nll"][g] == pytest.approx(M.nll(P[g], y), rel=1e-9)
        assert s["accuracy"][g] == pytest.approx(M.accuracy(P[g], y), abs=1e-12)
        assert s["ece"][g] == pytest.approx(M.ece(P[g], y), abs=1e-6)


def test_grid_extension_and_scrambling():
    assert extended_grid(0, 0) == list(BASE_GRID)
    g = extended_grid(3, 1)
    assert g[0] == pytest.approx(1e-5) and g[-1] == pytest.approx(100.0) and len(g) == len(BASE_GRID) + 4
    X = torch.randn(3, 3, 32, 32)
    Z = scrambled(X, 0)
    assert Z.shape == X.shape and not torch.equal(Z, X)
    # a permutation of pixel positions: each image's per-channel values are kept
    assert torch.equal(Z.flatten(2).sort(-1).values, X.flatten(2).sort(-1).values)
