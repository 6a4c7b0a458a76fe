"""CIFAR-10/100 readers on tiny files written here in the exact official layouts."""

from __future__ import annotations

import os
import pickle
import struct

import numpy as np
import pytest
import torch

from laplace_debiased.data import cifar as C
from laplace_debiased.data.images import CIFAR10_MEAN, CIFAR10_STD, ImageDataset

# ----------------------------------------------------------------------------- official writers


def planes(images: np.ndarray) -> np.ndarray:
    """uint8 (n, 32, 32, 3) -> the official (n, 3072) rows: R plane, G plane, B plane, row-major."""
    return images.transpose(0, 3, 1, 2).reshape(len(images), 3072)


def write_binary(path, images: np.ndarray, labels: np.ndarray) -> None:
    """One official binary batch: per record the label byte(s), then 3072 pixel bytes."""
    labels = labels.reshape(len(images), -1).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(np.concatenate([labels, planes(images)], axis=1).tobytes())


def _pystr(b: bytes) -> bytes:
    """A Python-2 ``str`` as pickled by cPickle (SHORT_BINSTRING / BINSTRING)."""
    return b"U" + bytes([len(b)]) + b if len(b) < 256 else b"T" + struct.pack("<I", len(b)) + b


def _py2_value(v) -> bytes:
    if isinstance(v, bytes):
        return _pystr(v)
    if isinstance(v, list):
        items = b"".join(b"J" + struct.pack("<i", x) if isinstance(x, int) else _pystr(x) for x in v)
        return b"](" + items + b"e"
    assert isinstance(v, np.ndarray) and v.dtype == np.uint8 and v.ndim == 2
    return (
        b"cnumpy.core.multiarray\n_reconstruct\n" b"cnumpy\nndarray\n"
        b"K\x00\x85" + _pystr(b"b") + b"\x87R"  # _reconstruct(ndarray, (0,), 'b')
        b"(K\x01" + b"J" + struct.pack("<i", v.shape[0]) + b"J" + struct.pack("<i", v.shape[1])
        + b"\x86" + b"cnumpy\ndtype\n" + _pystr(b"u1") + b"K\x00K\x01\x87R"
        b"(K\x03" + _pystr(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"  # dtype state
        b"\x89" + _pystr(v.tobytes()) + b"tb"  # (1, shape, dtype, False, raw bytes) -> BUILD
    )  # fmt: skip


def py2_pickle(d: dict[bytes, object]) -> bytes:
    """A protocol-2 pickle of a dict as Python 2 wrote the official CIFAR python files."""
    body = b"".join(_pystr(k) + _py2_value(v) for k, v in d.items())
    return b"\x80\x02}(" + body + b"u."


def write_python10(path, images, labels, name=b"testing batch 1 of 1") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(py2_pickle({
        b"batch_label": name,
        b"labels": [int(x) for x in labels],
        b"data": planes(images),
        b"filenames": [b"img_%d.png" % i for i in range(len(images))],
    }))  # fmt: skip


def random_images(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 32, 32, 3), dtype=np.uint8)


def write_cifar10_binary(root, n_per_file: int = 3, seed: int = 0):
    """All six CIFAR-10 binary files with ``n_per_file`` records; returns (train, test) arrays."""
    rng = np.random.default_rng(seed)
    out = {}
    for split, names in (("train", [f"data_batch_{i}.bin" for i in range(1, 6)]),
                         ("test", ["test_batch.bin"])):  # fmt: skip
        xs, ys = [], []
        for k, name in enumerate(names):
            x = random_images(n_per_file, seed + 10 * k + (split == "test"))
            y = rng.integers(0, 10, size=n_per_file)
            write_binary(root / "cifar-10-batches-bin" / name, x, y)
            xs.append(x)
            ys.append(y)
        out[split] = (np.concatenate(xs), np.concatenate(ys))
    return out


# ----------------------------------------------------------------------------- binary version


def test_binary_round_trip_and_layout(tmp_path):
    data = write_cifar10_binary(tmp_path, n_per_file=3)
    for split in ("train", "test"):
        x, y = C.read_cifar_arrays(tmp_path, split, verify="structure")
        np.testing.assert_array_equal(x, data[split][0])
        np.testing.assert_array_equal(y, data[split][1])
        assert x.dtype == np.uint8 and y.dtype == np.int64
    # layout by hand: record = label, then R plane, G plane, B plane, each row-major
    img = np.zeros((1, 32, 32, 3), dtype=np.uint8)
    img[0, 0, 1, 0] = 11  # R at row 0, column 1  -> byte 1 + 1
    img[0, 2, 0, 1] = 22  # G at row 2, column 0  -> byte 1 + 1024 + 64
    img[0, 31, 31, 2] = 33  # B, last pixel       -> last byte
    path = tmp_path / "one.bin"
    write_binary(path, img, np.array([7]))
    raw = path.read_bytes()
    assert raw[0] == 7 and raw[2] == 11 and raw[1 + 1024 + 64] == 22 and raw[-1] == 33
    x, y = C.read_binary_records(path, n_label_bytes=1, n_classes=(10,))
    np.testing.assert_array_equal(x, img)
    assert y.tolist() == [[7]]


