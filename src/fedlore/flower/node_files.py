"""Client states a deployment's SuperNodes keep on their own disks (``flower.node_states``), so
that a ``flwr run`` killed mid-run and resumed with ``resume=true`` continues as the
uninterrupted run would, clients' states included (FedLore's model cache for log replays,
SCAFFOLD's control variates, Ditto's personal model).

A Flower simulation's clients write their states to the run folder, which its server prunes
before a resume (:mod:`fedlore.engine.node_states`). A deployment's server cannot reach the
nodes' disks, and a node not contacted since a resume cannot tell, by the round alone, a
discarded round's state (written after the checkpoint the run resumed from) from a kept one.
So every attempt of a run (its first start, each ``resume=true``) has its own random token
(:class:`Attempts`), and the server's checkpoint keeps the run's history: each earlier attempt's
token with the last round whose broadcast it sent before the checkpoint (its files of later
rounds belong to rounds the kill discarded). Every broadcast carries that history with the
current attempt's token last (:data:`HISTORY`, a string; not counted in ``bytes_down``).

On the node (:func:`load_state`, :func:`keep_state`), client ``c``'s states lie in
``<state-dir>/<run>/<c>/state.<round>.<token>.pt`` (``state-dir`` its node config,
:data:`NODE_KEY`; ``<run>`` the first attempt's token, so runs sharing a node keep apart). A
file is valid when its token is in the history and it is the current attempt's or its round
is at most that attempt's last kept round (:func:`valid`). A client reads its ``Context.state``
when it holds this attempt's state, else its newest valid file; after training on round t's
broadcast it writes ``state.<t>.<token>.pt`` and deletes every file but that one, the newest
valid one of an earlier round (the state as of the checkpoint of round t - 1, which a kill
during round t resumes from) and the newest one of the earlier attempts (the state as of the
checkpoint this attempt resumed from, which a kill before this attempt's first checkpoint
resumes from again), invalid ones included: at most three files per client. An attempt
killed before its first checkpoint leaves no entry in any checkpoint, so its files are never
valid again.

A file that cannot be read or is not where it lies (another client, round, attempt, method or
seed) is refused in one line naming it (:class:`~fedlore.engine.node_states.NodeStateError`),
and so is a client that the server knows kept a state (:data:`HELD`: it replied in a kept
round) but whose node holds no valid file (a wiped disk): training it without its state would
change the result without a word.
"""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context

from fedlore.atomic import TMP_SUFFIX, save_tensors
from fedlore.engine import node_states
from fedlore.engine.checkpoint_io import damage_reason, load_tensors
from fedlore.engine.node_states import NodeStateError
from fedlore.flower.codec import record_to_state, state_to_record
from fedlore.types import Scalar, State

HISTORY = "fedlore.attempts"
"""Broadcast config key: the run's attempts, ``[[token, last kept round], ..., [token, null]]``
as JSON, the current attempt last (:class:`Attempts`)."""
HELD = "fedlore.state_held"
"""Broadcast config key: True when the server knows the client kept a state in a kept round
(its reply arrived), so that a node without it refuses instead of training from nothing."""
NODE_KEY = "state-dir"
"""The node config key naming the folder, on the node's own disk, where it keeps its states."""
TOKEN = "fedlore.attempt"
"""``Context.state`` record naming the attempt whose state it holds."""
SECAGG_STATE = "secaggplus"
"""The ``Context.state`` record of flwr's ``secaggplus_mod`` (its protocol state), kept."""
FORMAT = 1
"""The version of a node state file's layout (``format`` in the file)."""

_NAME = re.compile(r"^state\.(-?\d+)\.([0-9a-f]+)\.pt$")

History = list[tuple[str, int | None]]


