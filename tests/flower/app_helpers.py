"""What the tests calling a ClientApp in this process share (no Ray, no SuperLink): the
``Context`` a SuperNode keeps for its client and the train ``Message`` a ServerApp would send
(imported by ``test_app.py``, ``test_client_states.py``, ``test_node_files.py`` and
``test_resume_across_engines.py``; not a test module)."""

from __future__ import annotations

import time
from typing import Any

from flwr.app import Context, Message, Metadata, RecordDict
from flwr.app.message import make_message

from fedlore.flower.codec import broadcast_to_record
from fedlore.types import Broadcast


def node_context(cid: int, **node_config: Any) -> Context:
    """The ``Context`` of client ``cid``'s node: empty state, ``partition-id`` = ``cid`` plus
    ``node_config`` (e.g. a ``state-dir``)."""
    conf = {"partition-id": cid, **node_config}
    return Context(run_id=1, node_id=cid + 1, node_config=conf, state=RecordDict(), run_config={})


def node_contexts(num_clients: int) -> dict[int, Context]:
    """One new ``Context`` per client: a new run's nodes, holding nothing."""
    return {c: node_context(c) for c in range(num_clients)}


def train_message(rnd: int, cid: int, broadcast: Broadcast) -> Message:
    """The train ``Message`` of round ``rnd`` to client ``cid``, carrying ``broadcast``."""
    meta = Metadata(
        run_id=1, message_id=f"{rnd}.{cid}", src_node_id=0, dst_node_id=cid + 1,
        reply_to_message_id="", group_id=str(rnd), created_at=time.time(), ttl=3600.0,
        message_type="train",
    )  # fmt: skip
    return make_message(meta, broadcast_to_record(broadcast))
