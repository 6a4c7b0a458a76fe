"""CIFAR-10-C / CIFAR-100-C (Hendrycks & Dietterich, 2019) from the released ``.npy`` files.

Layout of a release directory (``CIFAR-10-C/`` or ``CIFAR-100-C/``): ``<corruption>.npy`` uint8
``(50000, 32, 32, 3)`` whose rows ``(s-1)*10000 : s*10000`` are the 10,000 test images at severity
``s`` (test-set order), and ``labels.npy`` uint8 ``(50000,)`` (the test labels repeated five
times).  Files are memory-mapped: selecting one severity of one corruption reads only those
10,000 rows, never the whole 150 MB file.

Integrity: each file's ``.npy`` header must give uint8 ``(50000, 32, 32, 3)`` (labels ``(50000,)``)
and its size must match the header (a truncated file is refused).  The release publishes only the
md5 of the tar archives (listed in [`ARCHIVE_MD5`][laplace_debiased.data.cifar_c.ARCHIVE_MD5]), no per-file
checksums, so per-file checksums are optional: pass
``checksums={"gaussian_noise.npy": "<md5 or sha256>", ...}``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from .cifar import CIFAR10_CLASSES, DataIntegrityError, verify_checksum
from .corruptions import CORRUPTIONS, EXTRA_CORRUPTIONS
from .images import CIFAR10_MEAN, CIFAR10_STD, CIFAR100_MEAN, CIFAR100_STD, ImageDataset

ALL_CORRUPTIONS = CORRUPTIONS + EXTRA_CORRUPTIONS
N_TEST = 10000
N_SEVERITIES = 5
ARCHIVE_MD5 = {  # Zenodo records 2535967 (CIFAR-10-C) and 3555552 (CIFAR-100-C)
    "CIFAR-10-C.tar": "56bf5dcef84df0e2308c6dcbcbbd8499",
    "CIFAR-100-C.tar": "11f0ed0f1191edbf9fa23466ae6021d3",
}


def _npy_header(path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """dtype, shape and data offset of a ``.npy`` file, read from its header alone."""
    readers = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version not in readers:
            raise ValueError(f".npy format version {version} (numpy writes 1.0 or 2.0 for plain arrays)")
        shape, fortran_order, dtype = readers[version](f)
        if fortran_order:
            raise ValueError("Fortran-ordered array (numpy's np.save of a C array writes C order)")
        return dtype, tuple(shape), f.tell()


def open_npy(path: Path, shape: tuple[int, ...] | None = None, checksum: str | None = None,
             tail: tuple[int, ...] | None = None) -> np.memmap:
    """Memory-map a uint8 ``.npy`` file after checking it, without ever unpickling.

    Checked, from the header before any mapping: the dtype is uint8 (an object array is refused,
    since loading it would run pickle); the shape is ``shape`` (or ends in ``tail``); and the file
    size is exactly header + data (refusing truncated files, trailing bytes and headers that
    declare more data than the file holds).

    Args:
        path: The ``.npy`` file.
        shape: The expected shape; ``None``: any shape ending in ``tail``.
        checksum: An optional md5 or sha256 hex digest of the file.
        tail: The expected trailing dimensions when ``shape`` is ``None``.

    Returns:
        The read-only memory map of the array.

    Raises:
        DataIntegrityError: If the file is missing, fails its checksum, or fails a check above.
    """
    path = Path(path)
    if not path.is_file():
        raise DataIntegrityError(f"{path}: file not found.")
    if checksum is not None:
        verify_checksum(path, checksum, "user-given checksum")
    want = f"uint8 {shape}" if shape is not None else f"uint8 (..., {', '.join(map(str, tail or ()))})"
    try:
        dtype, found, offset = _npy_header(path)
    except (ValueError, EOFError, SyntaxError) as err:
        raise DataIntegrityError(f"{path}: not a .npy file of {want} ({err}); the file is altered.") from err
    if dtype.hasobject:
        raise DataIntegrityError(
            f"{path}: holds Python objects (dtype {dtype}); refused, since loading it would run "
            "pickle. If it is a cache file, delete it (it is regenerated); else replace it with the "
            "official uint8 file."
        )
    if dtype != np.uint8 or (shape is not None and found != shape) or (tail and found[-len(tail):] != tail):
        raise DataIntegrityError(f"{path}: expected {want}, found {dtype} {found}.")
    expected_size = offset + int(np.prod(found, dtype=np.int64))
    size = path.stat().st_size
    if size < expected_size:
        raise DataIntegrityError(
            f"{path}: not a complete .npy file of {want} ({size} bytes, header needs {expected_size}); "
            "the file is truncated or altered."
        )
    if size > expected_size:
        raise DataIntegrityError(
            f"{path}: {size - expected_size} bytes after the array data; the file is altered or not a "
            "single .npy array."
        )
    return np.load(path, mmap_mode="r", allow_pickle=False)


def parse_corruptions(corruptions: str | Sequence[str]) -> tuple[str, ...]:
    """``"all"`` -> the 15 standard; ``"extra"`` -> the 4 extra; ``"a+b"`` or a list -> those."""
    if isinstance(corruptions, str):
        special = {"all": CORRUPTIONS, "extra": EXTRA_CORRUPTIONS}
        names = special.get(corruptions, tuple(corruptions.split("+")))
    else:
        names = tuple(corruptions)
    unknown = [n for n in names if n not in ALL_CORRUPTIONS]
    if unknown or not names:
        raise ValueError(
            f"Unknown corruption(s) {unknown or names}; choose from {', '.join(ALL_CORRUPTIONS)} "
            "(or 'all' for the 15 standard, 'extra' for the 4 extra)."
        )
    return names


def _check_severity(severity: int) -> int:
    if isinstance(severity, bool) or severity not in range(1, N_SEVERITIES + 1):
        raise ValueError(f"severity must be an integer 1..{N_SEVERITIES}, got {severity!r}.")
    return int(severity)


class CifarC:
    """A release directory of CIFAR-10-C or CIFAR-100-C, files memory-mapped on first use.

    Args:
        directory: the folder holding ``<corruption>.npy`` and ``labels.npy``.
        n_test: rows per severity (10,000 in the release; smaller for test files).
        checksums: optional ``{file name: md5 or sha256}`` verified on opening.
        dataset: ``"cifar10"`` or ``"cifar100"`` (normalisation statistics and class names).
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        n_test: int = N_TEST,
        checksums: Mapping[str, str] | None = None,
        dataset: str = "cifar10",
    ) -> None:
        self.directory = Path(directory).expanduser()
        if not self.directory.is_dir():
            raise FileNotFoundError(
                f"CIFAR-C directory {self.directory} not found; download and unpack the release "
                "(zenodo.org/record/2535967) or use generated sets ('cifar10-c-generated:...')."
            )
        if dataset not in ("cifar10", "cifar100"):
            raise ValueError(f"dataset must be 'cifar10' or 'cifar100', got {dataset!r}.")
        self.n_test = n_test
        self.dataset = dataset
        self.checksums = dict(checksums or {})
        self._maps: dict[str, np.memmap] = {}
        self.labels = self._open("labels").astype(np.int64)
        n_classes = 10 if dataset == "cifar10" else 100
        if self.labels.max(initial=0) >= n_classes:
            raise DataIntegrityError(
                f"{self.directory / 'labels.npy'}: labels outside [0, {n_classes}) (max "
                f"{self.labels.max()}); not the {dataset} test labels."
            )
        if not np.array_equal(self.labels, np.tile(self.labels[:n_test], N_SEVERITIES)):
            raise DataIntegrityError(
                f"{self.directory / 'labels.npy'}: the five severity blocks should repeat the same "
                "test labels; they do not."
            )

    def _open(self, name: str) -> np.memmap:
        if name not in self._maps:
            shape = (N_SEVERITIES * self.n_test,) + (() if name == "labels" else (32, 32, 3))
            file = f"{name}.npy"
            self._maps[name] = open_npy(self.directory / file, shape, self.checksums.get(file))
        return self._maps[name]

    def _dataset(self, names: Sequence[str], which: np.ndarray, rows: np.ndarray, info: dict):
        """Lazy data set whose item i is row ``rows[i]`` of corruption ``names[which[i]]``."""
        if len(names) == 1:  # a memmap slice: lazy, nothing read yet
            images = self._open(names[0])[rows[0] : rows[-1] + 1]
        else:
            images = RowView([self._open(n) for n in names], which, rows)
        ten = self.dataset == "cifar10"
        return ImageDataset(
            images,  # type: ignore[arg-type]
            self.labels[rows],
            mean=CIFAR10_MEAN if ten else CIFAR100_MEAN,
            std=CIFAR10_STD if ten else CIFAR100_STD,
            classes=CIFAR10_CLASSES if ten else (),
            info=info,
            corruption_names=names,
            corruption_index=which,
        )

    def select(self, corruptions: str | Sequence[str], severity: int) -> ImageDataset:
        """The test images of ``corruptions`` at ``severity``, one corruption after the other.

        ``dataset.corruption_index[i]`` tells which of ``dataset.corruption_names`` item i has.
        """
        names = parse_corruptions(corruptions)
        s = _check_severity(severity)
        block = np.arange((s - 1) * self.n_test, s * self.n_test)
        which = np.repeat(np.arange(len(names)), self.n_test)
        rows = np.tile(block, len(names))
        info = {"source": str(self.directory), "corruptions": list(names), "severity": s}
        return self._dataset(names, which, rows, info)

    def mixed(self, severity: int, seed: int = 0) -> ImageDataset:
        """The paper's mixed set: each test image once, with a corruption drawn uniformly.

        Image i gets corruption ``CORRUPTIONS[k_i]``, ``k = default_rng(seed).integers(0, 15,
        n_test)`` see [`mixed_choice`][laplace_debiased.data.cifar_c.mixed_choice]), recorded in ``dataset.corruption_index``.
        """
        s = _check_severity(severity)
        which = mixed_choice(self.n_test, seed)
        rows = (s - 1) * self.n_test + np.arange(self.n_test)
        info = {"source": str(self.directory), "mixed": True, "severity": s, "seed": seed}
        return self._dataset(CORRUPTIONS, which, rows, info)


def mixed_choice(n: int, seed: int) -> np.ndarray:
    """Seeded uniform choice of one of the 15 standard corruptions per image, int64 ``(n,)``."""
    return np.random.default_rng(seed).integers(0, len(CORRUPTIONS), size=n)


class RowView:
    """Lazy array-like over several memory-maps: item ``i`` is row ``rows[i]`` of ``maps[which[i]]``.

    Indexing (int, slice or index array) reads only the requested rows from disk.
    """

    dtype = np.dtype(np.uint8)
    ndim = 4

    def __init__(self, maps: Sequence[np.ndarray], which: np.ndarray, rows: np.ndarray) -> None:
        self.maps = list(maps)
        self.which = np.asarray(which, dtype=np.int64)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.shape = (len(self.rows),) + tuple(self.maps[0].shape[1:])

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index) -> np.ndarray:
        if np.ndim(index) == 0 and not isinstance(index, slice):
            return np.asarray(self.maps[self.which[index]][self.rows[index]])
        items = np.arange(len(self))[index]
        out = np.empty((len(items),) + self.shape[1:], dtype=np.uint8)
        for k, array in enumerate(self.maps):
            mask = self.which[items] == k
            if mask.any():
                out[mask] = array[self.rows[items[mask]]]
        return out
