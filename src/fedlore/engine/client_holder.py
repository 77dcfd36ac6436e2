"""Where a run's clients kept their states, recorded in its checkpoint, so that a resume on
another engine than the attempt it continues knows what its clients still hold.

A client's state (a model cache that a log replay needs, SCAFFOLD's control variates, a personal
model) is kept in one of four places, by the transport that ran the rounds (:func:`holder`):

* :data:`CHECKPOINT`: in process (``engine: local``), the server's
  :class:`~fedlore.engine.store.ClientStore`, saved in the checkpoint;
* :data:`NODES`: a Flower deployment (``flwr run``, whose config also reads ``engine: local``):
  each node's ``Context.state``, gone with that Flower run
  (:attr:`fedlore.flower.transport.FlowerTransport.keeps_client_states` False);
* :data:`NODE_FILES`: a Flower simulation, its clients' files in ``<run folder>/clients/``
  (:mod:`fedlore.engine.node_states`);
* :data:`NODE_DISKS`: a Flower deployment with ``flower.node_states``, each node's files on its
  own disk (:mod:`fedlore.flower.node_files`), which a deployment's resume with the same
  setting reads (the only resume of a deployment that keeps the clients' states).

Every checkpoint names its holder (:data:`KEY`). A resume whose transport cannot restore the
states from where the checkpoint says they are (another holder, or a deployment's new run)
gives every client the dense model at its next contact
(:meth:`fedlore.algorithms.base.Hyper.clients_restarted`) and starts every client without its
state (:func:`restart_clients`): the run a deployment resumed over new nodes would give, with no
round lost to log replays the clients must reject. A change of holder says so in one line
(:class:`ClientsRestartedWarning`), unless the restart loses nothing (:func:`held_nothing`: a
FedAvg-like method whose clients keep no state, whose run goes on as the uninterrupted one
would). The DP ledger is not touched: the rows the resume runs
again are counted as on any resume (:mod:`fedlore.engine.dp_ledger`).

A checkpoint written before the holder was recorded names none (:func:`recorded`): one with a
Flower transport's entry was a simulation's when its ``clients/`` folder holds states, else a
deployment's; any other, an in-process run's.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedlore.engine.checkpoint_io import load_tensors
from fedlore.engine.store import ClientStore
from fedlore.types import State

KEY = "client_states"
"""The checkpoint's entry naming where the clients kept their states."""

CHECKPOINT = "checkpoint"
NODES = "nodes"
NODE_FILES = "node-files"
NODE_DISKS = "node-disks"

_WHERE = {
    CHECKPOINT: "in its checkpoint (in process)",
    NODES: "on a Flower deployment's nodes",
    NODE_FILES: "in the Flower simulation's clients/ folder",
    NODE_DISKS: "on a Flower deployment's nodes' disks (flower.node_states)",
}
_RESUME = {
    CHECKPOINT: "an in-process resume",
    NODES: "a deployment's new run",
    NODE_FILES: "a Flower simulation",
    NODE_DISKS: "a deployment with flower.node_states",
}


class ClientsRestartedWarning(UserWarning):
    """A resume whose clients start without the states the attempt it continues left elsewhere."""


def holder(clients: Any) -> str:
    """Where the transport ``clients`` keeps its clients' states: a transport without
    ``keeps_client_states`` runs them in process (:data:`CHECKPOINT`); a Flower transport on
    its nodes (:data:`NODES`), on their disks (``node_files``: :data:`NODE_DISKS`) or, when
    they keep them in the run folder, :data:`NODE_FILES`."""
    keeps = getattr(clients, "keeps_client_states", None)
    if keeps is None:
        return CHECKPOINT
    if getattr(clients, "node_files", False):
        return NODE_DISKS
    return NODE_FILES if keeps else NODES


def recorded(raw: dict[str, Any], states: Path) -> str:
    """The holder the checkpoint ``raw`` (its whole dict) names; one written before it was
    recorded: :data:`NODE_FILES` when it has a Flower transport's entry and ``states`` (the run
    folder's ``clients/``) holds files, :data:`NODES` with that entry and no files, else
    :data:`CHECKPOINT`."""
    named = raw.get(KEY)
    if isinstance(named, str) and named in _WHERE:
        return named
    if "transport" not in raw:
        return CHECKPOINT
    has_files = states.is_dir() and any(p.is_file() for p in states.rglob("*"))
    return NODE_FILES if has_files else NODES


def recorded_in(path: Path, states: Path) -> str:
    """:func:`recorded` of the checkpoint file ``path`` (read on the CPU)."""
    return recorded(load_tensors(path, torch.device("cpu")), states)


def restarts(before: str, now: str) -> bool:
    """Whether a resume over ``now``'s transport from a checkpoint whose clients were kept by
    ``before`` must restart its clients: a deployment's new run never has them (unless its
    nodes keep them on their disks, :data:`NODE_DISKS`); any other holder has them only where
    the attempt left them."""
    return now == NODES or before != now


def with_holder(
    clients: Any, keep: Callable[[], dict[str, Any]] | None
) -> Callable[[], dict[str, Any]]:
    """``keep`` (the checkpoint's extra entries) with :data:`KEY` naming ``clients``' holder."""
    entry = {KEY: holder(clients)}
    return lambda: {**(keep() if keep is not None else {}), **entry}


def held_nothing(rows: Path, state: State, restarted: State) -> bool:
    """Whether restarting the clients loses nothing: every row of ``rows`` (the run's
    ``metrics.jsonl`` up to its checkpoint) reports that no client kept a state
    (``client_state_bytes`` 0, which the round loop records as the largest over the round's
    clients) and the server's ``state`` records nothing about what they hold (``restarted``,
    its restarted form, equals it). A row without the count (under secure aggregation or DP,
    which send it not; a torn line) or no row at all: not known, so False."""
    try:
        lines = rows.read_text().splitlines()
        counts = [json.loads(line).get("client_state_bytes") for line in lines if line.strip()]
    except (OSError, ValueError):
        return False
    if not counts or any(c != 0 for c in counts):
        return False
    if state.values != restarted.values or state.arrays.keys() != restarted.arrays.keys():
        return False
    return all(torch.equal(v, restarted.arrays[k]) for k, v in state.arrays.items())


def restart_clients(
    restarted: Callable[[State], State],
    state: State,
    store: ClientStore,
    before: str,
    now: str,
    rows: Path,
) -> State:
    """The server ``state`` with every client restarted (``restarted``: the method's
    ``clients_restarted``) and ``store`` emptied (states a checkpoint holds of an earlier
    in-process attempt are not the clients' as of this checkpoint when another holder came
    between), warning in one line when the holder changed and the restart loses something
    (:func:`held_nothing` of ``rows``, the run's ``metrics.jsonl``)."""
    for cid in store.client_ids():
        store.put(cid, None)
    new = restarted(state)
    if before != now and not held_nothing(rows, state, new):
        warnings.warn(
            f"--resume: the attempt this run continues kept its clients' states "
            f"{_WHERE[before]}, where {_RESUME[now]} cannot restore them from: every client "
            "restarts, without its state, from the dense model at its next round (the run "
            "differs from an uninterrupted one from here on)",
            ClientsRestartedWarning,
            stacklevel=2,
        )
    return new
