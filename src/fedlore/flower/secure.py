"""Secure aggregation on Flower: one fedlore round through flwr's own SecAgg+ protocol.

Server side, :func:`secure_round` drives flwr's ``SecAggPlusWorkflow`` (Bell et al., "Secure
Single-Server Aggregation with (Poly)Logarithmic Overhead", CCS 2020) stage by stage: *setup*
(the protocol's parameters out, two public keys per client back), *share keys* (public keys to
the neighbours, encrypted Shamir shares of each client's mask seed and secret key back),
*collect masked vectors* (the shares forwarded, with the client's fedlore broadcast; the
quantized, weighted and masked upload vector back) and *unmask* (the live clients' shares of
the survivors' seeds and of the dropped clients' keys, from which the server removes the
masks). The workflow is written for flwr's legacy Strategy API; :class:`_RoundStrategy` is the
smallest adapter it needs (its ``configure_fit`` names the round's nodes, its ``aggregate_fit``
captures the unmasked result) and :class:`_Workflow` puts fedlore's own broadcast record in
place of the legacy ``FitIns``. Only the sum of the contributing clients' vectors is ever
unmasked.

Client side, :func:`secagg_mod` (a Flower mod on fedlore's ClientApp ``train`` handler) hands
SecAgg+ stage messages to flwr's ``secaggplus_mod`` and every other message straight to the
app: flwr's mod alone would fail on a message without its ``"secaggplus"`` record. Its
collect-masked-vectors stage calls the app, whose reply (:func:`contribution_record`) is a
legacy ``FitRes`` holding the contribution vector v_i as its one array and the weight p_i as
``num_examples``; flwr's mod multiplies v_i by p_i / max_weight, quantizes and masks it, and
:func:`secagg_mod` then blanks the clear ``num_examples`` of the reply, so p_i travels only
inside the masked sum.

What the workflow returns (verified in flwr 1.42's source): client i uploads
``[q_i, Q_i]`` with q_i = round(p_i / max_weight * T) and Q_i the stochastic rounding of
``(clip(q_i / T * v_i, -c, c) + c) * T / (2c)``; the unmasked sums give
``(sum Q_i * 2c / T - n c) * T / sum q_i = sum (q_i/T) v_i / sum (q_i/T)``, the weighted mean
sum p_i v_i / sum p_i up to the quantization of the weights (to max_weight / T) and of the
entries (steps of 2c / T): :class:`SecureSum`'s ``mean`` without further conversion.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Parameters,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
)
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager, SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.strategy import Strategy
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import (
    SecAggPlusWorkflow,
    WorkflowState,
)
from flwr.serverapp import Grid

from fedlore.privacy.crypto import prg
from fedlore.types import Scalars

log = logging.getLogger(__name__)


def wide_mask_prg(
    seed: bytes, num_range: int, dimensions_list: list[tuple[int, ...]]
) -> list[np.ndarray]:
    """SecAgg+'s mask expansion keyed by the whole seed: int64 arrays of the given shapes with
    entries uniform in ``[0, num_range)`` (a power of two: the ring's modulus), from the
    AES-256-CTR keystream of HKDF-SHA256(seed) (:func:`fedlore.privacy.crypto.prg`).

    flwr 1.42's own ``pseudo_rand_gen`` folds the 32-byte seed into 32 bits (XOR of its 4-byte
    words) and seeds numpy's Mersenne Twister with them: 2^32 candidates, so a server could
    search for a client's self-mask seed (against a vector whose pair masks it removed) or
    for a pair mask. :func:`use_wide_mask_prg` puts this function in its place on both sides.
    """
    sizes = [math.prod(d) for d in dimensions_list]
    words = prg(bytes(seed), sum(sizes))
    if num_range & (num_range - 1) == 0:
        words &= np.uint64(num_range - 1)
    else:
        words %= np.uint64(num_range)
    out, at = [], 0
    for dims, n in zip(dimensions_list, sizes, strict=True):
        out.append(words[at : at + n].astype(np.int64).reshape(dims))
        at += n
    return out


def use_wide_mask_prg() -> None:
    """Make flwr's SecAgg+ workflow (server) and ``secaggplus_mod`` (client) expand masks with
    :func:`wide_mask_prg`. Both of fedlore's apps import this module, so the server and every
    client agree; called once at import."""
    import importlib

    for module in (
        "flwr.client.mod.secure_aggregation.secaggplus_mod",
        "flwr.server.workflow.secure_aggregation.secaggplus_workflow",
    ):
        side = importlib.import_module(module)
        if not hasattr(side, "pseudo_rand_gen"):
            raise RuntimeError(f"{module} has no pseudo_rand_gen: this flwr is not 1.42's")
        setattr(side, "pseudo_rand_gen", wide_mask_prg)  # noqa: B010 (a module attribute)


use_wide_mask_prg()

SECURE_KEY = "privacy.secure"
"""Broadcast config key that is true when the round's uploads go through secure aggregation."""
DROP_ROUND_KEY = "fault-drop-round"
"""Node-config key (fault injection for tests and demos): in the collect-masked-vectors stage
of this round the node's ClientApp kills its SuperNode and exits (:func:`drop_out_now`)."""


