"""Model registry: ``mlp``, ``cnn``, ``resnet20/32/44/56``, ``vit``, ``text_encoder``, ``llama``.

Importing this package imports every model module, which registers its factories with
:func:`fedlore.registry.register_model`. A factory has the signature
``f(input_shape, num_classes, **kwargs) -> nn.Module`` where ``input_shape`` is the per-example
shape without the batch dimension (``(C, H, W)`` for images). Every model names its final
classifier Linear ``head``, so classifier parameter names start with ``head.`` (low-rank
optimizers exclude them). Initialization draws from torch's global generator at construction
only: seed with ``torch.manual_seed`` right before building for a reproducible model.

``vit`` and ``text_encoder`` are built on Hugging Face transformers, imported only when one of
them is built; they load from local folders only (see :mod:`fedlore.models.text`). Text models
take int64 token ids ``[B, L]`` (``input_shape = (L,)``) and mask padding themselves.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from fedlore import registry
from fedlore.models import cnn, llama, mlp, resnet, text, vit
from fedlore.models.common import check_num_classes, check_shape

__all__ = ["build_model", "cnn", "llama", "mlp", "resnet", "text", "vit"]


def build_model(
    name: str, input_shape: tuple[int, ...], num_classes: int, **kwargs: Any
) -> nn.Module:
    """Build the registered model ``name``.

    Args:
        name: registry name, e.g. ``"cnn"``.
        input_shape: per-example shape without the batch dimension, e.g. ``(1, 28, 28)``.
        num_classes: number of classes ``K``; the model maps ``[B, *input_shape]`` to ``[B, K]``.
        **kwargs: model-specific keyword arguments (see each factory).

    Returns:
        A freshly initialized ``nn.Module`` with a ``head`` Linear classifier.

    Raises:
        KeyError: if ``name`` is not registered (the message lists the registered names).
        ValueError: on a malformed or unsupported input shape, a bad class count, an unknown
            keyword argument, a bad keyword value, a factory that cannot be called as
            ``f(input_shape, num_classes, **kwargs)`` or returns no ``nn.Module``, or a ``head``
            with another number of outputs than ``num_classes``, naming the model and the
            offending value.
    """
    factory = registry.get("model", name)
    shape = check_shape(name, input_shape)
    check_num_classes(name, num_classes)
    signature = inspect.signature(factory)
    params = signature.parameters
    accepted = [p for p, spec in params.items() if spec.kind is inspect.Parameter.KEYWORD_ONLY]
    has_var_kw = any(s.kind is inspect.Parameter.VAR_KEYWORD for s in params.values())
    unknown = sorted(set(kwargs) - set(accepted))
    if unknown and not has_var_kw:
        glued = [k for k in unknown if ":" in str(k)]  # YAML reads {norm:batch} as one key
        hint = ""
        if glued:
            hint = f" (YAML reads {{{glued[0]}}} as one key: put a space after the colon)"
        raise ValueError(f"model {name!r}: unknown kwargs {unknown}; accepted: {accepted}{hint}")
    try:  # a factory of another signature failed with the misleading "wrong type" below
        signature.bind(shape, num_classes, **kwargs)
    except TypeError as e:
        called = getattr(factory, "__name__", "")  # a functools.partial has none
        raise ValueError(
            f"model {name!r}: its factory {called}{signature} cannot "
            f"be called as f(input_shape, num_classes, **model.kwargs) ({e})"
        ) from None
    try:
        model = factory(shape, num_classes, **kwargs)
    except TypeError as e:  # a kwarg of the wrong type (e.g. an int where a list is needed)
        raise ValueError(
            f"model {name!r}: a keyword argument has the wrong type ({e}): {kwargs}"
        ) from e
    if not isinstance(model, nn.Module):  # else "does not name its classifier Linear 'head'"
        raise ValueError(
            f"model {name!r}: its factory returned {type(model).__name__}, not an nn.Module"
        )
    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model {name!r} does not name its classifier Linear 'head'")
    if head.out_features != num_classes:  # else a run fails in its first loss
        raise ValueError(
            f"model {name!r}: its head gives {head.out_features} outputs, but the data "
            f"have {num_classes} classes; build head = nn.Linear(..., num_classes)"
        )
    return model
