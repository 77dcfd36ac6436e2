"""The keyed client-state store of the in-process transport (``Context.state`` under Flower).

States live in memory up to a byte limit; past it, the least recently used ones spill to disk,
one immutable file per state, and come back when their client is next touched.

Spill files are named ``<client>.<generation>.pt`` with a generation counter that never reuses
a name in the spill directory (a store starts above every generation already there), so a file
is written once and never changed. :meth:`ClientStore.to_dict` references spilled states by
file name instead of loading them; a checkpoint of that dict stays valid as long as the files it
names exist. Files are therefore deleted only when no committed checkpoint can name them:

* a file written after the last commit is deleted as soon as the store stops referencing it;
* a file referenced by the last commit survives until :meth:`ClientStore.collect_garbage`, which
  the checkpointer calls right after the next commit (so a run killed at any moment resumes from
  its last checkpoint with every file that checkpoint names).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fedlore.atomic import TMP_SUFFIX, WriteError, remove_temps, save_tensors
from fedlore.engine.checkpoint_io import damage_reason, load_tensors
from fedlore.tensors import to_cpu, to_device
from fedlore.types import Arrays, State

_SPILL_FILE = re.compile(r"^(\d+)\.(\d+)\.pt$")
"""``<client>.<generation>.pt``: the only files :meth:`ClientStore.collect_garbage` deletes."""


def remove_spill_temps(spill_dir: Path) -> list[str]:
    """Delete the ``<client>.<generation>.pt.tmp`` files in ``spill_dir`` (a spilled state's write
    that a kill cut short; no checkpoint names one) and return their names. The run that owns
    the folder calls it while it holds the folder's lock."""
    if not spill_dir.is_dir():
        return []
    named = [p.name.removesuffix(TMP_SUFFIX) for p in spill_dir.iterdir()]
    return remove_temps(spill_dir, [n for n in named if _SPILL_FILE.match(n)])


def _state_bytes(state: State) -> int:
    return sum(int(t.numel()) * t.element_size() for t in state.arrays.values())


def _storages(state: State) -> dict[int, int]:
    """Data pointer -> bytes of each distinct storage of a compact state's tensors (empty
    tensors own no memory and are left out)."""
    out: dict[int, int] = {}
    for t in state.arrays.values():
        n = t.untyped_storage().nbytes()
        if n:
            out[t.untyped_storage().data_ptr()] = n
    return out


