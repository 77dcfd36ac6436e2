"""Hyperparameters every method shares, and small helpers the method modules reuse.

Parity (reference notes section 13): every method gets the same K local steps, the same
minibatches, the same learning-rate schedule, the same optimizer reset each round (a fresh
optimizer per round), the same gradient clipping, weight-decay policy and aggregation weights.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import nn

from fedlore.data.client_data import ClientData, TensorSplit, minibatches
from fedlore.device import autocast
from fedlore.tensors import WIRE_DTYPES, select
from fedlore.train.local import Schedule, evaluate, task_loss
from fedlore.types import Reply, Scalar, Scalars, State

ReplySpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class Hyper:
    """Local-training hyperparameters shared by all methods.

    Attributes:
        lr: base learning rate (eta).
        local_steps: K, optimizer steps per client per round.
        batch_size: B.
        rounds: T, used by the learning-rate schedule.
        betas, eps: Adam coefficients.
        weight_decay: decoupled decay lambda.
        schedule: ``"constant"`` or ``"cosine"`` over all T*K local steps.
        min_lr_ratio: final lr of the cosine schedule as a share of ``lr``.
        grad_clip: global gradient-norm clip (None: off).
        weighting: aggregation weights p_i, ``"num_examples"`` (n_i / Σ n_j) or ``"uniform"``.
        freeze: glob patterns (:func:`fnmatch.fnmatchcase`) over ``state_dict`` names; matching
            tensors are never trained, uploaded or averaged by any method and cross the wire only
            at a client's first contact (reference notes section 13.3: the same non-adapted
            parameters train under every method). Everything else that a method does not
            project or adapt trains densely with AdamW and is averaged with p_i.
        local_eval: in the last round, a client also scores the model it just trained on its
            own test split (P-local, reference notes Part 0.8) and reports ``local_accuracy``,
            ``local_loss``, ``local_ece`` and ``local_n`` (methods built on
            :func:`local_eval_metrics`).
        mc_samples: S, the MC predictive's samples for models with stochastic layers (0: one
            pass with the posterior means / dropout off).
        robust_aggregate: how a server that averages dense deltas combines them: ``"mean"`` (the
            weighted mean, FedAvg), ``"median"`` or ``"trimmed_mean"`` (coordinate-wise, see
            :func:`fedlore.robust.combine_updates`); other methods accept only ``"mean"``.
        trim_fraction: share of clients the trimmed mean drops at each end, in [0, 0.5).
        transport_dtype: the dtype floating tensors cross the wire in (config
            ``transport_dtype``): ``"fp32"`` (default: the model's own dtype, unchanged),
            ``"fp16"`` or ``"bf16"`` (half the bytes; the receiver upcasts to the model's dtype;
            what each method quantizes is in its docstring). Only methods that declare
            :attr:`honours_transport_dtype` themselves accept a 16-bit setting.
        upload_increments: every uploaded tensor is an increment from the value the client
            started the round from (never a value), so a client's contribution can be clipped
            and the uploads summed (set by the run under ``secure_aggregation`` and ``dp``; only
            :attr:`sum_aggregable` methods accept it; FedAvg-style deltas already are).
    """

    honours_transport_dtype: ClassVar[bool] = False
    """Whether the method casts what it sends to ``transport_dtype``. Only a class that sets it
    in its own body counts: an inherited True does not, since a subclass may send other
    tensors (the check is in ``__post_init__``)."""

    sum_aggregable: ClassVar[bool] = False
    """Whether the server needs only the weighted sums ``Σ p_i x_i`` and ``Σ p_i`` of the
    uploads ``x_i`` (every reply array), so the method runs under secure aggregation and central
    DP (:mod:`fedlore.privacy`). Only a class that sets it in its own body counts
    (:func:`is_sum_aggregable`): a subclass may use the uploads otherwise."""

    individual_uploads: ClassVar[str] = (
        "its server uses each client's upload on its own, not only their weighted sum"
    )
    """Why a method that is not :attr:`sum_aggregable` needs individual uploads (the reason a
    run under ``secure_aggregation`` or ``dp`` is refused with)."""

    lr: float = 1e-3
    local_steps: int = 10
    batch_size: int = 32
    rounds: int = 20
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    grad_clip: float | None = None
    weighting: Literal["num_examples", "uniform"] = "num_examples"
    freeze: tuple[str, ...] = ()
    local_eval: bool = False
    mc_samples: int = 20
    robust_aggregate: Literal["mean", "median", "trimmed_mean"] = "mean"
    trim_fraction: float = 0.1
    transport_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    upload_increments: bool = False

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0,
            "local_steps": self.local_steps >= 1,
            "batch_size": self.batch_size >= 1,
            "rounds": self.rounds >= 1,
            "betas": all(0 <= b < 1 for b in self.betas) and len(self.betas) == 2,
            "eps": self.eps > 0,
            "weight_decay": self.weight_decay >= 0,
            "schedule": self.schedule in ("constant", "cosine"),
            "min_lr_ratio": 0 <= self.min_lr_ratio <= 1,
            "grad_clip": self.grad_clip is None or self.grad_clip > 0,
            "weighting": self.weighting in ("num_examples", "uniform"),
            "freeze": all(isinstance(p, str) and p for p in self.freeze),
            "mc_samples": self.mc_samples >= 0,
            "robust_aggregate": self.robust_aggregate in ("mean", "median", "trimmed_mean"),
            "trim_fraction": 0 <= self.trim_fraction < 0.5,
            "transport_dtype": self.transport_dtype in WIRE_DTYPES,
        }
        for field, ok in checks.items():
            if not ok:
                raise ValueError(f"{type(self).__name__}: invalid {field}={getattr(self, field)!r}")
        if self.upload_increments and not is_sum_aggregable(type(self)):
            raise ValueError(
                f"{type(self).__name__}: invalid upload_increments=True: {self.individual_uploads}"
            )
        if self.transport_dtype != "fp32" and not vars(type(self)).get(
            "honours_transport_dtype", False
        ):
            raise ValueError(
                f"{type(self).__name__}: invalid transport_dtype={self.transport_dtype!r}: this "
                "method sends its tensors at the model's dtype only (16-bit transport: FedLore and "
                "its variants, FedFull, FedAvg, FedProx and the LoRA methods)"
            )

    @property
    def wire_dtype(self) -> torch.dtype | None:
        """The dtype of floating tensors on the wire (None: the model's own, ``"fp32"``)."""
        return WIRE_DTYPES[self.transport_dtype]

    def wire_spec(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a received tensor of model dtype ``dtype`` has on the wire (for
        ``expected_reply``): the 16-bit dtype for floating dtypes, else ``dtype``."""
        wire = self.wire_dtype
        return wire if wire is not None and dtype.is_floating_point else dtype

    def lr_schedule(self) -> Schedule:
        """The run's :class:`~fedlore.train.local.Schedule`."""
        return Schedule(self.lr, self.schedule, self.rounds * self.local_steps, self.min_lr_ratio)

    def round_lrs(self, rnd: int) -> list[float]:
        """Learning rates of the K local steps of round ``rnd``."""
        return self.lr_schedule().round_lrs(max(rnd, 0), self.local_steps)

    def round_decay(self, rnd: int) -> float:
        """``a = Π_k (1 - lr_k * weight_decay)``, the common decay of round ``rnd`` (Prop. 8)."""
        a = 1.0
        for lr in self.round_lrs(rnd):
            a *= 1.0 - lr * self.weight_decay
        return a

    def is_frozen(self, name: str) -> bool:
        """Whether tensor ``name`` (a plain ``state_dict`` name) matches a ``freeze`` pattern."""
        if not self.freeze:  # the default: asked per tensor per client, so answered at once
            return False
        return any(fnmatch.fnmatchcase(name, p) for p in self.freeze)

    def check_freeze(self, model: nn.Module) -> None:
        """Refuse ``freeze`` patterns that match no tensor of ``model`` (a typo would silently
        train everything) or that leave no parameter to train.

        Raises:
            ValueError: naming the patterns that match nothing, or saying nothing trains.
        """
        names = list(model.state_dict())
        unused = [p for p in self.freeze if not any(fnmatch.fnmatchcase(n, p) for n in names)]
        if unused:
            raise ValueError(
                f"params.freeze pattern(s) {unused} match no tensor of the model "
                f"(names look like {names[:3]})"
            )
        if self.freeze and all(self.is_frozen(n) for n, _ in model.named_parameters()):
            raise ValueError(f"params.freeze={list(self.freeze)} freezes every parameter")

    def fill_frozen(
        self, arrays: dict[str, torch.Tensor], state: State | None, model: nn.Module
    ) -> dict[str, torch.Tensor]:
        """Client side: ``arrays`` (plain names) with the frozen tensors the server left out
        taken from the client's ``cache.*`` (frozen tensors never change, so a cache from any
        round is current).

        Raises:
            RuntimeError: when a left-out frozen tensor is not in the client's cache.
        """
        if not self.freeze:
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
        """Aggregation weights p_i of the given replies (not normalized)."""
        if self.weighting == "uniform":
            return [1.0] * len(replies)
        return [float(r.num_examples) for r in replies]


def is_sum_aggregable(cls: type) -> bool:
    """Whether method class ``cls`` itself declares :attr:`Hyper.sum_aggregable` (an inherited
    True does not count)."""
    return bool(vars(cls).get("sum_aggregable", False))


def build_hyper(cls: type, common: dict[str, Any], overrides: dict[str, Any]) -> Any:
    """Instantiate algorithm ``cls`` from common settings plus per-method overrides.

    Common keys that ``cls`` does not declare are dropped; override keys must all be fields.

    Raises:
        ValueError: naming every override key that ``cls`` has no field for and every value of
            the wrong kind, all at once (then the first invalid value ``cls`` itself refuses).
    """
    fields = {f.name for f in dataclasses.fields(cls)}
    problems: list[str] = []
    unknown = sorted(set(overrides) - fields)
    if unknown:
        problems.append(
            f"{cls.__name__} has no hyperparameter(s) {unknown}; known: {sorted(fields)}"
        )
    kw = {k: v for k, v in common.items() if k in fields}
    kw.update({k: v for k, v in overrides.items() if k in fields})
    types = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for k, v in list(kw.items()):
        if isinstance(v, list):
            kw[k] = tuple(v)
        elif isinstance(v, str) and types[k].startswith("tuple[str"):
            kw[k] = (v,)  # one name for a list-of-names field, not its letters
        what = f"{cls.__name__}: hyperparameter {k}"
        try:
            if "float" in types[k]:  # YAML 1.1 reads 1e-3 (no dot) as a string
                kw[k] = _as_floats(what, kw[k])
            kw[k] = _check_kind(what, types[k], kw[k])
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("; ".join(problems))
    try:
        return cls(**kw)
    except ValueError as first:  # every out-of-range value, not only the first one checked
        raise ValueError("; ".join(_range_problems(cls, kw, types)) or str(first)) from first
    except TypeError as e:  # e.g. a string where a number is needed
        bad = {k: overrides[k] for k in overrides}
        raise ValueError(
            f"{cls.__name__}: a hyperparameter has the wrong type ({e}); got {bad}"
        ) from e


def _range_problems(cls: type, kw: dict[str, Any], types: dict[str, str]) -> list[str]:
    """The checks of ``cls`` that each value of ``kw`` fails on its own (every other field at
    its default), with the accepted values of ``Literal`` fields; empty when only a combination
    of values is refused."""
    out = []
    for key, value in kw.items():
        try:
            cls(**{key: value})
        except (ValueError, TypeError) as e:
            text = str(e)
            choices = re.findall(r"'([^']*)'", types[key]) if "Literal[" in types[key] else []
            if choices:
                text += f" (accepted: {', '.join(choices)})"
            out.append(text)
    return out


def _check_kind(what: str, kind: str, value: Any) -> Any:
    """``value`` checked against a field's annotation ``kind``: whole numbers for ``int``
    fields (``2.0`` becomes ``2``), true/false for ``bool`` fields, finite numbers for ``float``
    fields (None stays where the field allows it; other annotations pass unchanged).

    Raises:
        ValueError: naming ``what`` and the bad value.
    """
    items = value if isinstance(value, tuple) else (value,)
    if value is None and "None" in kind:
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{what} must be true or false, got {value!r}")
        return value
    if kind.startswith(("int", "tuple[int")):
        out = []
        for v in items:
            whole = isinstance(v, float) and math.isfinite(v) and v.is_integer()
            if isinstance(v, bool) or not (isinstance(v, int) or whole):
                raise ValueError(f"{what} must be a whole number, got {v!r}")
            out.append(int(v))
        return tuple(out) if isinstance(value, tuple) else out[0]
    if kind.startswith(("float", "tuple[float")):
        for v in items:
            if isinstance(v, bool) or (isinstance(v, int | float) and not math.isfinite(float(v))):
                raise ValueError(f"{what} must be a finite number, got {v!r}")
    return value


def _as_floats(what: str, value: Any) -> Any:
    """``value`` with strings that spell numbers (``"1e-3"``) turned into floats, in a tuple or
    alone; other values unchanged (the dataclass check then names them).

    Raises:
        ValueError: for a string that is not a number, prefixed by ``what`` (the method and
            hyperparameter).
    """

    def conv(v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:
            return float(v)
        except ValueError:
            raise ValueError(f"{what} has the wrong type: {v!r} is not a number") from None

    return tuple(conv(v) for v in value) if isinstance(value, tuple) else conv(value)


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
    run's last round when ``hyper.local_eval`` is on (else ``{}``): see :func:`local_scores`.
    The test split is read only here, after training."""
    if not local_eval_due(hyper, rnd) or len(data.test) == 0:
        return {}
    return local_scores(model, data, hyper.mc_samples)


def local_eval_due(hyper: Hyper, rnd: int) -> bool:
    """Whether a client reports P-local scores in round ``rnd``: ``local_eval`` is on and it is
    the run's last round."""
    return hyper.local_eval and rnd == hyper.rounds - 1


def local_scores(model: nn.Module, data: ClientData, mc_samples: int) -> Scalars:
    """``model`` on ``data.test``: ``local_accuracy`` (share), ``local_loss`` (NLL, nats),
    ``local_ece`` and ``local_n`` (test examples), with the MC predictive over ``mc_samples``
    draws for a stochastic model (:func:`~fedlore.train.local.evaluate`). Regression:
    ``local_mse`` (squared error of the predictive mean, pooled over clients into
    ``local_rmse`` by the round loop) and ``local_loss`` instead of accuracy and ECE."""
    res = evaluate(model, data.test, mc_samples=mc_samples)
    if "rmse" in res:
        return {"local_mse": res["rmse"] ** 2, "local_loss": res["loss"], "local_n": len(data.test)}
    return {
        "local_accuracy": res["accuracy"],
        "local_loss": res["loss"],
        "local_ece": res["ece"],
        "local_n": len(data.test),
    }


def reply_metrics(num_examples: int, **values: Scalar) -> Scalars:
    """Reply metrics with the aggregation weight under its standard key."""
    return {"num_examples": int(num_examples), **values}
