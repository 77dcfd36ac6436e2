"""Client states a client keeps itself, in a folder, round by round: what a Flower simulation's
virtual SuperNodes write so that a killed simulated run resumes from its checkpoint.

In process the server-side :class:`~fedlore.engine.store.ClientStore` holds every client's
state and the checkpoint saves it. On Flower a client's state lives in its node's
``Context.state``, which a new simulation does not have; so every simulated client also writes
the state it keeps to ``<run folder>/clients/<client id>/state.<round>.pt`` (:data:`FOLDER`,
:func:`save`), as a real device keeps its own on local storage, and a resumed simulation's
client whose ``Context.state`` is empty reads its newest file (:func:`load`).

Versions: ``<round>`` is the round of the broadcast the client trained on. A round that a kill
interrupted was discarded by the server, but its clients may have written a state of that round;
so before a resumed simulation starts, :func:`restore_point` deletes every state newer than the
checkpoint's round (and every ``.tmp`` a killed write left) and those older than each
client's newest remaining one, which it checks can be read: a client's one state on disk is
then its state as of the checkpoint. A client writing the state
of round t keeps only the newest state before t beside it (:func:`save`): the one the
checkpoint of round t - 1 needs while round t runs; older ones are deleted.

A file that cannot be read, or that names another client, round, method or seed than where it
lies, is refused before anything runs (:class:`NodeStateError`, one line naming the file and
the ways out): a client cannot be trained from a state it does not have without changing the
result.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from fedlore.atomic import TMP_SUFFIX, save_tensors
from fedlore.config import Config, ConfigError
from fedlore.engine import client_holder
from fedlore.engine.callbacks import checkpoint_round
from fedlore.engine.checkpoint_io import damage_reason, load_tensors
from fedlore.progress import say
from fedlore.types import State

FOLDER = "clients"
"""The folder of a run folder that holds the clients' own states (one folder per client id)."""

FORMAT = 1
"""The version of a state file's layout (``format`` in the file)."""

_NAME = re.compile(r"^state\.(-?\d+)\.pt$")


class NodeStateError(ConfigError):
    """A client state file that cannot be used to resume (damaged, or another run's)."""


def kept_by_clients(cfg: Config) -> bool:
    """Whether a simulated run of ``cfg`` has its clients write their states (:func:`save`) and
    resumes from its checkpoint: with ``checkpoint`` on (else there is nothing to resume from),
    except FedBuff on the wall clock (``asynchronous.clock: wall``), whose clients in flight at
    a kill may have trained from a version the checkpoint holds without their replies in it;
    such a run is run again from its first round by ``--resume``."""
    wall = cfg.asynchronous.enabled and cfg.asynchronous.clock == "wall"
    return cfg.checkpoint and not wall


def _versions(folder: Path) -> dict[int, Path]:
    """round -> file of the states in one client's ``folder``."""
    out: dict[int, Path] = {}
    if folder.is_dir():
        for path in folder.iterdir():
            m = _NAME.match(path.name)
            if m:
                out[int(m.group(1))] = path
    return out


def payload(
    fmt: int, cid: int, rnd: int, state: State, method: str, seed: int, **extra: str
) -> dict[str, Any]:
    """What a client's state file holds: its header (layout version ``fmt``, client, round,
    method, seed and ``extra``, e.g. a deployment's attempt token) and ``state`` as CPU
    tensors."""
    head = {"format": fmt, "client": cid, "round": rnd, **extra, "method": method, "seed": seed}
    arrays = {k: v.detach().cpu() for k, v in state.arrays.items()}
    return {**head, "arrays": arrays, "values": dict(state.values)}


def save(root: Path, cid: int, rnd: int, state: State, method: str, seed: int) -> None:
    """Write client ``cid``'s ``state`` after its training on round ``rnd``'s broadcast to
    ``root/<cid>/state.<rnd>.pt`` (atomically, CPU tensors), then delete the client's states
    older than its newest one before ``rnd`` (that one is what a resume from the checkpoint of
    round ``rnd - 1`` needs)."""
    folder = root / str(cid)
    folder.mkdir(parents=True, exist_ok=True)
    save_tensors(payload(FORMAT, cid, rnd, state, method, seed), folder / f"state.{rnd}.pt")
    older = sorted(r for r in _versions(folder) if r < rnd)
    for r in older[:-1]:
        (folder / f"state.{r}.pt").unlink(missing_ok=True)