@dataclass(frozen=True)
class SecAggSettings:
    """flwr ``SecAggPlusWorkflow`` parameters (see :class:`fedlore.config.FlowerConfig`'s
    ``secagg_*`` settings for what each guarantees).

    Attributes:
        num_shares: neighbourhood size k (int > 2) or a fraction of the sampled clients.
        reconstruction_threshold: shares t that rebuild a secret (int) or a fraction of k.
        clipping_range: c, entries of (p_i / max_weight) v_i are clipped to [-c, c].
        quantization_range: T, entries are rounded to integers in [0, T].
        modulus_range: M, a power of two above T; sums and masks are taken mod M.
        max_weight: the largest weight p_i a client may carry.
        timeout: seconds each of the four stages waits for replies (None: for all).
        follow_privacy: set ``clipping_range`` each round from the run's DP mechanism (its
            clip norm C_t, which adaptive clipping moves, plus the noise shares' tail), for a
            run that left ``flower.secagg_clipping_range`` unset.
    """

    num_shares: int | float = 1.0
    reconstruction_threshold: int | float = 0.5
    clipping_range: float = 1.0
    quantization_range: int = 2**24
    modulus_range: int = 2**32
    max_weight: float = 1.0
    timeout: float | None = None
    follow_privacy: bool = False

    def max_clients(self) -> int:
        """The most clients a round may sum without overflowing M (n * T < M)."""
        return (self.modulus_range - 1) // self.quantization_range

    def mean_error_bound(self, weights: Iterable[float], max_abs: float) -> float:
        """A bound on |mean - sum p_i v_i / sum p_i| per entry for clients of these weights
        whose entries are at most ``max_abs`` (and within the clipping range): each client's
        stochastic rounding errs by less than one step 2c / T, and its weight is rounded to
        max_weight / (2T) at most, which moves the weighted mean by at most
        2 max_abs * that / sum of weights per client."""
        w = [float(x) / self.max_weight for x in weights]
        total = sum(round(x * self.quantization_range) for x in w) / self.quantization_range
        step = 2.0 * self.clipping_range / self.quantization_range
        weight_err = 0.5 / self.quantization_range
        return len(w) * (step + 2.0 * max_abs * weight_err) / total


# ------------------------------------------------------------------------------ server side


