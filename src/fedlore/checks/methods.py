"""The refusals of a config and of each method against it, and the one reader of a method's
:class:`~fedlore.algorithm.Capabilities` (see :mod:`fedlore.checks`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.checks.compression import (
    NO_PRIVATE_COMPRESSION,
    Declares,
    check_compression_settings,
)
from fedlore.config import Config, ConfigError
from fedlore.settings import hyperparameter_names, not_applicable, not_applicable_problems
from fedlore.train.metrics import check_names as check_metric_names

if TYPE_CHECKING:
    import torch

    from fedlore.data.federation import Federation
    from fedlore.privacy import Privacy

log = logging.getLogger("fedlore.checks")


NAMED = (("data.name", "source"), ("partition.name", "partition"), ("model.name", "model"))
"""Config keys that name a registered entry, with the registry kind."""


def _names(cfg: Config) -> str:
    """``algorithms`` as the command line spells it: ``[fedfull, fedlore]``."""
    return f"[{', '.join(cfg.algorithms)}]"


def name_problems(cfg: Config) -> list[str]:
    """``key: unknown <kind> ...; registered: [...]`` for every name of :data:`NAMED` that is
    not registered, and the problems of ``eval.metrics``
    (:func:`fedlore.train.metrics.check_names`)."""
    problems = []
    for key, kind in NAMED:
        section, field = key.split(".")
        try:
            registry.get(kind, getattr(getattr(cfg, section), field))
        except KeyError as e:
            problems.append(f"{key}: {e.args[0] if e.args else e}")
    return problems + check_metric_names(cfg.eval.metrics)


def unused_method_problems(cfg: Config) -> list[str]:
    """Problems of the ``method`` sections of methods not in ``algorithms``: an unknown method,
    or keys that are not hyperparameters of the method (the sections of the run's methods are
    checked in full when the methods are built)."""
    problems = []
    for name, settings in cfg.method.items():
        if name in cfg.algorithms:
            continue
        try:
            cls = registry.get("algorithm", name)
        except KeyError as e:
            problems.append(f"method.{name}: {e.args[0] if e.args else e}")
            continue
        fields = hyperparameter_names(cls)
        problems += not_applicable_problems(cls, name, settings)
        unknown = sorted(set(settings) - set(fields) - set(not_applicable(cls)))
        if unknown:
            problems.append(
                f"method.{name}: {cls.__name__} has no hyperparameter(s) {unknown}"
                f"{registry.did_you_mean(unknown[0], fields)}; known: {fields} "
                f"({name} is not in algorithms {_names(cfg)} either)"
            )
    return problems


def override_problems(cfg: Config, overrides: Sequence[str]) -> list[str]:
    """One line for every ``key=value`` override of ``method.<name>`` (or of the whole
    ``method`` section) that sets a method not in ``cfg.algorithms``."""
    problems = []
    for item in overrides:
        key = item.partition("=")[0].strip()
        parts = key.split(".")
        if parts[0] != "method":
            continue
        names = [parts[1]] if len(parts) > 1 else list(cfg.method)
        for name in names:
            if name not in cfg.algorithms:
                problems.append(
                    f"{item}: method {name!r} is not in algorithms {_names(cfg)}, so the "
                    f"setting would change nothing; add {name} to algorithms or drop the setting"
                )
    return problems


def check_overrides(cfg: Config, overrides: Sequence[str]) -> None:
    """Refuse command-line settings of methods the run does not include.

    Raises:
        ConfigError: listing every such override (:func:`override_problems`).
    """
    problems = override_problems(cfg, overrides)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid overrides:\n  " + "\n  ".join(problems))


def privacy_modes(cfg: Config) -> str:
    """The privacy modes the config turns on, as named in error messages:
    ``"secure_aggregation"``, ``"dp"``, ``"secure_aggregation and dp"`` or ``""``."""
    on = (("secure_aggregation", cfg.secure_aggregation), ("dp", cfg.dp.enabled))
    return " and ".join(m for m, enabled in on if enabled)


SERVER_KEYS = ("server_optimizer", "server_eta")
"""The ``method.<name>`` overrides that choose a server optimizer."""


def check_method_settings(
    name: str, cls: type[Declares], cfg: Config, overrides: dict[str, Any]
) -> None:
    """Refuse settings that method class ``cls`` (registered as ``name``) cannot honour: a
    ``method.<name>.freeze``, ``.exclude`` or ``.num_clients`` override (``params.*`` and
    ``num_clients`` set them for every method),
    a robust aggregate for a method that averages no dense deltas, a 16-bit transport for one
    that sends at the model's dtype only, upload compression for one without
    ``compress_uploads`` or with an update attack.

    Raises:
        ValueError: for a ``freeze`` or ``exclude`` override; ConfigError: for the others.
    """
    for key in ("freeze", "exclude"):
        if key in overrides:
            raise ValueError(
                f"method.{name}.{key}: set params.{key} instead; it applies to every method "
                "alike (reference notes section 13.3)"
            )
    if "num_clients" in overrides:  # SCAFFOLD's N: the federation's, not a method's choice
        raise ValueError(
            f"method.{name}.num_clients: set num_clients instead; it is the federation's size"
        )
    caps = cls.capabilities
    # the method's own robust_aggregate / num_byzantine, where given, are what its server uses
    rule = overrides.get("robust_aggregate", cfg.robust.aggregate)
    rule_key = (
        f"method.{name}.robust_aggregate" if "robust_aggregate" in overrides else "robust.aggregate"
    )
    if rule != "mean" and not caps.robust_aggregate:
        raise ConfigError(
            f"{rule_key}={rule}: method {name!r} offers no robust "
            "combination of its uploads (the low-rank and mask methods' servers combine factors, "
            "bases or masks; SCAFFOLD's and FedDyn's add up their control variates or gradient "
            "states; FedNova's rescales each delta by the client's own reported ‖a_i‖₁, q-FFL's "
            "by its reported loss to the power q), so a "
            "coordinate-wise median, trimmed mean or Krum is not defined for it; use "
            "robust.aggregate=mean (the norm screen, robust.norm_screen, works for every method)"
        )
    f = overrides.get("num_byzantine", cfg.robust.num_byzantine)
    f_key = (
        f"method.{name}.num_byzantine" if "num_byzantine" in overrides else "robust.num_byzantine"
    )
    n = cfg.clients_per_round()
    if rule == "bulyan" and n < 4 * f + 3:
        raise ConfigError(
            f"{rule_key}=bulyan with {f_key}={f} needs at least 4f + 3 = "
            f"{4 * f + 3} clients per round; this config samples {n} (El Mhamdi et al. 2018)"
        )
    if rule in ("krum", "multi_krum") and n <= 2 * f + 2:
        raise ConfigError(
            f"{rule_key}={rule} with {f_key}={f} needs more than 2f + 2 = "
            f"{2 * f + 2} clients per round; this config samples {n} (Blanchard et al. 2017)"
        )
    if cfg.attack.kind in ("sign_flip", "scale", "gaussian") and not caps.robust_aggregate:
        raise ConfigError(
            f"attack.kind={cfg.attack.kind}: an update attack is simulated against the methods "
            "whose servers offer a robust combination of the uploaded deltas (robust.aggregate), "
            f"and {name!r} offers none (its uploads are factors, bases or masks, or its server "
            "keeps state built from each upload), so the attack is not defined for it; "
            "attack.kind=label_flip works for every method"
        )
    if cfg.attack.kind != "none" and cfg.attack.fraction > 0 and cfg.engine != "local":
        raise ConfigError(
            f"attack.kind={cfg.attack.kind}: attacks are simulated by the in-process engine; "
            "use engine=local"
        )
    c = cfg.clients
    unreliable = c.dropout > 0 or c.round_deadline_s is not None or c.availability is not None
    if unreliable and cfg.engine != "local":
        raise ConfigError(
            "clients.*: unreliable clients are simulated in process; use engine=local"
        )
    private = cfg.secure_aggregation or cfg.dp.enabled
    if private and c.partial_work and c.round_deadline_s is not None:
        raise ConfigError(
            "clients.partial_work: a straggler's upload is weighted by the share of its steps "
            "done, so the server would need each client's weight, not the plain sum that secure "
            "aggregation and DP give it; drop stragglers instead (partial_work=false)"
        )
    if cfg.dp.enabled and c.availability is not None:
        raise ConfigError(
            "clients.availability: DP's accountant assumes every client can be sampled in every "
            "round (uniform sampling); an availability trace breaks that assumption"
        )
    server = cfg.server
    own = {k: overrides[k] for k in SERVER_KEYS if k in overrides}
    kind, lr = own.get("server_optimizer", server.optimizer), own.get("server_eta", server.lr)
    if (kind != "sgd" or lr != 1.0) and not caps.server_optimizer:
        raise ConfigError(
            f"server.optimizer={kind}, server.lr={lr}: method {name!r} does not add an averaged "
            "dense delta to its model (its server combines low-rank factors, bases, masks or "
            "forwarded models, or runs its own optimizer, or corrects the mean by a state of its "
            "own: FedDyn's h, or takes a step size of its own: q-FFL's 1 / Σ h_k), so no server "
            "optimizer applies; use server.optimizer=sgd with server.lr=1"
        )
    kind = overrides.get("compression", cfg.compression.kind)
    key = f"method.{name}.compression" if "compression" in overrides else "compression.kind"
    check_compression_settings(name, caps, cfg, overrides)
    if kind == "topk" and rule in ("median", "trimmed_mean", "bulyan"):
        raise ConfigError(
            f"{rule_key}={rule} with {key}=topk: each client's top-k "
            "keeps other coordinates, so a coordinate-wise median or trimmed mean of the sparse "
            "deltas is zero almost everywhere (a run on digits fell to 16 %); use the mean, "
            "krum or multi_krum, or compression.kind=qsgd"
        )
    if kind != "none" and cfg.attack.kind in ("sign_flip", "scale", "gaussian"):
        raise ConfigError(
            f"attack.kind={cfg.attack.kind} with {key}={kind}: the update attacks "
            "corrupt dense deltas (update.*), and a compressed upload holds top-k values and "
            "indices or QSGD norms and codes; use compression.kind=none or attack.kind=label_flip"
        )
    if cfg.transport_dtype != "fp32" and not caps.transport_16bit:
        raise ConfigError(
            f"transport_dtype={cfg.transport_dtype}: method {name!r} sends its tensors at the "
            "model's dtype only; 16-bit transport is implemented for fedlore, fedlore_random, "
            "fedlore_fixed, fedlore_sketch, fedfull, fedavg, fedprox, fednova, qffl, moon, "
            "fedper, fedbn, fedrep and the LoRA methods (use transport_dtype=fp32)"
        )


def check_min_clients(name: str, algo: Algorithm, cfg: Config) -> None:
    """Refuse a config that samples fewer clients per round than method ``name`` needs (its
    ``caps().min_clients``).

    Raises:
        ValueError: naming both counts.
    """
    need = algo.caps().min_clients
    if cfg.clients_per_round() < need:
        raise ValueError(
            f"{name} needs at least {need} clients per round, the config samples "
            f"{cfg.clients_per_round()} (num_clients x participation)"
        )


def setup_rounds(algo: Algorithm) -> int:
    """How many setup exchanges the method runs before round 0 (its ``caps().setup_rounds``),
    numbered -setup_rounds .. -1."""
    return algo.caps().setup_rounds


def is_sum_aggregable(cls: type[Declares]) -> bool:
    """Whether method class ``cls`` needs only the weighted sums of the uploads
    (:attr:`~fedlore.algorithm.Capabilities.sum_aggregable`): it runs under secure aggregation
    and DP and accepts ``upload_increments``."""
    caps = cls.capabilities
    return caps.sum_aggregable


def projects(algo: Algorithm) -> Literal["shared", "client"] | None:
    """Whether the method trains matrices in a low-rank subspace (its ``plan(model)``), with one
    basis shared by all clients (``"shared"``) or one per client (``"client"``); None if not."""
    return algo.caps().projects


def adapts(algo: Algorithm) -> bool:
    """Whether the method trains LoRA adapters on the matrices its ``targets(model)`` names."""
    return algo.caps().adapts


def keeps_layers_local(algo: Algorithm) -> bool:
    """Whether the method's clients keep some of the model's tensors to themselves, so that its
    global model is incomplete by design (FedPer, FedBN: :mod:`fedlore.algorithms.partial`;
    FedRep: :mod:`fedlore.algorithms.fedrep`)."""
    return algo.caps().keeps_layers_local


def check_wire_settings(cls: type[Declares], upload_increments: bool, transport_dtype: str) -> None:
    """Refuse, when method class ``cls`` is instantiated, the settings of what crosses the wire
    that it cannot honour: ``upload_increments`` for a method that is not sum-aggregable, a
    16-bit ``transport_dtype`` for one that sends at the model's dtype only.

    Raises:
        ValueError: naming the class, the setting and the reason.
    """
    caps = cls.capabilities
    if upload_increments and not caps.sum_aggregable:
        raise ValueError(
            f"{cls.__name__}: invalid upload_increments=True: {caps.individual_uploads}"
        )
    if transport_dtype != "fp32" and not caps.transport_16bit:
        raise ValueError(
            f"{cls.__name__}: invalid transport_dtype={transport_dtype!r}: this "
            "method sends its tensors at the model's dtype only (16-bit transport: FedLore and "
            "its variants, FedFull, FedAvg, FedProx, FedNova, q-FFL, MOON, FedPer, FedBN, FedRep "
            "and the LoRA methods)"
        )


def check_privacy(name: str, cls: type[Declares], cfg: Config) -> None:
    """Refuse a config that asks for secure aggregation or DP where it cannot hold.

    Raises:
        ConfigError: naming the setting and the reason: a method whose server needs individual
            uploads (its capabilities' ``individual_uploads``), DP for a method that takes
            secure aggregation alone (its ``no_dp``), a robust aggregate
            (coordinate-wise medians need each upload), a 16-bit transport (the masked sum is
            fixed point), DP with ``weighting: num_examples`` (a client's weight would scale its
            contribution past C). ``eval.local`` is allowed: the run warns that its P-local
            scores are measured outside the mechanism
            (:func:`fedlore.experiment_privacy.make_privacy`).
    """
    mode = privacy_modes(cfg)
    caps = cls.capabilities
    if not caps.sum_aggregable:
        why = caps.individual_uploads
        able = [  # under DP, not those that take secure aggregation alone (``no_dp``)
            m
            for m in registry.names("algorithm")
            if (c := registry.get("algorithm", m).capabilities).sum_aggregable
            and not (cfg.dp.enabled and c.no_dp)
        ]
        raise ConfigError(
            f"{mode}: method {name!r} cannot run under it: {why} (methods "
            f"whose server needs only weighted sums: {', '.join(able)})"
        )
    if cfg.dp.enabled and caps.no_dp:
        raise ConfigError(
            f"dp: method {name!r} cannot run under it: {caps.no_dp} (secure_aggregation alone "
            "runs it)"
        )
    if cfg.robust.aggregate != "mean":
        raise ConfigError(
            f"{mode}: robust.aggregate={cfg.robust.aggregate} needs each client's upload; only "
            "the weighted mean is a sum (use robust.aggregate=mean)"
        )
    if cfg.compression.kind != "none":
        raise ConfigError(
            f"{mode}: compression.kind={cfg.compression.kind} is not supported: "
            f"{NO_PRIVATE_COMPRESSION[cfg.compression.kind]}; use compression.kind=none"
        )
    if cfg.transport_dtype != "fp32":
        raise ConfigError(
            f"{mode}: transport_dtype={cfg.transport_dtype} is not supported: uploads are "
            "clipped and summed (in fixed point under secure aggregation) at the model's dtype; "
            "use transport_dtype=fp32"
        )
    if cfg.dp.enabled and cfg.weighting != "uniform":
        raise ConfigError(
            "dp: weighting=num_examples scales a client's upload by its data size, so one client "
            "could move the sum by more than dp.clip_norm; DP-FedAvg (McMahan et al. 2018) "
            "weights clients uniformly: set weighting=uniform"
        )
    if cfg.secure_aggregation and cfg.clients_per_round() < 2:
        raise ConfigError(
            f"secure_aggregation: the config samples {cfg.clients_per_round()} client per round "
            "(num_clients x participation); the 'secure' sum of one upload is that upload. "
            "Sample at least 2 clients per round (3 or more: with 2, each client can subtract "
            "its own upload from the aggregate it receives)"
        )
    if (
        cfg.secure_aggregation
        and cfg.flower.site_data
        and cfg.weighting != "uniform"
        and cfg.flower.secagg_max_weight is None
    ):
        raise ConfigError(
            "secure_aggregation: with flower.site_data and weighting=num_examples the server "
            "does not know the largest client's training set, and SecAgg+ needs it to bound the "
            "weights (a larger client would be refused every round): set "
            "flower.secagg_max_weight to at least the largest site's example count"
        )


def check_secure_round(cfg: Config, privacy: Privacy) -> None:
    """Refuse, at start, a secure-aggregation config whose rounds could never complete or whose
    fixed point cannot hold the uploads (:mod:`fedlore.privacy.fixedpoint`).

    Raises:
        ConfigError: naming the setting.
    """
    m = cfg.clients_per_round()
    try:
        privacy.round_params(0, list(range(m)))
        privacy.fixed_point(m)
        privacy.noise_share(m)
    except ValueError as e:
        text = str(e)
        raise ConfigError(
            text if text.startswith("secure aggregation") else f"secure_aggregation: {text}"
        ) from e
    t = cfg.secure_aggregation_threshold
    if isinstance(t, int) and t > m:
        raise ConfigError(
            f"secure_aggregation_threshold={t} exceeds the {m} clients sampled per round: no "
            "round could complete"
        )


def server_data(algo: Algorithm, fed: Federation, method: str) -> torch.Tensor | None:
    """The server's unlabeled set U (``fed.server_unlabeled``) for a method whose capabilities
    have ``server_data`` (:class:`~fedlore.algorithm.Capabilities`), None for one without.

    Raises:
        ConfigError: when ``method`` needs U and the config holds none out
            (``data.server_fraction`` is 0), or is a classification method (``regression`` is
            False) and the data are a regression task.
    """
    caps = algo.caps()
    if fed.task == "regression" and not caps.regression:
        raise ConfigError(
            f"method {method!r} needs class probabilities (it is defined for classification); "
            f"data source {fed.source!r} is a regression task"
        )
    if not caps.server_data:
        return None
    unlabeled = fed.server_unlabeled
    if unlabeled is None or len(unlabeled) == 0:
        raise ConfigError(
            f"method {method!r} trains on the server's unlabeled set U, but the config holds "
            "none out: set data.server_fraction > 0 (e.g. data.server_fraction=0.2; it is "
            "removed from the clients' data for every method of the config)"
        )
    return unlabeled
