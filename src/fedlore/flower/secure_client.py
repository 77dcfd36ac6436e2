"""Secure aggregation on Flower, client side: the mod that routes SecAgg+ stage messages, the
contribution record flwr's ``secaggplus_mod`` masks, and the fault hook the deployment tests use
(the server side, and the protocol's description, are :mod:`fedlore.flower.secure`).
"""

from __future__ import annotations

import logging
import math
import os
import signal
from typing import cast

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
)
from flwr.compat.common import recorddict_compat as compat

from fedlore.flower.secure import DROP_ROUND_KEY
from fedlore.types import Scalars

log = logging.getLogger(__name__)


def secagg_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod of fedlore's ClientApp ``train`` handler: a message of a SecAgg+ stage (one
    holding flwr's ``"secaggplus"`` config record) goes through flwr's ``secaggplus_mod``, and
    the clear ``num_examples`` of its collect-stage reply is set to 0 (the weight travels only
    inside the masked sum); any other message goes straight to the app."""
    from flwr.client.mod import secaggplus_mod

    if RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, ctxt)
    out = secaggplus_mod(msg, ctxt, call_next)
    if not out.has_error() and "fitres.num_examples" in out.content.metric_records:
        out.content.metric_records["fitres.num_examples"] = MetricRecord({"num_examples": 0})
    return out


def is_secagg_stage(msg: Message) -> bool:
    """Whether ``msg`` is SecAgg+'s collect-masked-vectors stage (the only stage that
    ``secaggplus_mod`` passes on to the app)."""
    return RECORD_KEY_CONFIGS in msg.content.config_records


def contribution_record(
    vector: torch.Tensor, weight: float, metrics: Scalars, context: Context
) -> RecordDict:
    """A client's contribution as the legacy ``FitRes`` record ``secaggplus_mod`` masks: the
    vector v_i as its one float64 array and ``num_examples`` = p_i.

    Raises:
        ValueError: when ``vector`` is not 1-D and finite, ``weight`` is not a positive finite
            number, or ``weight`` exceeds the protocol's ``max_weight`` (from the mod's state of
            the setup stage): ``flower.secagg_max_weight`` must bound every client's weight.
    """
    if vector.dim() != 1:
        raise ValueError(f"a contribution vector must be 1-D, got shape {tuple(vector.shape)}")
    arr = vector.detach().to("cpu", torch.float64).numpy()
    if not np.isfinite(arr).all():
        raise ValueError("the contribution vector has NaN or Inf entries")
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"a contribution weight must be positive and finite, got {weight}")
    sa = context.state.config_records.get(RECORD_KEY_STATE)
    if sa is not None:
        max_weight = float(cast(float, sa.get("max_weight", 0.0)))
        if max_weight > 0 and weight > max_weight:
            raise ValueError(
                f"weight {weight} exceeds flower.secagg_max_weight={max_weight}: set it to at "
                "least the largest client's weight"
            )
        clip = float(cast(float, sa.get("clipping_range", 0.0)))
        if max_weight > 0 and clip > 0:
            over = int((np.abs(arr) * (weight / max_weight) > clip).sum())
            if over:
                log.warning(
                    "%d of %d entries of the weighted upload exceed flower."
                    "secagg_clipping_range=%g and are clipped", over, arr.size, clip
                )  # fmt: skip
    res = FitRes(
        status=Status(Code.OK, ""),
        parameters=ndarrays_to_parameters([arr]),
        num_examples=cast(int, float(weight)),  # flwr's mod divides it by max_weight: a float
        metrics=dict(metrics),
    )
    return compat.fitres_to_recorddict(res, keep_input=False)


def drop_out_now(context: Context, rnd: int) -> None:
    """Fault injection (node config ``fault-drop-round=<round>``): when ``rnd`` is that round,
    SIGKILL this node's SuperNode (the nearest ancestor process named ``flower-supernode``)
    and exit this ClientApp process at once, as a node that dies after sharing its keys. Does
    nothing on other rounds or without the key."""
    want = context.node_config.get(DROP_ROUND_KEY)
    if want is None or int(want) != rnd:
        return
    try:
        import psutil  # a dependency of flwr[simulation] (ray)

        for p in psutil.Process().parents():
            if any("flower-supernode" in part for part in p.cmdline()):
                p.send_signal(signal.SIGKILL)
                break
    except Exception as e:  # exiting anyway
        log.warning("fault-drop-round: could not kill the SuperNode: %s", e)
    os._exit(3)