class Attempts:
    """The server's side: this attempt's token, the earlier attempts (from the checkpoint) and
    the clients known to keep a state; what the broadcasts carry and the checkpoint keeps."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self.earlier: list[tuple[str, int]] = []
        self.sent: int | None = None  # the newest broadcast round this attempt sent
        self.held: set[int] = set()

    def history(self) -> History:
        """The earlier attempts and this one (its end: the newest round it sent, or None)."""
        return [*self.earlier, (self.token, self.sent)]

    def config(self, cid: int, msg_config: dict[str, Any]) -> dict[str, Scalar]:
        """The entries added to client ``cid``'s broadcast (``msg_config``: its own config,
        whose ``round`` this attempt has now sent)."""
        rnd = int(msg_config["round"])
        self.sent = rnd if self.sent is None else max(self.sent, rnd)
        current = [*([t, e] for t, e in self.earlier), [self.token, None]]
        return {HISTORY: json.dumps(current), HELD: cid in self.held}

    def entry(self) -> dict[str, Any]:
        """The checkpoint's part: the attempts with the newest round each sent before it (this
        one left out when it sent nothing yet) and the clients known to keep a state."""
        ended = [(t, e) for t, e in self.history() if e is not None]
        return {"attempts": [[t, e] for t, e in ended], "held": sorted(self.held)}

    def restore(self, raw: dict[str, Any] | None) -> None:
        """Go on from a checkpoint's :meth:`entry` (None: the clients restart, nothing kept)."""
        if raw is None:
            self.earlier, self.held = [], set()
            return
        self.earlier = [(str(t), int(e)) for t, e in raw["attempts"]]
        self.held = {int(c) for c in raw["held"]}


def parse(text: str) -> History:
    """The history a broadcast carries (:data:`HISTORY`)."""
    return [(str(t), None if e is None else int(e)) for t, e in json.loads(text)]


def valid(token: str, rnd: int, history: History) -> bool:
    """Whether a file of attempt ``token`` and round ``rnd`` holds a state of the run that
    ``history`` continues: the current attempt's (its end None, as a broadcast carries it), or
    an earlier one's up to its last kept round."""
    ends = dict(history)
    if token not in ends:
        return False
    end = ends[token]
    return end is None or rnd <= end


def folder(context: Context, history: History, cid: int) -> Path:
    """Client ``cid``'s folder on this node (``<state-dir>/<run>/<cid>``).

    Raises:
        ValueError: one line, when the node was started without :data:`NODE_KEY`.
    """
    root = context.node_config.get(NODE_KEY)
    if not root:
        raise ValueError(
            f"flower.node_states=true, but SuperNode {cid} has no {NODE_KEY}: start it with "
            f"--node-config 'partition-id={cid} {NODE_KEY}=\"<a folder on its own disk>\"'"
        )
    return Path(str(root)) / history[0][0] / str(cid)


def _files(where: Path) -> dict[tuple[int, str], Path]:
    """(round, token) -> file of one client's folder."""
    out: dict[tuple[int, str], Path] = {}
    if where.is_dir():
        for path in where.iterdir():
            m = _NAME.match(path.name)
            if m:
                out[(int(m.group(1)), m.group(2))] = path
    return out


def _newest(files: dict[tuple[int, str], Path], history: History) -> tuple[int, str] | None:
    """The newest valid (round, token) of ``files``: the highest round (two valid files never
    share one: an attempt resumed from the checkpoint of round c sends rounds after c, and an
    earlier attempt's files are valid up to at most c)."""
    ok = [k for k in files if valid(k[1], k[0], history)]
    return max(ok) if ok else None


def _read(path: Path, cid: int, rnd: int, token: str, method: str, seed: int) -> State:
    """The state in ``path``, checked to be client ``cid``'s of this round, attempt, method
    and seed.

    Raises:
        NodeStateError: one line naming the file and what is wrong.
    """
    try:
        raw = load_tensors(path, "cpu")
        keys = ("format", "client", "round", "token", "method", "seed")
        head = tuple(raw[k] for k in keys)
        state = State(dict(raw["arrays"]), dict(raw["values"]))
    except Exception as e:  # torn, truncated, foreign
        raise NodeStateError(
            f"client {cid}: its state {path} is damaged and cannot be read "
            f"({damage_reason(e, path)}); restore it, or resume with flower.node_states=false "
            "(every client restarts), or start the run over"
        ) from None
    if head != (FORMAT, cid, rnd, token, method, seed):
        raise NodeStateError(
            f"client {cid}: the state {path} is not this run's (it holds format {head[0]}, "
            f"client {head[1]}, round {head[2]}, attempt {head[3]}, {head[4]} seed {head[5]}); "
            "restore this node's own files, or start the run over"
        )
    return state


