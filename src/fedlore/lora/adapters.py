"""Adapter injection on peft and the adapter <-> Arrays mapping.

Injection uses :func:`peft.inject_adapter_in_model` on a plain ``nn.Module`` with one adapter
named :data:`ADAPTER`. peft renames an adapted ``<mod>.weight`` to ``<mod>.base_layer.weight``
and adds ``<mod>.lora_A.fedlore.weight`` / ``<mod>.lora_B.fedlore.weight``; everything else keeps
its ``state_dict`` name. On the wire and in states an adapter is ``<mod>.A`` (``r x n``) and
``<mod>.B`` (``m x r``) with the plain module path (callers add the ``lora.`` role prefix), and
every other tensor keeps its plain ``state_dict`` name, so a message never depends on peft's
naming. Adapter factors are always float32 (peft would give a bf16 base bf16 adapters).

Legend: see :mod:`fedlore.lora.factors`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from fedlore.tensors import load_model_arrays
from fedlore.types import Arrays

ADAPTER = "fedlore"
"""The one adapter name every method uses (fixed, so state-dict names are stable)."""

_LORA = re.compile(rf"^(?P<mod>.+)\.lora_(?P<factor>[AB])\.{ADAPTER}\.weight$")


@dataclass(frozen=True)
class Target:
    """One adapted ``nn.Linear``.

    Attributes:
        name: module path in the plain model (``"body.0"``, ``"encoder.layer.0.query"``).
        m: out_features (rows of W).
        n: in_features (columns of W).
    """

    name: str
    m: int
    n: int


def find_targets(
    model: nn.Module, target_modules: Sequence[str] = (), exclude: Sequence[str] = ()
) -> dict[str, Target]:
    """The ``nn.Linear`` modules that get an adapter, in module order.

    A Linear is adapted when its ``<name>.weight`` does not start with a prefix in ``exclude``
    (the classifier head trains densely) and, if ``target_modules`` is given, its name equals a
    target or ends with ``"." + target`` (peft's suffix rule: ``["query", "value", "dense"]``).

    Raises:
        ValueError: a target names a module that is not ``nn.Linear``, or nothing is adapted.
    """
    out: dict[str, Target] = {}
    for name, mod in model.named_modules():
        if not name or any(f"{name}.weight".startswith(p) for p in exclude):
            continue
        if target_modules and not any(name == t or name.endswith("." + t) for t in target_modules):
            continue
        if isinstance(mod, nn.Linear):
            out[name] = Target(name, mod.out_features, mod.in_features)
        elif target_modules:
            raise ValueError(
                f"LoRA target {name!r} is a {type(mod).__name__}; only nn.Linear is supported"
            )
    if not out:
        raise ValueError(
            f"no nn.Linear to adapt (target_modules={list(target_modules)}, "
            f"exclude={list(exclude)})"
        )
    return out


def inject(
    model: nn.Module, targets: Mapping[str, Target], rank: int, alpha: float, dropout: float = 0.0
) -> nn.Module:
    """Insert the adapter :data:`ADAPTER` of rank ``rank`` into every target, in place (peft).

    The adapter values are whatever peft's layer constructors drew: load them with
    :func:`load_adapters` next. The global torch RNG is left as it was.

    Args:
        model: a plain model (no adapters yet).
        targets: from :func:`find_targets`.
        rank: r.
        alpha: lora_alpha (scaling ``alpha / r``).
        dropout: LoRA dropout probability (0: none, deterministic).

    Returns:
        ``model`` itself.
    """
    # imported here: peft (and transformers under it) costs seconds to import, paid only by
    # the LoRA methods, not by every process that imports fedlore (a deployed ClientApp)
    from peft import LoraConfig, inject_adapter_in_model

    pattern = "^(?:" + "|".join(re.escape(t) for t in targets) + ")$"
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # annotated int; peft uses alpha / r
        lora_dropout=dropout,
        target_modules=pattern,
        init_lora_weights=False,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    mods = dict(model.named_modules())
    for name in targets:
        layer = mods[name]
        layer.lora_A[ADAPTER].float()
        layer.lora_B[ADAPTER].float()
    return model


def plain_name(peft_name: str) -> str:
    """The plain ``state_dict`` name of a tensor of an injected model (drops ``.base_layer``)."""
    return peft_name.replace(".base_layer.", ".")


def adapter_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """``<mod>.A`` / ``<mod>.B`` -> the adapter parameter of an injected model."""
    out = {}
    for name, p in model.named_parameters():
        hit = _LORA.match(name)
        if hit:
            out[f"{hit['mod']}.{hit['factor']}"] = p
    return out


def adapter_arrays(model: nn.Module, factors: Sequence[str] = ("A", "B")) -> Arrays:
    """Detached copies (on the model's device) of the adapter factors named in ``factors``
    (``<mod>.A`` / ``.B``)."""
    return {
        k: p.detach().clone().contiguous()
        for k, p in adapter_params(model).items()
        if k.rsplit(".", 1)[1] in factors
    }


def load_adapters(model: nn.Module, arrays: Arrays) -> None:
    """Load ``<mod>.A`` / ``<mod>.B`` into the injected adapter, strictly.

    Raises:
        KeyError: naming the adapter keys that are missing or unexpected.
        ValueError: naming a factor whose shape differs from the injected one.
    """
    own = adapter_params(model)
    missing = sorted(set(own) - set(arrays))
    unexpected = sorted(set(arrays) - set(own))
    if missing or unexpected:
        raise KeyError(f"adapter keys mismatch: missing={missing} unexpected={unexpected}")
    for k, p in own.items():
        if tuple(arrays[k].shape) != tuple(p.shape):
            raise ValueError(f"adapter {k}: shape {tuple(arrays[k].shape)}, model {tuple(p.shape)}")
    with torch.no_grad():
        for k, p in own.items():
            p.copy_(arrays[k])


def adapted_copy(
    model: nn.Module,
    plain: Arrays,
    targets: Mapping[str, Target],
    adapters: Arrays,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
) -> nn.Module:
    """A deep copy of ``model`` (which is left untouched) with ``plain`` loaded strictly under
    plain ``state_dict`` names, the adapter injected at rank ``rank`` and ``adapters``
    (``<mod>.A|B``) loaded strictly; no gradients.

    Raises:
        KeyError: naming missing or unexpected plain or adapter keys.
    """
    work = copy.deepcopy(model)
    for p in work.parameters():
        p.grad = None
    load_model_arrays(work, plain)
    inject(work, targets, rank, alpha, dropout)
    load_adapters(work, adapters)
    return work


def set_trainable(
    model: nn.Module, factors: Sequence[str], dense: Collection[str]
) -> list[nn.Parameter]:
    """Train the adapter factors named in ``factors`` and the parameters whose plain name is in
    ``dense``; freeze everything else. Returns the trainable parameters."""
    out = []
    for name, p in model.named_parameters():
        hit = _LORA.match(name)
        on = hit["factor"] in factors if hit else plain_name(name) in dense
        p.requires_grad_(on)
        if on:
            out.append(p)
    return out


def dense_arrays(model: nn.Module, dense: Collection[str]) -> Arrays:
    """Detached copies (on the model's device) of the parameters and buffers whose plain name
    is in ``dense``."""
    out = {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        key = plain_name(name)
        if key in dense:
            out[key] = p.detach().clone().contiguous()
    return out
