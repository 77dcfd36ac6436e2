"""Hyperparameters every method shares, and small helpers the method modules reuse.

Parity (reference notes section 13): every method gets the same K local steps, the same
minibatches, the same learning-rate schedule, the same optimizer reset each round (a fresh
optimizer per round), the same gradient clipping, weight-decay policy and aggregation weights.
"""

from __future__ import annotations

import fnmatch
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self

import torch
from pydantic import ConfigDict
from torch import nn

from fedlore.algorithm import Capabilities
from fedlore.algorithms.sync import LogFormat, clients_restarted
from fedlore.checks import check_wire_settings
from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.device import autocast
from fedlore.optim.server import ServerOpt
from fedlore.settings import STEP_BUDGET, LocalTraining
from fedlore.tensors import WIRE_DTYPES, select
from fedlore.train.local import Schedule, evaluate, task_loss
from fedlore.train.metrics import MetricError
from fedlore.types import Reply, Scalar, Scalars, State

ReplySpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class Hyper:
    """Hyperparameters of a method: the shared local-training settings in ``train`` (a
    :class:`~fedlore.settings.LocalTraining`: lr, K, B, T, the optimizer's and the schedule's
    settings, ``freeze``, ``local_eval``, ``mc_samples``, the robust aggregate,
    ``transport_dtype`` and ``upload_increments``, each with its constraint and description)
    and, in a subclass, the method's own fields. A field that a config setting fills declares
    its dotted config path in its metadata (``field(metadata={"config": "rank"})``);
    :func:`fedlore.settings.build_hyper` builds a method from a config and its
    ``method.<name>`` overrides.
    """

    capabilities: ClassVar[Capabilities] = Capabilities()
    """What the method can do (:class:`~fedlore.algorithm.Capabilities`, the defaults here); a
    subclass changes it with ``replace(Parent.capabilities, ...)`` and inherits it otherwise
    (the rule is in :mod:`fedlore.algorithm`). Read only by :mod:`fedlore.checks`."""

    per_client_metrics: ClassVar[tuple[str, ...]] = ()
    """Reply metrics the round loop records per client in each round's row (none here)."""

    sync_log: ClassVar[LogFormat | None] = None
    """The format of the server's record of its clients' model caches
    (:mod:`fedlore.algorithms.sync`; None: the method keeps none)."""

    __pydantic_config__ = ConfigDict(allow_inf_nan=False)  # method.<name>.* (build_hyper)

    train: LocalTraining = field(default_factory=LocalTraining)

    def clients_restarted(self, state: State) -> State:
        """``state`` once every client has lost what it held (a deployment resumed by a new
        ``flwr run``): no client is recorded as holding a cache or the first-contact tensors,
        so each gets the dense model at its next contact
        (:func:`fedlore.algorithms.sync.clients_restarted`)."""
        return clients_restarted(state, self.sync_log)

    def __post_init__(self) -> None:
        if not isinstance(self.train, LocalTraining):
            raise TypeError(f"{type(self).__name__}: train must be a LocalTraining")
        check_wire_settings(type(self), self.train.upload_increments, self.train.transport_dtype)

    def caps(self) -> Capabilities:
        """This method's capabilities: the class record; a method whose capabilities depend on
        its hyperparameters overrides this as ``replace(super().caps(), ...)``."""
        return type(self).capabilities

    @classmethod
    def of(cls, **settings: Any) -> Self:
        """The method built from flat keyword settings (tests, benchmarks): the keys that are
        :class:`~fedlore.settings.LocalTraining` fields go into ``train``, the rest to the
        method's own fields (``FedAvg.of(lr=0.1, local_steps=2, momentum=0.9)``)."""
        shared = {k: settings.pop(k) for k in list(settings) if k in LocalTraining.model_fields}
        return cls(train=LocalTraining(**shared), **settings)

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype of floating tensors on the wire (None: the model's own, ``"fp32"``)."""
        return WIRE_DTYPES[self.train.transport_dtype]

    def wire_spec(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a received tensor of model dtype ``dtype`` has on the wire (for
        ``expected_reply``): the 16-bit dtype for floating dtypes, else ``dtype``."""
        wire = self.wire_dtype
        return wire if wire is not None and dtype.is_floating_point else dtype

    def local_steps(self, num_examples: int | None = None) -> int:
        """K, the local steps of one round for a client of ``num_examples`` training examples
        (``local_steps``, or ``local_epochs * ceil(n / B)``:
        :meth:`~fedlore.settings.LocalTraining.steps`)."""
        return self.train.steps(num_examples)

    def round_steps(self, num_examples: int) -> int:
        """The local steps a client of ``num_examples`` training examples trains in a whole
        round, as it trains them: :meth:`local_steps` here (a method that trains on part of the
        client's data, Meta-BayFL with a held-out meta split, counts that part's epochs)."""
        return self.local_steps(num_examples)

    def round_work(self, num_examples: int, steps: int) -> int:
        """The optimizer steps, of any model, that a client of ``num_examples`` training
        examples runs in a round in which it trains ``steps`` local steps (all of
        :meth:`round_steps`, or a straggler's budget): the work the simulated clock charges
        (:mod:`fedlore.engine.simclock`). ``steps`` here; a method whose clients run other
        optimizer steps besides adds them (Meta-BayFL's trials, Ditto's personal model).
        Forward-only passes (scoring, evaluation) are not counted."""
        return steps

    def lr_schedule(self, num_examples: int | None = None) -> Schedule:
        """The run's :class:`~fedlore.train.local.Schedule` for a client of ``num_examples``
        training examples: over its ``rounds x K`` local steps (under ``local_epochs`` each
        client's own K, so every client's schedule spans the run)."""
        return Schedule(
            self.train.lr,
            self.train.schedule,
            self.train.rounds * self.local_steps(num_examples),
            self.train.min_lr_ratio,
        )

    def round_lrs(self, rnd: int, num_examples: int | None = None) -> list[float]:
        """Learning rates of the K local steps of round ``rnd`` (``num_examples``: the client's
        training examples, needed under ``local_epochs``)."""
        steps = self.local_steps(num_examples)
        lrs = self.lr_schedule(num_examples).round_lrs(max(rnd, 0), steps)
        budget = STEP_BUDGET.get()  # a straggler's partial work (fedlore.engine.unreliable)
        return lrs if budget is None else lrs[: max(1, budget)]

    def server_opt(self) -> ServerOpt:
        """The server optimizer of the ``server.*`` settings (:mod:`fedlore.optim.server`)."""
        t = self.train
        return ServerOpt(
            t.server_optimizer,
            t.server_eta,
            t.server_betas,
            t.server_tau,
            t.server_v0,
            t.server_bias_correction,
        )

    def round_decay(self, rnd: int) -> float:
        """``a = Π_k (1 - lr_k * weight_decay)``, the common decay of round ``rnd`` (Prop. 8);
        under ``local_epochs`` the clients take different numbers of steps, so there is no
        common decay: only ``weight_decay`` = 0 (a = 1) is accepted then.

        Raises:
            ValueError: under ``local_epochs`` with ``weight_decay`` > 0.
        """
        if self.train.weight_decay == 0:
            return 1.0
        if self.train.local_steps is None:
            raise ValueError(
                f"{type(self).__name__}: its server applies the round's common weight decay "
                "(seed 000, Prop. 8), which needs the same local steps on every client; with "
                "local_epochs the clients take E * ceil(n_i / B) steps: use local_steps, or "
                "optim.weight_decay=0"
            )
        a = 1.0
        for lr in self.round_lrs(rnd):
            a *= 1.0 - lr * self.train.weight_decay
        return a

    def is_frozen(self, name: str) -> bool:
        """Whether tensor ``name`` (a plain ``state_dict`` name) matches a ``freeze`` pattern."""
        if not self.train.freeze:  # the default: asked per tensor per client, so answered at once
            return False
        return any(fnmatch.fnmatchcase(name, p) for p in self.train.freeze)

    def check_freeze(self, model: nn.Module) -> None:
        """Refuse ``freeze`` patterns that match no tensor of ``model`` (a typo would silently
        train everything) or that leave no parameter to train.

        Raises:
            ValueError: naming the patterns that match nothing, or saying nothing trains.
        """
        names = list(model.state_dict())
        unused = [p for p in self.train.freeze if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unused:
            raise ValueError(
                f"params.freeze pattern(s) {unused} match no tensor of the model "
                f"(names look like {names[:3]})"
            )
        if self.train.freeze and all(self.is_frozen(n) for n, _ in model.named_parameters()):
            raise ValueError(f"params.freeze={list(self.train.freeze)} freezes every parameter")

    def fill_frozen(
        self, arrays: dict[str, torch.Tensor], state: State | None, model: nn.Module
    ) -> dict[str, torch.Tensor]:
        """Client side: ``arrays`` (plain names) with the frozen tensors the server left out
        taken from the client's ``cache.*`` (frozen tensors never change, so a cache from any
        round is current).

        Raises:
            RuntimeError: when a left-out frozen tensor is not in the client's cache.
        """
        if not self.train.freeze:
            return arrays
        missing = [k for k in model.state_dict() if self.is_frozen(k) and k not in arrays]
        if not missing:
            return arrays
        cache = select(state.arrays, "cache.") if state is not None else {}
        lost = [k for k in missing if k not in cache]
        if lost:
            raise RuntimeError(
                f"the server sent no frozen tensors {lost[:3]} and the client holds none "
                "(its state was lost)"
            )
        return {**arrays, **{k: cache[k] for k in missing}}

    def set_frozen(self, model: nn.Module) -> None:
        """``requires_grad = not frozen`` for every parameter of ``model`` (idempotent)."""
        for name, p in model.named_parameters():
            p.requires_grad_(not self.is_frozen(name))

    def weights(self, replies: list[Reply]) -> list[float]:
        """Aggregation weights p_i of the given replies (not normalized): n_i or 1, times the
        share of its round's steps a straggler finished (reply metric ``work_share``, set by
        the simulator under ``clients.partial_work``; 1 otherwise)."""
        # in [1e-6, 1] whatever a client reports: a share never raises a client above its n_i,
        # and never makes the weights sum to zero
        share = [min(1.0, max(1e-6, float(r.metrics.get("work_share", 1.0)))) for r in replies]
        if self.train.weighting == "uniform":
            return share
        return [float(r.num_examples) * s for r, s in zip(replies, share, strict=True)]


def construction_gradients(
    model: nn.Module, split: TensorSplit, batch_size: int, rng: torch.Generator, names: list[str]
) -> dict[str, torch.Tensor]:
    """Gradients of the mean cross-entropy (:func:`~fedlore.train.local.task_loss`) on one
    fresh minibatch, for the named parameters.

    This is the separate construction minibatch of seed Algorithm 2 line 4 (Local GaLore) and of
    FedLore's gradient-based P^0. Entries with non-finite values are returned as they are; the
    caller decides (``top_left_singular`` refuses them).
    """
    model.train()
    model.zero_grad(set_to_none=True)
    x, y = next(iter(minibatches(split, batch_size, 1, rng)))
    with autocast(x.device):  # the training precision, as local training
        loss = task_loss(model(x), y)
    loss.backward()
    params = dict(model.named_parameters())
    out = {}
    for k in names:
        g = params[k].grad
        out[k] = torch.zeros_like(params[k]) if g is None else g.detach().clone()
    model.zero_grad(set_to_none=True)
    return out


def local_eval_metrics(hyper: Hyper, model: nn.Module, data: ClientData, rnd: int) -> Scalars:
    """P-local metrics of a client's freshly trained ``model`` on its own test split, in the
    run's last round when ``hyper.train.local_eval`` is on (else ``{}``): see :func:`local_scores`.
    The test split is read only here, after training."""
    if not local_eval_due(hyper, rnd) or len(data.test) == 0:
        return {}
    return local_scores(model, data, hyper.train.mc_samples, hyper.train.metrics)


def local_eval_due(hyper: Hyper, rnd: int) -> bool:
    """Whether a client reports P-local scores in round ``rnd``: ``local_eval`` is on and it is
    the run's last round."""
    return hyper.train.local_eval and rnd == hyper.train.rounds - 1


def local_scores(
    model: nn.Module, data: ClientData, mc_samples: int, metrics: Sequence[str] = ()
) -> Scalars:
    """``model`` on ``data.test``: ``local_accuracy`` (share), ``local_loss`` (NLL, nats),
    ``local_ece``, ``local_<name>`` for each of ``metrics`` (``eval.metrics``,
    :mod:`fedlore.train.metrics`, from the same predictive) and ``local_n`` (test examples),
    with the MC predictive over ``mc_samples`` draws for a stochastic model
    (:func:`~fedlore.train.local.evaluate`). Regression: ``local_mse`` (squared error of the
    predictive mean, pooled over clients into ``local_rmse`` by the round loop) and
    ``local_loss`` instead of accuracy and ECE.

    A metric that fails on this client's predictive (each was tried on every client's labels
    before the run) makes every ``local_<name>`` of the client NaN, with a warning naming it:
    the client's update still counts, and the round leaves the client out of those metrics."""
    try:
        res = evaluate(model, data.test, mc_samples=mc_samples, metrics=metrics)
    except MetricError as e:
        warnings.warn(
            f"client {data.client_id}: P-local eval.metrics not scored ({e}); its update counts",
            RuntimeWarning,
            stacklevel=2,
        )
        res = evaluate(model, data.test, mc_samples=mc_samples)
        res.update(dict.fromkeys(metrics, float("nan")))
    if "rmse" in res:
        return {"local_mse": res["rmse"] ** 2, "local_loss": res["loss"], "local_n": len(data.test)}
    return {
        "local_accuracy": res["accuracy"],
        "local_loss": res["loss"],
        "local_ece": res["ece"],
        **{f"local_{name}": res[name] for name in metrics},
        "local_n": len(data.test),
    }


def reply_metrics(num_examples: int, **values: Scalar) -> Scalars:
    """Reply metrics with the aggregation weight under its standard key."""
    return {"num_examples": int(num_examples), **values}
