"""The parts of an experiment, each built from the config: the method, the model, the
server's first state and the evaluation of a server state.

:func:`make_algorithm` is the one place a method is built (with the config's common settings and
its ``method.<name>`` overrides, after :mod:`fedlore.checks` has had its say);
:func:`model_factory` builds the same initial model for every method of a seed;
:func:`start_server` starts the method's server (with the server's unlabeled set where the
method needs it); :func:`evaluator` scores a server state on the central test set, the
selection split and the clients' test splits, :func:`make_diagnoser` measures it
(``diagnostics.*``); :func:`describe_parameters` says at the start what a method projects or
adapts; :func:`try_method` is the preflight's trial of a method. :class:`Experiment` holds
them for one method and one seed (:func:`fedlore.experiment.build` makes it).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.checks import (
    adapts,
    check_asynchronous,
    check_early_stopping,
    check_eval,
    check_method_settings,
    check_min_clients,
    check_model_fits_data,
    check_privacy,
    check_tokenizer_matches_model,
    name_problems,
    privacy_modes,
    projects,
    server_data,
    unused_method_problems,
)
from fedlore.config import Config, ConfigError
from fedlore.data.client_data import TensorSplit
from fedlore.data.federation import Federation, build_federation
from fedlore.device import resolve_device
from fedlore.diagnostics import Diagnoser
from fedlore.experiment_privacy import make_privacy
from fedlore.models import build_model
from fedlore.privacy import Privacy
from fedlore.progress import say
from fedlore.seeding import MODEL_INIT, SERVER_INIT, derive_seed, generator
from fedlore.settings import build_hyper
from fedlore.tensors import load_model_arrays
from fedlore.tracking import tracking_problems
from fedlore.train.local import (
    classification_metrics,
    evaluate,
    is_regression,
    predictive_draws,
    predictive_log_probs,
    regression_metrics,
)
from fedlore.types import State

if TYPE_CHECKING:
    from fedlore.algorithms.lora_common import LoraMethod
    from fedlore.algorithms.lowrank import LowRankHyper

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Experiment:
    """One method for one seed, built and checked, with nothing written yet
    (:func:`fedlore.experiment.build`).

    Attributes:
        cfg: the config.
        method: the registered name of the method.
        seed: the run's seed.
        fed: the seed's federation, on ``device`` (checked against the model).
        device: where the run trains.
        fingerprint: ``fed.fingerprint()``, recorded in ``config.json``.
        algorithm: the method (:func:`~fedlore.experiment_parts.make_algorithm`).
        model_factory: builds the seed's initial model (the same for every method).
        eval_model: the model server states are evaluated on.
        state: the server's first state (a resumed run continues from its checkpoint instead).
        privacy: secure aggregation and DP (None without either); its clip norm and ledger
            total are updated as the run resumes and trains.
    """

    cfg: Config
    method: str
    seed: int
    fed: Federation
    device: torch.device
    fingerprint: str
    algorithm: Algorithm
    model_factory: Callable[[], nn.Module]
    eval_model: nn.Module
    state: State
    privacy: Privacy | None


def make_algorithm(name: str, cfg: Config) -> Algorithm:
    """The registered method ``name`` with the config's common settings and its ``method.<name>``
    overrides.

    Raises:
        KeyError: for an unknown method.
        ValueError: for an override the method does not have, or fewer clients per round than
            the method's ``min_clients`` (its capabilities).
    """
    cls = registry.get("algorithm", name)
    overrides = dict(cfg.method.get(name, {}))
    check_method_settings(name, cls, cfg, overrides)
    private = cfg.secure_aggregation or cfg.dp.enabled
    fixed = {"upload_increments": True} if private else {}
    if private:
        check_privacy(name, cls, cfg)
    try:  # every setting from its declared config path (fedlore.settings)
        algo: Algorithm = build_hyper(cls, name, cfg, overrides, **fixed)
    except ValueError as e:
        if not private:
            raise
        raise ConfigError(
            f"{privacy_modes(cfg)} (every upload becomes an increment, upload_increments=True): {e}"
        ) from e
    check_min_clients(name, algo, cfg)
    check_asynchronous(name, algo, cfg)  # asynchronous.buffer: FedBuff's methods and settings
    return algo


def model_factory(cfg: Config, fed: Federation, seed: int) -> Callable[[], nn.Module]:
    """Builds the model with the same initial weights for every method of a seed (the global
    torch RNG is forked, so nothing outside is disturbed) on the CPU, then moves it to the
    federation's device (so every device starts from the same weights), in float64 under
    ``precision: fp64`` (initialized in float32 and cast, so fp32 and fp64 runs start from the
    same weights up to the cast)."""

    def build() -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(seed, MODEL_INIT))
            model = build_model(
                cfg.model.name, tuple(fed.input_shape), fed.num_classes, **cfg.model.kwargs
            )
        dtype = torch.float64 if cfg.precision == "fp64" else None
        return model.to(device=fed.device, dtype=dtype)

    return build


def start_server(
    algo: Algorithm, model: nn.Module, rng: torch.Generator, fed: Federation, method: str
) -> State:
    """``algo.init_server(model, rng)``, with the server's unlabeled set U
    (``unlabeled=fed.server_unlabeled``) for a method whose capabilities have ``server_data``
    (:mod:`fedlore.algorithm`). Every run, the Flower ServerApp (through
    :func:`fedlore.experiment.run_one`) and the preflight (:func:`fedlore.checks.preflight`)
    start the server here.

    Raises:
        ConfigError: when ``method`` needs U and the config holds none out, or is a
            classification method and the data are a regression task
            (:func:`fedlore.checks.server_data`).
    """
    unlabeled = server_data(algo, fed, method)
    if unlabeled is None:
        return algo.init_server(model, rng)
    init: Callable[..., State] = algo.init_server
    return init(model, rng, unlabeled=unlabeled)


def make_diagnoser(
    cfg: Config, algo: Algorithm, model: nn.Module, fed: Federation, seed: int
) -> Diagnoser | None:
    """The run's diagnostics (``diagnostics.*``; None when ``diagnostics.every`` is 0), on the
    scratch ``model``."""
    if cfg.diagnostics.every == 0:
        return None
    d = cfg.diagnostics
    uniform = cfg.weighting == "uniform"
    return Diagnoser(
        algo, model, fed.client, fed.num_clients, d.every, d.batch_size, d.clients, seed,
        cfg.rank, uniform=uniform,
    )  # fmt: skip


def evaluator(
    cfg: Config, fed: Federation, algo: Algorithm, model: nn.Module
) -> Callable[[State], dict[str, float]]:
    """Server state -> its evaluation row: the global model (loaded into ``model``) on the
    central test set (``accuracy``, ``loss``, ``ece``, ``perplexity`` or ``rmse``), on the
    selection split when there is one (``selection_*``), and with ``eval.clients`` on every
    client's test split (:func:`global_local_metrics`; the splits are pooled once, here)."""
    tests = [fed.client(c).test for c in range(fed.num_clients)] if cfg.eval.clients else []
    tests = [t for t in tests if len(t)]
    pooled_tests = TensorSplit.concat(tests) if tests else None  # built once per run
    test_sizes = [len(t) for t in tests]

    extra = tuple(cfg.eval.metrics)

    def evaluate_state(s: State) -> dict[str, float]:
        load_model_arrays(model, algo.global_arrays(s))
        bs, mc = cfg.eval.batch_size, cfg.eval.mc_samples
        res = evaluate(model, fed.central_test, bs, mc, extra)
        keys = ("accuracy", "loss", "ece", "perplexity", "rmse", *extra)
        row: dict[str, float] = {k: res[k] for k in keys if k in res}
        if fed.selection is not None:  # the split hyperparameters are chosen on
            sel = evaluate(model, fed.selection, bs, mc, extra)
            for k in ("accuracy", "loss", "perplexity", "rmse", *extra):
                if k in sel:
                    row[f"selection_{k}"] = sel[k]
        if cfg.eval.clients:
            row.update(global_local_metrics(model, pooled_tests, test_sizes, bs, mc, extra))
        levels = level_scores(algo, s, model, fed, bs, mc)
        if levels:
            row["levels"] = levels  # type: ignore[assignment]
        return row

    return evaluate_state