def test_binary_dataset_tensors_and_normalisation(tmp_path):
    data = write_cifar10_binary(tmp_path)
    ds = C.load_cifar10(tmp_path, "test", verify="structure")
    assert len(ds) == 3 and ds.classes[3] == "cat"
    x, y = ds[1]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    raw = torch.from_numpy(data["test"][0][1]).permute(2, 0, 1).double() / 255
    expected = (raw - torch.tensor(CIFAR10_MEAN).view(3, 1, 1).double()) / torch.tensor(
        CIFAR10_STD
    ).view(3, 1, 1).double()
    torch.testing.assert_close(x.double(), expected, atol=1e-6, rtol=0)
    X, Y = ds.tensors()
    torch.testing.assert_close(X[1], x)
    assert Y.tolist() == data["test"][1].tolist()
    plain = C.load_cifar10(tmp_path, "test", verify="structure", normalize=False)
    torch.testing.assert_close(plain[1][0].double(), raw.float().double(), atol=1e-7, rtol=0)


def test_cifar100_binary_coarse_and_fine(tmp_path):
    x = random_images(4, 1)
    labels = np.array([[19, 99], [0, 0], [5, 42], [7, 3]])  # (coarse, fine) per record
    write_binary(tmp_path / "cifar-100-binary" / "train.bin", x, labels)
    (tmp_path / "cifar-100-binary" / "fine_label_names.txt").write_text(
        "\n".join(f"class{i}" for i in range(100)) + "\n"
    )
    fine = C.load_cifar100(tmp_path, "train", verify="structure")
    coarse = C.load_cifar100(tmp_path, "train", label="coarse", verify="structure")
    assert fine.labels.tolist() == [99, 0, 42, 3] and coarse.labels.tolist() == [19, 0, 5, 7]
    np.testing.assert_array_equal(fine.images, x)
    assert fine.classes[42] == "class42"


def test_official_mode_requires_official_record_count(tmp_path):
    write_cifar10_binary(tmp_path, n_per_file=3)
    with pytest.raises(C.DataIntegrityError, match=r"data_batch_1.bin: expected 10000 records"):
        C.load_cifar10(tmp_path, "train")  # default verify="official"


def test_truncated_binary_is_refused(tmp_path):
    write_cifar10_binary(tmp_path, n_per_file=3)
    path = tmp_path / "cifar-10-batches-bin" / "data_batch_3.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(C.DataIntegrityError, match=r"data_batch_3.bin: size 9119 bytes .* 3073"):
        C.load_cifar10(tmp_path, "train", verify="structure")


def test_tampered_binary_is_refused(tmp_path):
    write_cifar10_binary(tmp_path, n_per_file=3)
    path = tmp_path / "cifar-10-batches-bin" / "test_batch.bin"
    good = C.file_digest(path, "sha256")
    checks = {"cifar-10-batches-bin/test_batch.bin": good}
    assert len(C.load_cifar10(tmp_path, "test", verify="structure", checksums=checks)) == 3
    raw = bytearray(path.read_bytes())
    raw[500] ^= 0xFF  # one pixel byte changed
    path.write_bytes(bytes(raw))
    with pytest.raises(C.DataIntegrityError, match=f"expected {good}, found"):
        C.load_cifar10(tmp_path, "test", verify="structure", checksums=checks)
    raw[3073] = 10  # label byte of record 1 out of range
    path.write_bytes(bytes(raw))
    with pytest.raises(C.DataIntegrityError, match=r"test_batch.bin: record 1 has label .* 10"):
        C.load_cifar10(tmp_path, "test", verify="structure")


def test_missing_data_names_the_fix(tmp_path):
    with pytest.raises(FileNotFoundError, match="cifar-10-batches-bin or cifar-10-batches-py"):
        C.load_cifar10(tmp_path, "test")


# ----------------------------------------------------------------------------- python version


