"""CIFAR-C release loader (tiny .npy files in the released layout) and resolve_eval_set."""

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

N = 4  # images per severity in the tiny release (10,000 in the real one)


def encoded(k: int, s: int, i: int) -> int:
    """Pixel value written for corruption k, severity s, test image i."""
    return (40 * k + 8 * s + i) % 256


def write_release(directory, names=CORRUPTIONS + ("speckle_noise",), labels=None):
    """``<name>.npy`` uint8 (5*N, 32, 32, 3), rows (s-1)*N .. s*N-1 = severity s; labels.npy."""
    directory.mkdir(parents=True, exist_ok=True)
    labels = np.array([3, 1, 4, 1]) if labels is None else labels
    np.save(directory / "labels.npy", np.tile(labels, 5).astype(np.uint8))
    for k, name in enumerate(names):
        arr = np.empty((5 * N, 32, 32, 3), dtype=np.uint8)
        for s in range(1, 6):
            for i in range(N):
                arr[(s - 1) * N + i] = encoded(k, s, i)
        np.save(directory / f"{name}.npy", arr)
    return labels


def test_severity_slicing_and_memory_map(tmp_path):
    labels = write_release(tmp_path)
    release = CC.CifarC(tmp_path, n_test=N)
    k = CORRUPTIONS.index("motion_blur")
    for s in (1, 3, 5):
        ds = release.select("motion_blur", s)
        assert len(ds) == N and ds.labels.tolist() == labels.tolist()
        assert isinstance(ds.images, np.memmap)  # a lazy view, not a loaded copy
        assert [int(ds.uint8(i)[0, 0, 0]) for i in range(N)] == [encoded(k, s, i) for i in range(N)]
        x, y = ds[2]
        assert x.shape == (3, 32, 32) and int(y) == labels[2]


def test_several_corruptions_concatenate_in_order(tmp_path):
    write_release(tmp_path)
    ds = CC.CifarC(tmp_path, n_test=N).select("fog+speckle_noise", 2)
    assert ds.corruption_names == ("fog", "speckle_noise") and len(ds) == 2 * N
    assert ds.corruption_index.tolist() == [0] * N + [1] * N
    expected = [encoded(CORRUPTIONS.index("fog"), 2, i) for i in range(N)] + [
        encoded(15, 2, i) for i in range(N)  # speckle_noise was written as the 16th file
    ]
    assert ds.uint8(slice(None))[:, 0, 0, 0].tolist() == expected
    assert ds.uint8(np.array([5, 0]))[:, 5, 5, 1].tolist() == [expected[5], expected[0]]
    all_ds = CC.CifarC(tmp_path, n_test=N).select("all", 4)
    assert len(all_ds) == 15 * N and all_ds.tensors()[0].shape == (15 * N, 3, 32, 32)


def test_mixed_is_reproducible_and_records_choice(tmp_path):
    write_release(tmp_path)
    release = CC.CifarC(tmp_path, n_test=N)
    a, b, c = release.mixed(3, seed=7), release.mixed(3, seed=7), release.mixed(3, seed=8)
    np.testing.assert_array_equal(a.corruption_index, b.corruption_index)
    np.testing.assert_array_equal(a.uint8(slice(None)), b.uint8(slice(None)))
    # each image appears once, at severity 3, with the recorded corruption
    for i in range(N):
        assert a.uint8(i)[0, 0, 0] == encoded(int(a.corruption_index[i]), 3, i)
    choice = CC.mixed_choice(3000, seed=7)
    assert not np.array_equal(CC.mixed_choice(3000, seed=8), choice)
    counts = np.bincount(choice, minlength=15)
    assert counts.min() > 150 and counts.max() < 250  # uniform: 200 expected per corruption
    assert len(c) == N


