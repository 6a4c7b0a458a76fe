"""``benchmarks/resnet20_estimators.py`` (setting 4 of the third registration) on a tiny synthetic
CIFAR-10 in the official binary layout: a BatchNorm ResNet-20, one file per draw, resumed, and the
single batch of all N training images equal to the reference over all N."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from benchmarks import cifar_cnn_estimators, resnet20_estimators
from benchmarks.digits_mlp_estimators import CANDIDATES, DELTAS
from tests.test_benchmark_smoke import write_cifar10_bin


@pytest.mark.slow
def test_draw_files_resume_and_the_single_batch_of_all_data_is_the_reference(tmp_path, monkeypatch):
    root = tmp_path / "data"
    write_cifar10_bin(root, n_per_batch=40, n_test=30)  # 200 images: 160 training, 40 validation
    monkeypatch.setenv("LAPLACE_DEBIASED_CACHE", str(tmp_path / "models"))
    # the pipeline, not the training, is under test: one epoch
    monkeypatch.setattr(resnet20_estimators, "MAP", replace(resnet20_estimators.MAP, epochs=1))
    # the reference reads all 160 training images in three loader batches, as it reads 10,000 in 20
    monkeypatch.setattr(cifar_cnn_estimators, "FULL_BATCH", 60)
    cache = tmp_path / "draws"
    args = ["--seeds", "3", "5", "--batch-sizes", "16", "160", "--cache", str(cache), "--data", str(root)]
    assert resnet20_estimators.main(args) == 0
    files = sorted(cache.glob("b*/seed*.json"))
    assert [f.relative_to(cache).as_posix() for f in files] == [
        "b16/seed3.json", "b16/seed4.json", "b160/seed3.json", "b160/seed4.json"]
    records = [json.loads(f.read_text()) for f in files]
    for r in records:
        assert set(r["nll"]) == set(CANDIDATES) and r["deltas"] == list(DELTAS)
        assert all(len(v) == len(DELTAS) and all(math.isfinite(x) for x in v) for v in r["nll"].values())
    # b = N: the single batch holds every training image in another order. Its K-FAC factors and
    # BatchNorm blocks are the reference's sums reordered, equal to float32 round-off (160 terms:
    # 160 · 2⁻²⁴ ≈ 1e-5 relative), and the NLL moves by less than that relative change of the variances.
    for r in records[2:]:
        for got, want in zip(r["nll"]["single"], r["full"]):
            assert abs(got - want) <= 1e-4 * abs(want), (got, want)
    stamps = [f.stat().st_mtime_ns for f in files]
    assert resnet20_estimators.main(args) == 0
    assert [f.stat().st_mtime_ns for f in files] == stamps