def test_python_pickle_round_trip_and_official_md5(tmp_path):
    x, y = random_images(5, 3), np.array([0, 9, 3, 3, 1])
    base = tmp_path / "cifar-10-batches-py"
    write_python10(base / "test_batch", x, y)
    # our writer emits the Python-2 opcodes of the official files, which Python 3's own
    # unpickler (latin1) reads back into the same arrays
    ref = pickle.loads((base / "test_batch").read_bytes(), encoding="latin1")
    np.testing.assert_array_equal(ref["data"], planes(x))
    ds = C.load_cifar10(tmp_path, "test", verify="structure", fmt="python")
    np.testing.assert_array_equal(ds.images, x)
    assert ds.labels.tolist() == y.tolist()
    # "official" mode checks the published md5 before unpickling: a non-official file fails
    with pytest.raises(C.DataIntegrityError, match="40351d587109b95175f43aff81a1287e, found"):
        C.load_cifar10(tmp_path, "test", fmt="python")


def test_cifar100_python(tmp_path):
    x = random_images(3, 4)
    path = tmp_path / "cifar-100-python" / "test"
    path.parent.mkdir(parents=True)
    path.write_bytes(py2_pickle({
        b"filenames": [b"a.png", b"b.png", b"c.png"], b"batch_label": b"testing batch 1 of 1",
        b"fine_labels": [5, 99, 0], b"coarse_labels": [1, 19, 4], b"data": planes(x),
    }))  # fmt: skip
    (path.parent / "meta").write_bytes(py2_pickle({
        b"fine_label_names": [b"c%d" % i for i in range(100)],
        b"coarse_label_names": [b"s%d" % i for i in range(20)],
    }))  # fmt: skip
    ds = C.load_cifar100(tmp_path, "test", verify="structure")
    assert ds.labels.tolist() == [5, 99, 0] and ds.classes[99] == "c99"
    assert C.load_cifar100(tmp_path, "test", label="coarse", verify="structure").labels.tolist() == [1, 19, 4]
    np.testing.assert_array_equal(ds.images, x)


def test_truncated_pickle_is_refused(tmp_path):
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    write_python10(path, random_images(2, 0), np.array([1, 2]))
    path.write_bytes(path.read_bytes()[:-200])
    with pytest.raises(C.DataIntegrityError, match="test_batch: not a complete CIFAR python pickle"):
        C.load_cifar10(tmp_path, "test", verify="structure")


def test_pickle_with_wrong_content_is_refused(tmp_path):
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    write_python10(path, random_images(2, 0), np.array([1, 12]))  # label 12 out of range
    with pytest.raises(C.DataIntegrityError, match=r"'labels' outside \[0, 10\)"):
        C.load_cifar10(tmp_path, "test", verify="structure")


class _Evil:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


@pytest.mark.parametrize("payload", ["os.system", "float64-array"])
def test_malicious_pickle_is_refused_without_running(tmp_path, payload):
    marker = tmp_path / "pwned"
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.parent.mkdir(parents=True)
    if payload == "os.system":
        raw = pickle.dumps({"data": _Evil(f"touch {marker}"), "labels": [1]}, protocol=2)
        match = "refused global (posix|os|nt).system"
    else:  # an official-looking array of another dtype (object arrays could smuggle anything)
        raw = py2_pickle({b"data": np.zeros((1, 3072), np.uint8), b"labels": [1]})
        assert raw.count(b"U\x02u1") == 1
        raw = raw.replace(b"U\x02u1", b"U\x02f8")
        match = "refused numpy dtype 'f8'"
    path.write_bytes(raw)
    with pytest.raises(C.DataIntegrityError, match=match):
        C.load_cifar10(tmp_path, "test", verify="structure")
    assert not marker.exists()
    # the same bytes through the stock unpickler *would* run the command: the test is live
    if payload == "os.system":
        pickle.loads(path.read_bytes())
        assert marker.exists()


def _pickle_with_data(data_value: bytes) -> bytes:
    """An official-looking CIFAR-10 python pickle whose 'data' value is the given pickle bytes."""
    return b"\x80\x02}(" + _pystr(b"data") + data_value + _pystr(b"labels") + b"](J\x01\x00\x00\x00eu."


_RECONSTRUCT = b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\n"
_SHAPE_1x3072 = b"K\x01M\x00\x0c\x86"  # the tuple (1, 3072)


@pytest.mark.parametrize("how", ["ndarray-call", "reconstruct-typecode"])
def test_float64_array_in_pickle_is_refused(tmp_path, how):
    """Two ways to get a float64 ndarray past a dtype filter that sees only numpy.dtype(...)."""
    if how == "ndarray-call":  # numpy.ndarray((1, 3072), 'f8') called directly by REDUCE
        value = b"cnumpy\nndarray\n" + _SHAPE_1x3072 + _pystr(b"f8") + b"\x86R"
    else:  # _reconstruct(ndarray, (1, 3072), 'd') and no __setstate__: a float64 array
        value = _RECONSTRUCT + _SHAPE_1x3072 + _pystr(b"d") + b"\x87R"
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.parent.mkdir(parents=True)
    path.write_bytes(_pickle_with_data(value))
    assert pickle.loads(path.read_bytes(), encoding="latin1")["data"].dtype == np.float64  # live
    with pytest.raises(C.DataIntegrityError, match="test_batch: .*(refused|uint8)"):
        C.load_cifar10(tmp_path, "test", verify="structure")


