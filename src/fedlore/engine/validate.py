"""The server's checks of a client reply against the method's expected arrays."""

from __future__ import annotations

import math

import torch

from fedlore.tensors import all_finite
from fedlore.types import Reply, State


def validate_reply(
    reply: Reply, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]
) -> str | None:
    """Why ``reply`` must be rejected, or None if it is acceptable.

    Checks: ``num_examples`` is a finite positive integer; every array is a tensor; the array
    keys are exactly the expected ones; each array has the expected shape and dtype, is detached,
    and (if floating or complex) finite.
    """
    n = reply.metrics.get("num_examples")
    if (
        not isinstance(n, int | float)
        or isinstance(n, bool)
        or not math.isfinite(n)
        or not n > 0
        or int(n) != n
    ):
        return f"num_examples must be a positive integer, got {n!r}"
    bad = sorted(k for k, v in reply.arrays.items() if not isinstance(v, torch.Tensor))
    if bad:
        return f"arrays that are not tensors: {_few(bad)}"
    missing = sorted(set(expected) - set(reply.arrays))
    extra = sorted(set(reply.arrays) - set(expected))
    if missing or extra:
        return f"array keys differ: missing {_few(missing)}, unexpected {_few(extra)}"
    checked: list[str] = []  # keys that pass the metadata checks, in order
    problem = None
    for k, (shape, dtype) in expected.items():
        t = reply.arrays[k]
        if tuple(t.shape) != tuple(shape):
            problem = f"{k}: shape {tuple(t.shape)}, expected {tuple(shape)}"
        elif t.dtype != dtype:
            problem = f"{k}: dtype {t.dtype}, expected {dtype}"
        elif t.requires_grad:
            problem = f"{k}: requires grad (replies must be detached)"
        if problem is not None:
            break
        checked.append(k)
    # the first problem in key order, as if each key were checked in turn; the finiteness of
    # every key before it at once (one wait on the device)
    if not all_finite(reply.arrays[k] for k in checked):
        for k in checked:
            if not all_finite([reply.arrays[k]]):
                return f"{k}: contains NaN or Inf"
    return problem


def method_problem(
    algorithm: object, state: State, rnd: int, client_id: int, reply: Reply
) -> str | None:
    """Why the method rejects a reply that passed :func:`validate_reply`, or None: its optional
    ``reply_problem(state, rnd, client_id, reply)`` (:mod:`fedlore.algorithm`), for what shapes
    and dtypes cannot say (a compressed upload's indices in range and distinct, its codes within
    the levels, its norms >= 0). A method without it accepts every such reply."""
    check = getattr(algorithm, "reply_problem", None)
    if check is None:
        return None
    why: str | None = check(state, rnd, client_id, reply)
    return why


def _few(keys: list[str], shown: int = 3) -> str:
    """The first ``shown`` keys, and how many more there are: ``['a', 'b', 'c'] and 4 more``
    (``[]`` for none), never a list cut short without saying so."""
    more = len(keys) - shown
    return f"{keys[:shown]}" + (f" and {more} more" if more > 0 else "")
