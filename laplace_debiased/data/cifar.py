"""CIFAR-10 and CIFAR-100 from their official on-disk layouts, without torchvision.

Layouts read (directory names as in the official archives, under ``root``):

* binary: ``cifar-10-batches-bin/data_batch_{1..5}.bin, test_batch.bin`` (records of 1 label
  byte + 3072 pixel bytes) and ``cifar-100-binary/train.bin, test.bin`` (coarse label byte,
  fine label byte, 3072 pixel bytes).  Pixels: the R plane, then G, then B, each 32x32 row-major.
* python: ``cifar-10-batches-py/data_batch_{1..5}, test_batch`` and ``cifar-100-python/train,
  test`` -- Python-2 pickles of a dict with ``data`` (uint8 ``(n, 3072)``, same pixel order) and
  ``labels`` / ``fine_labels`` + ``coarse_labels``.  They are read with a restricted unpickler
  that admits only numpy's array reconstruction for uint8 arrays; any other global (``os.system``,
  ``builtins.eval``, ...) is refused before it can be called.

Integrity: every file's size / record count is checked, the official md5 checksums are checked
where they are published (the python version; no checksums are published for the files of the
binary version), labels are range-checked, and a caller may pass its own checksum table.  Any
failure raises [`DataIntegrityError`][laplace_debiased.data.cifar.DataIntegrityError] naming the file, what
was expected and what was found; partial data is never returned.

Images come back as [`ImageDataset`][laplace_debiased.data.images.ImageDataset] (uint8 ``(N, 32, 32, 3)``
storage, normalised float tensors served), labels int64.  Get the data from
https://www.cs.toronto.edu/~kriz/cifar.html (the python or the binary version), unpack the archive
into a folder and point ``root`` (or the environment variable ``LAPLACE_DEBIASED_DATA``) at it.
"""

from __future__ import annotations

import hashlib
import importlib
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import numpy as np

from ..paths import default_data_root
from .images import CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, ImageDataset

Verify = Literal["official", "structure"]

CIFAR10_CLASSES = (
    "airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck",
)  # fmt: skip
PIXELS = 3 * 32 * 32

# Official md5 checksums of the python-version files (as published with the archives).
OFFICIAL_MD5 = {
    "cifar-10-batches-py/data_batch_1": "c99cafc152244af753f735de768cd75f",
    "cifar-10-batches-py/data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
    "cifar-10-batches-py/data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
    "cifar-10-batches-py/data_batch_4": "634d18415352ddfa80567beed471001a",
    "cifar-10-batches-py/data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
    "cifar-10-batches-py/test_batch": "40351d587109b95175f43aff81a1287e",
    "cifar-100-python/train": "16019d7e3df5f24257cddd939b257f8d",
    "cifar-100-python/test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
}


class DataIntegrityError(ValueError):
    """A data file is missing, truncated, altered or not in the expected format."""


class RefusedPickleContent(pickle.UnpicklingError):
    """The pickle asks for something the CIFAR files never contain (a global, a dtype)."""


def file_digest(path: Path, algorithm: str, chunk: int = 1 << 22) -> str:
    """Hex digest (``"md5"`` or ``"sha256"``) of a file, read in chunks."""
    h = hashlib.new(algorithm)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def verify_checksum(path: Path, expected: str, what: str = "checksum") -> None:
    """Check a file's md5 or sha256 digest.

    Args:
        path: the file.
        expected: its md5 (32 hex digits) or sha256 (64 hex digits).
        what: the name of the check in the error message.

    Raises:
        DataIntegrityError: if the file's digest differs from ``expected``.
    """
    algorithm = {32: "md5", 64: "sha256"}.get(len(expected))
    if algorithm is None:
        raise ValueError(f"{expected!r} is neither an md5 (32 hex) nor a sha256 (64 hex) digest.")
    found = file_digest(path, algorithm)
    if found != expected.lower():
        raise DataIntegrityError(
            f"{path}: {what} mismatch ({algorithm}): expected {expected}, found {found}. "
            "The file is altered or incomplete; replace it with a fresh copy."
        )