@pytest.mark.parametrize("where", ["reconstruct", "setstate"])
def test_huge_array_declared_in_pickle_is_a_clear_error_not_memoryerror(tmp_path, where):
    huge = b"\x8a\x08" + (2**62).to_bytes(8, "little") + b"\x85"  # the tuple (2**62,)
    if where == "reconstruct":
        value = _RECONSTRUCT + huge + _pystr(b"b") + b"\x87R"
    else:  # official reconstruction, then a state declaring 2**62 uint8 with 3 bytes of data
        value = (_RECONSTRUCT + b"K\x00\x85" + _pystr(b"b") + b"\x87R"
                 b"(K\x01" + huge + b"cnumpy\ndtype\n" + _pystr(b"u1") + b"K\x00K\x01\x87R"
                 b"(K\x03" + _pystr(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
                 b"\x89" + _pystr(b"abc") + b"tb")  # fmt: skip
    path = tmp_path / "cifar-10-batches-py" / "test_batch"
    path.parent.mkdir(parents=True)
    path.write_bytes(_pickle_with_data(value))
    with pytest.raises(C.DataIntegrityError, match="test_batch: "):
        C.load_cifar10(tmp_path, "test", verify="structure")


# ----------------------------------------------------------------------------- split, stats


def test_seeded_split_is_deterministic_disjoint_and_complete(tmp_path):
    write_cifar10_binary(tmp_path, n_per_file=4)
    a = C.cifar_splits(tmp_path, n_val=5, seed=3, verify="structure")
    b = C.cifar_splits(tmp_path, n_val=5, seed=3, verify="structure")
    c = C.cifar_splits(tmp_path, n_val=5, seed=4, verify="structure")
    assert (len(a["train"]), len(a["val"]), len(a["test"])) == (15, 5, 4)
    np.testing.assert_array_equal(a["val"].images, b["val"].images)
    assert not np.array_equal(a["val"].images, c["val"].images)
    train_idx, val_idx = C.split_indices(20, 5, 3)
    assert sorted(np.concatenate([train_idx, val_idx]).tolist()) == list(range(20))
    full = C.load_cifar10(tmp_path, "train", verify="structure")
    np.testing.assert_array_equal(a["val"].images, full.images[val_idx])
    np.testing.assert_array_equal(a["train"].labels, full.labels[train_idx])
    # the paper's sizes on the real counts
    tr, va = C.split_indices(50000, 10000, 0)
    assert (len(tr), len(va), len(np.intersect1d(tr, va))) == (40000, 10000, 0)


def test_dataset_validation():
    x = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match="uint8 of shape"):
        ImageDataset(x.astype(np.float32), np.zeros(2))
    with pytest.raises(ValueError, match="3 labels for 2 images"):
        ImageDataset(x, np.zeros(3))


@pytest.mark.parametrize("rows", [range(0, 15), range(2, 7), range(5, 5), range(14, 15), range(3, 6)])
def test_rows_of_the_training_split_equal_the_slice_of_all_rows(tmp_path, rows):
    """Across file boundaries (3 records a file), empty, one row, a whole file; binary and python."""
    data = write_cifar10_binary(tmp_path, n_per_file=3)
    x, y = data["train"]
    for i in range(5):
        write_python10(tmp_path / "cifar-10-batches-py" / f"data_batch_{i + 1}", x[3 * i:3 * i + 3], y[3 * i:3 * i + 3])
    for fmt in ("binary", "python"):
        got_x, got_y = C.read_cifar_arrays(tmp_path, "train", fmt=fmt, verify="structure", rows=rows)
        assert np.array_equal(got_x, x[rows.start:rows.stop]) and np.array_equal(got_y, y[rows.start:rows.stop])
    part = C.load_cifar10(tmp_path, "train", fmt="binary", verify="structure", rows=rows)
    assert len(part) == len(rows) and part.images.nbytes == len(rows) * 3072  # only these rows held
    with pytest.raises(ValueError, match="15 rows"):
        C.read_cifar_arrays(tmp_path, "train", fmt="binary", verify="structure", rows=range(10, 16))


def test_official_size_needs_no_file():
    assert C.official_size("cifar10", "train") == 50000 and C.official_size("cifar100", "test") == 10000
