"""What a debiased class's ``state_dict`` adds to laplace-torch's so that a loaded posterior
predicts like the saved one, and the check that a state fits the object it is loaded into.

laplace-torch's state holds the MAP estimate, the curvature, the loss and the sizes, and
``load_state_dict`` checks the class name, the number of parameters and the likelihood only: a
state of another network with as many parameters loads silently, and a fit with token outputs
``(n, tokens, C)`` loses its output shape. [`fit_state`][laplace_debiased.two_batch.saved_state.fit_state] adds the ``hessian_structure``, the
``subset_of_weights``, every approximated parameter's name and shape and the per-sample output
shape; [`check_saved_fit`][laplace_debiased.two_batch.saved_state.check_saved_fit] names the first difference between a state and an object, in that
order: structure, subset, parameter name, parameter shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["Layout", "check_saved_fit", "fit_state"]

Layout = Sequence[tuple[str, tuple[int, ...]]]
"""The approximated parameters in order: ``(qualified name, shape)`` per tensor."""

_KEYS = ("hessian_structure", "subset_of_weights", "parameter_names", "parameter_shapes", "output_shape")


def fit_state(structure: str, subset: str, layout: Layout, output_shape: tuple[int, ...]) -> dict[str, Any]:
    """The ``state_dict`` entries of a fit (strings, integers and lists of them only).

    Args:
        structure: The ``hessian_structure`` (``"debiased_kron"``, ...).
        subset: The ``subset_of_weights`` (``"all"`` or ``"last_layer"``).
        layout: The approximated parameters ([`Layout`][laplace_debiased.two_batch.saved_state.Layout]).
        output_shape: The per-sample output shape ``([tokens, ...,] C)`` of the fit.

    Returns:
        ``hessian_structure``, ``subset_of_weights``, ``parameter_names``, ``parameter_shapes``
        and ``output_shape``.
    """
    return {
        "hessian_structure": structure,
        "subset_of_weights": subset,
        "parameter_names": [name for name, _ in layout],
        "parameter_shapes": [list(shape) for _, shape in layout],
        "output_shape": list(output_shape),
    }


def check_saved_fit(
    state_dict: dict[str, Any], structure: str, subset: str, layout: Callable[[], Layout]
) -> None:
    """Refuse a state that does not fit the object it is loaded into.

    Args:
        state_dict: The state to load.
        structure: The loading object's ``hessian_structure``.
        subset: The loading object's ``subset_of_weights``.
        layout: The loading object's approximated parameters ([`Layout`][laplace_debiased.two_batch.saved_state.Layout]), called once the
            structure and subset agree (and so the state's ``parameter_names`` are known).

    Raises:
        ValueError: The state was not saved by a debiased class (names the class that saved it),
            or the first difference: structure, subset, parameter name, parameter shape, or a
            parameter one side lacks.
    """
    missing = [key for key in _KEYS if key not in state_dict]
    if missing:
        raise ValueError(
            f"this state was saved by {state_dict.get('cls_name', 'an unknown class')!r}, not by a debiased Laplace "
            f"class of this version (it lacks {missing}); load it into the class that saved it, or refit "
            f"with hessian_structure={structure!r}."
        )
    for key, mine in (("hessian_structure", structure), ("subset_of_weights", subset)):
        if state_dict[key] != mine:
            raise ValueError(
                f"this state was saved with {key}={state_dict[key]!r}, and this object has {key}={mine!r}; "
                f"construct it with {key}={state_dict[key]!r} to load it."
            )
    mine = layout()
    saved = list(zip(state_dict["parameter_names"], map(tuple, state_dict["parameter_shapes"]), strict=True))
    for i, ((name, shape), (my_name, my_shape)) in enumerate(zip(saved, mine)):
        if name != my_name:
            raise ValueError(
                f"parameter {i} of this state is {name!r}, of this model {my_name!r}: the state was saved "
                "from another network (or other parameters with requires_grad)."
            )
        if shape != tuple(my_shape):
            raise ValueError(
                f"parameter {name!r} has shape {shape} in this state and {tuple(my_shape)} in this model: "
                "the state was saved from another network."
            )
    if len(saved) != len(mine):
        extra, side = (saved[len(mine)][0], "this state") if len(saved) > len(mine) else (mine[len(saved)][0], "this model")
        raise ValueError(
            f"this state approximates {len(saved)} parameter tensors and this model {len(mine)}; the first "
            f"that only {side} has is {extra!r} (another network, or other parameters with requires_grad)."
        )
