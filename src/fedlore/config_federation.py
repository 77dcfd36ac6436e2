"""Configuration sections of the simulated federation around the method: the server optimizer,
upload compression, malicious clients and unreliable clients (sections of
:class:`fedlore.config_model.Config`; import them from :mod:`fedlore.config`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedlore.settings import StrictModel as _Strict


class ClientsConfig(_Strict):
    """Unreliable clients in simulation (:mod:`fedlore.engine.unreliable`): sampled clients that
    drop out, compute speeds with a round deadline (stragglers dropped or sending what they
    finished), and a trace of which clients can be sampled when. Everything is seeded by the run
    seed; off by default. In-process engine only."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """p: each sampled client fails to answer with probability p, drawn per (seed, round,
    client); its reply is lost like a dead node's (reason ``dropped out``)."""
    speed: Literal["equal", "lognormal", "uniform"] = "equal"
    """The clients' relative compute speeds: all 1, lognormal (median 1, σ = ``speed_spread``)
    or uniform on [1 - ``speed_spread``, 1 + ``speed_spread``], one per client for the run; they
    set the round deadline's stragglers and the simulated clock: ``sim_round_s`` and ``sim_time_s``
    of synchronous rounds (:mod:`fedlore.engine.simclock`), FedBuff's (``asynchronous``)."""
    speed_spread: float = Field(0.5, ge=0.0)
    """σ of ``lognormal`` speeds; the half-width of ``uniform`` ones (below 1)."""
    speed_trace: str | None = None
    """A JSON file with one speed (> 0) per client, replacing ``speed``."""
    step_s: float = Field(0.05, gt=0.0)
    """Simulated seconds of one optimizer step at speed 1: client i needs W_i · step_s / speed_i
    for a round of K_i local steps, W_i = K_i plus the optimizer steps its method runs besides
    (Meta-BayFL's trials, Ditto's personal steps; the method's ``round_work``)."""
    round_deadline_s: float | None = Field(None, gt=0.0)
    """The round's deadline in simulated seconds (None: no deadline): a client that needs
    longer is a straggler."""
    partial_work: bool = False
    """A straggler sends what it finished by the deadline (the most local steps whose work fits:
    floor(deadline · speed / step_s) when W = K; at least 1), weighted by the share of its local
    steps done; otherwise it is dropped."""
    availability: str | None = None
    """A JSON file: a list of lists of client ids; round t samples only from list t mod its
    length (clients that come and go); None: every client is always available."""


class AttackConfig(_Strict):
    """Malicious clients, to test a defence in simulation (:mod:`fedlore.engine.attack`): a
    seeded share of the clients attacks in every round it is sampled. Off while ``kind`` is
    ``none`` or ``fraction`` is 0. In-process engine only."""

    kind: Literal["none", "label_flip", "sign_flip", "scale", "gaussian"] = "none"
    """``label_flip`` (train on labels C - 1 - y), ``sign_flip`` (upload -s·Δ), ``scale``
    (upload s·Δ) or ``gaussian`` (upload N(0, s²) noise of Δ's shape), with s = ``scale``. The
    three update attacks need a method whose server averages dense deltas."""
    fraction: float = Field(0.0, ge=0.0, lt=1.0)
    """Share of the federation's clients that attack: round(fraction · num_clients), chosen
    by a permutation seeded with the run seed (the same for every method)."""
    scale: float = Field(10.0, gt=0.0)
    """s: the factor of ``sign_flip`` and ``scale``, the standard deviation of ``gaussian``."""


class ServerConfig(_Strict):
    """The server optimizer (:mod:`fedlore.optim.server`): how the global model steps from the
    round's aggregated client delta Δ_t. ``sgd`` at ``lr`` 1 is FedAvg itself (the default);
    ``momentum`` is FedAvgM (Hsu et al. 2019), ``adagrad``, ``adam`` and ``yogi`` are
    FedAdagrad, FedAdam and FedYogi (Reddi et al., ICLR 2021, Algorithm 2). For methods whose
    server adds an averaged dense delta (FedAvg, FedFull, FedProx, SCAFFOLD, FedNova, Local
    GaLore, the Meta-BayFL family, Ditto, pFedMe, pFedBayes, MOON, FedPer, FedBN and FedRep for
    their shared layers), for FedLore and its variants, whose moments live in the shared r x n
    coordinates, and for FedIT and FFA-LoRA (the averaged adapter factors); the others refuse any
    other setting. Every key can be set for one method as ``method.<name>.server_optimizer``,
    ``server_eta`` (the lr), ``server_betas``, ``server_tau``, ``server_v0``,
    ``server_bias_correction``."""

    optimizer: Literal["sgd", "momentum", "adagrad", "adam", "yogi"] = "sgd"
    """The server optimizer: ``sgd`` (x += η Δ), ``momentum`` (FedAvgM: m = β1 m + Δ,
    x += η m), or the adaptive ``adagrad``, ``adam``, ``yogi`` (x += η m / (√v + τ))."""
    lr: float = Field(1.0, gt=0.0)
    """η, the server learning rate (1 with ``sgd``: FedAvg's plain average)."""
    betas: tuple[float, float] = (0.9, 0.99)
    """(β1, β2) of the adaptive optimizers, each in [0, 1); β1 is also FedAvgM's momentum."""
    tau: float = Field(1e-3, gt=0.0)
    """τ, the adaptivity: added to √v in the adaptive step (Reddi et al. tune it in
    {1e-5 ... 1})."""
    v0: float | None = Field(None, ge=0.0)
    """The adaptive optimizers' initial second moment v_{-1}: None is τ² (Reddi et al.'s
    v_{-1} ≥ τ²); 0 is Flower's."""
    bias_correction: bool = False
    """FedAdam only: scale η by √(1-β2^t)/(1-β1^t) at the t-th server step (Kingma & Ba);
    Reddi et al. do not."""