# ----------------------------------------------------------------------------- binary version


def read_binary_records(
    path: Path,
    *,
    n_label_bytes: int,
    n_classes: tuple[int, ...],
    expected_records: int | None = None,
    records: range | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Read one official binary batch file (or only its records ``records``).

    Args:
        path: the ``.bin`` file.
        n_label_bytes: 1 (CIFAR-10) or 2 (CIFAR-100: coarse, then fine).
        n_classes: number of classes of each label byte, for range checks.
        expected_records: required number of records, or ``None`` for any whole number.
        records: a contiguous range of record indices to read (the file's size is checked
            whole, only these records are read from disk and range-checked); ``None``: all.

    Returns:
        images uint8 ``(n, 32, 32, 3)`` and labels uint8 ``(n, n_label_bytes)``.
    """
    path = Path(path)
    if not path.is_file():
        raise DataIntegrityError(f"{path}: file not found.")
    record = n_label_bytes + PIXELS
    size = path.stat().st_size
    if expected_records is not None and size != expected_records * record:
        raise DataIntegrityError(
            f"{path}: expected {expected_records} records of {record} bytes "
            f"({expected_records * record} bytes), found {size} bytes."
        )
    if size == 0 or size % record:
        raise DataIntegrityError(
            f"{path}: size {size} bytes is not a positive multiple of the {record}-byte record; "
            "the file is truncated or not a CIFAR binary batch."
        )
    records = range(size // record) if records is None else records
    if records.step != 1 or records.start < 0 or records.stop > size // record:
        raise ValueError(f"{path}: records must be a contiguous range within its {size // record} records, got {records}")
    raw = np.fromfile(path, dtype=np.uint8, count=len(records) * record,
                      offset=records.start * record).reshape(-1, record)
    labels = raw[:, :n_label_bytes]
    for j, n in enumerate(n_classes):
        bad = np.flatnonzero(labels[:, j] >= n)
        if bad.size:
            raise DataIntegrityError(
                f"{path}: record {records.start + bad[0]} has label byte {j} = {labels[bad[0], j]}, expected "
                f"< {n}; the file is altered or not in the official layout."
            )
    images = raw[:, n_label_bytes:].reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), np.ascontiguousarray(labels)


# ----------------------------------------------------------------------------- python version


def _numpy_reconstruct():
    """numpy's array-unpickling helper (``numpy._core`` in numpy 2, ``numpy.core`` before)."""
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        try:
            return importlib.import_module(module)._reconstruct
        except (ImportError, AttributeError):
            continue
    raise ImportError("numpy's multiarray._reconstruct not found")  # pragma: no cover


def _uint8_dtype(spec, align=False, copy=False):
    """``numpy.dtype`` for unpickling, admitting only uint8."""
    spec = spec.decode("latin1") if isinstance(spec, bytes) else spec
    if spec not in ("u1", "|u1", "uint8"):
        raise RefusedPickleContent(f"refused numpy dtype {spec!r}: CIFAR pickles hold only uint8.")
    return np.dtype(spec, align=bool(align), copy=bool(copy))


class _NdarrayToken:
    """Stands for ``numpy.ndarray`` inside a pickle: only ``_array_reconstruct`` accepts it.

    Handing out the real class would let a pickle call ``numpy.ndarray(shape, "f8")`` directly,
    an array of any dtype and size that no dtype filter sees.
    """

    def __new__(cls, *args, **kwargs):
        raise RefusedPickleContent(
            "refused a direct numpy.ndarray(...) call: it builds an array of any dtype and size; "
            "CIFAR pickles hold only uint8 arrays written by numpy."
        )


def _array_reconstruct(cls, shape, typecode):
    """``_reconstruct`` for unpickling, admitting only what numpy itself writes.

    numpy pickles an array as ``_reconstruct(ndarray, (0,), b"b")`` and then sets shape, dtype
    and bytes with ``__setstate__`` (where the dtype passes ``_uint8_dtype`` and numpy checks
    that the bytes fill the shape).  Any other shape or type code would build an array of another
    dtype, or allocate a declared size before a single byte is checked.
    """
    if cls is not _NdarrayToken:
        raise RefusedPickleContent(f"refused array class {cls!r}.")
    if tuple(shape) != (0,) or typecode not in ("b", b"b"):
        raise RefusedPickleContent(
            f"refused array reconstruction with shape {shape!r} and type code {typecode!r} "
            "(numpy writes (0,) and 'b', then the uint8 content)."
        )
    return _numpy_reconstruct()(np.ndarray, (0,), "b")


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for the CIFAR python version: dicts, lists, strings, ints and uint8 arrays only.

    Any global other than numpy's ndarray reconstruction (``os.system``, ``builtins.eval``,
    ``subprocess.Popen``, ...) raises
    [`RefusedPickleContent`][laplace_debiased.data.cifar.RefusedPickleContent] *before* it is looked up, so it
    can never be called.
    """

    _ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"): _array_reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _array_reconstruct,
        ("numpy", "ndarray"): _NdarrayToken,
        ("numpy", "dtype"): _uint8_dtype,
    }

    def find_class(self, module: str, name: str):
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise RefusedPickleContent(
                f"refused global {module}.{name}: CIFAR pickles contain only numpy uint8 arrays, "
                "lists, strings and numbers. This file is not an official CIFAR file."
            ) from None


def read_python_batch(path: Path) -> dict:
    """Unpickle one python-version file with
    [`RestrictedUnpickler`][laplace_debiased.data.cifar.RestrictedUnpickler] (keys become ``str``)."""
    path = Path(path)
    if not path.is_file():
        raise DataIntegrityError(f"{path}: file not found.")
    try:
        with open(path, "rb") as f:
            obj = RestrictedUnpickler(f, encoding="latin1").load()
    except RefusedPickleContent as err:
        raise DataIntegrityError(f"{path}: {err}") from err
    except (MemoryError, OverflowError) as err:
        raise DataIntegrityError(
            f"{path}: declares an array too large to hold ({type(err).__name__}); the file is not "
            "an official CIFAR file."
        ) from err
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError) as err:
        raise DataIntegrityError(
            f"{path}: not a complete CIFAR python pickle ({type(err).__name__}: {err}); the file "
            "is truncated or altered."
        ) from err
    if not isinstance(obj, dict):
        raise DataIntegrityError(f"{path}: expected a pickled dict, found {type(obj).__name__}.")
    return obj


def _python_records(
    path: Path, label_keys: tuple[str, ...], n_classes: tuple[int, ...], expected: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """Images ``(n, 32, 32, 3)`` and labels ``(n, len(label_keys))`` from a python-version file."""
    batch = read_python_batch(path)
    missing = [k for k in ("data", *label_keys) if k not in batch]
    if missing:
        raise DataIntegrityError(f"{path}: keys {missing} missing; found {sorted(batch)}.")
    data = batch["data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != PIXELS:
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataIntegrityError(f"{path}: 'data' should be uint8 (n, {PIXELS}), found {found}.")
    n = data.shape[0]
    if expected is not None and n != expected:
        raise DataIntegrityError(f"{path}: expected {expected} images, found {n}.")
    columns = []
    for key, n_cls in zip(label_keys, n_classes):
        values = np.asarray(batch[key])
        if values.shape != (n,) or not np.issubdtype(values.dtype, np.integer):
            raise DataIntegrityError(f"{path}: '{key}' should be {n} integers, found {values.shape}.")
        if values.min() < 0 or values.max() >= n_cls:
            raise DataIntegrityError(
                f"{path}: '{key}' outside [0, {n_cls}): found [{values.min()}, {values.max()}]."
            )
        columns.append(values.astype(np.uint8))
    images = data.reshape(n, 3, 32, 32).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(images), np.stack(columns, axis=1)


# ----------------------------------------------------------------------------- public loaders

_LAYOUTS = {
    # (dataset, format): (directory, {split: [files]})
    ("cifar10", "binary"): (
        "cifar-10-batches-bin",
        {"train": [f"data_batch_{i}.bin" for i in range(1, 6)], "test": ["test_batch.bin"]},
    ),
    ("cifar10", "python"): (
        "cifar-10-batches-py",
        {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]},
    ),
    ("cifar100", "binary"): ("cifar-100-binary", {"train": ["train.bin"], "test": ["test.bin"]}),
    ("cifar100", "python"): ("cifar-100-python", {"train": ["train"], "test": ["test"]}),
}
_RECORDS_PER_FILE = {("cifar10", "train"): 10000, ("cifar10", "test"): 10000,
                     ("cifar100", "train"): 50000, ("cifar100", "test"): 10000}  # fmt: skip


def _find_format(root: Path, dataset: str) -> str:
    for fmt in ("binary", "python"):
        if (root / _LAYOUTS[(dataset, fmt)][0]).is_dir():
            return fmt
    dirs = " or ".join(_LAYOUTS[(dataset, f)][0] for f in ("binary", "python"))
    raise FileNotFoundError(
        f"No {dataset} under {root}: expected a directory {dirs}. Download the python or binary version "
        "from https://www.cs.toronto.edu/~kriz/cifar.html, unpack it into a folder, and pass that folder "
        "as root or set LAPLACE_DEBIASED_DATA to it."
    )


def read_cifar_arrays(
    root: str | Path | None,
    split: Literal["train", "test"],
    *,
    dataset: Literal["cifar10", "cifar100"] = "cifar10",
    fmt: Literal["auto", "binary", "python"] = "auto",
    verify: Verify = "official",
    checksums: Mapping[str, str] | None = None,
    rows: range | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Images uint8 ``(N, 32, 32, 3)`` and labels of one official split (or of its rows ``rows``).

    Labels: int64 ``(N,)`` for CIFAR-10; int64 ``(N, 2)`` = (coarse, fine) for CIFAR-100.

    Args:
        root: directory holding ``cifar-10-batches-bin`` etc.; ``None`` =
            [`default_data_root`][laplace_debiased.paths.default_data_root].
        split: ``"train"`` or ``"test"``.
        dataset: ``"cifar10"`` or ``"cifar100"``.
        fmt: ``"binary"`` (the official binary version), ``"python"`` (the pickled python
            version, read without unpickling code) or ``"auto"``: the one found under ``root``,
            binary first.
        verify: ``"official"`` requires the official record counts (10,000 per CIFAR-10 file,
            50,000 / 10,000 for CIFAR-100) and, for the python version, the official md5;
            ``"structure"`` accepts any whole number of well-formed records (small test files,
            sub-sampled copies).
        checksums: optional ``{"<dir>/<file>": md5-or-sha256}``, checked in either mode.
        rows: a contiguous range of the split's rows (in the files' order) to return; the binary
            layout then reads only those records from disk (the python version reads each file
            whole and keeps the rows). ``None``: every row.

    Returns:
        ``(images, labels)``.

    Raises:
        ValueError: For an unknown ``split``, ``verify`` or ``dataset``, or ``rows`` outside the
            split.
        FileNotFoundError: With ``fmt="auto"``, if neither layout is under ``root``.
        DataIntegrityError: If a file is missing, altered or fails its checksum.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    if verify not in ("official", "structure"):
        raise ValueError(f"verify must be 'official' or 'structure', got {verify!r}.")
    if (dataset, "binary") not in _LAYOUTS:
        raise ValueError(f"dataset must be 'cifar10' or 'cifar100', got {dataset!r}.")
    root = default_data_root() if root is None else Path(root).expanduser()
    fmt = _find_format(root, dataset) if fmt == "auto" else fmt
    directory, files = _LAYOUTS[(dataset, fmt)]
    expected = _RECORDS_PER_FILE[(dataset, split)] if verify == "official" else None
    n_classes = (10,) if dataset == "cifar10" else (20, 100)
    images, labels, offset = [], [], 0
    for name in files[split]:
        key = f"{directory}/{name}"
        path = root / directory / name
        if checksums and key in checksums:
            verify_checksum(path, checksums[key], "user-given checksum")
        if fmt == "python" and verify == "official" and path.is_file():
            verify_checksum(path, OFFICIAL_MD5[key], "official checksum")
        x, y, n_file = _read_file(path, fmt, dataset, expected, rows, offset)
        images.append(x)
        labels.append(y)
        offset += n_file
    if rows is not None and (rows.step != 1 or rows.start < 0 or rows.stop > offset):
        raise ValueError(f"rows must be a contiguous range within the split's {offset} rows, got {rows}.")
    y = np.concatenate(labels).astype(np.int64)
    return np.concatenate(images), (y[:, 0] if dataset == "cifar10" else y)


def _read_file(path: Path, fmt: str, dataset: str, expected: int | None, rows: range | None,
               offset: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Images, labels and the number of records of one file holding the split's rows from
    ``offset`` on: only those of ``rows`` (the binary layout reads no other record)."""
    n_classes = (10,) if dataset == "cifar10" else (20, 100)
    if fmt == "binary":
        n_file = path.stat().st_size // (len(n_classes) + PIXELS) if path.is_file() else 0
        x, y = read_binary_records(path, n_label_bytes=len(n_classes), n_classes=n_classes,
                                   expected_records=expected, records=_within(rows, offset, n_file))
        return x, y, n_file
    keys = ("labels",) if dataset == "cifar10" else ("coarse_labels", "fine_labels")
    x, y = _python_records(path, keys, n_classes, expected)
    part = _within(rows, offset, len(x))
    return (x, y, len(x)) if part is None else (x[part.start:part.stop].copy(), y[part.start:part.stop].copy(), len(x))


