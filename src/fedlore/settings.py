"""One settings model: the local-training settings every method shares, where each setting of a
method comes from in the config, and the building of a method's hyperparameters.

:class:`LocalTraining` holds the shared settings (parity, reference notes section 13: every
method gets the same K local steps, minibatches, learning-rate schedule, fresh optimizer per
round, gradient clipping, weight-decay policy and aggregation weights) with their types,
constraints and descriptions. Each method's hyperparameters (a frozen dataclass,
:class:`fedlore.algorithms.base.Hyper`) hold one as ``train``.

Where a setting comes from is declared once, on its field: ``json_schema_extra={"config":
"optim.betas"}`` on a :class:`LocalTraining` field, ``dataclasses.field(metadata={"config":
"rank"})`` on a method's own field. :func:`build_hyper` reads those paths from a config, lays
the ``method.<name>`` overrides over them and validates everything with pydantic.

This module imports nothing of fedlore (the config and the algorithms both import it).
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import typing
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from fedlore.registry import did_you_mean

CONFIG = "config"
"""The metadata key naming a setting's dotted path in the config."""


def admits_bool(annotation: Any) -> bool:
    """Whether a field's type accepts a boolean as such (``bool`` or ``Any`` somewhere in it)."""
    if annotation is bool or annotation is Any:
        return True
    return any(admits_bool(a) for a in get_args(annotation))


class StrictModel(BaseModel):
    """A frozen pydantic model that refuses unknown keys, non-finite floats and booleans where
    a number is expected."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """``true`` is not 1 (pydantic's lax mode would take it for a number or a string)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(v, bool) and field is not None and not admits_bool(field.annotation):
            raise ValueError("expected a number or text, got a boolean")
        return v


def _from(path: str) -> dict[str, Any]:
    return {CONFIG: path}


Beta = Annotated[float, Field(ge=0.0, lt=1.0)]
Pattern = Annotated[str, Field(min_length=1)]


DEFAULT_LOCAL_STEPS = 10
"""K when neither ``local_steps`` nor ``local_epochs`` is set."""

STEP_BUDGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "step_budget", default=None
)
"""The most local steps a client may take this round (None: all of them): set by the simulator
for a straggler that sends what it finished by the round's deadline
(:mod:`fedlore.engine.unreliable`, ``clients.partial_work``); the methods' ``round_lrs`` stop
there, their schedules unchanged."""

STEP_PAIR = {"local_steps": "local_epochs", "local_epochs": "local_steps"}
"""The two ways to size a round's local work; a config sets one (a later layer or override of
one replaces the other)."""


def steps_or_epochs(data: Any) -> Any:
    """Raw settings (a dict) with exactly one of ``local_steps`` and ``local_epochs`` (neither:
    :data:`DEFAULT_LOCAL_STEPS` steps); the ``mode="before"`` check of the config and of
    :class:`LocalTraining`.

    Raises:
        ValueError: when both are set.
    """
    if isinstance(data, dict):
        steps, epochs = data.get("local_steps"), data.get("local_epochs")
        if steps is not None and epochs is not None:
            raise ValueError(
                f"local_steps={steps!r} and local_epochs={epochs!r} are both set: a round is "
                "either K steps or E passes over the client's data; set one"
            )
        if steps is None and epochs is None:
            data = {**data, "local_steps": DEFAULT_LOCAL_STEPS}
    return data