def test_truncated_and_malformed_files_are_refused(tmp_path):
    write_release(tmp_path, names=("fog",))
    path = tmp_path / "fog.npy"
    path.write_bytes(path.read_bytes()[:-3000])
    release = CC.CifarC(tmp_path, n_test=N)
    with pytest.raises(DataIntegrityError, match="fog.npy: not a complete .npy"):
        release.select("fog", 1)
    np.save(path, np.zeros((5 * N, 32, 32), np.uint8))
    with pytest.raises(DataIntegrityError, match=r"fog.npy: expected uint8 \(20, 32, 32, 3\)"):
        CC.CifarC(tmp_path, n_test=N).select("fog", 1)
    np.save(tmp_path / "labels.npy", (np.arange(5 * N) % 10).astype(np.uint8))  # in range, not repeating
    with pytest.raises(DataIntegrityError, match="repeat the same test labels"):
        CC.CifarC(tmp_path, n_test=N)


@pytest.mark.parametrize("dataset, bad", [("cifar10", 10), ("cifar10", 255), ("cifar100", 100)])
def test_out_of_range_labels_are_refused(tmp_path, dataset, bad):
    write_release(tmp_path, names=("fog",), labels=np.array([3, 1, bad, 1]))
    with pytest.raises(DataIntegrityError, match=rf"labels.npy: labels outside \[0, {10 if dataset == 'cifar10' else 100}\)"):
        CC.CifarC(tmp_path, n_test=N, dataset=dataset)
    write_release(tmp_path, names=("fog",), labels=np.array([3, 1, 9, 1]))
    assert CC.CifarC(tmp_path, n_test=N, dataset=dataset).labels.max() == 9


def test_npy_with_trailing_bytes_is_refused(tmp_path):
    write_release(tmp_path, names=("fog",))
    path = tmp_path / "fog.npy"
    path.write_bytes(path.read_bytes() + b"\x00" * 7)
    with pytest.raises(DataIntegrityError, match="fog.npy: 7 bytes after the array data"):
        CC.CifarC(tmp_path, n_test=N).select("fog", 1)
    labels = tmp_path / "labels.npy"
    labels.write_bytes(labels.read_bytes() + b"x")
    with pytest.raises(DataIntegrityError, match="labels.npy: 1 bytes after the array data"):
        CC.CifarC(tmp_path, n_test=N)


def test_object_dtype_and_huge_declared_npy_are_refused(tmp_path):
    write_release(tmp_path, names=("fog",))
    arr = np.empty((5 * N, 32, 32, 3), dtype=object)
    np.save(tmp_path / "fog.npy", arr, allow_pickle=True)
    with pytest.raises(DataIntegrityError, match="fog.npy: holds Python objects"):
        CC.CifarC(tmp_path, n_test=N).select("fog", 1)
    # a header declaring 2**40 images over a few bytes of data: refused before any mapping
    with open(tmp_path / "fog.npy", "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "|u1", "fortran_order": False, "shape": (2**40, 32, 32, 3)})
        f.write(b"\x00" * 64)
    with pytest.raises(DataIntegrityError, match="fog.npy: expected uint8"):
        CC.CifarC(tmp_path, n_test=N).select("fog", 1)


def test_user_checksums(tmp_path):
    write_release(tmp_path, names=("fog",))
    from laplace_debiased.data.cifar import file_digest

    good = file_digest(tmp_path / "fog.npy", "md5")
    assert len(CC.CifarC(tmp_path, n_test=N, checksums={"fog.npy": good}).select("fog", 1)) == N
    with pytest.raises(DataIntegrityError, match=f"fog.npy: user-given checksum mismatch .*{'0' * 32}"):
        CC.CifarC(tmp_path, n_test=N, checksums={"fog.npy": "0" * 32}).select("fog", 1)


def test_bad_names_and_severities():
    with pytest.raises(ValueError, match="Unknown corruption.*'fogg'"):
        CC.parse_corruptions("fog+fogg")
    assert CC.parse_corruptions("extra") == CC.EXTRA_CORRUPTIONS
    assert len(CC.ALL_CORRUPTIONS) == 19
    with pytest.raises(ValueError, match="severity must be an integer 1..5"):
        CC._check_severity(6)


# ----------------------------------------------------------------------------- resolve_eval_set


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