class _RoundStrategy(Strategy):
    """The legacy Strategy that ``SecAggPlusWorkflow`` calls: ``configure_fit`` returns the
    round's nodes (with empty ``FitIns``: :class:`_Workflow` sends fedlore's own records),
    ``aggregate_fit`` keeps the results (their parameters are the unmasked aggregate)."""

    def __init__(self, proxies: list[ClientProxy]) -> None:
        self.proxies = proxies
        self.results: list[tuple[ClientProxy, FitRes]] | None = None
        self.failures: list[Any] = []

    def initialize_parameters(self, client_manager: ClientManager) -> Parameters | None:
        return None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, FitIns]]:
        return [(p, FitIns(Parameters([], "numpy.ndarray"), {})) for p in self.proxies]

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[Any],
    ) -> tuple[Parameters | None, dict[str, Any]]:
        self.results, self.failures = list(results), list(failures)
        return None, {}  # the workflow then leaves its (unused) parameters record alone

    def configure_evaluate(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def aggregate_evaluate(self, *args: Any, **kwargs: Any) -> tuple[None, dict[str, Any]]:
        return None, {}

    def evaluate(self, *args: Any, **kwargs: Any) -> None:
        return None


class _Workflow(SecAggPlusWorkflow):
    """flwr's SecAgg+ workflow with fedlore's broadcast records as the clients' fit content
    (the legacy ``FitIns`` cannot hold named tensors of several dtypes)."""

    def __init__(self, contents: Mapping[int, RecordDict], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.contents = contents

    def setup_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        return bool(ok)


class _PromptGrid(Grid):
    """A Grid whose ``send_and_receive`` is ``send`` (fedlore's shorter-poll version); every
    other call goes to the wrapped grid."""

    def __init__(
        self, grid: Grid, send: Callable[[Grid, Iterable[Message], float | None], list[Message]]
    ) -> None:
        self.grid = grid
        self.send = send

    def set_run(self, run: Any) -> None:
        self.grid.set_run(run)

    @property
    def run(self) -> Any:
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        return self.send(self.grid, messages, timeout)


STAGES = ("setup", "share keys", "collect masked vectors", "unmask")


def secure_round(
    grid: Grid,
    rnd: int,
    contents: Mapping[int, RecordDict],
    length: int,
    settings: SecAggSettings,
    send: Callable[[Grid, Iterable[Message], float | None], list[Message]] | None = None,
) -> tuple[np.ndarray, dict[int, Scalars], set[int]] | RuntimeError:
    """One SecAgg+ round over ``grid`` with flwr's workflow (see the module docstring).

    Args:
        grid: the ServerApp's grid.
        rnd: the round (the messages' ``group_id``).
        contents: node id -> the fit content its ClientApp gets (fedlore's broadcast record).
        length: the length of every upload vector.
        settings: the protocol's parameters.
        send: ``send_and_receive(grid, messages, timeout)`` to use for each stage (None:
            the grid's own).

    Returns:
        ``(mean, metrics, nodes)``: the float64 ``(length,)`` weighted mean, the clear metrics
        per contributing node and the set of those nodes; or a RuntimeError naming the stage
        where the protocol stopped (fewer than two nodes, too few live neighbours, a vector of
        the wrong length) and the clients' errors.
    """
    n = len(contents)
    if n < 2:
        return RuntimeError(f"secure aggregation needs at least 2 clients in a round, got {n}")
    if n > settings.max_clients():
        return RuntimeError(
            f"secure aggregation of {n} clients overflows flower.secagg_modulus_range="
            f"{settings.modulus_range} at flower.secagg_quantization_range="
            f"{settings.quantization_range} (at most {settings.max_clients()} per round)"
        )
    try:
        run_id = int(grid.run.run_id)
    except (AttributeError, RuntimeError):  # a grid without a run: the id is only a label
        run_id = 0
    proxies: list[ClientProxy] = [GridClientProxy(nid, grid, run_id) for nid in contents]
    strategy = _RoundStrategy(proxies)
    manager = SimpleClientManager()
    for p in proxies:
        manager.register(p)
    base = Context(run_id=run_id, node_id=0, node_config={}, state=RecordDict(), run_config={})
    context = LegacyContext(base, strategy=strategy, client_manager=manager)
    context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord(
        {WorkflowKey.CURRENT_ROUND: rnd}
    )
    context.state.array_records[MAIN_PARAMS_RECORD] = ArrayRecord()
    workflow = _Workflow(
        contents,
        num_shares=settings.num_shares,
        reconstruction_threshold=settings.reconstruction_threshold,
        max_weight=settings.max_weight,
        clipping_range=settings.clipping_range,
        quantization_range=settings.quantization_range,
        modulus_range=settings.modulus_range,
        timeout=settings.timeout,
    )
    state = WorkflowState()
    stage_grid = grid if send is None else _PromptGrid(grid, send)
    steps = (
        workflow.setup_stage,
        workflow.share_keys_stage,
        workflow.collect_masked_vectors_stage,
        workflow.unmask_stage,
    )
    live = set(contents)
    for name, step in zip(STAGES, steps, strict=True):
        try:
            ok = step(stage_grid, context, state)
        except ValueError as e:  # e.g. vectors of different lengths cannot be summed
            return RuntimeError(f"secure aggregation failed in the {name} stage: {e}")
        gone = live - state.active_node_ids
        if gone:
            log.warning("round %d: SecAgg+ %s stage: nodes %s dropped out", rnd, name, gone)
        live = set(state.active_node_ids)
        if not ok:
            errors = "; ".join(str(f) for f in state.failures[:3])
            return RuntimeError(
                f"secure aggregation stopped in the {name} stage: too few live clients for "
                f"the reconstruction threshold ({state.threshold} of {state.num_shares} "
                f"shares; live: {len(live)} of {n})"
                + (f"; client errors: {errors}" if errors else "")
            )
    if strategy.results is None or not strategy.results:
        return RuntimeError("secure aggregation ended without an aggregate")
    arrays = parameters_to_ndarrays(strategy.results[0][1].parameters)
    if len(arrays) != 1 or arrays[0].shape != (length,):
        shapes = [a.shape for a in arrays]
        return RuntimeError(f"secure aggregate has shapes {shapes}, expected [({length},)]")
    metrics: dict[int, Scalars] = {}
    for proxy, res in strategy.results:
        metrics[int(proxy.node_id)] = {
            k: v for k, v in res.metrics.items() if isinstance(v, int | float | str | bool)
        }
    return np.asarray(arrays[0], dtype=np.float64), metrics, set(metrics)


# ------------------------------------------------------------------------------ client side


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