def _within(rows: range | None, offset: int, n_file: int) -> range | None:
    """The part of ``rows`` (global row indices) in a file holding rows ``offset..offset+n_file-1``,
    as record indices within the file (``None``: every record)."""
    if rows is None:
        return None
    start = min(max(rows.start - offset, 0), n_file)
    return range(start, max(start, min(rows.stop - offset, n_file)))


def official_size(dataset: Literal["cifar10", "cifar100"], split: Literal["train", "test"]) -> int:
    """Rows of an official split (50,000 train or 10,000 test images), without reading a file."""
    directory, files = _LAYOUTS[(dataset, "binary")]
    return _RECORDS_PER_FILE[(dataset, split)] * len(files[split])


def _class_names(root: Path, dataset: str, n: int) -> tuple[str, ...]:
    if dataset == "cifar10":
        return CIFAR10_CLASSES
    names: tuple[str, ...] = ()
    text_meta = root / "cifar-100-binary" / "fine_label_names.txt"
    pickle_meta = root / "cifar-100-python" / "meta"
    if text_meta.is_file():
        names = tuple(line.strip() for line in text_meta.read_text().splitlines() if line.strip())
    elif pickle_meta.is_file():
        names = tuple(str(x) for x in read_python_batch(pickle_meta).get("fine_label_names", ()))
    return names if len(names) == n else tuple(str(i) for i in range(n))


