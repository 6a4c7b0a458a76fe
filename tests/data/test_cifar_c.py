"""CIFAR-C release loader (tiny .npy files in the released layout)."""

from __future__ import annotations

import numpy as np
import pytest

from laplace_debiased.data import cifar_c as CC
from laplace_debiased.data.cifar import DataIntegrityError, file_digest
from laplace_debiased.data.corruptions import CORRUPTIONS

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
