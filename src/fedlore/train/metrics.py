"""The scores of a classifier's predictive: accuracy, NLL and ECE, always
(:func:`classification_metrics`), and the further metrics a config names in ``eval.metrics``.

A metric scores a classifier's predictive on a split: ``fn(log_probs, y) -> float`` with
``log_probs`` the ``[n, K]`` log predictive probabilities (the MC predictive for a stochastic
model, :func:`fedlore.train.local.predictive_log_probs`) and ``y`` the ``[n]`` class indices. The
evaluation computes the predictive once and hands it to every metric, so a metric costs no
forward pass. Each named metric is recorded for the central test set (``<name>``), the
selection split (``selection_<name>``), with ``eval.clients`` the clients' pooled test splits
(``client_<name>``) and with ``eval.local`` each client's own model on its test split, the
test-size-weighted mean over the clients (``local_<name>``, P-local); ``summary.json`` holds
their last values as ``final_<key>``.

Built in:

- ``balanced_accuracy``: the mean over the classes present in ``y`` of each class's recall
  (scikit-learn's ``balanced_accuracy_score``; a client's test split that lacks a class does
  not count it as a zero, as torchmetrics' macro accuracy would), the accuracy a skewed test
  set does not inflate;
- ``f1_macro``: the unweighted mean of the per-class F1 scores over the classes in ``y`` or
  predicted (torchmetrics ``multiclass_f1_score``, as scikit-learn's ``f1_score``);
- ``top5_accuracy``: the share of examples whose class is among the five most probable
  (refused with 5 classes or fewer, where it is 1);
- ``auroc_macro``: the mean one-vs-rest area under the ROC curve (torchmetrics
  ``multiclass_auroc`` per class) over the classes with positives and negatives in ``y`` (NaN
  with one class);
- ``brier``: the mean over examples of ``sum_k (p_k - [y = k])^2`` (Brier 1950, the
  multi-class form; 0 is perfect, 2 the worst), a proper score of the whole predictive.

Register your own with :func:`fedlore.registry.register_metric` in a module the config's
``imports`` names::

    @register_metric("worst_class_recall")
    def worst_class_recall(log_probs, y):
        ...
        return float(value)
"""

from __future__ import annotations

import re
import reprlib
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fedlore import registry
from fedlore.registry import register_metric
from fedlore.types import LOOP_KEYS

Metric = Callable[[torch.Tensor, torch.Tensor], float]

ALWAYS = frozenset({"accuracy", "loss", "ece", "perplexity", "rmse"})
"""What every evaluation records already."""

RESERVED = (
    ALWAYS
    | frozenset(
        {
            # the evaluation's and the G-local spread's (client_<name> of these); the round
            # loop's are LOOP_KEYS
            "num_examples",
            "num_tokens",
            "accuracy_mean",
            "accuracy_std",
            "accuracy_min",
            "accuracy_p10",
            "eval_metrics",
            # report.csv's final_accuracy_pct_mean (final_<name>_mean of a metric's columns)
            "accuracy_pct",
            # P-local's own (local_<name> of these: local_n, local_clients, local_mse)
            "n",
            "clients",
            "mse",
        }
    )
    | LOOP_KEYS
)
"""Row keys fedlore writes itself: a metric named like one would replace it."""

RESERVED_PREFIXES = ("client_", "selection_", "local_", "final_", "best_", "diag", "dp_", "lr_")
"""Prefixes of the keys fedlore writes (and of those it makes from a metric's name)."""

NAME = re.compile(r"[a-z][a-z0-9_]*")

ECE_BINS = 15
"""Equal-width confidence bins of the expected calibration error (Guo et al. 2017)."""