def load_state(
    context: Context,
    config: dict[str, Any],
    cid: int,
    method: str,
    seed: int,
    state_dir: Path | None,
) -> State | None:
    """Client ``cid``'s state before training on a broadcast of ``config``: ``Context.state``'s;
    with :data:`HISTORY`, only when it holds this attempt's, else the newest valid file on the
    node's disk; without, a simulated client's newest file in ``state_dir`` when the context
    holds none (:func:`fedlore.engine.node_states.load`).

    Raises:
        NodeStateError: a damaged or foreign file, or no file of a client the server knows
            kept a state (:data:`HELD`).
        ValueError: no :data:`NODE_KEY` in the node config.
    """
    if HISTORY not in config:
        state = record_to_state(context.state)
        if state is None and state_dir is not None:  # a new simulation: as of the resume
            state = node_states.load(state_dir, cid, method, seed)
        return state
    history = parse(str(config[HISTORY]))
    mine = context.state.config_records.get(TOKEN)
    if mine is not None and mine.get("token") == history[-1][0]:
        return record_to_state(context.state)
    where = folder(context, history, cid)
    files = _files(where)
    newest = _newest(files, history)
    if newest is None:
        if config.get(HELD):
            raise NodeStateError(
                f"client {cid}: the server's checkpoint says it kept a state, but {where} "
                f"holds none of this run's ({NODE_KEY} wiped or another folder?); restore it, "
                "or resume with flower.node_states=false (every client restarts)"
            )
        return None
    return _read(files[newest], cid, newest[0], newest[1], method, seed)


def keep_state(
    context: Context,
    config: dict[str, Any],
    cid: int,
    state: State,
    method: str,
    seed: int,
    state_dir: Path | None,
) -> None:
    """Keep client ``cid``'s new ``state`` after training on a broadcast of ``config``: in
    ``Context.state`` (SecAgg+'s record kept), in ``state_dir`` (a simulation's,
    :func:`fedlore.engine.node_states.save`) and, with :data:`HISTORY`, on the node's disk
    (module docstring), versioned by the broadcast's ``round``."""
    for key in list(context.state.keys()):
        if key != SECAGG_STATE:
            del context.state[key]
    for key, rec in state_to_record(state).items():
        context.state[key] = rec
    rnd = int(config["round"])  # not FedBuff's repeat key
    if state_dir is not None:
        node_states.save(state_dir, cid, rnd, state, method, seed)
    if HISTORY not in config:
        return
    history = parse(str(config[HISTORY]))
    token = history[-1][0]
    context.state[TOKEN] = ConfigRecord({"token": token})
    where = folder(context, history, cid)
    where.mkdir(parents=True, exist_ok=True)
    payload = node_states.payload(FORMAT, cid, rnd, state, method, seed, token=token)
    save_tensors(payload, where / f"state.{rnd}.{token}.pt")
    for tmp in where.glob(f"*{TMP_SUFFIX}"):  # a killed write's
        tmp.unlink(missing_ok=True)
    files = _files(where)
    # the state as of the checkpoint of round rnd - 1 (a kill during this round resumes from
    # it) and the state as of the checkpoint this attempt resumed from (it may die before a
    # checkpoint of its own is kept: then its files are never valid again)
    before = _newest({k: p for k, p in files.items() if k[0] < rnd}, history)
    resumed = _newest(files, history[:-1])
    for at, path in files.items():
        if at not in ((rnd, token), before, resumed):
            path.unlink(missing_ok=True)


__all__ = [
    "HELD",
    "HISTORY",
    "NODE_KEY",
    "Attempts",
    "keep_state",
    "load_state",
    "parse",
    "valid",
]
