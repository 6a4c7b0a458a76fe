"""The methods the main job can sweep: one table of [`Method`][laplace_debiased.evaluation.methods.Method] records.

A method is a Laplace structure, the options its fit takes, a batch rule and its words in the
report. The pipeline fits it by these fields
([`fit_laplace`][laplace_debiased.evaluation.pipeline.fit_laplace]), ``--methods`` offers its name,
and the report reads its structure, role and words from the table; a new entry of
[`METHODS`][laplace_debiased.evaluation.methods.METHODS] appears in all three. Its name is the key
of its result rows (``method@b<b>`` at one of several batch sizes,
[`method_key`][laplace_debiased.evaluation.options.method_key]), so a name, once used, keeps
its meaning. Torch-free, like the options.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal

__all__ = ["BATCH_RULES", "METHODS", "STRUCTURE_NAMES", "Method", "lookup"]

#: The batches a fit reads: ``"single"`` one batch of b (B̃ = B), ``"two"`` two disjoint batches of
#: b/2 (B then B̃), ``"full"`` one batch of every training point (B̃ = B, fitted once).
BATCH_RULES = ("single", "two", "full")
BatchRule = Literal["single", "two", "full"]
#: ``hessian_structure`` -> the structure's name in the report.
STRUCTURE_NAMES = {"debiased_kron": "K-FAC", "debiased_ekfac": "EKFAC", "debiased_lowrank": "low-rank"}


@dataclass(frozen=True)
class Method:
    """One approximation the main job sweeps.

    Attributes:
        name: The key of its result rows and its ``--methods`` value (``"kron_shrunk"``).
        structure: laplace-torch's ``hessian_structure`` of the fit (``"debiased_kron"``).
        batches: Its batch rule, one of [`BATCH_RULES`][laplace_debiased.evaluation.methods.BATCH_RULES].
        options: The structure's options of the fit (``{"estimator": "corrected"}``).
        role: Its short name among the fits of one structure, in the report's sentences
            (``"corrected split (default)"``); the table's order is the report's order.
        summary: A phrase that completes "<structure>, <summary> <batch sizes>" in the report's
            labels (``"corrected"``; unused by a full-batch method).
        description: What it does, for the report's setting; ``{structure}``, ``{b}`` and
            ``{half}`` (b/2) are filled in.
    """

    name: str
    structure: str
    batches: BatchRule
    role: str
    summary: str
    description: str
    options: Mapping[str, object] = field(default_factory=lambda: MappingProxyType({}))

    def __post_init__(self) -> None:
        if self.batches not in BATCH_RULES:
            raise ValueError(f"method {self.name!r}: batches must be one of {BATCH_RULES}, got {self.batches!r}")
        if self.structure not in STRUCTURE_NAMES:
            raise ValueError(f"method {self.name!r}: structure must be one of {tuple(STRUCTURE_NAMES)}, "
                             f"got {self.structure!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    @property
    def full_batch(self) -> bool:
        """Whether it reads every training point (fitted once, the reference of its structure)."""
        return self.batches == "full"

    def describe(self, b: int | None, n_train: int, rank: int) -> dict[str, str | int]:
        """The method in words at batch size ``b`` (``None`` for a full-batch method).

        Args:
            b: The batch size.
            n_train: The training points N.
            rank: The rank of a low-rank structure.

        Returns:
            ``{"label", "description", "samples"}``, and ``"batch_size"`` for a mini-batch method.
        """
        structure = STRUCTURE_NAMES[self.structure]
        if self.structure == "debiased_lowrank":
            structure += f" (rank {rank})"
        if self.full_batch:
            return {"label": f"{structure}, full batch of {n_train}", "samples": n_train,
                    "description": f"{structure} over all N = {n_train} training points (the reference)"}
        half = b // 2
        sizes = f"{b}" if self.batches == "single" else f"{half} + {half}"
        return {"label": f"{structure}, {self.summary} {sizes}", "samples": b if self.batches == "single" else 2 * half,
                "description": self.description.format(structure=structure, b=b, half=half), "batch_size": b}


_SINGLE = "{structure} from one batch of {b} training points (B̃ = B: the plain single-batch LA)"
_PAPER = ("debiased {structure}: directions (eigenvectors) from a batch B of {half} training points, "
          "magnitudes re-measured on an independent batch B̃ of {half}")
_POOLED = ("eigenvectors of both batches of {half} training points together, eigenvalues less the "
           "regression-to-the-mean bias the two batches measure against each other")
_CORRECTED = f"corrected {{structure}} (the default fit): {_POOLED} (estimator='corrected')"
_SHRUNK = (f"shrunk {{structure}}: {_POOLED}, that correction shrunk per factor by how much "
           "the two batches disagree on it (estimator='shrunk')")
_STEIN = (f"stein {{structure}}: {_POOLED}, that correction weighted per factor by its minimum-MSE "
          "(James-Stein) weight (estimator='stein')")


def _table(*methods: Method) -> Mapping[str, Method]:
    return MappingProxyType({m.name: m for m in methods})


#: Every method, by name (the ``--methods`` choices, in this order).
METHODS: Mapping[str, Method] = _table(
    Method("kron_single", "debiased_kron", "single", "single batch", "single batch of", _SINGLE),
    Method("kron_debiased", "debiased_kron", "two", "paper's split", "debiased", _PAPER, {"estimator": "paper"}),
    Method("kron_corrected", "debiased_kron", "two", "corrected split (default)", "corrected", _CORRECTED,
           {"estimator": "corrected"}),
    Method("kron_shrunk", "debiased_kron", "two", "shrunk split", "shrunk", _SHRUNK, {"estimator": "shrunk"}),
    Method("kron_stein", "debiased_kron", "two", "James-Stein split", "stein", _STEIN, {"estimator": "stein"}),
    Method("kron_full", "debiased_kron", "full", "full batch", "full batch", ""),
    Method("lowrank_single", "debiased_lowrank", "single", "single batch", "single batch of", _SINGLE),
    Method("lowrank_debiased", "debiased_lowrank", "two", "paper's split", "debiased", _PAPER, {"estimator": "paper"}),
    Method("lowrank_corrected", "debiased_lowrank", "two", "corrected split (default)", "corrected", _CORRECTED,
           {"estimator": "corrected"}),
    Method("ekfac_single", "debiased_ekfac", "single", "single batch", "single batch of", _SINGLE),
    Method("ekfac_debiased", "debiased_ekfac", "two", "debiased split", "debiased", _PAPER, {"estimator": "paper"}),
    Method("ekfac_full", "debiased_ekfac", "full", "full batch", "full batch", ""),
)


def lookup(key: str) -> Method | None:
    """The method of [`METHODS`][laplace_debiased.evaluation.methods.METHODS] whose rows carry ``key``
    (``"kron_single@b32"`` or ``"kron_single"``); ``None`` for a name the table does not hold (rows of
    another sweep, or ``"map"``)."""
    from laplace_debiased.evaluation.options import split_method_key

    return METHODS.get(split_method_key(key)[0])
