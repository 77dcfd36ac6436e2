"""The whole experiment configuration, :class:`Config`: the top-level settings and the sections
of :mod:`fedlore.config_sections` (import it from :mod:`fedlore.config`)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedlore import plugins
from fedlore.config_federation import (
    AsynchronousConfig,
    AttackConfig,
    ClientsConfig,
    CompressionConfig,
    ServerConfig,
)
from fedlore.config_sections import (
    DataConfig,
    DiagnosticsConfig,
    DPConfig,
    EvalConfig,
    FlowerConfig,
    ModelConfig,
    OptimConfig,
    ParamsConfig,
    PartitionConfig,
    RobustConfig,
    StoreConfig,
)
from fedlore.config_stopping import EarlyStoppingConfig
from fedlore.config_tracking import TrackingConfig
from fedlore.config_tune import TuneConfig, key_problem
from fedlore.config_unset import clients_per_round
from fedlore.settings import StrictModel as _Strict
from fedlore.settings import steps_or_epochs


class Config(_Strict):
    """A whole experiment. Every key means what it says; see ``experiments/quickstart.yaml``."""

    name: str = "experiment"
    """The experiment's name: its results go to ``output_dir/name/`` (one folder per method and
    seed, the report beside them)."""
    rounds: int = Field(20, ge=1)
    """Communication rounds T."""
    num_clients: int = Field(10, ge=1)
    """Clients N in the federation (each gets one part of the partitioned training set)."""
    participation: float = Field(1.0, gt=0.0, le=1.0)
    """Participation rate C: each round samples max(1, floor(C * num_clients)) clients."""
    local_steps: int | None = Field(None, ge=1)
    """K, local optimizer steps (minibatches) per sampled client per round; 10 when neither
    this nor ``local_epochs`` is set. Set one of the two, not both."""
    local_epochs: int | None = Field(None, ge=1)
    """E, local passes over each sampled client's training split per round (the convention of
    the FL literature and of seed 001, whose clients train T local epochs): a client with n
    examples takes ``E * ceil(n / B)`` steps, so clients of different sizes take different
    numbers of steps. Set this or ``local_steps``, not both (an override of one replaces the
    other given in the file). Under ``data.sampling: stream`` (the pre-training corpora's
    default) the steps are the same, but a stream's batches are all full and may straddle two
    shuffles, so a round reads each example about E times rather than exactly E times."""
    batch_size: int = Field(32, ge=1)
    """Local minibatch size B."""
    lr: float = Field(1e-3, gt=0.0)
    """Base learning rate eta of local training, for every method (``method.<name>.lr``
    overrides it for one)."""
    rank: int = Field(8, ge=1)
    """r: the rank of every projected matrix (FedLore, Local GaLore) and of every LoRA adapter."""
    imports: list[str] = Field(default_factory=list)
    """Your own code to import before anything is looked up by name: Python files
    (``my_methods.py``, relative to the working directory) or module names
    (``mylab.fl_methods``). A method, model, data source or partitioner they register can then be
    named in this config, on every engine: each process that reads the config imports them
    (:mod:`fedlore.plugins`). Imported when the config is validated; a file that is missing or
    fails to import is a config error."""
    algorithms: list[str] = Field(default_factory=lambda: ["fedlore"])
    """One method or a list (their registered names, see the method reference), run side by side
    on identical client data."""
    seeds: list[int] = Field(default_factory=lambda: [42])
    """Seeds of the runs; a seed fixes the partition, the initial model and the sampling, the
    same for every method. The report gives mean ± std over seeds."""
    output_dir: str = "runs"
    """Folder the experiment's folder ``name/`` is written in. Checked before any run trains,
    and by ``--dry-run``: the deepest part of ``output_dir/name`` that exists must be a folder
    that takes a new file (a temporary one is created there and removed at once)."""
    engine: Literal["local", "flower-sim"] = "local"
    """Transport: "local" (in-process, the embedded default) or "flower-sim" (Flower's
    Simulation Engine with the Ray backend; needs the ``flower`` extra)."""
    device: str = "auto"
    """Where the run computes: ``auto`` (CUDA when present, else the CPU), ``cpu``, ``cuda`` or
    ``cuda:N``. The federation's tensors, the models, optimizer moments, bases, coordinates,
    client and server states live there; randomness comes from seeded CPU generators on every
    device, checkpoints and spilled states are written as CPU tensors (a run resumes on any
    device). ``cuda`` without a CUDA device is an error."""
    threads: int | Literal["auto"] = "auto"
    """CPU threads of torch's intra-op parallelism in this process: a count >= 1, or ``auto``
    (default): one per CPU that other work leaves free when the run starts (the CPUs of the
    process's affinity and cgroup quota minus those other processes kept busy over a 0.25 s
    sample, :func:`fedlore.device.busy_cpus`; at least 1), or ``OMP_NUM_THREADS``
    when that is set; a resumed run reuses the count it started with. Oversubscribed threads
    wait for each other at every op: with torch's default count beside a competing process the
    quickstart took 8.5 minutes instead of 20 seconds. Float sums depend on the count (results
    differ in the last digits, as between devices), so it is not part of a run's config
    fingerprint; fix it (``threads=1``) so that machines with other CPU counts sum alike
    (bit-identical runs also need the same torch build and CPU kernels, which ``config.json``
    records: ``fedlore.device.platform_record``). Flower simulation clients use
    ``flower.client_cpus`` threads each."""
    precision: Literal["fp32", "bf16", "fp64"] = "fp32"
    """Floating-point precision: ``fp32`` (default); ``bf16``, bfloat16 autocast of the forward
    pass (and so of the backward) of local training, with fp32 master weights, optimizer moments,
    bases, coordinates ΔZ, BNN (μ, ρ), messages and every aggregation (evaluation runs in fp32);
    ``fp64``, models, inputs and every tensor derived from them (bases, coordinates, optimizer
    moments, server state) in float64, the precision the seed's theory is checked in
    (``tests/theory``; messages carry the model's dtype, so byte counts double; LoRA adapters
    stay fp32)."""
    transport_dtype: Literal["fp32", "fp16", "bf16"] = "fp32"
    """The dtype floating tensors cross the wire in, both ways: ``fp32`` (default; the model's
    own dtype, unchanged, so float64 under ``precision: fp64``), ``fp16`` or ``bf16`` (half the
    bytes; the receiver upcasts to the model's dtype; bf16 keeps float32's range, fp16 has
    3 more significand bits and overflows beyond 65504, which makes an upload non-finite and
    rejected). What is quantized: FedLore's coordinates ΔZ, increments Δ, bases P and the
    increments of its unprojected tensors; the dense deltas of FedFull, FedAvg and FedProx; the
    LoRA methods' factors, merge payloads and dense tensors. A full model (first contact,
    FedFull's broadcast) stays at the model's dtype. Other methods accept only ``fp32``."""
    weighting: Literal["num_examples", "uniform"] = "num_examples"
    """Aggregation weights p_i: data size (default) or uniform, the same rule for all methods."""
    secure_aggregation: bool = False
    """Secure aggregation (:mod:`fedlore.privacy`): the server sees only masked uploads and
    their sum (in process: pairwise masks; Flower engines: flwr's SecAgg+). Needs a
    sum-aggregable method (FedAvg, FedFull, FedProx, FedIT, FFA-LoRA, FedSLoP, FedLore-Sketch,
    FedLore-Random, FedLore-fixed, the shared tensors of FedPer, FedBN, FedRep and MOON, and
    SCAFFOLD, under secure aggregation alone); the others refuse with the reason (the
    refusal lists the methods that can)."""
    secure_aggregation_degree: int = Field(0, ge=0)
    """In-process secure aggregation: how many other clients each client masks with and shares
    its secrets with. 0 (default) pairs every two sampled clients (SecAgg, Bonawitz et al. 2017:
    O(m L) mask entries and O(m t) secret-sharing work per client); k > 0 joins each client to
    k neighbours on a seeded ring (SecAgg+, Bell et al. 2020), O(k L)."""
    secure_aggregation_threshold: int | float = 2 / 3
    """Secure aggregation: the fewest clients a round completes with (a count, or a fraction
    of the round's sampled clients), and the Shamir threshold t (the same count, or fraction
    of a client's share holders: its mask partners and itself; on Flower unless
    ``flower.secagg_reconstruction_threshold`` is set). A round with fewer survivors is aborted
    before anything is unmasked (the model does not move; ``secagg_aborted``), and so is one
    in which a survivor keeps fewer than t surviving mask partners (t − 1 colluders could then
    unmask it: on the complete graph a round needs t + 1 survivors). In process t is at most a
    client's partners, and every client needs at least 2 (3 or more clients per round).
    Larger: more colluding clients withstood (up to t − 1), fewer dropouts tolerated. At
    least 2."""
    secure_aggregation_range: float = Field(1000.0, ge=1.0)
    """Secure aggregation without DP: the bound on each upload entry; entries beyond it are
    clipped (counted in ``secagg_clipped_entries``). With the clients per round it sets the
    fixed-point resolution (:mod:`fedlore.privacy.fixedpoint`). At least 1: the clients'
    weights (at most 1) travel in the same ring. Under DP the bound comes from
    ``dp.clip_norm`` instead."""
    dp: DPConfig = Field(default_factory=DPConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    partition: PartitionConfig = Field(default_factory=PartitionConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    params: ParamsConfig = Field(default_factory=ParamsConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    early_stopping: EarlyStoppingConfig = Field(default_factory=EarlyStoppingConfig)
    flower: FlowerConfig = Field(default_factory=FlowerConfig)
    diagnostics: DiagnosticsConfig = Field(default_factory=DiagnosticsConfig)
    robust: RobustConfig = Field(default_factory=RobustConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    attack: AttackConfig = Field(default_factory=AttackConfig)
    clients: ClientsConfig = Field(default_factory=ClientsConfig)
    asynchronous: AsynchronousConfig = Field(default_factory=AsynchronousConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    method: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Per-method hyperparameter overrides, e.g. ``method: {fedfull: {lr: 1e-4}}``."""
    checkpoint: bool = True
    """Write a checkpoint after every round (atomically), from which ``--resume`` continues a
    killed run to the same result; false: an interrupted run starts over."""
    progress: bool = True
    """Progress messages and a bar per run on standard error (``fedlore: ...``); false turns
    them off, not the lines that say what happened to the results (a finished run kept instead
    of trained, replaced by ``--overwrite`` or resumed from its checkpoint, early stopping's
    end of a run, a run failed under ``--keep-going``): those are printed either way."""

    @field_validator("method", mode="before")
    @classmethod
    def _numbers_are_numbers(cls, v: Any) -> Any:
        """YAML 1.1 reads ``1e-4`` (no dot) as text: a method value that spells a number is
        stored as the number (in ``config.json`` too), so ``lr=1e-4`` and ``lr=0.0001`` are the
        same setting."""
        if not isinstance(v, dict):
            return v

        def num(x: Any) -> Any:
            if isinstance(x, list):
                return [num(i) for i in x]
            if isinstance(x, str) and _NUMBER.fullmatch(x.strip()):
                return float(x)
            return x

        return {
            m: {k: num(x) for k, x in h.items()} if isinstance(h, dict) else h for m, h in v.items()
        }

    @field_validator("algorithms", mode="before")
    @classmethod
    def _one_or_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("seeds", mode="before")
    @classmethod
    def _seed_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) else v

    @field_validator("algorithms", "seeds")
    @classmethod
    def _nonempty_unique(cls, v: list[Any]) -> list[Any]:
        if not v:
            raise ValueError("at least one entry is needed")
        dup = sorted({x for x in v if v.count(x) > 1})
        if dup:
            raise ValueError(f"duplicate entries {dup}")
        return v

    @field_validator("device")
    @classmethod
    def _device_name(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or re.fullmatch(r"cuda:\d+", v):
            return v
        raise ValueError("must be auto, cpu, cuda or cuda:N (N a device index)")

    @field_validator("threads", mode="before")
    @classmethod
    def _thread_count(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"must be auto or a thread count >= 1, got {v!r}")

    @model_validator(mode="before")
    @classmethod
    def _steps_or_epochs(cls, data: Any) -> Any:
        return steps_or_epochs(data)

    @model_validator(mode="after")
    def _secure_aggregation_degree_needs_the_mode(self) -> Config:
        if self.secure_aggregation_degree and not self.secure_aggregation:
            raise ValueError(
                "secure_aggregation_degree is set but secure_aggregation is off (it sets the "
                "in-process masking graph)"
            )
        t = self.secure_aggregation_threshold
        if (
            isinstance(t, bool)
            or (isinstance(t, float) and not 0 < t <= 1)
            or (isinstance(t, int) and t < 2)
        ):
            raise ValueError(
                f"secure_aggregation_threshold={t!r}: a count must be at least 2, a fraction in "
                "(0, 1]"
            )
        if self.secure_aggregation_degree and self.engine != "local":
            raise ValueError(
                "secure_aggregation_degree is the in-process masking graph; on Flower, SecAgg+ "
                "takes its neighbourhood from flower.secagg_num_shares"
            )
        return self

    @model_validator(mode="after")
    def _canary_audit(self) -> Config:
        k = self.dp.audit.canaries
        if not k:
            return self
        # here, not in the dp section, so that the message is not followed by the whole section
        if self.dp.clip_norm is None:
            raise ValueError(
                f"dp.audit.canaries = {k} needs DP, which is off: the audit measures the DP "
                "mechanism; set dp.clip_norm and dp.noise_multiplier (or dp.epsilon), or drop "
                "dp.audit"
            )
        if self.dp.mode == "local":
            raise ValueError(
                "dp.audit.canaries with dp.mode=local is refused: local DP's guarantee is "
                "against a server that sees each noised upload, which a final-model canary "
                "test does not attack, and canaries noising their own uploads would add √k "
                "times the noise to the model; audit dp.mode=central"
            )
        if self.secure_aggregation:
            raise ValueError(
                "dp.audit.canaries with secure_aggregation is refused: the server would add the "
                "canaries to the unmasked sum, outside the protocol, so the audit would not "
                "measure the mechanism that ran; audit the config without secure_aggregation "
                "(the secure sum only hides single uploads from the server; the noised sum and "
                "its ε are central DP's either way)"
            )
        m, n = self.clients_per_round(), self.num_clients
        per = "clients per round"
        if self.asynchronous.buffer is not None:  # DP-FedBuff: K of N contribute to a step
            m, per = int(self.asynchronous.buffer), "clients a step (asynchronous.buffer)"
        if k * m < n:
            raise ValueError(
                f"dp.audit.canaries = {k} with {m} of {n} {per} would insert "
                f"⌊{k} · {m} / {n}⌋ = 0 canaries per round (canaries are sampled at the real "
                f"clients' ratio); use at least {-(-n // m)}"
            )
        return self

    @model_validator(mode="after")
    def _asynchronous(self) -> Config:
        a = self.asynchronous
        if a.buffer is None:  # set to other than its default: a config recorded with its
            # defaults (config.json, the config a Flower engine passes on) sets every field
            changed = [k for k, f in type(a).model_fields.items()
                       if k != "buffer" and getattr(a, k) != f.default]  # fmt: skip
            if changed:
                raise ValueError(
                    f"asynchronous.{changed[0]} is set but asynchronous.buffer is not "
                    "(buffered aggregation is off)"
                )
            return self
        c, n = self.async_concurrency(), self.num_clients
        if not a.buffer <= c <= n:
            raise ValueError(
                f"asynchronous: buffer K={a.buffer}, concurrency C={c} and num_clients N={n} "
                "must hold K <= C <= N (the buffer fills from the C clients in flight, drawn "
                "from the N clients)"
            )
        timeout = type(a).model_fields["flight_timeout_s"].default
        if a.clock == "simulated" and a.flight_timeout_s != timeout:
            raise ValueError(
                "asynchronous.flight_timeout_s is set but asynchronous.clock is simulated "
                "(a simulated client always arrives; the timeout is clock=wall's)"
            )
        return self

    def async_concurrency(self) -> int:
        """C, the clients in flight under ``asynchronous`` (``clients_per_round`` when unset)."""
        c = self.asynchronous.concurrency
        return self.clients_per_round() if c is None else c

    @model_validator(mode="after")
    def _tune_space_keys(self) -> Config:
        problems = [
            f"tune.space: {key}: {why}"
            for key in self.tune.space
            if (why := key_problem(type(self), key)) is not None
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @field_validator("imports")
    @classmethod
    def _import_them(cls, v: list[str]) -> list[str]:
        entries = [plugins.resolve(e) for e in v]
        plugins.load(entries)  # every process that reads the config: its names exist
        return entries

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not v or "/" in v or "\\" in v or v in (".", "..") or v.startswith("."):
            raise ValueError("must be a plain folder name (no path separators, not . or ..)")
        return v

    def clients_per_round(self) -> int:
        """Number of clients sampled each round: max(1, floor(C * num_clients))."""
        return clients_per_round(self.participation, self.num_clients)


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
"""A decimal number as text (``1e-4``, ``3.0E2``, ``.5``)."""