def steps_for_epochs(epochs: int, num_examples: int, batch_size: int) -> int:
    """``E * ceil(n / B)``: the local steps of ``epochs`` passes over ``num_examples`` examples
    in minibatches of ``batch_size`` (capped at n, as the minibatch sampler caps it), at least 1.

    Raises:
        ValueError: when ``num_examples`` < 1 (a client without training data has no epoch).
    """
    if num_examples < 1:
        raise ValueError(
            f"local_epochs={epochs}: a client with {num_examples} training examples has no epoch"
        )
    per_epoch = -(-num_examples // min(batch_size, num_examples))
    return epochs * per_epoch


class LocalTraining(StrictModel):
    """Local-training settings shared by all methods (the config's defaults)."""

    lr: float = Field(
        1e-3, gt=0.0, description="base learning rate eta", json_schema_extra=_from("lr")
    )
    local_steps: int | None = Field(
        None,
        ge=1,
        description=(
            "K, optimizer steps per client per round (10 when neither this nor local_epochs is "
            "set; set one of the two)"
        ),
        json_schema_extra=_from("local_steps"),
    )
    local_epochs: int | None = Field(
        None,
        ge=1,
        description=(
            "E, passes over the client's training split per round: E * ceil(n / B) steps for a "
            "client of n examples (set this or local_steps)"
        ),
        json_schema_extra=_from("local_epochs"),
    )
    batch_size: int = Field(32, ge=1, description="B", json_schema_extra=_from("batch_size"))
    rounds: int = Field(
        20,
        ge=1,
        description="T, used by the learning-rate schedule",
        json_schema_extra=_from("rounds"),
    )
    betas: tuple[Beta, Beta] = Field(
        (0.9, 0.999), description="Adam coefficients", json_schema_extra=_from("optim.betas")
    )
    eps: float = Field(1e-8, gt=0.0, description="Adam's eps", json_schema_extra=_from("optim.eps"))
    weight_decay: float = Field(
        0.0,
        ge=0.0,
        description="decoupled decay lambda",
        json_schema_extra=_from("optim.weight_decay"),
    )
    schedule: Literal["constant", "cosine"] = Field(
        "constant",
        description="learning-rate schedule over all T*K local steps",
        json_schema_extra=_from("optim.schedule"),
    )
    min_lr_ratio: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="final lr of the cosine schedule as a share of lr",
        json_schema_extra=_from("optim.min_lr_ratio"),
    )
    grad_clip: float | None = Field(
        None,
        gt=0.0,
        description="global gradient-norm clip (None: off)",
        json_schema_extra=_from("optim.grad_clip"),
    )
    weighting: Literal["num_examples", "uniform"] = Field(
        "num_examples",
        description="aggregation weights p_i: n_i / sum n_j, or uniform",
        json_schema_extra=_from("weighting"),
    )
    freeze: tuple[Pattern, ...] = Field(
        (),
        description=(
            "glob patterns (fnmatch.fnmatchcase) over state_dict names; matching tensors are "
            "never trained, uploaded or averaged by any method and cross the wire only at a "
            "client's first contact (reference notes section 13.3)"
        ),
        json_schema_extra=_from("params.freeze"),
    )
    local_eval: StrictBool = Field(
        False,
        description=(
            "in the last round a client also scores the model it just trained on its own test "
            "split (P-local: local_accuracy, local_loss, local_ece, local_<name> of "
            "eval.metrics, local_n)"
        ),
        json_schema_extra=_from("eval.local"),
    )
    mc_samples: int = Field(
        20,
        ge=0,
        description="S, the MC predictive's samples for stochastic layers (0: one mean pass)",
        json_schema_extra=_from("eval.mc_samples"),
    )
    metrics: tuple[str, ...] = Field(
        (),
        description=(
            "further classifier metrics the P-local scores of local_eval add as local_<name> "
            "(fedlore.train.metrics)"
        ),
        json_schema_extra=_from("eval.metrics"),
    )
    robust_aggregate: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan"] = (
        Field(
            "mean",
            description=(
                "how a server that averages dense deltas combines them (fedlore.robust); other "
                "methods accept only mean"
            ),
            json_schema_extra=_from("robust.aggregate"),
        )
    )
    trim_fraction: float = Field(
        0.1,
        ge=0.0,
        lt=0.5,
        description="share the trimmed mean drops at each end",
        json_schema_extra=_from("robust.trim_fraction"),
    )
    num_byzantine: int = Field(
        0,
        ge=0,
        description="f, the Byzantine clients Krum, Multi-Krum and Bulyan tolerate",
        json_schema_extra=_from("robust.num_byzantine"),
    )
    multi_krum_keep: int | None = Field(
        None,
        ge=1,
        description="m, the updates Multi-Krum averages (None: n - f)",
        json_schema_extra=_from("robust.multi_krum_keep"),
    )
    server_optimizer: Literal["sgd", "momentum", "adagrad", "adam", "yogi"] = Field(
        "sgd",
        description=(
            "the server optimizer that turns the aggregated delta into the global model's step "
            "(fedlore.optim.server: sgd, FedAvgM momentum, FedAdagrad, FedAdam, FedYogi); only "
            "methods whose server adds an averaged dense delta accept another than sgd"
        ),
        json_schema_extra=_from("server.optimizer"),
    )
    server_eta: float = Field(
        1.0,
        gt=0.0,
        description="eta, the server learning rate",
        json_schema_extra=_from("server.lr"),
    )
    server_betas: tuple[Beta, Beta] = Field(
        (0.9, 0.99),
        description="the server optimizer's (beta1, beta2); beta1 is FedAvgM's momentum",
        json_schema_extra=_from("server.betas"),
    )
    server_tau: float = Field(
        1e-3,
        gt=0.0,
        description="tau, the adaptivity of FedAdagrad, FedAdam and FedYogi",
        json_schema_extra=_from("server.tau"),
    )
    server_v0: float | None = Field(
        None,
        ge=0.0,
        description="the adaptive optimizers' initial second moment (None: tau^2)",
        json_schema_extra=_from("server.v0"),
    )
    server_bias_correction: StrictBool = Field(
        False,
        description="FedAdam: scale eta by sqrt(1 - beta2^t) / (1 - beta1^t)",
        json_schema_extra=_from("server.bias_correction"),
    )
    transport_dtype: Literal["fp32", "fp16", "bf16"] = Field(
        "fp32",
        description=(
            "the dtype floating tensors cross the wire in (fp32: the model's own); only methods "
            "that honour a 16-bit transport accept fp16 or bf16"
        ),
        json_schema_extra=_from("transport_dtype"),
    )
    upload_increments: StrictBool = Field(
        False,
        description=(
            "every uploaded tensor is an increment from the value the client started the round "
            "from, so uploads can be clipped and summed; set by the run under "
            "secure_aggregation or dp (only sum-aggregable methods accept it)"
        ),
        json_schema_extra={"set_by": "secure_aggregation or dp"},
    )

    @model_validator(mode="before")
    @classmethod
    def _steps_or_epochs(cls, data: Any) -> Any:
        return steps_or_epochs(data)

    def steps(self, num_examples: int | None = None) -> int:
        """The local steps of one round for a client of ``num_examples`` training examples:
        ``local_steps``, or ``local_epochs * ceil(n / B)`` (:func:`steps_for_epochs`).

        Raises:
            ValueError: under ``local_epochs`` without ``num_examples`` (the count depends on
                the client), or for a client without training data.
        """
        if self.local_steps is not None:
            return self.local_steps
        assert self.local_epochs is not None  # the validator sets one of the two
        if num_examples is None:
            raise ValueError(
                f"local_epochs={self.local_epochs}: the steps of a round depend on the client's "
                "number of training examples, which the caller did not give"
            )
        return steps_for_epochs(self.local_epochs, num_examples, self.batch_size)


