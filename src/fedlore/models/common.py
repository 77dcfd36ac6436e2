"""Shape checks shared by the model factories.

Every factory validates the ``input_shape`` it is given with these helpers, so a bad shape fails
with the same clear ``ValueError`` whether the factory is reached through
:func:`fedlore.models.build_model` or called directly from the registry.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence


def check_shape(model: str, input_shape: Sequence[int]) -> tuple[int, ...]:
    """Validate a generic per-example input shape (no batch dimension).

    Args:
        model: registry name of the model, for the error message.
        input_shape: per-example shape, e.g. ``(C, H, W)`` or ``(D,)``.

    Returns:
        The shape as a tuple of Python ints.

    Raises:
        ValueError: if the shape is empty or has a non-integer or non-positive entry.
    """
    raw = tuple(input_shape)
    if not raw:
        raise ValueError(f"model {model!r}: input_shape must not be empty")
    try:  # accepts numpy / torch integer scalars and torch.Size, rejects floats and bools
        shape = tuple(operator.index(d) for d in raw if not isinstance(d, bool))
    except TypeError:
        shape = ()
    if len(shape) != len(raw) or min(shape) <= 0:
        raise ValueError(f"model {model!r}: input_shape entries must be positive ints, got {raw!r}")
    return shape


def check_image_shape(model: str, input_shape: Sequence[int], min_hw: int) -> tuple[int, int, int]:
    """Validate an image shape ``(C, H, W)``.

    Args:
        model: registry name of the model, for the error message.
        input_shape: ``(C, H, W)``: channels, height and width in pixels.
        min_hw: smallest height and width (pixels) the model can take.

    Returns:
        ``(C, H, W)`` as Python ints.

    Raises:
        ValueError: if the shape is not three positive ints or ``H`` or ``W`` is below ``min_hw``.
    """
    shape = check_shape(model, input_shape)
    if len(shape) != 3:
        raise ValueError(
            f"model {model!r} takes images of shape (C, H, W), got input_shape={shape!r}"
        )
    c, h, w = shape
    if h < min_hw or w < min_hw:
        raise ValueError(
            f"model {model!r} needs H and W >= {min_hw} pixels, got input_shape={shape!r}"
        )
    return c, h, w


def check_num_classes(model: str, num_classes: int) -> int:
    """Validate the number of output classes (``>= 1``; 1 for a single logit).

    Raises:
        ValueError: if ``num_classes`` is not a positive int.
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(
            f"model {model!r}: num_classes must be a positive int, got {num_classes!r}"
        )
    return num_classes
