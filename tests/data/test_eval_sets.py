"""Evaluation sets by name (:func:`laplace_debiased.data.eval_sets.resolve_eval_set`): clean sets,
released CIFAR-C files, generated corruptions and the mixed set with their cache, bad specs."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from tests.data.test_cifar import random_images, write_binary

from laplace_debiased.data import cifar_c as CC
from laplace_debiased.data.cifar import DataIntegrityError, file_digest
from laplace_debiased.data.corruptions import CORRUPTIONS, corrupt
from laplace_debiased.data.eval_sets import resolve_eval_set


@pytest.fixture
def clean_root(tmp_path):
    """A tiny CIFAR-10 (binary) with 6 test and 5x4 training images."""
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for i in range(1, 6):
        write_binary(root / "cifar-10-batches-bin" / f"data_batch_{i}.bin",
                     random_images(4, i), rng.integers(0, 10, 4))  # fmt: skip
    x = random_images(6, 99)
    y = np.array([0, 1, 2, 3, 4, 5])
    write_binary(root / "cifar-10-batches-bin" / "test_batch.bin", x, y)
    return root, x, y


def test_resolve_clean_sets(clean_root):
    root, x, y = clean_root
    test = resolve_eval_set("cifar10-test", root, verify="structure")
    np.testing.assert_array_equal(test.images, x)
    with pytest.raises(ValueError, match=r"n_val=10000 must be in \(0, 20\)"):
        resolve_eval_set("cifar10-val", root, verify="structure")  # 20 training images only
    # without a directory in the spec the release is looked for under <root>/CIFAR-10-C
    with pytest.raises(FileNotFoundError, match="CIFAR-10-C not found"):
        resolve_eval_set("cifar10-c:fog:2", root)


def test_resolve_released_with_real_counts(tmp_path):
    """Spec parsing over a release with the official 10,000 rows per severity (tiny pixels)."""
    release = tmp_path / "CIFAR-10-C"
    release.mkdir()
    labels = np.tile(np.arange(10000) % 10, 5).astype(np.uint8)
    np.save(release / "labels.npy", labels)
    sev = np.repeat(np.arange(1, 6, dtype=np.uint8), 10000)
    for k, name in enumerate(("fog", "snow")):
        arr = np.lib.format.open_memmap(release / f"{name}.npy", "w+", np.uint8, (50000, 32, 32, 3))
        arr[:, 0, 0, 0] = sev
        arr[:, 0, 0, 1] = k
        arr.flush()
        del arr
    ds = resolve_eval_set(f"cifar10-c:{release}:snow:4", None)
    assert len(ds) == 10000 and ds.uint8(9999)[0, 0].tolist() == [4, 1, 0]
    ds = resolve_eval_set("cifar10-c:fog+snow:2", tmp_path)  # default directory under root
    assert len(ds) == 20000 and ds.uint8(np.array([0, 10000]))[:, 0, 0, :2].tolist() == [[2, 0], [2, 1]]
    with pytest.raises(DataIntegrityError, match="gaussian_noise.npy: file not found"):
        resolve_eval_set(f"cifar10-c-mixed:{release}:1", None)


def test_resolve_generated_and_mixed_with_cache(clean_root, tmp_path):
    root, x, y = clean_root
    cache = tmp_path / "cache"
    kw = dict(cache_dir=cache, verify="structure", seed=5)
    ds = resolve_eval_set("cifar10-c-generated:gaussian_noise+contrast:2", root, **kw)
    assert len(ds) == 12 and ds.corruption_names == ("gaussian_noise", "contrast")
    np.testing.assert_array_equal(ds.uint8(slice(0, 6)), corrupt(x, "gaussian_noise", 2, 5))
    np.testing.assert_array_equal(ds.uint8(slice(6, 12)), corrupt(x, "contrast", 2, 5))
    assert ds.labels.tolist() == y.tolist() * 2
    files = sorted(p.name for p in (cache / "corrupted").iterdir())
    assert len(files) == 4 and all("-s2-seed5-" in f for f in files)
    # second call: served from the cache (memory-mapped), identical
    again = resolve_eval_set("cifar10-c-generated:contrast:2", root, **kw)
    assert isinstance(again.images, np.memmap)
    np.testing.assert_array_equal(again.uint8(slice(None)), ds.uint8(slice(6, 12)))
    # a tampered cache file is detected and regenerated, never used
    npy = next((cache / "corrupted").glob("cifar10-contrast-*.npy"))
    arr = np.load(npy)
    arr[0, 0, 0, 0] ^= 0xFF
    np.save(npy, arr)
    with pytest.warns(UserWarning, match="fails its integrity check"):
        fixed = resolve_eval_set("cifar10-c-generated:contrast:2", root, **kw)
    np.testing.assert_array_equal(fixed.uint8(slice(None)), corrupt(x, "contrast", 2, 5))

    # an object-dtype cache file (with a matching sidecar hash) is refused, never unpickled
    obj = np.empty(arr.shape, dtype=object)
    np.save(npy, obj, allow_pickle=True)
    sidecar = npy.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    sidecar.write_text(json.dumps({**meta, "sha256": file_digest(npy, "sha256")}))
    with pytest.raises(DataIntegrityError, match="holds Python objects.*delete it"):
        resolve_eval_set("cifar10-c-generated:contrast:2", root, **kw)
    npy.unlink()

    mixed = resolve_eval_set("cifar10-c-mixed:3", root, **kw)
    assert len(mixed) == 6 and mixed.corruption_names == CORRUPTIONS
    np.testing.assert_array_equal(mixed.corruption_index, CC.mixed_choice(6, 5))
    for j in np.unique(mixed.corruption_index):
        group = np.flatnonzero(mixed.corruption_index == j)
        np.testing.assert_array_equal(mixed.uint8(group), corrupt(x[group], CORRUPTIONS[j], 3, 5))
    meta = json.loads(next((cache / "corrupted").glob("cifar10-mixed-*.json")).read_text())
    assert meta["params"]["severity"] == 3 and meta["params"]["seed"] == 5
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean cache hit warns about nothing
        again = resolve_eval_set("cifar10-c-mixed:3", root, **kw)
    np.testing.assert_array_equal(again.uint8(slice(None)), mixed.uint8(slice(None)))


@pytest.mark.parametrize(
    "spec, match",
    [
        ("", "Empty eval-set spec"),
        ("cifar11-test", "unknown data set 'cifar11'"),
        ("cifar10-c-generated:0", "severity must be 1..5, got '0'"),
        ("cifar10-c-generated:fogg:2", "Unknown corruption"),
        ("cifar10-c", "Cannot parse eval-set spec"),
        ("cifar10-test:3", "Cannot parse eval-set spec"),
    ],
)
def test_bad_specs(spec, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        resolve_eval_set(spec, tmp_path)
