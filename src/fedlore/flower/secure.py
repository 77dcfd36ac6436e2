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

Client side (:mod:`fedlore.flower.secure_client`), ``secagg_mod`` (a Flower mod on fedlore's
ClientApp ``train`` handler) hands SecAgg+ stage messages to flwr's ``secaggplus_mod`` and
every other message straight to the app: flwr's mod alone would fail on a message without its
``"secaggplus"`` record. Its collect-masked-vectors stage calls the app, whose reply
(``contribution_record``) is a
legacy ``FitRes`` holding the contribution vector v_i as its one array and the weight p_i as
``num_examples``; flwr's mod multiplies v_i by p_i / max_weight, quantizes and masks it, and
``secagg_mod`` then blanks the clear ``num_examples`` of the reply, so p_i travels only
inside the masked sum.

What the workflow returns (verified in flwr 1.42's source): client i uploads
``[q_i, Q_i]`` with q_i = round(p_i / max_weight * T) and Q_i the stochastic rounding of
``(clip(q_i / T * v_i, -c, c) + c) * T / (2c)``; the unmasked sums give
``(sum Q_i * 2c / T - n c) * T / sum q_i = sum (q_i/T) v_i / sum (q_i/T)``, the weighted mean
sum p_i v_i / sum p_i up to the quantization of the weights (to max_weight / T) and of the
entries (steps of 2c / T): :class:`~fedlore.privacy.plan.SecureSum`'s ``mean`` without further
conversion.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.common import (
    FitIns,
    FitRes,
    Parameters,
    parameters_to_ndarrays,
)
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

from fedlore.config import Config
from fedlore.privacy.aggregation import DEFAULT_THRESHOLD
from fedlore.privacy.crypto import prg
from fedlore.privacy.topology import threshold_count
from fedlore.progress import say_once
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
of this round the node's ClientApp kills its SuperNode and exits
(:func:`~fedlore.flower.secure_client.drop_out_now`)."""


@dataclass(frozen=True)
class SecAggSettings:
    """flwr ``SecAggPlusWorkflow`` parameters (see :class:`fedlore.config.FlowerConfig`'s
    ``secagg_*`` settings for what each guarantees).

    Attributes:
        num_shares: neighbourhood size k (int > 2) or a fraction of the sampled clients.
        reconstruction_threshold: shares t that rebuild a secret (int) or a fraction of k
            (flwr's rule: rounded, at least 2); None: ``secure_aggregation_threshold`` as
            fedlore applies it in process, ``min(k, ceil(f k))`` for a fraction f, the count
            itself (at most k) for an int (:func:`secure_round`'s ``threshold``).
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
    reconstruction_threshold: int | float | None = None
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


def neighbourhood_size(num_shares: int | float, n: int) -> int:
    """A node's share holders (itself included) in flwr 1.42's SecAgg+ graph of ``n`` nodes
    (``SecAggPlusWorkflow.setup_stage``): a fraction of n is rounded, made odd below n and
    replaced by n when at most 2 (an int 1 is the fraction 1.0); an even int below n gets one
    more; each node's neighbours are the k // 2 on either side on a ring of the n nodes."""
    if isinstance(num_shares, float) or num_shares == 1:
        k = round(float(num_shares) * n)
        if k < n and k & 1 == 0:
            k += 1
        if k <= 2:
            k = n
    else:
        k = num_shares + 1 if num_shares != n and num_shares & 1 == 0 else num_shares
    return min(n, 2 * (k >> 1) + 1)


class _Workflow(SecAggPlusWorkflow):
    """flwr's SecAgg+ workflow with fedlore's broadcast records as the clients' fit content
    (the legacy ``FitIns`` cannot hold named tensors of several dtypes) and fedlore's two
    thresholds.

    ``min_survivors`` (m_min): after each of the setup, share-keys and collect-masked-vectors
    stages, fewer live nodes than this stop the round (:attr:`refusal` says why), so the unmask
    stage never runs for a sum over fewer than m_min clients; flwr alone unmasks as soon as
    every node keeps t live neighbours. ``threshold`` (not None): the Shamir threshold t of a
    node's k share holders is ``min(k, threshold_count(threshold, k))``, set before the setup
    message carries it to the clients, in place of flwr's ``reconstruction_threshold``."""

    def __init__(
        self,
        contents: Mapping[int, RecordDict],
        min_survivors: int = 2,
        threshold: int | float | None = None,
        **kwargs: Any,
    ) -> None:
        if threshold is not None:  # flwr validates a value here; setup_stage sets the count
            kwargs["reconstruction_threshold"] = 1.0
        super().__init__(**kwargs)
        self.contents = contents
        self.min_survivors = min_survivors
        self.threshold = threshold
        self.refusal: str | None = None

    def _enough_live(self, state: WorkflowState) -> bool:
        live = len(state.active_node_ids)
        if live >= self.min_survivors:
            return True
        self.refusal = (
            f"{live} of {len(self.contents)} clients live, secure_aggregation_threshold needs "
            f"{self.min_survivors}: nothing is unmasked"
        )
        return False

    def setup_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        if self.threshold is not None:  # an int: flwr's setup_stage sends it as it is
            k = neighbourhood_size(self.num_shares, len(self.contents))
            self.reconstruction_threshold = min(k, threshold_count(self.threshold, k))
        ok = super().setup_stage(grid, context, state)
        state.nid_to_fitins = {nid: self.contents[nid] for nid in state.nid_to_fitins}
        if not ok:
            return False
        if self.threshold is not None:  # the graph flwr built: t still holds (no shares yet)
            k = max(len(nb) for nb in state.nid_to_neighbours.values())
            need = min(k, threshold_count(self.threshold, k))
            if state.threshold < need:
                self.refusal = (
                    f"flwr's reconstruction threshold {state.threshold} of {k} shares is below "
                    f"secure_aggregation_threshold's {need}"
                )
                return False
        return self._enough_live(state)

    def share_keys_stage(self, grid: Grid, context: LegacyContext, state: WorkflowState) -> bool:
        return bool(super().share_keys_stage(grid, context, state)) and self._enough_live(state)

    def collect_masked_vectors_stage(
        self, grid: Grid, context: LegacyContext, state: WorkflowState
    ) -> bool:
        """flwr's stage (it sums the masked vectors that arrived; nothing is unmasked), then
        the survivor check: fewer than ``min_survivors`` vectors stop the round here."""
        ok = super().collect_masked_vectors_stage(grid, context, state)
        return bool(ok) and self._enough_live(state)


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
    min_survivors: int = 2,
    threshold: int | float = DEFAULT_THRESHOLD,
    name_nodes: bool = True,
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
        min_survivors: m_min, the fewest clients the round completes with
            (``secure_aggregation_threshold`` of the sampled clients): with fewer live nodes
            after the setup, share-keys or collect-masked-vectors stage the round stops there
            and the unmask stage never runs.
        threshold: ``secure_aggregation_threshold``; when ``settings.reconstruction_threshold``
            is None it sets the Shamir threshold t of a node's k share holders,
            ``min(k, threshold_count(threshold, k))`` (as in process).
        name_nodes: whether the log names the nodes that dropped out (False under DP, whose
            sample the logs must not give away: a count instead).

    Returns:
        ``(mean, metrics, nodes)``: the float64 ``(length,)`` weighted mean, the clear metrics
        per contributing node and the set of those nodes; or a RuntimeError naming the stage
        where the protocol stopped (fewer than two nodes or than ``min_survivors``, too few
        live neighbours, a vector of the wrong length) and the clients' errors.
    """
    n = len(contents)
    if n < 2:
        return RuntimeError(f"secure aggregation needs at least 2 clients in a round, got {n}")
    if n < min_survivors:
        return RuntimeError(
            f"secure aggregation of {n} reachable clients: secure_aggregation_threshold needs "
            f"{min_survivors}: nothing is sent"
        )
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
    derived = settings.reconstruction_threshold is None
    workflow = _Workflow(
        contents,
        min_survivors=min_survivors,
        threshold=threshold if derived else None,
        num_shares=settings.num_shares,
        reconstruction_threshold=1.0 if derived else settings.reconstruction_threshold,
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
            said = f"nodes {gone}" if name_nodes else f"{len(gone)} node(s)"  # DP: a count
            log.warning("round %d: SecAgg+ %s stage: %s dropped out", rnd, name, said)
        live = set(state.active_node_ids)
        if not ok and workflow.refusal is not None:
            log.warning(
                "round %d: SecAgg+ stopped in the %s stage: %s", rnd, name, workflow.refusal
            )
            return RuntimeError(
                f"secure aggregation stopped in the {name} stage: {workflow.refusal}"
            )
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


def secagg_settings(cfg: Config, method: str, client_data: Any = None) -> SecAggSettings:
    """The SecAgg+ parameters of a run of ``method`` (``flower.secagg_*``; each stage waits
    ``flower.round_timeout_s``; ``clipping_range`` unset: see the setting). ``max_weight``
    unset: 1 under ``weighting: uniform``, else the largest ``num_examples`` of the clients of
    ``client_data`` (client id -> ClientData, the central federation); None there (site-local
    data) leaves 1, which a client of more examples refuses with the setting's name."""
    f = cfg.flower
    clip = f.secagg_clipping_range
    if cfg.secure_aggregation and clip is None and not cfg.dp.enabled:  # else nothing clips
        say_once(
            "SecAgg+: every upload entry is clipped to [-1, 1] before quantization "
            "(flower.secagg_clipping_range unset, no DP clip bounds the uploads); an update with "
            "larger entries changes silently: set flower.secagg_clipping_range to bound them"
        )
    follow = clip is None and cfg.dp.enabled  # C_t + the noise shares' tail, every round
    if clip is None:
        clip = 1.0
    max_weight = f.secagg_max_weight
    if max_weight is None:
        max_weight = 1.0
        if cfg.weighting != "uniform" and client_data is not None:
            max_weight = float(max(client_data(c).num_examples for c in range(cfg.num_clients)))
    return SecAggSettings(
        num_shares=f.secagg_num_shares,
        reconstruction_threshold=f.secagg_reconstruction_threshold,
        clipping_range=clip,
        quantization_range=f.secagg_quantization_range,
        modulus_range=f.secagg_modulus_range,
        max_weight=max_weight,
        timeout=f.round_timeout_s,
        follow_privacy=follow,
    )
