"""The refusals of ``early_stopping`` (:class:`fedlore.config.EarlyStoppingConfig`) that span
other settings: the watched metric must be one the run records at every evaluation
(:func:`recorded_metrics`), not one of the test sets it reports (unless
``early_stopping.allow_test``, which warns, once for all the runs of a command), and, under DP,
not one read from the clients' data outside the mechanism.

Threat model under DP (the accountant's ε covers what the clients' noised uploads reveal):
the round the run stops at and the model it keeps are functions of the released global models
and of data the server holds itself (the selection split, the central test set), which is
post-processing and costs no ε. A metric read from the clients' data beside the mechanism
(``client_*``: their test splits; ``train_loss``: their training losses, which clients do not
release under DP or secure aggregation at all, :func:`fedlore.privacy.released_metrics`)
would make the released model depend on data ε does not cover, so it is refused.

The metric ``fedlore tune`` optimizes (:func:`check_tune_metric`) follows the same rule, more
strictly: only the selection split's scores.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from fedlore import registry
from fedlore.config import Config, ConfigError
from fedlore.config_stopping import known_direction, watches_test
from fedlore.progress import in_command, warn_once
from fedlore.stopping_rule import OPTIONAL

if TYPE_CHECKING:
    from fedlore.data.federation import Federation


class TestSelectionWarning(UserWarning):
    """Early stopping watches a metric of a test set the run reports
    (``early_stopping.allow_test``): the reported scores are optimistic."""

    __test__ = False  # not a pytest test class


CLIENT_SPREAD = ("accuracy_mean", "accuracy_std", "accuracy_min", "accuracy_p10")


def recorded_metrics(cfg: Config, fed: Federation) -> set[str]:
    """The row keys the run records at every evaluation (and ``train_loss`` every round)
    that early stopping may watch: what :func:`fedlore.experiment_parts.evaluator` scores on
    the central test set, the selection split (``selection_*``, when the federation has one)
    and, with ``eval.clients``, the clients' test splits (``client_*``), for the federation's
    task; ``train_loss`` unless secure aggregation or DP keeps the clients' losses home."""
    central, selection, client = _scores(cfg, fed)
    out = set(central)
    if fed.selection is not None:
        out |= {f"selection_{k}" for k in selection}
    if cfg.eval.clients:
        out |= {f"client_{k}" for k in client}
    if not (cfg.secure_aggregation or cfg.dp.enabled):
        out.add("train_loss")
    return out


def _scores(cfg: Config, fed: Federation) -> tuple[set[str], set[str], set[str]]:
    """The scores of the central test set, the selection split and the clients' test splits
    (without their prefixes) for the federation's task."""
    extra = set(cfg.eval.metrics)
    if fed.task == "regression":
        return {"rmse", "loss"}, {"rmse", "loss"}, {"rmse", "loss"}
    if fed.task == "language_modeling":
        scores = {"accuracy", "loss", "perplexity"}
        return scores, set(scores), set()  # no local test splits
    return (
        {"accuracy", "loss", "ece"} | extra,
        {"accuracy", "loss"} | extra,
        {"accuracy", "loss", "ece", *CLIENT_SPREAD} | extra,
    )


def _selection_twin(cfg: Config, fed: Federation, metric: str) -> str:
    """The selection split's score to watch instead of a test set's ``metric``: its namesake,
    or, where the selection split scores none (the clients' spread, ECE), its accuracy for an
    accuracy figure and its loss otherwise."""
    base = metric.removeprefix("client_")
    if base in _scores(cfg, fed)[1]:
        return f"selection_{base}"
    return "selection_accuracy" if base.startswith("accuracy") else "selection_loss"


def check_early_stopping(cfg: Config, fed: Federation) -> None:
    """Refuse an ``early_stopping`` the run cannot honour; warn (:class:`TestSelectionWarning`)
    when it selects on a test set with ``allow_test``.

    Raises:
        ConfigError: a metric the run does not record (naming why and what it records); a
            test set's metric without ``allow_test``; a ``client_*`` metric under DP;
            ``train_loss`` with ``eval.every`` above 1.
    """
    es = cfg.early_stopping
    metric = es.metric
    if metric is None:
        return
    recorded = recorded_metrics(cfg, fed)
    if metric not in recorded:
        raise ConfigError(f"early_stopping.metric={metric}: {_why_not(cfg, fed, metric)}; the "
                          f"run records {', '.join(sorted(recorded))}")  # fmt: skip
    if metric == "train_loss" and cfg.eval.every > 1:
        raise ConfigError(
            f"early_stopping.metric=train_loss with eval.every={cfg.eval.every}: the round it "
            "stops at (or keeps, restore_best) may have no evaluation to report; set "
            "eval.every=1 or watch a selection_* metric"
        )
    if not watches_test(metric):
        return
    where = "the clients' test splits" if metric.startswith("client_") else "the central test set"
    if metric.startswith("client_") and cfg.dp.enabled:
        raise ConfigError(
            f"early_stopping.metric={metric} under DP: {where} are the clients' data, read "
            "outside the mechanism; choosing the round on them would release the choice "
            "beside ε. Watch the selection split (data.selection_fraction, "
            f"early_stopping.metric={_selection_twin(cfg, fed, metric)}), which the "
            "server holds: post-processing, no ε"
        )
    if not es.allow_test:
        alternative = _selection_twin(cfg, fed, metric)
        raise ConfigError(
            f"early_stopping.metric={metric} is scored on {where}, which the run reports: "
            "stopping and selecting on it inflates the reported scores. Watch the selection "
            f"split instead (early_stopping.metric={alternative}, with data.selection_fraction "
            "above 0, e.g. 0.1), or set early_stopping.allow_test=true to do it anyway (the "
            "summary says so)"
        )
    if not in_command():  # one run (run_one, build): every time
        warnings.warn(_test_selection(cfg, fed), TestSelectionWarning, stacklevel=2)
    # in a command (fedlore run, its dry run) the command says it once, counting the runs it
    # trains and keeps (warn_test_selection)