def _read(path: Path, cid: int, rnd: int, method: str, seed: int) -> State:
    """The state in ``path``, checked to be client ``cid``'s of round ``rnd`` of this method
    and seed.

    Raises:
        NodeStateError: naming the file, what is wrong and the ways out.
    """
    try:
        raw = load_tensors(path, "cpu")
        head = (raw["format"], raw["client"], raw["round"], raw["method"], raw["seed"])
        state = State(dict(raw["arrays"]), dict(raw["values"]))
    except Exception as e:  # torn, truncated, foreign
        why = damage_reason(e, path)
        raise NodeStateError(
            f"--resume: the client state {path} is damaged and cannot be read ({why}); "
            "run without --resume to start this run over"
        ) from None
    if head != (FORMAT, cid, rnd, method, seed):
        raise NodeStateError(
            f"--resume: the client state {path} is not this run's (it holds format {head[0]}, "
            f"client {head[1]}, round {head[2]}, {head[3]} seed {head[4]}); restore the run "
            "folder's own clients/ folder, or run without --resume to start this run over"
        )
    return state


def load(root: Path, cid: int, method: str, seed: int) -> State | None:
    """Client ``cid``'s newest state under ``root`` (None: it has none), on the CPU.

    Raises:
        NodeStateError: when that file cannot be read or is another run's (:func:`_read`).
    """
    versions = _versions(root / str(cid))
    if not versions:
        return None
    rnd = max(versions)
    return _read(versions[rnd], cid, rnd, method, seed)


def restore_point(root: Path, last: int | None, method: str, seed: int) -> list[str]:
    """Before a resumed simulation starts from the checkpoint of round ``last``: delete the
    states of rounds after ``last`` (a discarded round's) and the ``.tmp`` files a killed write
    left, or the whole of ``root`` when ``last`` is None (no checkpoint: the run starts from
    its first round), then each client's states older than its newest remaining one, which is
    read (its state as of the checkpoint). Returns the names of the deleted files of rounds
    after ``last`` and of the ``.tmp`` files (``"<cid>/state.<round>.pt"``).

    Raises:
        NodeStateError: when a client's newest state cannot be read or is another run's.
    """
    if not root.exists():
        return []
    if last is None:
        gone = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
        shutil.rmtree(root)
        return gone
    gone = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        for tmp in folder.glob(f"*{TMP_SUFFIX}"):
            tmp.unlink()
            gone.append(f"{folder.name}/{tmp.name}")
        versions = _versions(folder)
        for rnd in sorted(r for r in versions if r > last):
            versions.pop(rnd).unlink()
            gone.append(f"{folder.name}/state.{rnd}.pt")
        for rnd in sorted(versions)[:-1]:  # older than the state as of the checkpoint
            versions.pop(rnd).unlink()
        if versions and folder.name.isdigit():
            rnd = max(versions)
            _read(versions[rnd], int(folder.name), rnd, method, seed)
    return gone


def newest_round(root: Path, cid: int) -> int | None:
    """The round of client ``cid``'s newest state under ``root`` (None: none); for tests and
    messages."""
    versions = _versions(root / str(cid))
    return max(versions) if versions else None


__all__ = [
    "FOLDER",
    "NodeStateError",
    "kept_by_clients",
    "load",
    "newest_round",
    "payload",
    "restore_point",
    "save",
]


def restore_clients(folder: Path, states: Path, method: str, seed: int) -> None:
    """Before a resumed simulation of the run in ``folder``: its clients' states in ``states``
    as of its checkpoint (:func:`restore_point`; all of them gone
    when it has no checkpoint yet, or when its checkpoint's clients kept their states elsewhere:
    :mod:`fedlore.engine.client_holder`), with a progress line naming what was deleted."""
    ckpt = folder / "checkpoint.pt"
    last = checkpoint_round(ckpt) if ckpt.exists() else None
    # a checkpoint of another engine's attempt: its clients restart (fedlore.engine.client_holder)
    # and the states here are an older simulated attempt's, not theirs as of the checkpoint
    elsewhere = (
        last is not None and client_holder.recorded_in(ckpt, states) != client_holder.NODE_FILES
    )
    gone = restore_point(states, None if elsewhere else last, method, seed)
    if gone:
        which = (
            "(no checkpoint yet)"
            if last is None
            else f"(the checkpoint of round {last} is not this engine's)"
            if elsewhere
            else f"of the rounds after round {last}"
        )
        listed = ", ".join(gone[:5]) + (" ..." if len(gone) > 5 else "")
        say(
            "%s seed %d: deleted %d client state file(s) %s: %s",
            method,
            seed,
            len(gone),
            which,
            listed,
        )