def load_cifar10(
    root: str | Path | None = None,
    split: Literal["train", "test"] = "test",
    *,
    normalize: bool = True,
    fmt: Literal["auto", "binary", "python"] = "auto",
    verify: Verify = "official",
    checksums: Mapping[str, str] | None = None,
    rows: range | None = None,
) -> ImageDataset:
    """CIFAR-10 ``split`` as an [`ImageDataset`][laplace_debiased.data.images.ImageDataset] (50,000 train or
    10,000 test images).

    Args:
        root: the data directory ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        split: ``"train"`` or ``"test"``.
        normalize: apply the standard CIFAR-10 per-channel mean/std.
        fmt: the file layout ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        verify: the integrity check ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        checksums: expected checksums by file
            ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        rows: the records to read ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]);
            default all.

    Returns:
        The images (uint8 storage, served as float tensors ``(3, 32, 32)``) and their labels.
    """
    x, y = read_cifar_arrays(root, split, dataset="cifar10", fmt=fmt, verify=verify,
                             checksums=checksums, rows=rows)  # fmt: skip
    return ImageDataset(
        x, y,
        mean=CIFAR10_MEAN if normalize else None,
        std=CIFAR10_STD if normalize else None,
        classes=CIFAR10_CLASSES,
        info={"dataset": "cifar10", "split": split},
    )  # fmt: skip