def config_paths(owner: type) -> dict[str, str]:
    """``{setting: dotted config path}`` of a :class:`LocalTraining`-like model or a method's
    hyperparameter dataclass (its own fields only; ``train`` is read through
    :class:`LocalTraining`)."""
    if isinstance(owner, type) and issubclass(owner, BaseModel):
        out = {}
        for name, info in owner.model_fields.items():
            extra = info.json_schema_extra
            if isinstance(extra, dict) and isinstance(extra.get(CONFIG), str):
                out[name] = str(extra[CONFIG])
        return out
    fields = dataclasses.fields(owner)  # type: ignore[arg-type]
    return {f.name: f.metadata[CONFIG] for f in fields if CONFIG in f.metadata}


def config_value(cfg: Any, path: str) -> Any:
    """The value at dotted ``path`` of ``cfg`` (lists as tuples).

    Raises:
        AttributeError: when ``cfg`` has no such setting.
    """
    value = cfg
    for part in path.split("."):
        value = getattr(value, part)
    return tuple(value) if isinstance(value, list) else value


NOT_APPLICABLE = "not_applicable"
"""Name of a method class's optional ``{setting: why}`` mapping: settings it inherits or shares
that it never reads (FedSLoP's inner optimizer is always the heavy ball). They are not among
its :func:`hyperparameter_names`: a ``method.<name>`` override of one is refused with the
reason, and the method's settings page lists them apart."""


def not_applicable(cls: type) -> dict[str, str]:
    """``{setting: why}``: the settings method class ``cls`` never reads
    (:data:`NOT_APPLICABLE`)."""
    return dict(getattr(cls, NOT_APPLICABLE, {}))


def not_applicable_problems(cls: type, name: str, keys: Any) -> list[str]:
    """One line for each of ``keys`` (a ``method.<name>`` section's) that method class ``cls``
    never reads, with the reason."""
    ignored = not_applicable(cls)
    return [
        f"method.{name}.{k}: does not apply to {name} ({ignored[k]})"
        for k in sorted(keys)
        if k in ignored
    ]


RUN_WIDE = frozenset({"metrics"})
""":class:`LocalTraining` fields that copy a setting of the whole run (``eval.metrics``: the
clients score P-local with the metrics the run records and tabulates everywhere else): a
``method.<name>`` section may not set them, and ``config.json`` records them at their config
path only, not among a method's ``hyper`` settings."""


def hyperparameter_names(cls: type) -> list[str]:
    """The names a ``method.<name>`` section may set for method class ``cls``: its own fields
    and, for a class holding ``train``, the :class:`LocalTraining` fields (sorted) but the
    :data:`RUN_WIDE` ones, less those it never reads (:func:`not_applicable`)."""
    names = {f.name for f in dataclasses.fields(cls)}
    if "train" in names:
        names = (names - {"train"}) | (set(LocalTraining.model_fields) - RUN_WIDE)
    return sorted(names - set(not_applicable(cls)))


