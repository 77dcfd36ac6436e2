"""The simulated ClientApp called in this process (no Ray): the same model as the in-process
transport, torch threads set to ``flower.client_cpus``; the
transport's polling and its client -> node map without a running Flower."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
import torch
from app_helpers import node_contexts, train_message
from flwr.app import Context, Message, RecordDict

from fedlore.config import load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.app import client_query, client_threads, make_apps
from fedlore.flower.codec import record_to_reply
from fedlore.flower.transport import FlowerTransport, send_and_receive
from fedlore.types import Broadcast, Reply

pytestmark = pytest.mark.flower

SMALL = ["num_clients=2", "local_steps=2", "batch_size=16", "rounds=2", "progress=false"]


class ClientAppInProcess:
    """A transport calling the ClientApp of :func:`make_apps` here, each client with its own
    ``Context`` (as Flower keeps one per virtual SuperNode); notes torch's threads after each."""

    def __init__(self, client: Any, num_clients: int) -> None:
        self.client = client
        self.threads: list[int] = []
        self.ctx = node_contexts(num_clients)

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        for cid, b in messages.items():
            reply = self.client(train_message(rnd, cid, b), self.ctx[cid])
            self.threads.append(torch.get_num_threads())
            out[cid] = record_to_reply(reply.content)
        return out


def test_client_app_matches_in_process_and_uses_client_cpus_threads(tmp_path: Path) -> None:
    before = torch.get_num_threads()
    local = load_config(None, [*SMALL, f"output_dir={tmp_path / 'l'}"])
    app = load_config(None, [*SMALL, "flower.client_cpus=3", f"output_dir={tmp_path / 'a'}"])
    run_one(local, "fedlore", 42)
    _, client = make_apps(app, "fedlore", 42)
    box: dict[str, ClientAppInProcess] = {}

    def transport(*_: Any) -> ClientAppInProcess:
        box["t"] = ClientAppInProcess(client, app.num_clients)
        return box["t"]

    try:
        run_one(app, "fedlore", 42, make_transport=transport)
    finally:
        torch.set_num_threads(before)
    assert box["t"].threads and set(box["t"].threads) == {3}
    _, s_local, _ = Checkpointer.load(run_dir(local, "fedlore", 42) / "checkpoint.pt")
    _, s_app, _ = Checkpointer.load(run_dir(app, "fedlore", 42) / "checkpoint.pt")
    keys = [k for k in s_local.arrays if k.startswith("model.")]
    assert keys
    for k in keys:
        torch.testing.assert_close(s_app.arrays[k], s_local.arrays[k], rtol=1e-5, atol=1e-6)


def test_bfloat16_messages_travel_through_the_client_app_as_their_bit_pattern(
    tmp_path: Path,
) -> None:
    """On Flower a ``transport_dtype=bf16`` run is not refused: its bfloat16 tensors travel as
    their 16-bit pattern (an ``int16`` payload marked ``bfloat16``) both ways, and the run
    is the in-process one, byte for byte."""
    over = [*SMALL, "transport_dtype=bf16"]
    local = load_config(None, [*over, f"output_dir={tmp_path / 'l'}"])
    app = load_config(None, [*over, f"output_dir={tmp_path / 'a'}"])
    s_local = run_one(local, "fedfull", 42)
    _, client = make_apps(app, "fedfull", 42)
    dtypes: set[str] = set()

    def spy(msg: Message, ctx: Context) -> Message:
        dtypes.update(a.dtype for a in msg.content.array_records["arrays"].values())
        reply = client(msg, ctx)
        dtypes.update(a.dtype for a in reply.content.array_records["arrays"].values())
        return reply

    s_app = run_one(
        app, "fedfull", 42, make_transport=lambda *_: ClientAppInProcess(spy, app.num_clients)
    )
    assert s_local is not None and s_app is not None
    assert "bfloat16" in dtypes
    assert s_app["bytes_up_total"] == s_local["bytes_up_total"]
    assert s_app["final_accuracy"] == pytest.approx(s_local["final_accuracy"], abs=1e-6)


def test_client_threads() -> None:
    cfg = load_config(None, ["flower.client_cpus=0.5"])
    assert client_threads(cfg, simulated=True) == 1
    assert client_threads(load_config(None, ["flower.client_cpus=2.5"]), simulated=True) == 2