def load_cifar100(
    root: str | Path | None = None,
    split: Literal["train", "test"] = "test",
    *,
    label: Literal["fine", "coarse"] = "fine",
    normalize: bool = True,
    fmt: Literal["auto", "binary", "python"] = "auto",
    verify: Verify = "official",
    checksums: Mapping[str, str] | None = None,
    rows: range | None = None,
) -> ImageDataset:
    """CIFAR-100 ``split`` as an [`ImageDataset`][laplace_debiased.data.images.ImageDataset] (50,000 train or
    10,000 test images).

    Args:
        root: the data directory ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        split: ``"train"`` or ``"test"``.
        label: ``"fine"`` (100 classes) or ``"coarse"`` (20 superclasses).
        normalize: apply the standard CIFAR-100 per-channel mean/std.
        fmt: the file layout ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        verify: the integrity check ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        checksums: expected checksums by file
            ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        rows: the records to read ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]);
            default all.

    Returns:
        The images (uint8 storage, served as float tensors ``(3, 32, 32)``) and their labels.
    """
    if label not in ("fine", "coarse"):
        raise ValueError(f"label must be 'fine' or 'coarse', got {label!r}.")
    x, y = read_cifar_arrays(root, split, dataset="cifar100", fmt=fmt, verify=verify,
                             checksums=checksums, rows=rows)  # fmt: skip
    y = y[:, 1] if label == "fine" else y[:, 0]
    root_path = default_data_root() if root is None else Path(root).expanduser()
    classes = _class_names(root_path, "cifar100", 100) if label == "fine" else ()
    return ImageDataset(
        x, y,
        mean=CIFAR100_MEAN if normalize else None,
        std=CIFAR100_STD if normalize else None,
        classes=classes,
        info={"dataset": "cifar100", "split": split, "label": label},
    )  # fmt: skip