def level_scores(
    algo: Algorithm, state: State, model: nn.Module, fed: Federation, bs: int, mc: int
) -> dict[str, dict[str, float | None]]:
    """A method's per-level evaluation (HeteroFL's ``eval_levels``): for each sub-model of its
    optional ``level_models(state, model, num_clients)`` the central test set's ``accuracy``
    and ``loss`` with the level's ``share``, ``clients`` and ``params``, keyed by the level's
    rate (a score that is not finite: None); empty for a method without levels."""
    levels = getattr(algo, "level_models", None)
    out: dict[str, dict[str, float | None]] = {}
    for rate, sub, info in [] if levels is None else levels(state, model, fed.num_clients):
        res = evaluate(sub, fed.central_test, bs, mc)
        scores = {k: float(res[k]) for k in ("accuracy", "loss")}
        out[str(rate)] = {k: v if math.isfinite(v) else None for k, v in scores.items()} | info
    return out


def global_local_metrics(
    model: nn.Module,
    pooled: TensorSplit | None,
    sizes: list[int],
    batch_size: int,
    mc_samples: int,
    extra: Sequence[str] = (),
) -> dict[str, float]:
    """G-local (reference notes Part 0.8): the global model on every client's test split, one
    predictive pass over their concatenation ``pooled`` (client after client, ``sizes`` examples
    each; None when no client has a test split). Pooled ``client_accuracy``, ``client_loss``
    (NLL) and ``client_ece`` over all test examples; over the clients' own accuracies (each
    client counts once, whatever its test size): ``client_accuracy_mean``, the spread
    ``client_accuracy_std`` (sample std), the worst client ``client_accuracy_min`` and the
    10th percentile ``client_accuracy_p10`` (linear interpolation), the fairness figures FL
    papers report besides the mean; ``client_<name>`` of each ``extra`` metric
    (``eval.metrics``) on the pooled splits. Clients without a test split are left out."""
    if pooled is None:
        return {}
    if is_regression(pooled.y):  # RMSE and NLL over every client's test example
        draws = predictive_draws(model, pooled.x, batch_size, mc_samples)
        reg = regression_metrics(draws, pooled.y)
        return {"client_rmse": reg["rmse"], "client_loss": reg["loss"]}
    log_probs = predictive_log_probs(model, pooled.x, batch_size, mc_samples)
    scores = classification_metrics(log_probs, pooled.y, extra)
    out = {f"client_{k}": v for k, v in scores.items()}
    out.pop("client_num_examples")
    if not bool(torch.isfinite(log_probs).all()):  # a diverged model: no score is meaningful
        return {**out, **dict.fromkeys(CLIENT_SPREAD, float("nan"))}
    hits = (log_probs.argmax(-1) == pooled.y).float()
    per = [float(h.mean()) for h in hits.split(sizes) if h.numel()]
    out["client_accuracy_mean"] = sum(per) / len(per)
    spread = torch.tensor(per, dtype=torch.float64)  # a CPU summary of a few numbers
    out["client_accuracy_std"] = float(spread.std()) if len(per) > 1 else 0.0
    out["client_accuracy_min"] = min(per)
    out["client_accuracy_p10"] = float(torch.quantile(spread, 0.1))
    return out


