"""What buffered asynchronous aggregation (``asynchronous.buffer``, FedBuff;
:mod:`fedlore.engine.buffered`) refuses, each in one line with its reason.

The config's own section checks K <= C <= N (:class:`fedlore.config.Config`); here is what
depends on the method and on the other sections, and on the engine (:func:`check_in_process`:
``clock: wall`` needs Flower's):

* the method: only one whose :attr:`~fedlore.algorithm.Capabilities.synchronous_only` is empty
  (FedFull, FedAvg, FedProx: the server adds a weighted mean of plain deltas, and a delta
  computed from an older global model is still a delta);
* secure aggregation: a buffer mixes updates computed from different global models and fills
  at times set by the clients' speeds, so the in-process masking rounds do not describe it (the
  paper's secure aggregation needs a trusted enclave holding the buffer);
* DP other than central DP with a fixed clip (DP-FedBuff, :mod:`fedlore.privacy.buffer_dp`):
  ``dp.mode: local`` and adaptive clipping (``dp.target_quantile``) are defined per synchronous
  round; ``dp.max_contributions`` is FedBuff's alone; DP-FedBuff on the wall clock and on a
  ``flwr run`` deployment (:func:`check_deployed`; tested in process and on ``engine:
  flower-sim`` under the simulated clock only);
* what is defined only for synchronous rounds: dropouts and a round deadline
  (``clients.dropout``, ``clients.round_deadline_s``: a client simply finishes later), malicious
  clients (``attack``), upload compression and robust aggregates (the server scales each delta
  by its staleness weight, which an encoded upload or a coordinate-wise rank does not allow),
  diagnostics (measured at a round's sampled clients), P-local scores (``eval.local``: the
  clients of the last round), a minibatch ``stream`` (its window is indexed by round, so a
  client that starts twice from one version would read it twice).
"""

from __future__ import annotations

from typing import Any

from fedlore.config import Config, ConfigError


def asynchronous_problems(cfg: Config) -> list[str]:
    """The run-wide settings buffered aggregation refuses (empty when it is off)."""
    if not cfg.asynchronous.enabled:
        return []
    why = "asynchronous.buffer (FedBuff) with "
    out = []
    if cfg.secure_aggregation:
        out.append(
            why + "secure_aggregation: a buffer of updates from different global models, "
            "filled at the clients' pace, is no masking round (the paper puts it in a trusted "
            "enclave); not implemented"
        )
    if cfg.dp.enabled and cfg.dp.mode == "local":
        out.append(
            why + "dp.mode=local: DP-FedBuff is central DP (the server noises the buffer's "
            "sum); local DP over the buffer is not implemented"
        )
    if cfg.dp.enabled and cfg.asynchronous.clock == "wall":
        out.append(
            why + "dp and asynchronous.clock=wall: DP-FedBuff is tested on the simulated clock "
            "only (in process and engine: flower-sim, whose rows are the in-process run's); on "
            "the wall clock the buffer fills from real arrivals and dropped flights, where its "
            "once-per-step rule and per-client counts are not tested"
        )
    if cfg.dp.enabled and cfg.dp.target_quantile is not None:
        out.append(
            why + "dp.target_quantile: adaptive clipping moves the clip once per synchronous "
            "round; DP-FedBuff clips at a fixed dp.clip_norm"
        )
    cap = cfg.dp.max_contributions
    if cap is not None and not cfg.dp.enabled:
        out.append(why + "dp.max_contributions but no dp.clip_norm: the cap is DP-FedBuff's")
    elif cap is not None and cap * cfg.num_clients < cfg.rounds * int(cfg.asynchronous.buffer or 0):
        out.append(
            why + f"dp.max_contributions={cap}: {cfg.num_clients} clients can fill at most "
            f"{cap * cfg.num_clients} buffer places, and {cfg.rounds} steps of "
            f"{cfg.asynchronous.buffer} need more; raise the cap or lower the rounds"
        )
    if cfg.clients.dropout > 0 or cfg.clients.round_deadline_s is not None:
        out.append(
            why + "clients.dropout or clients.round_deadline_s: rounds have no deadline under "
            "FedBuff (a slow client arrives later, weighted by its staleness)"
        )
    if cfg.attack.kind != "none" and cfg.attack.fraction > 0:
        out.append(why + "attack: the malicious clients are simulated in synchronous rounds only")
    if cfg.diagnostics.every:
        out.append(why + "diagnostics.every: the diagnostics measure a synchronous round's clients")
    if cfg.eval.local:
        out.append(
            why + "eval.local: P-local scores come from the clients of a synchronous last round"
        )
    c = cfg.clients
    if cfg.asynchronous.clock == "wall" and (c.speed != "equal" or c.speed_trace is not None):
        out.append(
            why + "asynchronous.clock=wall and clients.speed or clients.speed_trace: the clients "
            "arrive when they really finish, so simulated speeds would be ignored"
        )
    if cfg.data.sampling == "stream":
        out.append(
            why + "data.sampling=stream: the stream's window is indexed by round, so a client "
            "that starts twice from one version would read the same batches twice"
        )
    return out


