"""Explicit name -> factory tables for algorithms, models, data sources, partitioners and
evaluation metrics.

Each table is filled by a ``register_*`` decorator in the module that defines the entry; the
``get_*`` functions import the package that holds the entries first, so a name always resolves
without import-order surprises. Unknown names raise ``KeyError`` listing the known ones.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_TABLES: dict[str, dict[str, Any]] = {
    "algorithm": {},
    "model": {},
    "source": {},
    "partition": {},
    "metric": {},
}
# The package whose import fills each table.
_PACKAGES = {
    "algorithm": "fedlore.algorithms",
    "model": "fedlore.models",
    "source": "fedlore.data.sources",
    "partition": "fedlore.data.partition",
    "metric": "fedlore.train.metrics",
}
# Names with a prefix name entries of another library, resolved by a module's
# ``resolve(rest_of_the_name)`` instead of a table: ``flwr:<Class>`` is any row partitioner of
# flwr-datasets (:func:`fedlore.data.flwr_partitions.resolve`).
_PREFIXES = {
    "partition": {"flwr:": ("fedlore.data.flwr_partitions", "a partitioner of flwr-datasets")}
}


def _where(obj: object) -> str:
    """``module.qualname`` of a registered function or class."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', '?')}"


def _register(kind: str, name: str) -> Callable[[F], F]:
    def deco(obj: F) -> F:
        table = _TABLES[kind]
        old = table.get(name)
        if old is not None and old is not obj and _where(old) != _where(obj):
            raise ValueError(
                f"{kind} {name!r} is registered twice: by {_where(old)} and {_where(obj)}"
            )
        table[name] = obj  # the same definition run again (a notebook's cell) replaces it
        return obj

    return deco


# What :class:`fedlore.algorithm.Algorithm` asks of a method class (named here: the registry
# imports no method code).
ALGORITHM_PARTS = (
    "capabilities", "caps", "init_server", "broadcast", "client_update", "aggregate",
    "global_arrays", "expected_reply",
)  # fmt: skip


def register_algorithm(name: str) -> Callable[[F], F]:
    """Register an algorithm class (a frozen hyperparameter dataclass) under ``name``.

    Raises:
        TypeError: for a class that lacks a part of :class:`fedlore.algorithm.Algorithm` (a
            method of one's own that subclasses neither ``Hyper`` nor a built-in method would
            otherwise fail with a traceback when the first run starts).
    """
    deco = _register("algorithm", name)

    def checked(cls: F) -> F:
        missing = [part for part in ALGORITHM_PARTS if not hasattr(cls, part)]
        if missing:
            raise TypeError(
                f"algorithm {name!r}: {getattr(cls, '__name__', cls)!r} lacks {missing}; "
                "subclass fedlore.algorithms.base.Hyper (or a built-in method) and define "
                "the four methods of docs/how-to/add-method"
            )
        return deco(cls)

    return checked


def register_model(name: str) -> Callable[[F], F]:
    """Register a model factory ``f(input_shape, num_classes, **kwargs) -> nn.Module``."""
    return _register("model", name)


def register_source(name: str) -> Callable[[F], F]:
    """Register a data-source loader ``f(root, **kwargs) -> DataSource``."""
    return _register("source", name)


def register_partition(name: str) -> Callable[[F], F]:
    """Register a partitioner ``f(labels, num_clients, rng, **kwargs) -> list[index array]``."""
    return _register("partition", name)


def register_metric(name: str) -> Callable[[F], F]:
    """Register an evaluation metric ``f(log_probs [n, K], y [n]) -> float`` under ``name``
    (:mod:`fedlore.train.metrics`; named in ``eval.metrics``)."""
    return _register("metric", name)


def did_you_mean(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the known name closest to a misspelled ``word`` (a
    different case, a typo), or an empty string when none is close."""
    choices = sorted(set(known))
    same_case = [c for c in choices if c.lower() == word.lower()]
    close = same_case or difflib.get_close_matches(word.lower(), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get(kind: str, name: str) -> Any:
    """Look up ``name`` in the ``kind`` table (a prefixed name, ``flwr:<Class>``, in the
    library it names).

    Raises:
        KeyError: naming the unknown entry and listing the registered ones (and the prefixed
            names of the kind).
    """
    prefixes = _PREFIXES.get(kind, {})
    for prefix, (module, _) in prefixes.items():
        if name.startswith(prefix):
            return importlib.import_module(module).resolve(name[len(prefix) :])
    importlib.import_module(_PACKAGES[kind])
    table = _TABLES[kind]
    if name not in table:
        more = "".join(f"; or {p}<class>, {what}" for p, (_, what) in prefixes.items())
        hint = did_you_mean(name, table)
        raise KeyError(f"unknown {kind} {name!r}{hint}; registered: {sorted(table)}{more}")
    return table[name]


def names(kind: str) -> list[str]:
    """Sorted registered names of one kind."""
    importlib.import_module(_PACKAGES[kind])
    return sorted(_TABLES[kind])