class _Grid:
    """A grid whose replies come in after a number of pulls; one message cannot be pushed."""

    def __init__(self, pulls_until_reply: int) -> None:
        self.left = pulls_until_reply
        self.pulls = 0

    def push_messages(self, messages: Any) -> list[str | None]:
        return ["m1", "m2", None]

    def pull_messages(self, ids: Any) -> list[Any]:
        self.pulls += 1
        self.left -= 1
        if self.left > 0:
            return []
        meta = type("M", (), {"reply_to_message_id": None})

        def reply(i: str) -> Any:
            m = type("R", (), {})()
            m.metadata = meta()
            m.metadata.reply_to_message_id = i
            return m

        return [reply(i) for i in sorted(ids)]


def test_send_and_receive_polls_until_every_pushed_message_is_answered() -> None:
    grid = _Grid(pulls_until_reply=4)
    got = send_and_receive(grid, [], timeout=None)  # type: ignore[arg-type]
    assert sorted(r.metadata.reply_to_message_id for r in got) == ["m1", "m2"]
    assert grid.pulls == 4  # stops at the pull that brought the last reply
    never = _Grid(pulls_until_reply=10**9)
    assert send_and_receive(never, [], timeout=0.05) == []  # type: ignore[arg-type]
    assert never.pulls >= 2


class _Nodes:
    """SuperNodes (node id -> partition id) that answer a ``query`` at once with fedlore's
    handler (:func:`client_query`), except the ``dead`` ones, which never answer."""

    def __init__(self, pids: dict[int, int]) -> None:
        self.pids = dict(pids)
        self.dead: set[int] = set()
        self.asked: list[int] = []
        self.replies: dict[str, Message] = {}

    def get_node_ids(self) -> list[int]:
        return list(self.pids)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = mid = str(uuid.uuid4())
            node = msg.metadata.dst_node_id
            self.asked.append(node)
            if node not in self.dead:
                ctx = Context(
                    run_id=1, node_id=node, node_config={"partition-id": self.pids[node]},
                    state=RecordDict(), run_config={},
                )  # fmt: skip
                self.replies[mid] = client_query(msg, ctx)
            ids.append(mid)
        return ids

    def pull_messages(self, ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]


def test_a_round_waits_for_the_nodes_of_its_clients_not_for_a_dead_one(
    task_identity: None,
) -> None:
    """Client 1's SuperNode died (the SuperLink still lists it) and came back under a new node
    id: the round that needs client 1 asks both unknown nodes and goes on as soon as the new
    one has answered, not after ``round_timeout``; a refresh without a need waits for all."""
    grid = _Nodes({11: 0})
    t = FlowerTransport(grid, round_timeout=30.0, expected_nodes=1)  # type: ignore[arg-type]
    assert t.node_of == {0: 11} and grid.asked == [11]
    grid.pids.update({12: 1, 13: 1})
    grid.dead.add(12)
    start = time.monotonic()
    t.refresh_nodes(need=[0, 1])
    assert time.monotonic() - start < 10.0
    assert t.node_of == {0: 11, 1: 13} and sorted(grid.asked[1:]) == [12, 13]
    t.round_timeout = 0.3
    del t.node_of[1]
    start = time.monotonic()
    t.refresh_nodes()
    assert time.monotonic() - start >= 0.3 and t.node_of == {0: 11, 1: 13}


@pytest.mark.parametrize("dp", ["none", "secret", "reproducible"])
def test_under_dp_the_flower_transport_names_no_client_of_the_sample(
    dp: str, task_identity: None, caplog: pytest.LogCaptureFixture
) -> None:
    """Client 1's SuperNode is dead and no node holds client 2: the round's warnings and the
    failure it returns name them, except under DP with secret noise (the sample is secret:
    ε's amplification assumes it), where they count them."""
    grid = _Nodes({11: 0, 12: 1})
    t = FlowerTransport(grid, round_timeout=0.2, expected_nodes=2)  # type: ignore[arg-type]
    grid.dead.add(12)
    privacy = {
        "none": {},
        "secret": {"privacy.clip_norm": 1.0},
        "reproducible": {"privacy.clip_norm": 1.0, "privacy.reproducible": True},
    }[dp]
    msg = Broadcast({"w": torch.zeros(2)}, {"round": 1, **privacy})
    with caplog.at_level(logging.WARNING, logger="fedlore.flower.transport"):
        out = t.send(1, {1: msg, 2: msg})
    said = [r.getMessage() for r in caplog.records] + [str(e) for e in out.values()]
    assert any("no reply in time" in s for s in said) and isinstance(out[2], LookupError)
    named = [s for s in said if re.search(r"clients? \[?\d", s)]
    if dp == "secret":
        assert not named, named
        assert "no reply in time from 1 client(s)" in said[0]
        assert str(out[2]) == "no connected SuperNode holds a client"
    else:
        assert len(named) == 2, said  # client 1's lost reply, client 2's missing node