CLIENT_SPREAD = (
    "client_accuracy_mean",
    "client_accuracy_std",
    "client_accuracy_min",
    "client_accuracy_p10",
)
"""The row keys of :func:`global_local_metrics` over the clients' own accuracies."""


def describe_parameters(name: str, algo: Algorithm, model: nn.Module) -> None:
    """Say once, at the start of a run (:func:`fedlore.progress.say`), which matrices ``algo``
    projects (FedLore, Local GaLore: ``plan``) or adapts (the LoRA methods: ``targets``) and
    which tensors train densely, and warn about every Linear/Conv weight outside
    ``params.exclude`` that is not projected because the rank covers it (``min(m, n) <= rank``):
    it trains densely, which a user asking for a projected method would not expect."""
    prepare = getattr(algo, "prepare_model", None)
    if prepare is not None:  # a Bayesian or MC-dropout twin: its own tensors
        model = prepare(model)
    params = dict(model.named_parameters())
    if projects(algo) is not None:
        lowrank = cast("LowRankHyper", algo)
        is_frozen = lowrank.is_frozen
        plan = lowrank.plan(model)
        kind = f"projects (rank {lowrank.rank})"
        chosen = {k: f"{s.m}x{s.n}" for k, s in plan.items()}
        for k, spec in plan.items():
            if spec.rank * (spec.m + spec.n) >= spec.m * spec.n:
                log.warning(
                    "%s: %s %dx%d is projected, but at rank %d its basis and coordinates "
                    "(r(m+n) = %d numbers) cost more than the matrix itself (%d): lower the rank "
                    "to save bytes",
                    name,
                    k,
                    spec.m,
                    spec.n,
                    spec.rank,
                    spec.rank * (spec.m + spec.n),
                    spec.m * spec.n,
                )
        for weight, shape in lowrank.projectable(model).items():
            if weight in plan or is_frozen(weight):
                continue
            if any(weight.startswith(p) for p in lowrank.exclude):
                continue
            m, n = shape[0], math.prod(shape[1:])
            log.warning(
                "%s: %s %s is not projected (min(m, n) = %d <= rank %d): it trains densely",
                name,
                weight,
                f"{m}x{n}",
                min(m, n),
                lowrank.rank,
            )
    elif adapts(algo):
        lora = cast("LoraMethod", algo)
        is_frozen = lora.is_frozen
        targets = lora.targets(model)
        kind = f"adapts (rank {lora.rank})"
        chosen = {f"{k}.weight": f"{t.m}x{t.n}" for k, t in targets.items()}
    else:
        return
    frozen = [k for k in params if is_frozen(k)]
    dense = [k for k in params if k not in chosen and k not in frozen]
    say(
        "%s %s %d matrices: %s; trains densely: %s%s",
        name,
        kind,
        len(chosen),
        ", ".join(f"{k} {v}" for k, v in chosen.items()),
        ", ".join(dense) or "nothing",
        f"; frozen: {', '.join(frozen)}" if frozen else "",
    )


