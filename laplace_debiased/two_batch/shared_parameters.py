"""Parameters shared between modules (tied weights), found and checked before a fit.

A parameter held by several modules (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``)
has one curvature block, and the exact GGN with respect to it sums the contributions of all its
uses. ``debiased_full`` and ``debiased_lowrank`` differentiate the model as a function of its
distinct parameters (``named_parameters()`` lists a shared one once), so they take such a
parameter exactly. The K-FAC structures give every layer its own block, so the curvature of a
shared parameter would be split over two layers' blocks; and a last-layer Laplace holds the
features fixed, though a last-layer parameter shared with an earlier module moves them too. Both
are refused ([`check_shared_parameters`][laplace_debiased.two_batch.shared_parameters.check_shared_parameters]).
"""

from __future__ import annotations

from torch import nn

__all__ = ["EXACT_STRUCTURES", "check_shared_parameters", "shared_parameters"]

EXACT_STRUCTURES = ("debiased_full", "debiased_lowrank")
"""The structures whose curvature of a shared parameter holds all its uses (all weights)."""


def _holders(model: nn.Module) -> dict[int, tuple[nn.Parameter, list[str]]]:
    """Every distinct parameter of ``model`` with the qualified names of the modules' entries
    that hold it, in module order."""
    held: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            held.setdefault(id(p), (p, []))[1].append(f"{module_name}.{name}" if module_name else name)
    return held


def shared_parameters(model: nn.Module, *, trainable_only: bool = True) -> list[list[str]]:
    """The parameters held by more than one module entry.

    Args:
        model: The network.
        trainable_only: Leave out parameters with ``requires_grad=False`` (no curvature needed).

    Returns:
        One list of qualified names per shared parameter (``["transformer.wte.weight",
        "lm_head.weight"]``), in module order; empty without tied weights.
    """
    return [names for p, names in _holders(model).values() if len(names) > 1 and (p.requires_grad or not trainable_only)]


def check_shared_parameters(model: nn.Module, structure: str, last_layer: nn.Module | None) -> None:
    """Refuse a fit that would get a shared parameter's curvature wrong.

    Args:
        model: The user's network (for a last-layer fit: the network inside laplace-torch's
            ``FeatureExtractor``).
        structure: The ``hessian_structure`` being fitted.
        last_layer: The last layer of a last-layer fit, ``None`` for all weights.

    Raises:
        ValueError: A last-layer parameter is also held by another module, or (all weights) a
            trainable parameter is shared and ``structure`` is not one of [`EXACT_STRUCTURES`][laplace_debiased.two_batch.shared_parameters.EXACT_STRUCTURES].
    """
    exact = " or ".join(f"hessian_structure={s!r}" for s in EXACT_STRUCTURES)
    if last_layer is not None:
        own = {id(p) for p in last_layer.parameters()}
        for p, names in _holders(model).values():
            if id(p) in own and len(names) > 1:
                raise ValueError(
                    f"the last layer's parameter {names[-1]} is shared with {', '.join(names[:-1])} (tied "
                    "weights): a last-layer Laplace holds the features fixed, but this parameter moves them "
                    f"too, so its curvature would miss those uses. Use subset_of_weights='all' with {exact} "
                    "(they take shared parameters exactly), or untie the weights (Hugging Face: "
                    "tie_word_embeddings=False)."
                )
        return
    if structure in EXACT_STRUCTURES:
        return
    for names in shared_parameters(model):
        raise ValueError(
            f"the parameter {names[0]} is shared by {', '.join(names)} (tied weights), and "
            f"hessian_structure={structure!r} gives every layer its own K-FAC block, which cannot hold "
            f"the curvature of both uses. Use {exact} (they take shared parameters exactly), freeze the "
            "shared parameter (requires_grad_(False)), or untie the weights (Hugging Face: "
            "tie_word_embeddings=False)."
        )