def check_asynchronous(name: str, algo: Any, cfg: Config) -> None:
    """Refuse buffered aggregation for method ``name`` (built as ``algo``) when it cannot run it.

    Raises:
        ConfigError: one line naming the setting and the reason.
    """
    if not cfg.asynchronous.enabled:
        if cfg.dp.max_contributions is not None:
            raise ConfigError(
                "dp.max_contributions is set but asynchronous.buffer is not: it caps a "
                "client's server steps under DP-FedBuff (a synchronous run's accountant counts "
                "its rounds)"
            )
        return
    caps = algo.caps()
    if caps.synchronous_only:
        raise ConfigError(
            f"asynchronous.buffer (FedBuff) with method {name!r}: {caps.synchronous_only}"
        )
    compression = getattr(algo, "compression", "none")
    if compression != "none":
        raise ConfigError(
            f"asynchronous.buffer (FedBuff) with {name}'s compression={compression}: the server "
            "scales each delta by its staleness weight, which an encoded upload does not allow"
        )
    rule = algo.train.robust_aggregate
    if rule != "mean":
        raise ConfigError(
            f"asynchronous.buffer (FedBuff) with {name}'s robust_aggregate={rule}: a robust "
            "combination of staleness-scaled deltas is not defined; use mean (the norm screen, "
            "robust.norm_screen, screens the buffer)"
        )
    problems = asynchronous_problems(cfg)
    if problems:
        raise ConfigError(problems[0])


def check_in_process(cfg: Config, deployed: bool) -> None:
    """Refuse ``asynchronous.clock: wall`` in process (``deployed`` False: not over a Flower
    transport): there the clients train one after the other and no reply arrives on a real
    clock. The simulated clock runs on every engine.

    Raises:
        ConfigError: naming the setting and the engines that run it.
    """
    if cfg.asynchronous.enabled and cfg.asynchronous.clock == "wall" and not deployed:
        raise ConfigError(
            "asynchronous.clock=wall in process (engine: local): there is no real clock to "
            "order the buffer (clients train one after another); use engine: flower-sim or a "
            "flwr run deployment, or asynchronous.clock=simulated"
        )


def check_deployed(cfg: Config) -> None:
    """Refuse DP-FedBuff on a ``flwr run`` deployment (the deployed ServerApp calls this before
    it trains): it is tested in process and on the Simulation Engine, whose rows are the
    in-process run's; a deployment's float32 training in other processes, its resume (a new
    process whose clients cannot answer) and its flights are not. Refuse also
    ``flower.node_states`` with FedBuff on the wall clock (its clients in flight at a kill
    trained from a version whose replies the checkpoint lacks: their nodes cannot roll back).

    Raises:
        ConfigError: one line naming the setting and why.
    """
    if cfg.flower.node_states and cfg.asynchronous.enabled and cfg.asynchronous.clock == "wall":
        raise ConfigError(
            "flower.node_states with asynchronous.clock: wall: a wall-clock FedBuff's clients "
            "in flight at a kill trained from a version whose replies its checkpoint lacks, so "
            "their nodes' states cannot be rolled back to it; use asynchronous.clock: "
            "simulated, or flower.node_states: false (a resume restarts every client)"
        )
    if cfg.asynchronous.enabled and cfg.dp.enabled:
        raise ConfigError(
            "asynchronous.buffer (FedBuff) with dp on a flwr run deployment: DP-FedBuff is "
            "tested in process (engine: local) and on engine: flower-sim only, whose rows equal "
            "the in-process run's; a deployment's resume and client processes are not tested "
            "with it; run it with engine: flower-sim or in process"
        )