class CompressionConfig(_Strict):
    """Upload compression of the dense methods (FedFull, FedAvg, FedProx;
    :mod:`fedlore.compression`): each client encodes its delta, the server checks and decodes it
    and averages as without compression. Every key can be set for one method as
    ``method.<name>.compression``, ``compression_fraction``, ``compression_levels``,
    ``error_feedback``; a method that uploads anything else refuses a ``kind`` other than
    ``none``, and so do secure aggregation, DP and the update attacks."""

    kind: Literal["none", "topk", "qsgd"] = "none"
    """``none`` (dense deltas), ``topk`` (per floating tensor the ``fraction`` largest-magnitude
    entries as values + int32 indices; Stich et al. 2018, Aji & Heafield 2017) or ``qsgd`` (per
    floating tensor its L2 norm and a signed int8 / int16 code per entry, stochastically rounded
    to ``levels`` levels so that the decoded delta is unbiased; Alistarh et al. 2017). Floating
    values travel in ``transport_dtype`` (a QSGD norm rounded up to it)."""
    fraction: float = Field(0.01, gt=0.0, le=1.0)
    """Top-k: the share of each tensor's entries sent, ``k = ceil(fraction * numel)``."""
    levels: int = Field(127, ge=1, le=32767)
    """QSGD: s, the number of nonzero levels; codes are int8 up to 127, int16 above."""
    error_feedback: bool | None = None
    """Each client keeps what its upload left out (``Δ + e - decoded``) in its client state and
    adds it to its next delta (Karimireddy et al. 2019); None: on for ``topk``, off for
    ``qsgd`` (unbiased already)."""


class AsynchronousConfig(_Strict):
    """Buffered asynchronous aggregation, FedBuff (Nguyen et al., AISTATS 2022;
    :mod:`fedlore.engine.buffered`): ``concurrency`` clients train at once, each from the global
    model version it downloaded, at the simulated speeds of ``clients.*``; every finished update
    goes into a buffer weighted by its staleness, and the server steps (``server.*``) each time
    the buffer holds ``buffer`` updates. One round is one server step. Off while ``buffer`` is
    None; for fedfull, fedavg and fedprox, in process and on Flower's engines (``clock``)."""

    buffer: int | None = Field(None, ge=1)
    """K: the server steps once K updates are buffered; None: synchronous rounds (off)."""
    concurrency: int | None = Field(None, ge=1)
    """C: clients training at once (K <= C <= num_clients); None: ``clients_per_round``."""
    staleness: Literal["sqrt", "constant", "polynomial"] = "sqrt"
    """w(s) of an update s server steps stale: ``sqrt`` 1/sqrt(1+s) (the paper's), ``constant``
    1, ``polynomial`` (1+s)^-a with a = ``staleness_exponent``."""
    staleness_exponent: float = Field(0.5, gt=0.0)
    """a of ``polynomial`` staleness weights (0.5 is ``sqrt``)."""
    max_staleness: int | None = Field(None, ge=0)
    """Updates more than this many server steps stale are dropped (recorded, not buffered);
    None: every update is kept."""
    clock: Literal["simulated", "wall"] = "simulated"
    """Whose clock orders the buffer: ``simulated``, the clients' configured speeds (every
    engine; ``engine: flower-sim`` and a deployment then only carry each client's training and
    give the in-process run's rows), or ``wall``, the real arrival order of Flower's replies
    (Flower engines only: in process there is no real clock; not bit-reproducible;
    :mod:`fedlore.flower.wallclock`)."""
    flight_timeout_s: float = Field(600.0, gt=0.0)
    """``clock: wall``: seconds a client in flight may take before its slot is freed and a
    replacement starts (a SuperNode that died never answers)."""

    @property
    def enabled(self) -> bool:
        """Whether the run aggregates asynchronously (``buffer`` is set)."""
        return self.buffer is not None
