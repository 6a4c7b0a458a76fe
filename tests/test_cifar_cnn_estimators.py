"""``benchmarks/cifar_cnn_estimators.py`` and ``benchmarks/resnet20_estimators.py`` (settings 3 and 4
of the third registration) on a tiny synthetic CIFAR-10 in the official binary layout: one file per
draw and b, resumed, and the single batch of all N training images equal to the reference, K-FAC
over all N in several loader batches."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from benchmarks import cifar_cnn_estimators, resnet20_estimators
from benchmarks.digits_mlp_estimators import CANDIDATES, DELTAS
from tests.test_benchmark_smoke import write_cifar10_bin


@pytest.mark.slow
@pytest.mark.parametrize("driver", [cifar_cnn_estimators, resnet20_estimators], ids=["cifar_cnn", "resnet20"])
def test_draw_files_resume_and_the_single_batch_of_all_data_is_the_reference(tmp_path, monkeypatch, driver):
    root = tmp_path / "data"
    write_cifar10_bin(root, n_per_batch=60, n_test=40)  # 300 images: 240 training, 60 validation
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "models"))
    # the reference reads all 240 training images in three loader batches, as it reads 10,000 in 20
    monkeypatch.setattr(cifar_cnn_estimators, "FULL_BATCH", 100)
    if driver is resnet20_estimators:  # the pipeline, not the training, is under test: one epoch
        monkeypatch.setattr(driver, "MAP", replace(driver.MAP, epochs=1))
    main = driver.main
    cache = tmp_path / "draws"
    args = ["--seeds", "3", "5", "--batch-sizes", "16", "240", "--cache", str(cache), "--data", str(root)]
    assert main(args) == 0
    files = sorted(cache.glob("b*/seed*.json"))
    assert [f.relative_to(cache).as_posix() for f in files] == [
        "b16/seed3.json", "b16/seed4.json", "b240/seed3.json", "b240/seed4.json"]
    records = [json.loads(f.read_text()) for f in files]
    for r in records:
        assert set(r["nll"]) == set(CANDIDATES) and r["deltas"] == list(DELTAS)
        assert all(len(v) == len(DELTAS) and all(math.isfinite(x) for x in v) for v in r["nll"].values())
    # b = N: the single batch holds every training image, in another order. Its K-FAC factors are the
    # reference's sums reordered, equal to float32 round-off (240 terms: 240 · 2⁻²⁴ ≈ 1.4e-5
    # relative), and the NLL moves by less than that relative change of the variances.
    for r in records[2:]:
        for got, want in zip(r["nll"]["single"], r["full"]):
            assert abs(got - want) <= 1e-4 * abs(want), (got, want)
    # resumed: nothing is computed again
    stamps = [f.stat().st_mtime_ns for f in files]
    assert main(args) == 0
    assert [f.stat().st_mtime_ns for f in files] == stamps
    # a reference that does not record all N images is refused, not read
    reference = json.loads((cache / "full.json").read_text())
    assert reference["images"] == 240
    del reference["images"]
    (cache / "full.json").write_text(json.dumps(reference))
    with pytest.raises(ValueError, match="not the K-FAC of all 240 training images"):
        main(args)


@pytest.mark.parametrize("full_batch", [40, 120])
def test_the_reference_is_the_curvature_of_every_training_image(monkeypatch, full_batch):
    """The reference reads all N images whatever the loader's batch size: its posterior precision
    equals that of one batch of all N (the single batch at b = N), with BatchNorm's dense blocks."""
    monkeypatch.setattr(cifar_cnn_estimators, "FULL_BATCH", full_batch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 5)).eval()
    train = TensorDataset(torch.randn(120, 3, 8, 8), torch.randint(0, 5, (120,)))
    precisions = []
    for la in (cifar_cnn_estimators.fit_full(model, train), cifar_cnn_estimators.fit(model, train, "single", 120, 0)):
        la.prior_precision = 1e-3
        precisions.append(la.posterior_precision.to_matrix().double())
    full, single = precisions
    # the same 120 outer products summed in another order and grouping: float32 round-off,
    # 120 · 2⁻²⁴ ≈ 7e-6 of the largest entry
    assert torch.allclose(full, single, rtol=0, atol=1e-5 * float(single.abs().max()))