def test_under_dp_a_clients_error_reply_and_a_secure_rounds_dropouts_name_no_client(
    task_identity: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error reply's failure says "a client" under DP with secret noise (``client 3``
    otherwise), and the SecAgg+ round is told not to name the nodes that drop out."""
    from flwr.app import Error

    import fedlore.flower.transport as transport

    t = FlowerTransport(_Nodes({11: 0}), round_timeout=0.2)  # type: ignore[arg-type]
    err = Message(Error(code=0, reason="boom"), reply_to=train_message(1, 3, _BCAST))
    assert str(t.decode(3, err, {"privacy.clip_norm": 1.0})) == "a client: boom"
    assert str(t.decode(3, err, {})) == "client 3: boom"
    told: list[bool] = []

    def secure_round(*args: Any) -> BaseException:
        told.append(args[-1])
        return RuntimeError("stopped here")

    monkeypatch.setattr(transport, "secure_round", secure_round)
    spec: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"w": ((2,), torch.float32)}
    for config in ({"privacy.clip_norm": 1.0}, {}):
        msg = Broadcast({"w": torch.zeros(2)}, {"round": 1, **config})
        assert isinstance(t.send_secure(1, {0: msg}, spec), RuntimeError)
    assert told == [False, True]


_BCAST = Broadcast({"w": torch.zeros(2)}, {"round": 1})


class _Measuring(ClientAppInProcess):
    """A transport with measurements of its own, as the Flower transport has its wire bytes."""

    def summary_fields(self) -> dict[str, Any]:
        return {"wire_bytes_up_total": 123, "client_num_examples": {"0": 7}}


def test_a_transports_measurements_are_in_the_summary_as_first_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run's one write of summary.json carries what the transport measured, and so does
    what its trackers receive (no second write after the run, which a reader or a tracker
    could miss)."""
    import fedlore.experiment as experiment

    app = load_config(None, [*SMALL, f"output_dir={tmp_path}"])
    _, client = make_apps(app, "fedfull", 42)
    writes: list[dict[str, Any]] = []
    real = experiment.write_json

    def spy(path: Path, obj: Any) -> None:
        if Path(path).name == "summary.json":
            writes.append(dict(obj))
        real(path, obj)

    monkeypatch.setattr(experiment, "write_json", spy)
    s = run_one(app, "fedfull", 42, make_transport=lambda *_: _Measuring(client, app.num_clients))
    assert s is not None and s["wire_bytes_up_total"] == 123
    assert len(writes) == 1 and writes[0]["client_num_examples"] == {"0": 7}
    on_disk = json.loads((run_dir(app, "fedfull", 42) / "summary.json").read_text())
    assert on_disk["wire_bytes_up_total"] == 123


@pytest.mark.parametrize(
    ("run_config", "says"),
    [
        ({"method": "fedlorex"}, r"run config method='fedlorex': unknown algorithm 'fedlorex' "
                                 r"\(did you mean 'fedlore'\?\)"),
        ({"method": "fedlore", "seed": "abc"}, r"run config seed='abc': a seed is an integer"),
        ({"method": "fedlore", "seed": 4.5}, r"run config seed=4.5: a seed is an integer"),
    ],
)  # fmt: skip
def test_a_wrong_run_config_is_a_value_error_the_server_app_reports_in_one_line(
    run_config: dict[str, Any], says: str
) -> None:
    """`flwr run --run-config` with a method typo or a seed that is no integer: a ValueError,
    which the deployed ServerApp logs as one `fedlore: error:` line (not a traceback)."""
    from fedlore.flower.app import _from_run_config

    config = str(Path(__file__).resolve().parents[2] / "experiments" / "quickstart.yaml")
    ctx = Context(
        run_id=1, node_id=0, node_config={}, state=RecordDict(),
        run_config={"config": config, **run_config},
    )  # fmt: skip
    with pytest.raises(ValueError, match=says):
        _from_run_config(ctx)
    ctx.run_config.update(method="fedfull", seed=43)
    assert _from_run_config(ctx)[1:] == ("fedfull", 43)
