"""Every refusal that spans several settings, and the one reader of what a method declares.

A config is checked before any run folder is looked at, so that the first error names the real
problem (a misspelt source or setting), not a folder in the way:

* names and method sections: every name the config gives is registered
  (:func:`name_problems`), a ``method.<name>`` section of a method not in ``algorithms`` names
  a registered method and only hyperparameters it has (:func:`unused_method_problems`), and a
  command-line ``method.<name>.*`` setting for a method the run leaves out is refused
  (:func:`check_overrides`);
* a method against the config: its overrides, ``robust.aggregate``, ``transport_dtype`` and
  clients per round (:func:`check_method_settings`, :func:`check_min_clients`), secure
  aggregation and DP (:func:`check_privacy`, :func:`check_secure_round`), the server's
  unlabeled set and regression data (:func:`server_data`);
* the model against the data: :func:`check_model_fits_data`,
  :func:`check_tokenizer_matches_model`, :func:`check_eval`, :func:`check_params`, and
  :func:`check_site_data`;
* :func:`preflight`: all of them for every method of an experiment on the real model, every
  problem at once, before any run folder is touched.

What a method declares (its optional class attributes: ``supports_robust_aggregate``,
``honours_transport_dtype``, ``min_clients_per_round``, ``individual_uploads``,
``supports_regression``, ``needs_server_data``, ``setup_rounds``, an ``optimizer`` setting) is
read here.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.algorithms.base import is_sum_aggregable
from fedlore.config import Config, ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fedlore.data.federation import Federation
    from fedlore.privacy import Privacy

log = logging.getLogger(__name__)

NAMED = (("data.name", "source"), ("partition.name", "partition"), ("model.name", "model"))
"""Config keys that name a registered entry, with the registry kind."""


def _names(cfg: Config) -> str:
    """``algorithms`` as the command line spells it: ``[fedfull, fedlore]``."""
    return f"[{', '.join(cfg.algorithms)}]"


def name_problems(cfg: Config) -> list[str]:
    """``key: unknown <kind> ...; registered: [...]`` for every name of :data:`NAMED` that is
    not registered."""
    problems = []
    for key, kind in NAMED:
        section, field = key.split(".")
        try:
            registry.get(kind, getattr(getattr(cfg, section), field))
        except KeyError as e:
            problems.append(f"{key}: {e.args[0] if e.args else e}")
    return problems


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
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(settings) - fields)
        if unknown:
            problems.append(
                f"method.{name}: {cls.__name__} has no hyperparameter(s) {unknown}; known: "
                f"{sorted(fields)} ({name} is not in algorithms {_names(cfg)} either)"
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


def check_method_settings(name: str, cls: type, cfg: Config, overrides: dict[str, Any]) -> None:
    """Refuse settings that method class ``cls`` (registered as ``name``) cannot honour: a
    ``method.<name>.freeze`` or ``.exclude`` override (``params.*`` sets them for every method),
    a robust aggregate for a method that averages no dense deltas, a 16-bit transport for one
    that sends at the model's dtype only.

    Raises:
        ValueError: for a ``freeze`` or ``exclude`` override; ConfigError: for the others.
    """
    for key in ("freeze", "exclude"):
        if key in overrides:
            raise ValueError(
                f"method.{name}.{key}: set params.{key} instead; it applies to every method "
                "alike (reference notes section 13.3)"
            )
    if cfg.robust.aggregate != "mean" and not getattr(cls, "supports_robust_aggregate", False):
        raise ConfigError(
            f"robust.aggregate={cfg.robust.aggregate}: method {name!r} does not average dense "
            "deltas (its server combines low-rank factors, bases or masks), so a coordinate-wise "
            "median or trimmed mean is not defined for it; use robust.aggregate=mean (the norm "
            "screen, robust.norm_screen, works for every method)"
        )
    if cfg.transport_dtype != "fp32" and not vars(cls).get("honours_transport_dtype", False):
        raise ConfigError(
            f"transport_dtype={cfg.transport_dtype}: method {name!r} sends its tensors at the "
            "model's dtype only; 16-bit transport is implemented for fedlore, fedlore_random, "
            "fedlore_fixed, fedlore_sketch, fedfull, fedavg, fedprox and the LoRA methods (use "
            "transport_dtype=fp32)"
        )


def check_min_clients(name: str, algo: Algorithm, cfg: Config) -> None:
    """Refuse a config that samples fewer clients per round than method ``name`` needs (its
    ``min_clients_per_round``).

    Raises:
        ValueError: naming both counts.
    """
    need = int(getattr(algo, "min_clients_per_round", 1))
    if cfg.clients_per_round() < need:
        raise ValueError(
            f"{name} needs at least {need} clients per round, the config samples "
            f"{cfg.clients_per_round()} (num_clients x participation)"
        )


def setup_rounds(algo: Algorithm) -> int:
    """How many setup exchanges the method runs before round 0 (its ``setup_rounds``; 0 when it
    declares none)."""
    return int(getattr(algo, "setup_rounds", 0))


def check_privacy(name: str, cls: type, cfg: Config) -> None:
    """Refuse a config that asks for secure aggregation or DP where it cannot hold.

    Raises:
        ConfigError: naming the setting and the reason: a method whose server needs individual
            uploads (its ``individual_uploads``), a robust aggregate (coordinate-wise medians
            need each upload), a 16-bit transport (the masked sum is fixed point), DP with
            ``weighting: num_examples`` (a client's weight would scale its contribution past C).
    """
    mode = privacy_modes(cfg)
    if not is_sum_aggregable(cls):
        why = getattr(cls, "individual_uploads", "")
        raise ConfigError(
            f"{mode}: method {name!r} cannot run under it: {why} (methods "
            "whose server needs only weighted sums: fedavg, fedfull, fedprox, fedit, ffa_lora, "
            "fedlore_sketch, fedlore_random, fedlore_fixed)"
        )
    if cfg.robust.aggregate != "mean":
        raise ConfigError(
            f"{mode}: robust.aggregate={cfg.robust.aggregate} needs each client's upload; only "
            "the weighted mean is a sum (use robust.aggregate=mean)"
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
    if cfg.eval.local:
        raise ConfigError(
            f"{mode}: eval.local reports each client's own test scores, which these modes do "
            "not release (only timings and memory travel in the clear); use eval.clients for "
            "the global model on the clients' test splits, or drop eval.local"
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
    """The server's unlabeled set U (``fed.server_unlabeled``) for a method that declares
    ``needs_server_data`` (:mod:`fedlore.algorithm`), None for one that does not.

    Raises:
        ConfigError: when ``method`` needs U and the config holds none out
            (``data.server_fraction`` is 0), or is a classification method (its class attribute
            ``supports_regression`` is False) and the data are a regression task.
    """
    if fed.task == "regression" and not getattr(algo, "supports_regression", True):
        raise ConfigError(
            f"method {method!r} needs class probabilities (it is defined for classification); "
            f"data source {fed.source!r} is a regression task"
        )
    if not getattr(algo, "needs_server_data", False):
        return None
    unlabeled = fed.server_unlabeled
    if unlabeled is None or len(unlabeled) == 0:
        raise ConfigError(
            f"method {method!r} trains on the server's unlabeled set U, but the config holds "
            "none out: set data.server_fraction > 0 (e.g. data.server_fraction=0.2; it is "
            "removed from the clients' data for every method of the config)"
        )
    return unlabeled


def check_site_data(cfg: Config, deployed: bool) -> None:
    """``flower.site_data`` needs a deployment (``deployed``: the run's transport is a Flower
    Grid's).

    Raises:
        ConfigError: for ``flower.site_data=true`` in process or in the simulation.
    """
    if cfg.flower.site_data and not deployed:
        raise ConfigError(
            "flower.site_data=true: each site's data stay on its SuperNode, so this run needs a "
            "`flwr run` deployment (scripts/flower_local_federation.sh with SITES=...); "
            "in process or in the simulation, leave it false"
        )


def check_params(cfg: Config, model: nn.Module) -> None:
    """Every ``params.exclude`` prefix names at least one tensor of ``model`` (a typo would
    silently project or adapt the head); ``params.freeze`` is checked by each method.

    Raises:
        ConfigError: naming the prefixes that match nothing.
    """
    names = list(model.state_dict())
    unused = [p for p in cfg.params.exclude if not any(n.startswith(p) for n in names)]
    if unused:
        raise ConfigError(
            f"params.exclude prefix(es) {unused} match no tensor of model {cfg.model.name!r} "
            f"(names look like {names[:3]})"
        )


def check_model_fits_data(model: str, fed: Federation) -> None:
    """Token-id data (text sources) needs a model that takes token ids, and image or feature
    data a model that does not; a pre-training corpus needs a causal language model, and
    labelled data a classifier.

    Raises:
        ConfigError: naming the model, the data's input dtype and the models that fit.
    """
    factory = registry.get("model", model)
    takes_tokens = bool(getattr(factory, "takes_token_ids", False))
    causal = bool(getattr(factory, "causal_lm", False))
    lm_data = fed.task == "language_modeling"
    if lm_data != causal:
        raise ConfigError(
            f"model {model!r} is "
            + ("a causal language model" if causal else "a classifier")
            + f", but data source {fed.source!r} is "
            + ("a pre-training corpus: use model.name=llama" if lm_data else "labelled")
        )
    tokens = not fed.pool.x.is_floating_point()
    if tokens and not takes_tokens:
        raise ConfigError(
            f"model {model!r} takes float inputs, but the data are token ids ({fed.pool.x.dtype}, "
            "a text source): use model.name=text_encoder"
        )
    if takes_tokens and not tokens:
        raise ConfigError(
            f"model {model!r} takes token ids, but the data are float features "
            f"({fed.pool.x.dtype}): use a text source (data.name=fortunes, text_csv, text_jsonl)"
        )


def check_eval(cfg: Config, fed: Federation) -> None:
    """Per-client evaluation needs local test splits, which a pre-training corpus does not
    have (every training document belongs to exactly one client's training data).

    Raises:
        ConfigError: for ``eval.clients=true`` on a pre-training corpus.
    """
    if cfg.eval.clients and fed.task == "language_modeling":
        raise ConfigError(
            f"eval.clients=true: {fed.source!r} clients have no local test split (the common "
            "validation corpus is evaluated every eval.every rounds); set eval.clients=false"
        )


def check_tokenizer_matches_model(cfg: Config, fed: Federation) -> None:
    """Text data must be tokenized with the text model's own tokenizer: ``data.tokenizer`` and
    ``model.kwargs.path`` name the same folder, or folders whose tokenizers (as Hugging Face
    loads them: ``tokenizer.json`` when present, else ``vocab.txt``) map the same tokens to the
    same ids with the same pad id; and no token id reaches past the model's embedding table
    (``vocab_size`` of the folder's ``config.json``, or of ``model.kwargs.config_overrides``).

    Raises:
        ConfigError: naming the folders and what differs.
    """
    if fed.pool.x.is_floating_point() or fed.task == "language_modeling":
        return  # a pre-training model takes its vocabulary size from the data's tokenizer
    from fedlore.data.text import load_tokenizer
    from fedlore.models.text import resolve_text_folder

    try:
        data_dir = resolve_text_folder(cfg.data.tokenizer).resolve()
    except FileNotFoundError as e:
        raise ConfigError(f"data.tokenizer: {e}") from e
    try:
        model_dir = resolve_text_folder(cfg.model.kwargs.get("path")).resolve()
    except FileNotFoundError as e:
        raise ConfigError(f"model.kwargs.path: {e}") from e
    data_tok = load_tokenizer(data_dir)
    if data_dir != model_dir:
        model_tok = load_tokenizer(model_dir)
        differs = []
        ours, theirs = data_tok.get_vocab(), model_tok.get_vocab()
        if ours != theirs:
            moved = sum(1 for t, i in ours.items() if theirs.get(t) != i)
            differs.append(
                f"vocabularies ({len(ours)} vs {len(theirs)} tokens; {moved} of the data's "
                "tokens have another id or none in the model's)"
            )
        if data_tok.pad_token_id != model_tok.pad_token_id:
            differs.append(f"pad ids ({data_tok.pad_token_id} vs {model_tok.pad_token_id})")
        if differs:
            raise ConfigError(
                f"data.tokenizer={str(data_dir)!r} and model.kwargs.path={str(model_dir)!r} have "
                f"different {' and '.join(differs)}: the data would be tokenized for another "
                "model. Set data.tokenizer to the model's folder (or leave both unset for "
                "all-MiniLM-L6-v2)."
            )
    overrides = cfg.model.kwargs.get("config_overrides") or {}
    vocab_size = overrides.get("vocab_size")
    if vocab_size is None:
        vocab_size = json.loads((model_dir / "config.json").read_text()).get("vocab_size")
    if isinstance(vocab_size, int) and len(data_tok) > vocab_size:
        raise ConfigError(
            f"the tokenizer in {str(data_dir)!r} has {len(data_tok)} tokens but the model's "
            f"embedding table has vocab_size={vocab_size} rows: ids past it cannot be embedded"
        )


def preflight(
    cfg: Config,
    fed: Federation,
    build: Callable[[], nn.Module],
    start: Callable[[str], Algorithm],
) -> list[tuple[str, Algorithm]]:
    """Refuse a config that would fail part-way: the model fits the data, the tokenizer is the
    model's, and every method accepts ``params`` and its hyperparameters on the real model
    (its server state is built once and dropped). Runs before any run folder is touched.
    Returns every method's name with the method as built.

    Args:
        build: the first seed's model factory (:func:`fedlore.experiment_parts.model_factory`).
        start: builds a method by name and starts its server on a fresh model (and, under secure
            aggregation, checks its round), raising ValueError (ConfigError included) for a
            problem; the driver passes it (:func:`fedlore.experiment.try_method`), so nothing
            here builds a method itself.

    Raises:
        ConfigError: naming the method and the problem.
    """
    check_model_fits_data(cfg.model.name, fed)
    check_tokenizer_matches_model(cfg, fed)
    check_eval(cfg, fed)
    check_params(cfg, build())
    problems: list[str] = []
    accepted: list[tuple[str, Algorithm]] = []
    for name in cfg.algorithms:  # every method's problems at once, not only the first's
        try:  # a fresh model per method: a method may convert its workspace (a BNN)
            algo = start(name)
        except ValueError as e:  # ConfigError included
            text = str(e)
            prefix = f"method {name!r}"
            problems.append(text if text.startswith(prefix) else f"{prefix}: {e}")
            continue
        accepted.append((name, algo))
    if problems:
        raise ConfigError("\n".join(problems))
    return accepted


def warn_own_optimizer(cfg: Config, name: str, algo: Algorithm) -> None:
    """Warn that ``optim.name`` does not reach method ``name`` when it keeps an inner optimizer
    of its own (it has no ``optimizer`` setting)."""
    if cfg.optim.name != "adam" and not hasattr(algo, "optimizer"):
        log.warning(
            "optim.name=%s sets the inner optimizer of the projected methods; %s keeps its "
            "own (method.%s.local_optimizer where it has one)",
            cfg.optim.name,
            name,
            name,
        )
