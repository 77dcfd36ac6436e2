"""Checks and helpers shared by the model factories.

Every factory validates the ``input_shape`` it is given with these helpers, so a bad shape fails
with the same clear ``ValueError`` whether the factory is reached through
:func:`fedlore.models.build_model` or called directly from the registry. The Hugging Face
models (:mod:`fedlore.models.vit`, :mod:`fedlore.models.text`) also share the local-folder check
and the log silencer below.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from pathlib import Path


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


def local_hf_folder(model: str, folder: str | Path, hint: str) -> Path:
    """Check that ``folder`` is a local Hugging Face model folder (it holds ``config.json``).

    Nothing is ever fetched from the Hub: every transformers call in fedlore passes
    ``local_files_only=True`` on a folder checked here first.

    Args:
        model: registry name of the model, for the error message.
        folder: the folder to check.
        hint: how to get a folder (appended to the error message).

    Returns:
        The folder as a resolved :class:`~pathlib.Path`.

    Raises:
        FileNotFoundError: naming the folder (and the missing ``config.json``) and the hint.
    """
    path = Path(folder).expanduser().resolve()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {model!r}: local Hugging Face folder {path} does not exist. {hint}"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model {model!r}: {path} holds no config.json, so it is not a Hugging Face model "
            f"folder. {hint}"
        )
    return path


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load reports and progress bars for the duration of the block.

    Loading a backbone without its pooler, or a checkpoint saved from a model with a different
    head, prints an "UNEXPECTED keys" report and a progress bar per load; fedlore builds the same
    model many times per run (one per client transport and evaluation), so they are noise.
    Errors still propagate as exceptions.
    """
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