@register_metric("balanced_accuracy")
def balanced_accuracy(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean recall over the classes present in ``y`` (argmax predictions)."""
    k = int(log_probs.shape[-1])
    hits = (log_probs.argmax(-1) == y).to(torch.float64)
    per_class = torch.bincount(y, weights=hits, minlength=k)
    counts = torch.bincount(y, minlength=k)
    present = counts > 0
    return float((per_class[present] / counts[present]).mean())


@register_metric("f1_macro")
def f1_macro(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Unweighted mean of the per-class F1 scores (argmax predictions)."""
    from torchmetrics.functional.classification import multiclass_f1_score

    k = int(log_probs.shape[-1])
    return float(multiclass_f1_score(log_probs.exp(), y, num_classes=k, average="macro"))


@register_metric("top5_accuracy")
def top5_accuracy(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Share of examples whose class is among the five most probable."""
    from torchmetrics.functional.classification import multiclass_accuracy

    k = int(log_probs.shape[-1])
    if k <= 5:
        raise ValueError(f"top5_accuracy needs more than 5 classes, the model has {k}")
    return float(multiclass_accuracy(log_probs.exp(), y, num_classes=k, top_k=5, average="micro"))


@register_metric("auroc_macro")
def auroc_macro(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean one-vs-rest ROC AUC over the classes that have positives and negatives in ``y``."""
    from torchmetrics.functional.classification import multiclass_auroc

    k = int(log_probs.shape[-1])
    counts = torch.bincount(y, minlength=k)
    scored = (counts > 0) & (counts < len(y))
    if not bool(scored.any()):
        return float("nan")  # one class only: no ROC curve
    with warnings.catch_warnings():  # torchmetrics warns of the classes left out below
        warnings.simplefilter("ignore", UserWarning)
        per_class = multiclass_auroc(log_probs.exp(), y, num_classes=k, average="none")
    return float(per_class[scored].mean())


@register_metric("brier")
def brier(log_probs: torch.Tensor, y: torch.Tensor) -> float:
    """Mean over examples of the squared distance between the predictive and the one-hot label."""
    probs = log_probs.exp().to(torch.float64)
    onehot = torch.nn.functional.one_hot(y, probs.shape[-1]).to(probs)
    return float((probs - onehot).pow(2).sum(-1).mean())


def check_names(names: Sequence[str]) -> list[str]:
    """Problems of an ``eval.metrics`` list: unknown names (with a did-you-mean), names a
    metric may not have (a key fedlore writes, or one it would make of the name), duplicates."""
    problems = []
    for name in names:
        if name in ALWAYS:
            problems.append(f"eval.metrics: {name!r} is recorded in every evaluation already")
            continue
        if not NAME.fullmatch(name):
            problems.append(
                f"eval.metrics: {name!r} cannot name a metric (lower-case letters, digits and _, "
                f"starting with a letter){registry.did_you_mean(name, registry.names('metric'))}"
            )
            continue
        if name in RESERVED or name.startswith(RESERVED_PREFIXES):
            problems.append(
                f"eval.metrics: {name!r} cannot name a metric: fedlore writes a key of that name "
                f"(its own keys, and those starting with {', '.join(RESERVED_PREFIXES)})"
            )
            continue
        try:
            registry.get("metric", name)
        except KeyError as e:
            problems.append(f"eval.metrics: {e.args[0] if e.args else e}")
    dup = sorted({n for n in names if list(names).count(n) > 1})
    if dup:
        problems.append(f"eval.metrics: {dup} named twice")
    return problems


class MetricError(ValueError):
    """A metric of ``eval.metrics`` raised, or returned something other than one real
    number; the message names it."""


def real_number(name: str, value: object) -> float:
    """A metric's value as a float: a Python or NumPy real, or a one-element tensor.

    Raises:
        MetricError: naming the metric, for anything else (a bool, a string, None, a tensor of
            several values).
    """
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.dtype.is_complex and value.dtype != torch.bool:
            return float(value.item())
        shown = f"a {value.dtype} tensor of shape {list(value.shape)}"
    elif isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    elif isinstance(value, np.ndarray | np.generic) and value.size == 1:
        if value.dtype.kind in "iuf":  # not bool, complex, text
            return float(value.item())
        shown = f"a numpy {value.dtype} value"
    else:
        # a whole repr, abbreviated where long ({'a': 1, ...}, 'abc...xyz'), not a cut one
        shown = f"{type(value).__name__} {reprlib.repr(value)}"
    raise MetricError(f"metric {name!r} returned {shown}; a metric returns one real number")


def trial_problems(
    names: Sequence[str], y: torch.Tensor, num_classes: int, where: str = "", limit: int = 64
) -> list[str]:
    """Each metric of ``names`` called once, before any run, on a made-up predictive over
    ``num_classes`` for the first ``limit`` labels of ``y`` (all of them for ``limit=0``; a
    client's test split, whose classes decide what a metric can score, is tried whole): a
    metric that raises or returns no real number is named now, not after the first
    ``eval.every`` rounds of training. ``where`` names the split in the message."""
    y = (y[:limit] if limit else y).cpu()
    if len(y) == 0:
        return []
    g = torch.Generator().manual_seed(0)  # a stand-in predictive, not a result
    log_probs = torch.log_softmax(torch.randn(len(y), num_classes, generator=g), -1)
    problems = []
    for name in names:
        try:
            extra_metrics(log_probs, y, [name])
        except MetricError as e:
            on = f" on {where}" if where else ""
            problems.append(f"eval.metrics: {e} (on a trial predictive{on}, before training)")
    return problems


def extra_metrics(
    log_probs: torch.Tensor, y: torch.Tensor, names: Sequence[str]
) -> dict[str, float]:
    """``{name: value}`` of every metric in ``names`` on one predictive; NaN for each when a
    log probability is not finite (a diverged model) or the split is empty.

    Raises:
        MetricError: naming the metric, when it raised (``top5_accuracy`` with 5 classes) or
            returned something that is not one real number (:func:`real_number`).
    """
    if not names:
        return {}
    if len(y) == 0 or not bool(torch.isfinite(log_probs).all()):
        return dict.fromkeys(names, float("nan"))
    out = {}
    for name in names:
        try:  # on copies: a metric that edits its inputs cannot change another's scores
            value = registry.get("metric", name)(log_probs.clone(), y.clone())
        except Exception as e:
            raise MetricError(f"metric {name!r} failed: {type(e).__name__}: {e}") from e
        out[name] = real_number(name, value)
    return out


def classification_metrics(
    log_probs: torch.Tensor, y: torch.Tensor, extra: Sequence[str] = ()
) -> dict[str, float]:
    """Accuracy, NLL and ECE of predictive log probabilities.

    Args:
        log_probs: ``[n, K]`` log predictive probabilities.
        y: ``[n]`` class indices.
        extra: names of further metrics (``eval.metrics``, :mod:`fedlore.train.metrics`), each
            added under its name.

    Returns:
        ``accuracy`` (argmax, torchmetrics micro), ``loss`` (mean NLL ``-log p(y|x)`` in nats),
        ``ece`` (torchmetrics ``multiclass_calibration_error``, 15 equal-width bins, L1;
        Guo et al. 2017), and ``num_examples``; all NaN when a log probability is not finite
        (a diverged model), never a chance-level accuracy read from NaN probabilities.
    """
    from torchmetrics.classification import MulticlassAccuracy  # lazily: seconds to import
    from torchmetrics.functional.classification import multiclass_calibration_error

    k = int(log_probs.shape[-1])
    more = extra_metrics(log_probs, y, extra)  # NaN for each when the model diverged
    if not bool(torch.isfinite(log_probs).all()):  # a diverged model: no score is meaningful
        nan = float("nan")
        return {"accuracy": nan, "loss": nan, "ece": nan, "num_examples": len(y), **more}
    probs = log_probs.exp()
    acc = MulticlassAccuracy(num_classes=k, average="micro")(probs, y)
    nll = F.nll_loss(log_probs, y)
    ece = multiclass_calibration_error(probs, y, num_classes=k, n_bins=ECE_BINS, norm="l1")
    scores = {"accuracy": float(acc), "loss": float(nll), "ece": float(ece)}
    return {**scores, "num_examples": len(y), **more}