def try_method(
    cfg: Config, fed: Federation, build_model: Callable[[], nn.Module], name: str
) -> Algorithm:
    """Method ``name`` built, its server started on a fresh model of ``build_model`` and
    dropped, and under secure aggregation its round (under ``dp.audit``, its canaries) checked:
    the preflight's trial of one method (:func:`fedlore.checks.preflight`).

    Raises:
        ValueError (ConfigError included), KeyError: the method's problem.
    """
    rng = generator(cfg.seeds[0], SERVER_INIT)
    algo = make_algorithm(name, cfg)
    state = start_server(algo, build_model(), rng, fed, name)
    if cfg.secure_aggregation or cfg.dp.audit.canaries:  # its round / audit checks, up front
        make_privacy(cfg, algo, cfg.seeds[0], float(fed.client_sizes().max()), state)
    return algo


def prepare_federation(cfg: Config, seed: int, fed: Federation | None = None) -> Federation:
    """The federation of ``seed`` (``fed``, or built) on the config's device, checked against
    the model: it fits the data, the tokenizer is the model's, ``eval.clients`` can hold, and
    so can ``early_stopping`` (:func:`~fedlore.checks.check_early_stopping`).

    Raises:
        ConfigError: naming the device, model or setting that does not fit.
    """
    device = resolve_device(cfg.device)
    fed = fed if fed is not None else build_federation(cfg, seed)
    fed = fed.to(device)  # once per run: every client's data are slices made there
    check_model_fits_data(cfg.model.name, fed)
    check_tokenizer_matches_model(cfg, fed)
    check_eval(cfg, fed)
    check_early_stopping(cfg, fed)
    return fed


def check_config(cfg: Config) -> None:
    """The config's own problems, all at once, before any folder is looked at (a typo is the
    problem to name, not a run folder in the way): names, settings of methods the run leaves
    out, trackers, and every method's name and hyperparameters.

    Raises:
        ConfigError: ``invalid config:`` and one line per problem.
    """
    problems = [*name_problems(cfg), *unused_method_problems(cfg), *tracking_problems(cfg)]
    for name in cfg.algorithms:
        try:
            make_algorithm(name, cfg)  # unknown methods and bad hyperparameters fail early
        except KeyError as e:  # not registered: the key is algorithms
            problems.append(f"algorithms: {e.args[0] if e.args else e}")
        except ValueError as e:  # the method's settings
            text = str(e.args[0] if e.args else e)
            named = f"method.{name}" in text or f"'{name}'" in text  # said once is enough
            problems.append(text if named else f"{name}: {text}")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