def _compact_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself if it is detached, contiguous and owns exactly its storage; else a compact
    copy (a view of a bigger tensor would keep, and ``torch.save`` would write, all of it)."""
    if (
        not t.requires_grad
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == int(t.numel()) * t.element_size()
    ):
        return t
    return t.detach().clone(memory_format=torch.contiguous_format)


def _compact(state: State) -> State:
    """``state`` itself when all its tensors are compact, else a copy with compact tensors."""
    arrays = {k: _compact_tensor(t) for k, t in state.arrays.items()}
    if all(arrays[k] is t for k, t in state.arrays.items()):
        return state
    return State(arrays, dict(state.values))


class StoreError(RuntimeError):
    """The store cannot write or read a spilled state (disk full, file deleted or unreadable).

    Not a client failure: the transport lets it stop the run, so that no client is silently
    dropped round after round; resume from the last checkpoint once the cause is fixed."""


@dataclass(frozen=True)
class _Spilled:
    """A state on disk: its file name (inside the spill directory) and its tensor bytes."""

    file: str
    nbytes: int


class ClientStore:
    """Client id -> :class:`State`. Empty states (stateless methods) are not kept.

    Args:
        max_memory_bytes: bytes of tensors kept in memory (None: no limit, never spill; a
            tensor shared by several states counts once). Past it, least recently used states
            (by :meth:`get` / :meth:`put`) are written to
            ``spill_dir``; the most recently used state always stays in memory, so memory
            never exceeds the limit by more than one state. States without tensors never spill.
        spill_dir: directory of spilled states, owned by this store (created when first
            needed). Needed with a limit, and to read a checkpoint that has spilled states.
        device: where states read back from disk go (the run's device); spill files hold CPU
            tensors, so a spilled state reads back on any device.

    Stored tensors are compact: contiguous and owning exactly their storage (others are copied
    on :meth:`put`). A state returned by :meth:`get` may be the stored object itself; treat it
    as read-only.

    Raises:
        ValueError: on a negative limit, a limit without ``spill_dir``, or a ``spill_dir`` that
            cannot be created (e.g. below a file).
    """

    def __init__(
        self,
        max_memory_bytes: int | None = None,
        spill_dir: Path | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        if max_memory_bytes is not None and max_memory_bytes < 0:
            raise ValueError(f"max_memory_bytes must be >= 0 or None, got {max_memory_bytes}")
        if max_memory_bytes is not None and spill_dir is None:
            raise ValueError("a memory limit needs a spill_dir for the states beyond it")
        if spill_dir is not None and max_memory_bytes is not None:
            try:  # fail now, not at the first spill in the middle of a round
                Path(spill_dir).mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ValueError(f"cannot use spill_dir {spill_dir}: {e}") from e
        self.max_memory_bytes = max_memory_bytes
        self.spill_dir = Path(spill_dir) if spill_dir is not None else None
        self.device = torch.device(device)
        self._mem: OrderedDict[int, State] = OrderedDict()  # least recently used first
        self._mem_storages: dict[int, dict[int, int]] = {}  # client -> its storages
        self._refs: dict[int, list[int]] = {}  # storage data pointer -> [bytes, holders]
        self._mem_total = 0  # bytes of distinct storages held by states in memory
        self._spilled: dict[int, _Spilled] = {}
        self._committed: set[str] = set()  # files the last committed checkpoint names
        self._unsynced: set[str] = set()  # files written since the last sync()
        self._generation = self._next_free_generation()

    # ------------------------------------------------------------------ public API
    def get(self, client_id: int) -> State | None:
        """The client's state, or None before its first contact. Marks it most recently used;
        a spilled state is read back into memory (which may spill others).

        Raises:
            StoreError: when the spilled state's file is missing or cannot be read (names
                the file).
        """
        if client_id in self._mem:
            self._mem.move_to_end(client_id)
            return self._mem[client_id]
        ref = self._spilled.get(client_id)
        if ref is None:
            return None
        state = self._load(client_id, ref)
        self._drop_spilled(client_id)
        self._insert(client_id, state)
        self._evict()
        return state

    def put(self, client_id: int, state: State | None) -> None:
        """Store (or, for an empty or None state, forget) a client's state; it becomes the most
        recently used. May spill least recently used states (see the class docstring)."""
        self._forget(client_id)
        if state is None or (not state.arrays and not state.values):
            return
        self._insert(client_id, _compact(state))
        self._evict()

    def __len__(self) -> int:
        return len(self._mem) + len(self._spilled)

    def __contains__(self, client_id: object) -> bool:
        return client_id in self._mem or client_id in self._spilled

    def client_ids(self) -> list[int]:
        """Ids of all stored clients (in memory or spilled), sorted."""
        return sorted([*self._mem, *self._spilled])

    def nbytes(self) -> int:
        """Bytes of the tensors held in memory (spilled states not included); a tensor shared
        by several states (e.g. the broadcast model that every client of a round cached) counts
        once."""
        return self._mem_total

    def disk_bytes(self) -> int:
        """Bytes of the tensors of spilled states (their files add a small header each)."""
        return sum(r.nbytes for r in self._spilled.values())

    def num_in_memory(self) -> int:
        """Number of states held in memory."""
        return len(self._mem)

    def num_spilled(self) -> int:
        """Number of states on disk."""
        return len(self._spilled)

    def stats(self) -> dict[str, int]:
        """``clients``, ``in_memory``, ``spilled`` (counts), ``memory_bytes``, ``disk_bytes``."""
        return {
            "clients": len(self),
            "in_memory": self.num_in_memory(),
            "spilled": self.num_spilled(),
            "memory_bytes": self.nbytes(),
            "disk_bytes": self.disk_bytes(),
        }

    # ------------------------------------------------------------ checkpointing
    def to_dict(self) -> dict[str, Any]:
        """A plain dict of tensors and scalars (loadable with ``weights_only=True``).

        ``{"<client>": {"arrays": ..., "values": ...}}`` for states in memory and
        ``{"<client>": {"spilled": "<file name>", "nbytes": int}}`` for spilled ones, which are
        referenced, not read: the dict is only valid while those files exist (see
        :meth:`collect_garbage`). Without spilled states it is exactly the store's contents.
        """
        out: dict[str, Any] = {
            str(c): {"spilled": r.file, "nbytes": r.nbytes} for c, r in self._spilled.items()
        }
        out.update({str(c): {"arrays": s.arrays, "values": s.values} for c, s in self._mem.items()})
        return out

    @classmethod
    def from_dict(
        cls,
        raw: dict[str, Any],
        max_memory_bytes: int | None = None,
        spill_dir: Path | None = None,
        device: torch.device | str = "cpu",
    ) -> ClientStore:
        """Inverse of :meth:`to_dict`, the in-memory states moved to ``device``. Spilled entries
        stay on disk (in ``spill_dir``) until their client is read; their files count as
        committed (kept until the next :meth:`collect_garbage`).

        Raises:
            ValueError: when ``raw`` has spilled entries but no ``spill_dir`` is given, or an
                entry is malformed; and as the constructor.
        """
        store = cls(max_memory_bytes, spill_dir, device)
        for c, s in raw.items():
            cid = int(c)
            if "spilled" in s:
                if store.spill_dir is None:
                    raise ValueError(
                        f"client {cid}'s state is spilled to {s['spilled']!r}; "
                        "pass the spill_dir it was written to"
                    )
                name = str(s["spilled"])
                m = _SPILL_FILE.match(name)
                if m is None:
                    raise ValueError(f"client {cid}: {name!r} is not a spill file name")
                store._forget(cid)
                store._spilled[cid] = _Spilled(name, int(s["nbytes"]))
                store._committed.add(name)
                store._generation = max(store._generation, int(m.group(2)) + 1)
            elif "arrays" in s and "values" in s:
                arrays = to_device(dict(s["arrays"]), store.device)
                store.put(cid, State(arrays, dict(s["values"])))
            else:
                raise ValueError(f"client {cid}: malformed store entry with keys {sorted(s)}")
        return store

    def verify_spilled(self) -> None:
        """Read every spilled state once (onto the meta device: no memory is filled), so that a
        missing or damaged file is found when a run resumes, not when its client is next
        sampled.

        Raises:
            StoreError: naming the client, the file and the ways out.
        """
        for cid, ref in sorted(self._spilled.items()):
            assert self.spill_dir is not None
            path = self.spill_dir / ref.file
            try:
                raw = load_tensors(path, "meta")
                dict(raw["arrays"]), dict(raw["values"])
            except Exception as e:
                raise StoreError(
                    f"the spilled state of client {cid} ({path}) is missing or damaged "
                    f"({damage_reason(e, path)}); the checkpoint needs it. Run without --resume to "
                    "start the run over"
                ) from None

    def sync(self) -> None:
        """fsync the spill files written since the last call (and the directory), so a
        checkpoint committed next never names a file a power loss could lose."""
        if self.spill_dir is None or not self._unsynced:
            return
        for name in sorted(self._unsynced):
            path = self.spill_dir / name
            if path.exists():
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        _fsync_dir(self.spill_dir)
        self._unsynced.clear()

    def collect_garbage(self) -> int:
        """Call right after a checkpoint holding :meth:`to_dict` was committed: the files it
        names become the committed set, and every other spill file (``<client>.<gen>.pt``, or
        its ``.tmp`` a kill cut short) in ``spill_dir`` is deleted (superseded states, leftovers
        of a killed run). Returns the number of files deleted."""
        self._committed = {r.file for r in self._spilled.values()}
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return 0
        deleted = 0
        for path in self.spill_dir.iterdir():
            if _SPILL_FILE.match(path.name.removesuffix(TMP_SUFFIX)) and (
                path.name not in self._committed
            ):
                path.unlink(missing_ok=True)
                self._unsynced.discard(path.name)
                deleted += 1
        return deleted

    # --------------------------------------------------------------- internals
    def _next_free_generation(self) -> int:
        """One above every generation in ``spill_dir``, so no existing file is ever rewritten
        (it may be named by a checkpoint of an earlier, killed run)."""
        if self.spill_dir is None or not self.spill_dir.is_dir():
            return 0
        names = (_SPILL_FILE.match(p.name) for p in self.spill_dir.iterdir())
        gens = [int(m.group(2)) for m in names if m is not None]
        return max(gens, default=-1) + 1

    def _insert(self, client_id: int, state: State) -> None:
        storages = _storages(state)
        self._mem[client_id] = state
        self._mem_storages[client_id] = storages
        for ptr, n in storages.items():
            ref = self._refs.setdefault(ptr, [n, 0])
            if ref[1] == 0:
                self._mem_total += n
            ref[1] += 1

    def _remove_from_memory(self, client_id: int) -> State:
        state = self._mem.pop(client_id)
        for ptr in self._mem_storages.pop(client_id):
            ref = self._refs[ptr]
            ref[1] -= 1
            if ref[1] == 0:
                self._mem_total -= ref[0]
                del self._refs[ptr]
        return state

    def _forget(self, client_id: int) -> None:
        if client_id in self._mem:
            self._remove_from_memory(client_id)
        if client_id in self._spilled:
            self._drop_spilled(client_id)

    def _drop_spilled(self, client_id: int) -> None:
        """Stop referencing a spilled state; its file goes now unless a commit names it."""
        ref = self._spilled.pop(client_id)
        if ref.file not in self._committed and self.spill_dir is not None:
            (self.spill_dir / ref.file).unlink(missing_ok=True)
            self._unsynced.discard(ref.file)

    def _evict(self) -> None:
        """Spill least recently used states (with tensors) until memory is within the limit,
        never the most recently used one. (Spilling a state whose tensors other states in
        memory share frees nothing until those spill too.)"""
        if self.max_memory_bytes is None or self._mem_total <= self.max_memory_bytes:
            return
        mru = next(reversed(self._mem))
        for cid in list(self._mem):
            if self._mem_total <= self.max_memory_bytes:
                break
            if cid == mru or not self._mem_storages[cid]:
                continue
            self._spill(cid)

    def _spill(self, client_id: int) -> None:
        assert self.spill_dir is not None
        state = self._mem[client_id]
        name = f"{client_id}.{self._generation}.pt"
        self._generation += 1
        payload: dict[str, Any] = {"arrays": to_cpu(state.arrays), "values": dict(state.values)}
        try:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WriteError(self.spill_dir, e) from None
        save_tensors(payload, self.spill_dir / name, fsync=False)  # fsynced by sync()
        self._unsynced.add(name)
        self._remove_from_memory(client_id)
        self._spilled[client_id] = _Spilled(name, _state_bytes(state))

    def _load(self, client_id: int, ref: _Spilled) -> State:
        assert self.spill_dir is not None
        path = self.spill_dir / ref.file
        if not path.is_file():
            raise StoreError(
                f"spilled state of client {client_id} is missing: {path} (was the spill "
                "directory deleted or shared with another run?)"
            )
        try:
            raw = torch.load(path, weights_only=True, map_location=self.device)
            arrays: Arrays = dict(raw["arrays"])
            values = dict(raw["values"])
        except Exception as e:
            raise StoreError(
                f"cannot read the spilled state of client {client_id} from {path}: {e}"
            ) from e
        return State(arrays, values)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory
    finally:
        os.close(fd)
