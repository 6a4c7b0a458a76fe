"""One-argument selection of evaluation sets: ``resolve_eval_set("cifar10-c-generated:3")``.

Spec grammar (``<ds>`` is ``cifar10`` or ``cifar100``; ``<corr>`` a corruption name, several
joined by ``+``, ``all`` for the 15 standard or ``extra`` for the 4 extra ones; ``<s>`` 1..5):

==========================================  =====================================================
``<ds>-test`` / ``<ds>-train`` / ``<ds>-val`` the clean test set; the 40k / 10k seeded split of the
                                            training set
                                            ([`cifar_splits`][laplace_debiased.data.cifar.cifar_splits])
``<ds>-c:[<dir>:]<corr>:<s>``               released CIFAR-C ``.npy`` files in ``<dir>`` (default
                                            ``<root>/CIFAR-10-C`` or ``<root>/CIFAR-100-C``)
``<ds>-c-mixed:<dir>:<s>``                  the paper's mixed set from the released files
``<ds>-c-generated:[<corr>:]<s>``           test set corrupted by
[`corrupt`][laplace_debiased.data.corruptions.corrupt]
                                            (``<corr>`` defaults to ``all``)
``<ds>-c-mixed:<s>``                        the mixed set, generated: each test image corrupted by
                                            one of the 15 corruptions drawn uniformly (seeded)
==========================================  =====================================================

``root`` is the directory holding the clean data (see
[`default_data_root`][laplace_debiased.paths.default_data_root]). Generated sets are cached under
``<cache dir>/corrupted/`` (``$LAPLACE_DEBIASED_CACHE``, default ``~/.cache/laplace-debiased``) as one
``.npy`` per (corruption, severity) -- or per mixed set -- plus a JSON sidecar holding its sha256, the
generator parameters and a fingerprint of the clean images; a file whose hash does not match is regenerated
(with a warning), never used.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

import numpy as np

from ..paths import default_cache_dir, default_data_root
from .cifar import Verify, cifar_splits, file_digest, load_cifar10, load_cifar100
from .cifar_c import CifarC, RowView, mixed_choice, open_npy, parse_corruptions
from .corruptions import CORRUPTIONS, corrupt
from .images import ImageDataset

GENERATOR_VERSION = 1  # bump when corruptions.py changes its output, to invalidate caches
_C_DIRS = {"cifar10": "CIFAR-10-C", "cifar100": "CIFAR-100-C"}

SPEC_HELP = (
    "Eval-set specs: cifar10-test | cifar10-val | cifar10-train | cifar10-c:[DIR:]CORR:S | "
    "cifar10-c-mixed:DIR:S | cifar10-c-generated:[CORR:]S | cifar10-c-mixed:S "
    "(cifar100-... likewise; CORR = name, a+b, all or extra; S = 1..5)."
)


def _severity(text: str, spec: str) -> int:
    if text not in {"1", "2", "3", "4", "5"}:
        raise ValueError(f"{spec!r}: severity must be 1..5, got {text!r}. {SPEC_HELP}")
    return int(text)


def resolve_eval_set(
    spec: str,
    root: str | Path | None = None,
    *,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    verify: Verify = "official",
) -> ImageDataset:
    """The evaluation set named by ``spec`` (grammar in the module docstring).

    Args:
        spec: e.g. ``"cifar10-test"``, ``"cifar10-c:/data/CIFAR-10-C:gaussian_noise:3"``,
            ``"cifar10-c-generated:3"``, ``"cifar10-c-mixed:3"``.
        root: clean-data directory; ``None`` = ``$LAPLACE_DEBIASED_DATA`` or ``<cache>/data``.
        seed: seed of generated corruptions, of the mixed choice and of the train/val split.
        cache_dir: where generated sets are cached (default
            [`default_cache_dir`][laplace_debiased.paths.default_cache_dir]).
        verify: integrity level of the clean CIFAR files (see
            [`read_cifar_arrays`][laplace_debiased.data.cifar.read_cifar_arrays]; ``"structure"`` admits
            sub-sampled copies).

    Returns:
        an [`ImageDataset`][laplace_debiased.data.images.ImageDataset]; CIFAR-C sets also carry
        ``corruption_names`` and ``corruption_index`` (int64 per item).
    """
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"Empty eval-set spec. {SPEC_HELP}")
    head, *parts = spec.split(":")
    dataset, _, kind = head.partition("-")
    if dataset not in _C_DIRS:
        raise ValueError(f"{spec!r}: unknown data set {dataset!r}. {SPEC_HELP}")
    root_path = default_data_root() if root is None else Path(root).expanduser()
    if kind in ("test", "train", "val") and not parts:
        if kind == "test":
            loader = load_cifar10 if dataset == "cifar10" else load_cifar100
            return loader(root_path, "test", verify=verify)
        return cifar_splits(root_path, dataset=dataset, seed=seed, verify=verify)[kind]  # type: ignore[arg-type]
    if kind == "c" and len(parts) in (2, 3):
        directory = Path(parts[0]) if len(parts) == 3 else root_path / _C_DIRS[dataset]
        release = CifarC(directory, dataset=dataset)
        return release.select(parse_corruptions(parts[-2]), _severity(parts[-1], spec))
    if kind == "c-mixed" and len(parts) == 2:
        return CifarC(Path(parts[0]), dataset=dataset).mixed(_severity(parts[1], spec), seed)
    if kind == "c-mixed" and len(parts) == 1:
        severity = _severity(parts[0], spec)
        return generated_mixed(dataset, severity, root_path, seed, cache_dir, verify)
    if kind == "c-generated" and len(parts) in (1, 2):
        names = parse_corruptions(parts[0] if len(parts) == 2 else "all")
        severity = _severity(parts[-1], spec)
        return generated_set(dataset, names, severity, root_path, seed, cache_dir, verify)
    raise ValueError(f"Cannot parse eval-set spec {spec!r}. {SPEC_HELP}")


def _clean_test(dataset: str, root: Path, verify: Verify) -> ImageDataset:
    return (load_cifar10 if dataset == "cifar10" else load_cifar100)(root, "test", verify=verify)


def _fingerprint(images: np.ndarray, labels: np.ndarray) -> str:
    h = hashlib.sha256(np.ascontiguousarray(images).tobytes())
    h.update(np.ascontiguousarray(labels).tobytes())
    return h.hexdigest()


def _cached(cache: Path, stem: str, params: dict, make) -> tuple[np.ndarray, dict]:
    """Memory-map ``cache/stem.npy`` if its sidecar matches ``params`` and its sha256; else make.

    ``make()`` returns ``(images uint8, extra json-able dict)``; written atomically.
    """
    cache.mkdir(parents=True, exist_ok=True)
    data, meta_path = cache / f"{stem}.npy", cache / f"{stem}.json"
    if data.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
        except json.JSONDecodeError:
            meta = {}
        if meta.get("params") == params and meta.get("sha256") == file_digest(data, "sha256"):
            return open_npy(data, tail=(32, 32, 3)), meta
        warnings.warn(
            f"Cached set {data} fails its integrity check (hash or parameters differ); "
            "regenerating it.",
            stacklevel=3,
        )
    images, extra = make()
    tmp = data.with_suffix(".npy.part")
    with open(tmp, "wb") as f:
        np.save(f, images)
    meta = {"params": params, "sha256": file_digest(tmp, "sha256"), **extra}
    tmp.replace(data)
    meta_path.with_suffix(".json.part").write_text(json.dumps(meta))
    meta_path.with_suffix(".json.part").replace(meta_path)
    return open_npy(data, tail=(32, 32, 3)), meta


def _cache_root(cache_dir: str | Path | None) -> Path:
    return (default_cache_dir() if cache_dir is None else Path(cache_dir)) / "corrupted"


def generated_set(
    dataset: str,
    corruptions: tuple[str, ...],
    severity: int,
    root: Path,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    verify: Verify = "official",
) -> ImageDataset:
    """The clean test set corrupted by each of ``corruptions`` at ``severity``, concatenated.

    One cached file per corruption; item ``i`` of corruption ``k`` is test image ``i`` corrupted
    by ``corrupt(test_images, corruptions[k], severity, seed)``.
    """
    clean = _clean_test(dataset, root, verify)
    fingerprint = _fingerprint(clean.images, clean.labels)
    maps = []
    for name in corruptions:
        params = {"dataset": dataset, "corruption": name, "severity": severity, "seed": seed,
                  "clean": fingerprint, "version": GENERATOR_VERSION}  # fmt: skip
        stem = f"{dataset}-{name}-s{severity}-seed{seed}-{fingerprint[:12]}"
        images, _ = _cached(
            _cache_root(cache_dir), stem, params,
            lambda name=name: (corrupt(clean.images, name, severity, seed), {}),
        )  # fmt: skip
        maps.append(images)
    n = len(clean)
    which = np.repeat(np.arange(len(corruptions)), n)
    rows = np.tile(np.arange(n), len(corruptions))
    images = maps[0] if len(maps) == 1 else RowView(maps, which, rows)
    return ImageDataset(
        images,  # type: ignore[arg-type]
        np.tile(clean.labels, len(corruptions)),
        mean=clean.mean, std=clean.std, classes=clean.classes,
        info={"dataset": dataset, "generated": True, "corruptions": list(corruptions),
              "severity": severity, "seed": seed},
        corruption_names=corruptions, corruption_index=which,
    )  # fmt: skip


def generated_mixed(
    dataset: str,
    severity: int,
    root: Path,
    seed: int = 0,
    cache_dir: str | Path | None = None,
    verify: Verify = "official",
) -> ImageDataset:
    """The paper's mixed set, generated: test image ``i`` corrupted by ``CORRUPTIONS[k_i]``.

    ``k = mixed_choice(n, seed)`` (uniform over the 15 standard corruptions), recorded in
    ``dataset.corruption_index``; the images of corruption ``j`` are
    ``corrupt(test_images[k == j], CORRUPTIONS[j], severity, seed)``.
    """
    clean = _clean_test(dataset, root, verify)
    fingerprint = _fingerprint(clean.images, clean.labels)
    which = mixed_choice(len(clean), seed)

    def make() -> tuple[np.ndarray, dict]:
        out = np.empty_like(clean.images)
        for j, name in enumerate(CORRUPTIONS):
            group = np.flatnonzero(which == j)
            if group.size:
                out[group] = corrupt(clean.images[group], name, severity, seed)
        return out, {}

    params = {"dataset": dataset, "mixed": True, "severity": severity, "seed": seed,
              "clean": fingerprint, "version": GENERATOR_VERSION}  # fmt: skip
    stem = f"{dataset}-mixed-s{severity}-seed{seed}-{fingerprint[:12]}"
    images, _ = _cached(_cache_root(cache_dir), stem, params, make)
    return ImageDataset(
        images, clean.labels, mean=clean.mean, std=clean.std, classes=clean.classes,
        info={"dataset": dataset, "generated": True, "mixed": True, "severity": severity,
              "seed": seed},
        corruption_names=CORRUPTIONS, corruption_index=which,
    )  # fmt: skip