def split_indices(n: int, n_val: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Seeded partition of ``range(n)`` into sorted (train, val) index arrays of sizes n-n_val, n_val."""
    if not 0 < n_val < n:
        raise ValueError(f"n_val={n_val} must be in (0, {n}).")
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_val:]), np.sort(perm[:n_val])


def cifar_splits(
    root: str | Path | None = None,
    *,
    dataset: Literal["cifar10", "cifar100"] = "cifar10",
    n_val: int = 10000,
    seed: int = 0,
    normalize: bool = True,
    verify: Verify = "official",
) -> dict[str, ImageDataset]:
    """The paper's deterministic split: ``{"train": 40k, "val": 10k, "test": 10k}`` (CIFAR-10).

    ``val`` is a seeded random subset (``numpy.random.default_rng(seed)``) of ``n_val`` images of
    the official training set, ``train`` the rest; both keep the official order.  No
    augmentation.

    Args:
        root: the data directory ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).
        dataset: ``"cifar10"`` or ``"cifar100"`` (fine labels).
        n_val: number of validation images taken from the official training set.
        seed: seed of the validation subset.
        normalize: apply the data set's per-channel mean/std.
        verify: the integrity check ([`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]).

    Returns:
        ``{"train": ..., "val": ..., "test": ...}`` image data sets.
    """
    if dataset not in ("cifar10", "cifar100"):
        raise ValueError(f"dataset must be 'cifar10' or 'cifar100', got {dataset!r}.")
    loader = load_cifar10 if dataset == "cifar10" else load_cifar100
    full = loader(root, "train", normalize=normalize, verify=verify)
    train_idx, val_idx = split_indices(len(full), n_val, seed)
    out = {"train": full.subset(train_idx), "val": full.subset(val_idx),
           "test": loader(root, "test", normalize=normalize, verify=verify)}  # fmt: skip
    for name in ("train", "val"):
        out[name].info = {**full.info, "split": name, "n_val": n_val, "seed": seed}
    return out