def warn_test_selection(cfg: Config, fed: Federation, trains: int, kept: int) -> None:
    """The command's one :class:`TestSelectionWarning` (``early_stopping.allow_test`` on a test
    set's metric; nothing otherwise), said once (:func:`fedlore.progress.warn_once`) before its
    first run, counting what the command does: the ``trains`` runs it trains (or continues)
    and the ``kept`` finished runs it keeps, which stopped and selected on it when they ran.
    :func:`fedlore.experiment.run_experiment` and ``fedlore run --dry-run`` call it."""
    es = cfg.early_stopping
    if es.metric is None or not es.allow_test or not watches_test(es.metric):
        return
    warn_once(_test_selection(cfg, fed, trains, kept, command=True), TestSelectionWarning)


def _test_selection(
    cfg: Config, fed: Federation, trains: int = 1, kept: int = 0, command: bool = False
) -> str:
    """The ``allow_test`` warning's words for a command that trains ``trains`` runs and keeps
    ``kept`` finished ones (``command`` False: one run of its own)."""
    metric = cfg.early_stopping.metric
    assert metric is not None
    where = "the clients' test splits" if metric.startswith("client_") else "the central test set"
    finished = "the finished run" if kept == 1 else f"the {kept} finished runs"
    whose = "its" if kept == 0 or trains + kept == 1 else "their"
    if trains == 0:
        said = f"{finished} the command keeps (it trains none) stopped and selected"
    else:
        if not command or (trains == 1 and kept == 0):
            runs = "the run"
        elif kept == 0:
            runs = f"each of the command's {trains} runs"
        else:
            runs = "the one run" if trains == 1 else f"each of the {trains} runs"
            runs += f" the command trains (as {finished} it keeps did)"
        said = f"{runs} stops and selects"
    return (
        f"early_stopping.metric={metric} (allow_test): {said} on {where} it reports, so "
        f"{whose} scores there are optimistic; {_selection_twin(cfg, fed, metric)} on the "
        "selection split would not be"
    )


def _why_not(cfg: Config, fed: Federation, metric: str) -> str:
    """Why the run does not record ``metric``, in words."""
    if metric.startswith("selection_") and fed.selection is None:
        return "the run holds out no selection split (set data.selection_fraction, e.g. 0.1)"
    if metric.startswith("client_") and not cfg.eval.clients:
        return "client_* scores need eval.clients=true"
    if metric.startswith("local_"):
        return "P-local scores are recorded in the last round only"
    if metric == "train_loss":
        return "clients release no training loss under secure aggregation or DP"
    if (listed := _unlisted(cfg, fed, metric)) is not None:
        return listed
    return f"not a score of this {fed.task.replace('_', ' ')} run"


def _unlisted(cfg: Config, fed: Federation, metric: str) -> str | None:
    """The exact fix when ``metric`` names a classifier's optional score (fedlore's
    :data:`~fedlore.stopping_rule.OPTIONAL` or a plugin's) that ``eval.metrics`` does not list:
    the run records it only when listed. None otherwise (another task, another name)."""
    base = metric.removeprefix("selection_").removeprefix("client_")
    if fed.task != "classification" or base in cfg.eval.metrics:
        return None
    if base not in OPTIONAL and base not in registry.names("metric"):
        return None
    fix = ", ".join([*cfg.eval.metrics, base])
    return f"{base} is recorded only when eval.metrics lists it: set eval.metrics=[{fix}]"


def check_tune_metric(cfg: Config, fed: Federation, metric: str) -> None:
    """Refuse a ``tune.metric`` (``fedlore tune --metric``) that is not a score of the selection
    split the run records: a score of a test set the run reports (the central test set, the
    clients' test splits ``client_*``, their P-local ``local_*``), named with the selection
    split's twin as :func:`check_early_stopping` names it; anything else with why the run does
    not record it. Choosing hyperparameters on the selection split, which the server holds, is
    post-processing under DP.

    Raises:
        ConfigError: as above; and when the run holds out no selection split.
    """
    if fed.selection is None:
        raise ConfigError(
            "fedlore tune chooses on the selection split, and the run holds none: set "
            "data.selection_fraction above 0 (e.g. 0.1), a share of the training data held out "
            "of every client; the test sets the run reports never choose"
        )
    recorded = recorded_metrics(cfg, fed)
    if metric.startswith("selection_") and metric in recorded:
        return
    local = metric.startswith("local_")
    a_score = metric in recorded or known_direction(metric.removeprefix("local_")) is not None
    if (watches_test(metric) or local) and a_score:  # a misspelt name is no test-set score
        where = (
            "the clients' test splits"
            if metric.startswith(("client_", "local_"))
            else "the central test set"
        )
        twin = _selection_twin(cfg, fed, metric.removeprefix("local_"))
        raise ConfigError(
            f"tune.metric={metric} is scored on {where}, which the run reports: choosing "
            "hyperparameters on it inflates the reported scores. Tune on the selection split "
            f"instead (--metric {twin}, with data.selection_fraction above 0, e.g. 0.1)"
        )
    if metric.startswith("selection_"):
        why = _why_not(cfg, fed, metric)
    else:
        why = "not a score of the selection split"
    scores = sorted(m for m in recorded if m.startswith("selection_"))
    raise ConfigError(f"tune.metric={metric}: {why}; the run records {', '.join(scores)}")
