"""The keyed client-state store of the in-process transport (``Context.state`` under Flower)."""

from __future__ import annotations

from typing import Any

from fedlore.types import State


class ClientStore:
    """Client id -> :class:`State`. Empty states (stateless methods) are not kept."""

    def __init__(self) -> None:
        self._states: dict[int, State] = {}

    def get(self, client_id: int) -> State | None:
        """The client's state, or None before its first contact."""
        return self._states.get(client_id)

    def put(self, client_id: int, state: State | None) -> None:
        """Store (or, for an empty or None state, forget) a client's state."""
        if state is None or (not state.arrays and not state.values):
            self._states.pop(client_id, None)
        else:
            self._states[client_id] = state

    def __len__(self) -> int:
        return len(self._states)

    def nbytes(self) -> int:
        """Bytes of all stored tensors."""
        return sum(
            t.numel() * t.element_size() for s in self._states.values() for t in s.arrays.values()
        )

    def to_dict(self) -> dict[str, Any]:
        """A plain dict of tensors and scalars (loadable with ``weights_only=True``)."""
        return {str(c): {"arrays": s.arrays, "values": s.values} for c, s in self._states.items()}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ClientStore:
        """Inverse of :meth:`to_dict`."""
        store = cls()
        for c, s in raw.items():
            store.put(int(c), State(dict(s["arrays"]), dict(s["values"])))
        return store
