"""Choosing the two independent batches of a debiased fit: B (directions) and B̃ (magnitudes).

A *batch* is whatever the loader yields: a ``(X, y)`` pair of tensors or a
``MutableMapping`` holding the input under ``dict_key_x`` and the targets under
``dict_key_y`` (laplace-torch's convention for Huggingface-style data).

Selection rules of [`split_batches`][laplace_debiased.two_batch.batches.split_batches] (the fit semantics of
every two-batch Laplace class):

``split="batches"`` (default)
    B = the first ``n_direction_batches`` loader batches, B̃ = the next
    ``n_magnitude_batches`` loader batches (disjoint as long as the loader does not repeat
    samples within one pass).  With a shuffling loader (``shuffle=True``) these are a random
    draw from the training set; in loader order they are whatever the dataset puts first.
    With ``generator`` the batches are instead drawn at random
    (without replacement) from one pass over the loader, reproducibly for a fixed seed: the
    loader passes run with torch's global RNG seeded from ``generator``
    ([`loader_rng_from`][laplace_debiased.two_batch.batches.loader_rng_from]), so a shuffling loader without a
    generator of its own shuffles the same way each time too (and the caller's global RNG is left as it was).
    A loader with its own ``DataLoader(generator=...)`` shuffles with that one, which the caller seeds.
one-batch loader (``split="batches"`` with one batch each, or ``split="halves"``)
    a loader that yields a single batch (full-batch training, a small fine-tuning set) has
    its samples split into two disjoint halves by a random permutation seeded with
    ``generator`` or, without one, with ``ONE_BATCH_SEED``: B gets ``ceil(n/2)`` samples, B̃
    ``floor(n/2)`` (the paper's debiased full-batch setting). Refused below
    ``2 * MIN_HALF_SIZE`` samples.
``n_magnitude_batches="auto"`` (with ``split="batches"``, B̃ ≠ B)
    B as above; then the structure's rule (``magnitude_rule``,
    [`laplace_debiased.two_batch.magnitude_rule`][laplace_debiased.two_batch.magnitude_rule]) maps B to a
    number ``k`` and B̃ is the next ``k`` batches of the same pass (or of the drawn order, or of
    ``magnitude_loader``), exactly the batches of ``n_magnitude_batches=k``; fewer if the loader has fewer
    left, an error if it has none.
``split="halves"``
    all batches of one pass over the loader: the first ``ceil(K/2)`` go to B, the remaining
    ``floor(K/2)`` to B̃ (the paper's "debiased full-batch"); with ``generator`` the batches
    are randomly assigned to the halves. ``n_*_batches`` must not be given.

Every split records its [`BatchChoice`][laplace_debiased.two_batch.batches.BatchChoice] (positions and sizes
of B and B̃, and how they were chosen); the fit logs it and keeps it as ``la.fit_batches``.
``magnitude_loader=other_loader``
    B from ``train_loader`` as above, B̃ = the first (or, with ``generator``, randomly drawn)
    ``n_magnitude_batches`` batches of ``other_loader``.
``magnitude_loader=train_loader`` (the *same object*)
    explicit opt-in to the reduction B̃ = B: the magnitude batches are the direction
    batches themselves, and the debiased fit reduces to ordinary K-FAC / eigen
    decompositions on B.  This is the only way to make B and B̃ share samples.

Checks (``ValueError`` with a hint what to do): too few batches in a loader, a batch with
fewer than two samples, NaN/Inf in inputs or targets, inputs whose squared norm overflows
their dtype, mismatched batch types, and a ``train_loader`` whose sampler draws with
replacement when B̃ comes from it.

Independence: B and B̃ drawn from one pass of ``train_loader`` (every split above) are
disjoint by the sampler's indices, since a sampler without replacement yields each index once
per pass. Rows of B̃ whose input and target bytes equal a row of B (hashed, since batches carry
no sample ids) are then repeated data at other indices, and
[`repeated_rows`][laplace_debiased.two_batch.batches.repeated_rows] names them in a ``UserWarning``. B̃ from a
separate ``magnitude_loader`` has no index in common with B to go by, so there equal rows are refused as
shared samples.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch
from torch.utils.data import DataLoader

from laplace_debiased.curvature.kfac import IGNORE_INDEX
from laplace_debiased.data.batch import Batch, batch_inputs_targets, batch_size, input_tensor, on_device

if TYPE_CHECKING:
    from laplace_debiased.two_batch.magnitude_rule import AutoMagnitude, FactorRowCount

__all__ = [
    "BatchChoice",
    "BatchSplit",
    "split_batches",
    "check_targets",
]


ONE_BATCH_SEED = 0  # seed of the one-batch split when no generator is given
MIN_HALF_SIZE = 2  # fewest samples in each half of a one-batch split
SAME_BATCHES = "same batches (B̃ = B)"


@dataclass(frozen=True)
class BatchChoice:
    """Which batches a fit used and how they were chosen (recorded as ``la.fit_batches``).

    Attributes:
        how: ``"loader order"`` (the first batches of one pass), ``"random draw"`` (drawn with
            ``generator``), ``"halves"`` / ``"random halves"`` (``split="halves"``),
            ``"one-batch split"`` (the loader's only batch split into two halves of samples) or
            ``"same batches (B̃ = B)"``.
        direction: The positions, in one pass over ``train_loader``, of the batches forming B.
        magnitude: The positions of the batches forming B̃, in one pass over the loader named
            by ``magnitude_source``.
        magnitude_source: ``"train_loader"`` or ``"magnitude_loader"``.
        direction_size: The number of samples in B.
        magnitude_size: The number of samples in B̃.
        n_data: ``N = len(train_loader.dataset)``.
        sample_split: For a one-batch split, the sample indices (within the batch) forming B
            and B̃; ``None`` otherwise.
        auto: With ``n_magnitude_batches="auto"``, the chosen number of magnitude batches and
            why ([`AutoMagnitude`][laplace_debiased.two_batch.magnitude_rule.AutoMagnitude]); ``None``
            otherwise.
    """

    how: str
    direction: tuple[int, ...]
    magnitude: tuple[int, ...]
    magnitude_source: str
    direction_size: int
    magnitude_size: int
    n_data: int
    sample_split: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    auto: AutoMagnitude | None = None

    def describe(self) -> str:
        """One line for logs: which batches, how many samples, how chosen."""
        if self.sample_split is not None:
            return (
                f"one-batch split: the only batch of train_loader split by a seeded random "
                f"permutation into B = {self.direction_size} and B̃ = {self.magnitude_size} "
                f"disjoint samples (N = {self.n_data})"
            )
        text = (
            f"B = train_loader batches {list(self.direction)} ({self.direction_size} samples), "
            f"B̃ = {self.magnitude_source} batches {list(self.magnitude)} "
            f"({self.magnitude_size} samples), {self.how} (N = {self.n_data})"
        )
        if self.how == "loader order":
            text += "; with a shuffling loader these are a random draw"
        if self.auto is not None:
            text += "; " + self.auto.describe()
        return text


@dataclass(frozen=True)
class BatchSplit:
    """The batches of a two-batch fit.

    Attributes:
        direction: The batches forming B (they choose the eigenvectors / search directions).
        magnitude: The batches forming B̃ (they measure the curvature along them); the very
            same list as ``direction`` when B̃ = B was requested explicitly.
        n_data: ``N = len(train_loader.dataset)``: curvatures are scaled to N data points.
        choice: Which batches were chosen and how.
    """

    direction: list[Batch]
    magnitude: list[Batch]
    n_data: int
    choice: BatchChoice


def _check_batch(batch: Batch, where: str, dict_key_x: str, dict_key_y: str) -> None:
    X, y = batch_inputs_targets(batch, dict_key_x, dict_key_y)
    x = input_tensor(X, dict_key_x)
    for name, t in (("inputs", x), ("targets", y)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}.")
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise ValueError(
                f"{where}: {name} contain NaN or Inf; clean or impute the data first."
            )
    if x.is_floating_point() and x.numel():
        squared_norms = x.detach().double().reshape(x.shape[0], -1).pow(2).sum(dim=1)
        if not (squared_norms <= torch.finfo(x.dtype).max).all():
            raise ValueError(
                f"{where}: the squared norm of an input sample overflows {x.dtype} "
                f"(largest |x| = {float(x.abs().max()):.3e}), so the curvature (which holds "
                "products of inputs) would be infinite; standardise or rescale the inputs."
            )
    if y.shape[0] < 2 or x.shape[0] != y.shape[0]:
        raise ValueError(
            f"{where}: a batch needs at least two samples and as many inputs as targets "
            f"(got {x.shape[0]} inputs, {y.shape[0]} targets); use a larger batch_size or "
            "drop_last=True."
        )


def check_targets(
    y: torch.Tensor, output_shape: tuple[int, ...], likelihood: str, where: str
) -> None:
    """Refuse targets that do not fit the model's per-sample output shape ``output_shape``.

    Regression: ``y.shape[1:]`` must equal ``output_shape`` (MSE would otherwise broadcast
    silently). Classification / reward modelling with integer labels: every label must be in
    ``[0, C)``, ``C = output_shape[-1]``, or be ``-100`` (``CrossEntropyLoss``'s
    ``ignore_index``): a padded position, which the fit leaves out of the curvature and the loss
    ([`padded_rows`][laplace_debiased.curvature.kfac.padded_rows]).
    """
    if likelihood == "regression":
        if tuple(y.shape[1:]) != tuple(output_shape):
            raise ValueError(
                f"{where}: the model outputs per-sample shape {tuple(output_shape)} but the "
                f"regression targets have {tuple(y.shape[1:])}; reshape the targets (or the "
                "model's output layer) so that they match."
            )
        return
    if y.is_floating_point() or not output_shape:
        return  # class probabilities or scalar outputs: the loss function's business
    n_classes = output_shape[-1]
    labels = y[y != IGNORE_INDEX]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= n_classes):
        raise ValueError(
            f"{where}: class labels must be in the range [0, {n_classes}) of the model's "
            f"{n_classes} outputs (or -100 for a padded position), got labels from "
            f"{int(labels.min())} to {int(labels.max())}."
        )


def _sample_keys(batch: Batch, dict_key_x: str, dict_key_y: str) -> list[int]:
    """One hash per sample of the raw bytes of its input and target."""
    X, y = batch_inputs_targets(batch, dict_key_x, dict_key_y)
    x = input_tensor(X, dict_key_x).detach().cpu().reshape(y.shape[0], -1).contiguous()
    t = y.detach().cpu().reshape(y.shape[0], -1).contiguous()
    xb, tb = x.numpy(), t.numpy()
    return [hash((xb[i].tobytes(), tb[i].tobytes())) for i in range(len(xb))]


def repeated_rows(
    direction: list[Batch], magnitude: list[Batch], dict_key_x: str, dict_key_y: str
) -> list[tuple[int, int, int, int]]:
    """Rows of B̃ whose input and target bytes equal a row of B.

    Returns:
        ``(magnitude batch, row, direction batch, row)`` for every such row of B̃ (positions in
        the lists ``magnitude`` and ``direction``, rows within the batch), in B̃'s order; the row
        of B is the first one with those bytes.
    """
    seen: dict[int, tuple[int, int]] = {}
    for i, b in enumerate(direction):
        for r, k in enumerate(_sample_keys(b, dict_key_x, dict_key_y)):
            seen.setdefault(k, (i, r))
    return [
        (j, r, *seen[k])
        for j, b in enumerate(magnitude)
        for r, k in enumerate(_sample_keys(b, dict_key_x, dict_key_y))
        if k in seen
    ]


def _describe_rows(rows: list[tuple[int, int, int, int]], shown: int = 5) -> str:
    text = ", ".join(f"magnitude batch {j} row {r} = direction batch {i} row {s}" for j, r, i, s in rows[:shown])
    return text + (f" and {len(rows) - shown} more" if len(rows) > shown else "")


def _check_disjoint(
    direction: list[Batch], magnitude: list[Batch], keys: tuple[str, str], by_index: bool
) -> None:
    """Compare B and B̃ by their bytes: with ``by_index`` (both from one pass of a sampler that
    draws without replacement, so disjoint by index) equal rows are repeated data, and a warning
    names them; otherwise (B̃ from ``magnitude_loader``) they are refused."""
    rows = repeated_rows(direction, magnitude, *keys)
    if not rows:
        return
    if by_index:
        warnings.warn(
            f"{len(rows)} row(s) of the magnitude batch B̃ have the same input and target bytes as a "
            f"row of the direction batch B: {_describe_rows(rows)}. B and B̃ come from one pass of "
            "train_loader, at different indices, so these are repeated rows of the data set (token "
            "windows, categorical features, duplicated images), not shared samples; if the data set "
            "should not repeat rows, deduplicate it.",
            UserWarning,
            stacklevel=2,
        )
        return
    raise ValueError(
        f"{len(rows)} sample(s) of the magnitude batch B̃ also occur in the direction batch B "
        f"({_describe_rows(rows)}); the two batches must be independent, and with a separate "
        "magnitude_loader only the bytes tell. Make magnitude_loader draw from data disjoint from "
        "the direction batches, or drop magnitude_loader so that B and B̃ come from one pass of "
        "train_loader (disjoint by index, so repeated rows are allowed); to use B̃ = B on purpose, "
        "pass magnitude_loader=train_loader."
    )


def _check_without_replacement(loader: Iterable) -> None:
    """Refuse a loader whose sampler draws with replacement: B and B̃ are disjoint by index only
    because one pass of the sampler yields each index at most once."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if getattr(sampler, "replacement", False):
            raise ValueError(
                f"train_loader's sampler ({type(sampler).__name__}) draws with replacement, so B and B̃ "
                "could share a sample (the same index in both) and would not be independent. Use a "
                "sampler without replacement (shuffle=True, or replacement=False), or pass B̃'s data "
                "as magnitude_loader."
            )


def _collect(loader: Iterable, n: int | None) -> list[Batch]:
    """The first ``n`` batches of one pass over ``loader`` (the whole pass for ``None``)."""
    batches: list[Batch] = []
    for b in loader:
        batches.append(b)
        if n is not None and len(batches) == n:
            break
    return batches


def _positions(
    batches: list[Batch], n: int, generator: torch.Generator | None, name: str
) -> list[int]:
    """``n`` batch positions: the first ``n``, or ``n`` drawn without replacement."""
    return _order(batches, n, generator, name)[:n]


def _order(batches: list[Batch], n: int, generator: torch.Generator | None, name: str) -> list[int]:
    """All batch positions, in order or (``generator``) a random permutation, after checking that
    there are at least ``n``; ``_positions`` takes the first ``n`` of them."""
    if len(batches) < n:
        raise ValueError(
            f"{name} yields {len(batches)} batch(es) but {n} are needed; use a smaller "
            "batch_size, fewer batches, or a larger data set."
        )
    if generator is None:
        return list(range(len(batches)))
    return torch.randperm(len(batches), generator=generator).tolist()


def _subset(batch: Batch, idx: torch.Tensor, n: int) -> Batch:
    """The samples ``idx`` of a batch of ``n`` samples (every tensor with leading dim ``n``)."""
    if isinstance(batch, MutableMapping):
        part = copy.copy(batch)
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == n:
                part[key] = value[idx.to(value.device)]
        return part
    X, y = batch
    return (X[idx.to(X.device)], y[idx.to(y.device)])


def _split_samples(
    batch: Batch, generator: torch.Generator | None, dict_key_x: str, dict_key_y: str
) -> tuple[Batch, Batch, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split one batch into two disjoint halves B, B̃ by a seeded random permutation.

    B gets ``ceil(n/2)`` samples, B̃ ``floor(n/2)``; each half keeps the batch's sample order.
    The permutation comes from ``generator``, else from a generator seeded with
    ``ONE_BATCH_SEED``, so the split is reproducible.
    """
    n = batch_size(batch, dict_key_x, dict_key_y)
    if n < 2 * MIN_HALF_SIZE:
        raise ValueError(
            f"train_loader yields one batch of {n} sample(s); a one-batch fit splits it into "
            f"two disjoint halves B and B̃ of at least {MIN_HALF_SIZE} samples each, so it "
            f"needs at least {2 * MIN_HALF_SIZE} samples. Use more data."
        )
    g = generator if generator is not None else torch.Generator().manual_seed(ONE_BATCH_SEED)
    perm = torch.randperm(n, generator=g)
    half = (n + 1) // 2
    idx_B, idx_Bt = perm[:half].sort().values, perm[half:].sort().values
    return (
        _subset(batch, idx_B, n),
        _subset(batch, idx_Bt, n),
        (tuple(idx_B.tolist()), tuple(idx_Bt.tolist())),
    )


def _dataset_size(loader: DataLoader) -> int:
    dataset = getattr(loader, "dataset", None)
    if dataset is None:
        raise ValueError("train_loader.dataset must be set: N = len(dataset) scales the fit.")
    return len(dataset)


def split_batches(
    train_loader: DataLoader,
    *,
    n_direction_batches: int | None = None,
    n_magnitude_batches: int | Literal["auto"] | None = None,
    magnitude_loader: DataLoader | None = None,
    split: Literal["batches", "halves"] = "batches",
    generator: torch.Generator | None = None,
    dict_key_x: str = "input_ids",
    dict_key_y: str = "labels",
    device: torch.device | str | None = None,
    magnitude_rule: Callable[[list[Batch]], AutoMagnitude] | None = None,
) -> BatchSplit:
    """Choose the direction batches B and the magnitude batches B̃ by the rules and checks of the
    module docstring; every batch is moved to ``device`` as laplace-torch's ``fit`` does.

    Args:
        train_loader: The training data; ``len(train_loader.dataset)`` is N.
        n_direction_batches: Loader batches in B (default 1).
        n_magnitude_batches: Loader batches in B̃ (default 1), or ``"auto"``: ``magnitude_rule(B)``.
        magnitude_loader: A separate source of B̃; ``train_loader`` itself for B̃ = B.
        split: ``"batches"`` or ``"halves"``.
        generator: Draw the batches at random, reproducibly.
        dict_key_x: The key of the inputs in dict batches.
        dict_key_y: The key of the targets in dict batches.
        device: The model's device.
        magnitude_rule: For ``"auto"``: B's batches ->
            [`AutoMagnitude`][laplace_debiased.two_batch.magnitude_rule.AutoMagnitude].

    Returns:
        The batches, with ``choice`` recording which batches (or samples) form B and B̃.

    Raises:
        ValueError: What the module docstring's checks refuse.
    """
    n_data = _dataset_size(train_loader)
    if magnitude_loader is None:
        _check_without_replacement(train_loader)
    with loader_rng_from(generator):
        return _split(
            train_loader, n_direction_batches, n_magnitude_batches, magnitude_loader, split, generator,
            (dict_key_x, dict_key_y), device, magnitude_rule, n_data,
        )


@contextlib.contextmanager
def loader_rng_from(generator: torch.Generator | None) -> Iterator[None]:
    """With ``generator``: inside the block torch's global CPU RNG, which a shuffling loader without
    a generator of its own shuffles with (and seeds its workers from), is seeded from ``generator``'s
    state, and afterwards it is restored. Loader passes inside the block are then a function of
    ``generator`` alone, and the caller's global RNG stream is untouched. The seed is drawn from a
    copy of ``generator``, which is not advanced: its draws of batch positions are those it makes
    without this block. Without ``generator``: nothing."""
    if generator is None:
        yield
        return
    copy_ = torch.Generator(device=generator.device)
    copy_.set_state(generator.get_state())
    seed = int(torch.randint(0, 2**62, (), generator=copy_, device=generator.device))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _split(
    train_loader: DataLoader,
    n_direction_batches: int | None,
    n_magnitude_batches: int | Literal["auto"] | None,
    magnitude_loader: DataLoader | None,
    split: str,
    generator: torch.Generator | None,
    keys: tuple[str, str],
    device: torch.device | str | None,
    magnitude_rule: Callable[[list[Batch]], AutoMagnitude] | None,
    n_data: int,
) -> BatchSplit:
    """[`split_batches`][laplace_debiased.two_batch.batches.split_batches] after its loader checks, dispatched
    by ``split`` and ``"auto"``."""
    auto = _check_auto(n_magnitude_batches, magnitude_rule, split, magnitude_loader is train_loader)
    if split == "halves":
        _check_halves(n_direction_batches, n_magnitude_batches, magnitude_loader)
        return _choose_halves(train_loader, generator, n_data, keys, device)
    if split != "batches":
        raise ValueError(f"split must be 'batches' or 'halves', got {split!r}.")
    n_dir = 1 if n_direction_batches is None else n_direction_batches
    n_mag = 1 if n_magnitude_batches is None or auto else n_magnitude_batches
    if n_dir < 1 or n_mag < 1:
        raise ValueError("n_direction_batches and n_magnitude_batches must be >= 1.")
    if auto:
        return _choose_auto(train_loader, magnitude_loader, n_dir, magnitude_rule, generator, n_data, keys, device)
    return _choose_batches(train_loader, magnitude_loader, n_dir, n_mag, generator, n_data, keys, device)


def _check_halves(
    n_direction_batches: int | None, n_magnitude_batches: int | str | None, magnitude_loader: Iterable | None
) -> None:
    """Refuse the arguments ``split="halves"`` has no use for: it takes every batch of ``train_loader``."""
    if n_direction_batches is not None or n_magnitude_batches is not None:
        raise ValueError("split='halves' uses all batches; do not pass n_*_batches.")
    if magnitude_loader is not None:
        raise ValueError("split='halves' splits train_loader; do not pass magnitude_loader.")


def _choose_batches(
    train_loader: Iterable,
    magnitude_loader: Iterable | None,
    n_dir: int,
    n_mag: int,
    generator: torch.Generator | None,
    n_data: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
) -> BatchSplit:
    """``split="batches"``: B from ``train_loader``, B̃ from the following batches, from
    ``magnitude_loader``, or B̃ = B when ``magnitude_loader is train_loader``."""
    how = "loader order" if generator is None else "random draw"
    if magnitude_loader is train_loader:
        if n_mag != n_dir:
            raise ValueError(
                "magnitude_loader=train_loader requests B̃ = B; n_magnitude_batches "
                "must then equal n_direction_batches."
            )
        batches = _collect(train_loader, n_dir if generator is None else None)
        pos = _positions(batches, n_dir, generator, "train_loader")
        return _finish(batches, pos, None, pos, SAME_BATCHES, "train_loader", n_data, keys, device)
    if magnitude_loader is None:
        batches = _collect(train_loader, n_dir + n_mag if generator is None else None)
        if len(batches) == 1 and n_dir == n_mag == 1:
            return _finish_one_batch(batches[0], generator, n_data, keys, device)
        pos = _positions(batches, n_dir + n_mag, generator, "train_loader")
        return _finish(batches, pos[:n_dir], batches, pos[n_dir:], how, "train_loader", n_data, keys, device)
    batches = _collect(train_loader, n_dir if generator is None else None)
    pos = _positions(batches, n_dir, generator, "train_loader")
    others = _collect(magnitude_loader, n_mag if generator is None else None)
    pos_mag = _positions(others, n_mag, generator, "magnitude_loader")
    return _finish(batches, pos, others, pos_mag, how, "magnitude_loader", n_data, keys, device)


def _check_auto(
    n_magnitude_batches: int | str | None,
    magnitude_rule: Callable[[list[Batch]], AutoMagnitude] | None,
    split: str,
    same: bool,
) -> bool:
    """Whether ``n_magnitude_batches`` is ``"auto"``; refuse any other string, and "auto" without a
    rule, with ``split="halves"`` or with B̃ = B (``same``)."""
    if not isinstance(n_magnitude_batches, str):
        return False
    if n_magnitude_batches != "auto":
        raise ValueError(f"n_magnitude_batches must be a positive integer or 'auto', got {n_magnitude_batches!r}.")
    if magnitude_rule is None:
        raise ValueError("n_magnitude_batches='auto' needs the structure's magnitude_rule; call it through la.fit.")
    if split == "halves":
        raise ValueError(
            "n_magnitude_batches='auto' chooses how many batches follow B; split='halves' gives half of all "
            "batches to B̃. Use split='batches' with 'auto', or split='halves' without n_*_batches."
        )
    if same:
        raise ValueError(
            "magnitude_loader=train_loader requests B̃ = B, so there are no magnitude batches for 'auto' to "
            "count; drop magnitude_loader (or pass n_magnitude_batches=n_direction_batches for B̃ = B)."
        )
    return True


def _choose_auto(
    train_loader: Iterable,
    magnitude_loader: Iterable | None,
    n_dir: int,
    rule: Callable[[list[Batch]], AutoMagnitude],
    generator: torch.Generator | None,
    n_data: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
) -> BatchSplit:
    """``n_magnitude_batches="auto"``: B as ``_choose_batches`` chooses it, ``k = rule(B).wanted``,
    then B̃ = the next ``k`` batches of the same pass over ``train_loader`` (or of the order drawn
    with ``generator``), or the first (drawn) ``k`` of ``magnitude_loader``: the batches an
    explicit ``n_magnitude_batches=k`` takes. Where B̃'s batches give a factor fewer rows than the
    rule expected (a short batch), more follow (``_made_up``). A loader with fewer batches left
    gives what it has (recorded in ``choice.auto.used``, a factor still short in
    ``choice.auto.short``); none left raises."""
    source = iter(train_loader)
    batches = _collect(source, n_dir if generator is None else None)
    order = _order(batches, n_dir, generator, "train_loader")
    direction = [on_device(batches[i], device, f"direction batch {j}") for j, i in enumerate(order[:n_dir])]
    for j, b in enumerate(direction):
        _check_batch(b, f"direction batch {j}", *keys)
    auto = rule(direction)
    name = "train_loader" if magnitude_loader is None else "magnitude_loader"
    if magnitude_loader is None:
        draw = _MagnitudeDraw(batches, order[n_dir:], source if generator is None else None)
    elif generator is None:
        draw = _MagnitudeDraw([], [], iter(magnitude_loader))
    else:
        others = _collect(magnitude_loader, None)
        draw = _MagnitudeDraw(others, _order(others, 0, generator, name), None)
    pos = draw.take(auto.wanted)
    if not pos:
        raise ValueError(
            f"{name} has no batch left for B̃ after the {n_dir} direction batch(es) of B; "
            "n_magnitude_batches='auto' needs at least one. Use a smaller batch_size, fewer direction "
            "batches, or an integer n_magnitude_batches (a one-batch loader is split into halves by default)."
        )
    pos, short = _made_up(direction, draw, pos, rule, auto.cap, keys, device)
    how = "loader order" if generator is None else "random draw"
    split = _finish(batches, order[:n_dir], draw.batches, pos, how, name, n_data, keys, device)
    return replace(split, choice=replace(split.choice, auto=replace(auto, used=len(pos), short=short)))


class _MagnitudeDraw:
    """The batches B̃ of "auto" is taken from, in the order it takes them: ``order`` (positions in
    ``batches``), extended from ``rest`` (the rest of one pass in loader order, read only as far as
    taken; ``None`` when ``batches`` already holds the whole pass)."""

    def __init__(self, batches: list[Batch], order: list[int], rest: Iterator | None) -> None:
        self.batches, self.order, self.rest = batches, order, rest

    def take(self, k: int) -> list[int]:
        """The positions of the first ``k`` batches (fewer when the source has fewer)."""
        if self.rest is not None and len(self.order) < k:
            new = _collect(self.rest, k - len(self.order))
            self.order += range(len(self.batches), len(self.batches) + len(new))
            self.batches += new
        return self.order[:k]


def _made_up(
    direction: list[Batch],
    draw: _MagnitudeDraw,
    pos: list[int],
    rule: Callable[[list[Batch]], AutoMagnitude],
    cap: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
) -> tuple[list[int], FactorRowCount | None]:
    """B̃'s positions once B ∪ B̃ spans every factor, and the factor still short, if any.

    The rule, applied to B ∪ B̃, counts the rows they give every factor (one forward pass over
    each batch). While a factor is short, B̃ holds fewer than ``cap`` batches and the source has
    more, B̃ takes as many more as the rule asks for B ∪ B̃ (at most up to ``cap``)."""
    while True:
        magnitude = [on_device(draw.batches[i], device, f"magnitude batch {j}") for j, i in enumerate(pos)]
        for j, b in enumerate(magnitude):
            _check_batch(b, f"magnitude batch {j}", *keys)
        union = rule(direction + magnitude)
        if union.limiting is None or len(pos) >= cap:
            return pos, union.limiting
        more = draw.take(len(pos) + min(union.needed, cap - len(pos)))
        if len(more) == len(pos):
            return pos, union.limiting
        pos = more


def _choose_halves(
    train_loader: Iterable,
    generator: torch.Generator | None,
    n_data: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
) -> BatchSplit:
    """``split="halves"``: the first ``ceil(K/2)`` of all ``K`` batches form B, the rest B̃
    (assigned at random with ``generator``); one batch is split into halves of samples."""
    batches = _collect(train_loader, None)
    if len(batches) == 1:
        return _finish_one_batch(batches[0], generator, n_data, keys, device)
    if not batches:
        raise ValueError("train_loader yields no batch.")
    pos = _positions(batches, len(batches), generator, "train_loader")
    half = (len(batches) + 1) // 2
    how = "halves" if generator is None else "random halves"
    return _finish(batches, pos[:half], batches, pos[half:], how, "train_loader", n_data, keys, device)


def _finish_one_batch(
    batch: Batch,
    generator: torch.Generator | None,
    n_data: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
) -> BatchSplit:
    """The one-batch split (``_split_samples``) as a checked
    [`BatchSplit`][laplace_debiased.two_batch.batches.BatchSplit]."""
    B, Bt, sample_split = _split_samples(batch, generator, *keys)
    return _checked(
        [B], [Bt], n_data, keys, device,
        how="one-batch split", direction_pos=[0], magnitude_pos=[0],
        source="train_loader", sample_split=sample_split,
    )


def _finish(
    batches: list[Batch],
    direction_pos: list[int],
    magnitude_batches: list[Batch] | None,
    magnitude_pos: list[int],
    how: str,
    source: str,
    n_data: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
) -> BatchSplit:
    """B and B̃ from batch positions (``magnitude_batches=None``: B̃ = B, the same list)."""
    direction = [batches[i] for i in direction_pos]
    magnitude = (
        direction if magnitude_batches is None else [magnitude_batches[i] for i in magnitude_pos]
    )
    return _checked(
        direction, magnitude, n_data, keys, device,
        how=how, direction_pos=direction_pos, magnitude_pos=magnitude_pos, source=source,
    )


def _checked(
    direction: list[Batch],
    magnitude: list[Batch],
    n_data: int,
    keys: tuple[str, str],
    device: torch.device | str | None,
    *,
    how: str,
    direction_pos: list[int],
    magnitude_pos: list[int],
    source: str,
    sample_split: tuple[tuple[int, ...], tuple[int, ...]] | None = None,
) -> BatchSplit:
    """Run the batch checks and record the choice."""
    dict_key_x, dict_key_y = keys
    first = direction[0]
    same = magnitude is direction
    for where, group in (("direction batch", direction), ("magnitude batch", magnitude)):
        for i, b in enumerate(group):
            if isinstance(b, MutableMapping) != isinstance(first, MutableMapping):
                raise ValueError("all batches must be of the same kind (all dicts or all pairs).")
            batch_inputs_targets(b, dict_key_x, dict_key_y)  # KeyError / ValueError on a bad batch
            group[i] = on_device(b, device, f"{where} {i}")
            _check_batch(group[i], f"{where} {i}", dict_key_x, dict_key_y)
        if same:
            break
    if magnitude is not direction:
        _check_disjoint(direction, magnitude, keys, by_index=source == "train_loader")
    choice = BatchChoice(
        how=how,
        direction=tuple(direction_pos),
        magnitude=tuple(magnitude_pos),
        magnitude_source=source,
        direction_size=sum(batch_size(b, *keys) for b in direction),
        magnitude_size=sum(batch_size(b, *keys) for b in magnitude),
        n_data=n_data,
        sample_split=sample_split,
    )
    return BatchSplit(direction=direction, magnitude=magnitude, n_data=n_data, choice=choice)