@functools.cache
def _adapter(cls: type) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def _kind_problems(cls: type, values: dict[str, Any]) -> dict[str, str]:
    """Values pydantic's lax mode would coerce but a config means otherwise: a boolean for a
    number, anything else for a switch; a single name for a list of names becomes a 1-tuple
    (in place)."""
    hints = typing.get_type_hints(cls)
    out = {}
    for key, value in list(values.items()):
        kind = hints.get(key)
        if kind is None:
            continue
        if isinstance(value, bool) and not admits_bool(kind):
            out[key] = f"expected a number or text, got a boolean (got {value!r})"
        elif kind is bool and not isinstance(value, bool):
            out[key] = f"must be true or false (got {value!r})"
        elif isinstance(value, str) and get_origin(kind) is tuple and get_args(kind)[:1] == (str,):
            values[key] = (value,)  # one name for a list-of-names field, not its letters
    return out


def build_hyper(cls: type, name: str, cfg: Any, overrides: dict[str, Any], **fixed: Any) -> Any:
    """Method class ``cls`` (registered as ``name``) built from config ``cfg``: each setting
    from its declared config path (:func:`config_paths`), then the ``method.<name>`` overrides
    (keys that are :class:`LocalTraining` fields go into ``train``), then ``fixed`` settings the
    run decides (``upload_increments``), validated by pydantic (YAML 1.1's ``1e-3`` text is the
    number).

    Raises:
        ValueError: naming every unknown override key (with the known ones) and every bad
            value with its key (``method.<name>.<key>`` for an override), all at once.
    """
    names = hyperparameter_names(cls)
    ignored = not_applicable(cls)
    problems = not_applicable_problems(cls, name, overrides)
    run_wide = sorted(set(overrides) & RUN_WIDE - set(names))
    problems += [
        f"method.{name}.{k}: set {config_paths(LocalTraining)[k]} instead (it applies to every "
        "method of the run)"
        for k in run_wide
    ]
    unknown = sorted(set(overrides) - set(names) - set(ignored) - set(run_wide))
    if unknown:
        problems.append(
            f"method.{name}: {cls.__name__} has no hyperparameter(s) {unknown}"
            f"{did_you_mean(unknown[0], names)}; known: {names}"
        )
    holds_train = any(f.name == "train" for f in dataclasses.fields(cls))
    train_paths = config_paths(LocalTraining) if holds_train else {}
    own_paths = config_paths(cls)
    train = {k: config_value(cfg, p) for k, p in train_paths.items()}
    own = {k: config_value(cfg, p) for k, p in own_paths.items()}
    source = train_paths | own_paths
    for k, v in fixed.items():
        (train if holds_train and k in LocalTraining.model_fields else own)[k] = v
        source[k] = k
    for k, v in overrides.items():
        if k in unknown or k in ignored or k in run_wide:
            continue
        if holds_train and k in STEP_PAIR and STEP_PAIR[k] not in overrides:
            train[STEP_PAIR[k]] = None  # method.<name>.local_epochs replaces local_steps
        (train if holds_train and k in LocalTraining.model_fields else own)[k] = v
        source[k] = f"method.{name}.{k}"
    kinds = _kind_problems(cls, own)
    problems += [f"{source.get(k, k)}: {p}" for k, p in kinds.items()]
    kw = {k: v for k, v in own.items() if k not in kinds}
    if holds_train:
        kw["train"] = train
    try:
        hyper = _adapter(cls).validate_python(kw)
    except ValidationError as e:
        for err in e.errors():
            parts = list(err["loc"])
            if parts[:1] == ["train"]:
                parts = parts[1:]
            loc = [str(p) for p in parts]
            msg = err["msg"].removeprefix("Value error, ")
            if not loc:  # a check across settings (the method's __post_init__)
                for who in (name, *(k.__name__ for k in cls.__mro__)):
                    msg = msg.removeprefix(f"{who}: ")  # named once, by the section
                problems.append(f"method.{name}: {msg}")
                continue
            where = source.get(loc[0], f"method.{name}.{loc[0]}") + loc_path(parts[1:])
            problems.append(f"{where}: {msg} (got {err.get('input')!r})")
    else:
        if not problems:
            return hyper
    raise ValueError("; ".join(problems))


def loc_path(loc: typing.Sequence[int | str]) -> str:
    """A validation error's location as the key a user writes: ``.name`` per field,
    ``[i]`` per list item (``method.heterofl.shares[1]``), so two bad items are two places."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc)
