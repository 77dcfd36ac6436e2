"""Run an experiment: every method of the config for every seed, side by side.

Output: ``<output_dir>/<name>/<method>/seed-<s>/metrics.jsonl`` (one object per round),
``summary.json`` and ``checkpoint.pt`` beside it. A run whose ``summary.json`` exists is complete;
with ``resume=True`` an incomplete run continues from its checkpoint and reaches the same final
metrics as an uninterrupted run (all randomness is derived from seed, round and client). A
complete run is reported, not trained again, and ``overwrite=True`` replaces it only once the new
run has finished (:mod:`fedlore.engine.rerun`); every file is written atomically
(:mod:`fedlore.atomic`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fedlore import registry
from fedlore.algorithm import Algorithm
from fedlore.algorithms import build_hyper
from fedlore.algorithms.base import is_sum_aggregable
from fedlore.atomic import write_json, write_text
from fedlore.config import Config, ConfigError
from fedlore.config_checks import name_problems, unused_method_problems
from fedlore.data.client_data import TensorSplit
from fedlore.data.federation import Federation, build_federation
from fedlore.device import (
    PLATFORM_KEYS,
    platform_record,
    resolve_device,
    training_precision,
    use_threads,
)
from fedlore.diagnostics import Diagnoser
from fedlore.engine.callbacks import Checkpointer, MetricsWriter, ProgressBar
from fedlore.engine.dp_ledger import LEDGER, account_repeats
from fedlore.engine.interrupt import Interrupted
from fedlore.engine.lock import RunLock
from fedlore.engine.loop import Callback, RoundLoop
from fedlore.engine.rerun import (
    check_no_finished_run_of_another_config,
    finished_run,
    finished_runs,
    swap_in,
    write_dir,
)
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport, Transport
from fedlore.models import build_model
from fedlore.privacy import ClipNorm, DPSettings, Privacy, noise_for_epsilon, noise_source
from fedlore.privacy.dp import (
    ADJACENCY,
    default_clipped_count_stddev,
    update_noise_multiplier,
)
from fedlore.progress import say, say_once
from fedlore.results.divergence import divergence
from fedlore.results.store import lm_summary
from fedlore.seeding import MODEL_INIT, SERVER_INIT, derive_seed, generator
from fedlore.tensors import load_model_arrays
from fedlore.train.local import (
    classification_metrics,
    evaluate,
    is_regression,
    predictive_draws,
    predictive_log_probs,
    regression_metrics,
)
from fedlore.types import State

log = logging.getLogger(__name__)


def make_algorithm(name: str, cfg: Config) -> Algorithm:
    """The registered method ``name`` with the config's common settings and its ``method.<name>``
    overrides.

    Raises:
        KeyError: for an unknown method; ValueError: for an override the method does not have,
            or fewer clients per round than the method's ``min_clients_per_round``.
    """
    cls = registry.get("algorithm", name)
    common = {
        "lr": cfg.lr,
        "local_steps": cfg.local_steps,
        "batch_size": cfg.batch_size,
        "rounds": cfg.rounds,
        "rank": cfg.rank,
        "betas": cfg.optim.betas,
        "eps": cfg.optim.eps,
        "weight_decay": cfg.optim.weight_decay,
        "schedule": cfg.optim.schedule,
        "min_lr_ratio": cfg.optim.min_lr_ratio,
        "grad_clip": cfg.optim.grad_clip,
        "scale": cfg.optim.scale,
        "optimizer": cfg.optim.name,
        "weighting": cfg.weighting,
        "diagnostics_every": cfg.diagnostics.every,
        "local_eval": cfg.eval.local,
        "mc_samples": cfg.eval.mc_samples,
        "freeze": tuple(cfg.params.freeze),
        "exclude": tuple(cfg.params.exclude),
        "robust_aggregate": cfg.robust.aggregate,
        "trim_fraction": cfg.robust.trim_fraction,
        "transport_dtype": cfg.transport_dtype,
    }
    overrides = dict(cfg.method.get(name, {}))
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
    private = cfg.secure_aggregation or cfg.dp.enabled
    if private:
        common["upload_increments"] = True
        check_privacy(name, cls, cfg)
    try:
        algo: Algorithm = build_hyper(cls, common, overrides)
    except ValueError as e:
        if not private:
            raise
        raise ConfigError(
            f"{privacy_modes(cfg)} (every upload becomes an increment, upload_increments=True): {e}"
        ) from e
    need = int(getattr(algo, "min_clients_per_round", 1))
    if cfg.clients_per_round() < need:
        raise ValueError(
            f"{name} needs at least {need} clients per round, the config samples "
            f"{cfg.clients_per_round()} (num_clients x participation)"
        )
    return algo


def privacy_modes(cfg: Config) -> str:
    """The privacy modes the config turns on, as named in error messages:
    ``"secure_aggregation"``, ``"dp"``, ``"secure_aggregation and dp"`` or ``""``."""
    on = (("secure_aggregation", cfg.secure_aggregation), ("dp", cfg.dp.enabled))
    return " and ".join(m for m, enabled in on if enabled)


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


NO_PRIVACY = (
    "no privacy: dp.reproducible_noise drew the DP noise and the client sample from the run seed"
)
"""The ``privacy`` entry of a summary whose DP noise anyone who knows the seed can regenerate."""


def make_privacy(
    cfg: Config, algo: Algorithm, seed: int, max_weight: float | None = None
) -> Privacy | None:
    """The run's :class:`~fedlore.privacy.Privacy` (None when neither secure aggregation nor DP
    is on). With ``dp.epsilon`` the noise multiplier is solved for the run's exchanges (its
    rounds plus the method's setup exchanges) and sampling.

    Args:
        max_weight: the largest client weight (training examples) under
            ``weighting: num_examples``; weights travel as p_i / max_weight in the secure sum.

    Raises:
        ValueError: if ``dp.epsilon`` cannot be reached; ConfigError when the secure round's
            thresholds or fixed point cannot hold for the config.
    """
    if not (cfg.secure_aggregation or cfg.dp.enabled):
        return None
    setup = int(getattr(algo, "setup_rounds", 0))
    per_round = cfg.clients_per_round()
    dp = None
    if cfg.dp.enabled:
        assert cfg.dp.clip_norm is not None
        sigma = cfg.dp.noise_multiplier
        if sigma is None:
            assert cfg.dp.epsilon is not None
            sigma = noise_for_epsilon(
                cfg.dp.epsilon,
                cfg.dp.delta,
                cfg.rounds + setup,
                cfg.num_clients,
                per_round,
                accountant=cfg.dp.accountant,
            )
        dp = DPSettings(
            cfg.dp.clip_norm, sigma, cfg.dp.delta, cfg.dp.sketch_share, cfg.dp.accountant
        )
        how = "solved from dp.epsilon" if cfg.dp.noise_multiplier is None else "dp.noise_multiplier"
        say_once(
            "DP: clip norm C = %g, noise multiplier σ = %.4g (%s) over %d exchanges of %d of %d "
            "clients, δ = %g",
            cfg.dp.clip_norm,
            sigma,
            how,
            cfg.rounds + setup,
            per_round,
            cfg.num_clients,
            cfg.dp.delta,
        )
        if sigma == 0:
            say_once("DP: dp.noise_multiplier = 0 adds no noise: ε is infinite (clipping only)")
        if cfg.dp.delta >= 1.0 / cfg.num_clients:
            say_once(
                "DP: dp.delta = %g is not below 1/num_clients = %g: a mechanism that publishes "
                "one client's data outright would meet it",
                cfg.dp.delta,
                1.0 / cfg.num_clients,
            )
        if cfg.diagnostics.every > 0 or cfg.eval.clients:
            say_once(
                "DP: diagnostics.every / eval.clients read client data outside the mechanism "
                "(simulation measurements, not covered by ε)"
            )
    if cfg.dp.enabled and cfg.dp.reproducible_noise:
        say_once(
            "DP: dp.reproducible_noise=true draws the noise and the client sample from the run "
            "seed: anyone who knows it can remove the noise. This run has NO PRIVACY (debugging "
            "only); its summary and report row say so"
        )
    clip = None
    if dp is not None:
        clip = ClipNorm(dp.clip_norm)
        if cfg.dp.target_quantile is not None:
            sb = cfg.dp.clipped_count_stddev
            clip = ClipNorm(
                dp.clip_norm,
                cfg.dp.target_quantile,
                cfg.dp.clip_lr,
                default_clipped_count_stddev(per_round) if sb is None else sb,
            )
            try:
                z_update = update_noise_multiplier(dp.noise_multiplier, clip.count_stddev)
            except ValueError as e:
                raise ConfigError(f"dp.target_quantile: {e}") from e
            say_once(
                "DP: adaptive clipping (Andrew et al. 2021) towards the %g quantile of the upload "
                "norms from C = %g, clip_lr %g; the unclipped count gets noise %g, so the update "
                "gets noise multiplier %.4g (total, accounted: %.4g)",
                cfg.dp.target_quantile,
                dp.clip_norm,
                cfg.dp.clip_lr,
                clip.count_stddev,
                z_update,
                dp.noise_multiplier,
            )
    privacy = Privacy(
        cfg.secure_aggregation,
        dp,
        cfg.weighting == "uniform",
        cfg.num_clients,
        per_round,
        setup,
        seed,
        cfg.secure_aggregation_degree,
        threshold=cfg.secure_aggregation_threshold,
        colluders=cfg.dp.colluding_clients,
        entry_bound=cfg.secure_aggregation_range,
        max_weight=1.0 if cfg.weighting == "uniform" or max_weight is None else float(max_weight),
        noise=noise_source(cfg.dp.enabled and cfg.dp.reproducible_noise, seed),
        clip=clip,
    )
    if cfg.secure_aggregation:
        check_secure_round(cfg, privacy)
    return privacy


def client_sampler(cfg: Config, seed: int, privacy: Privacy | None) -> Callable[[int], list[int]]:
    """Round -> the sorted ids of its clients: from OS entropy under DP (amplification by
    subsampling assumes nobody can predict the sample; :meth:`Privacy.sample`), else seeded
    from ``(seed, round)`` (:func:`~fedlore.engine.sampling.sample_clients`)."""
    if privacy is not None and privacy.dp is not None:
        return privacy.sample
    per_round = cfg.clients_per_round()
    return lambda rnd: sample_clients(cfg.num_clients, per_round, seed, rnd)


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


def start_server(
    algo: Algorithm, model: nn.Module, rng: torch.Generator, fed: Federation, method: str
) -> State:
    """``algo.init_server(model, rng)``, with the server's unlabeled set U
    (``unlabeled=fed.server_unlabeled``) for a method that declares ``needs_server_data``
    (:mod:`fedlore.algorithm`). Every run, the Flower ServerApp (through :func:`run_one`) and
    :func:`preflight` start the server here.

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
        return algo.init_server(model, rng)
    unlabeled = fed.server_unlabeled
    if unlabeled is None or len(unlabeled) == 0:
        raise ConfigError(
            f"method {method!r} trains on the server's unlabeled set U, but the config holds "
            "none out: set data.server_fraction > 0 (e.g. data.server_fraction=0.2; it is "
            "removed from the clients' data for every method of the config)"
        )
    init: Callable[..., State] = algo.init_server
    return init(model, rng, unlabeled=unlabeled)


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


def run_dir(cfg: Config, method: str, seed: int) -> Path:
    """``<output_dir>/<name>/<method>/seed-<seed>``."""
    return Path(cfg.output_dir) / cfg.name / method / f"seed-{seed}"


def run_one(
    cfg: Config,
    method: str,
    seed: int,
    fed: Federation | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    extra_callbacks: tuple[Callback, ...] = (),
    make_transport: Callable[..., Transport] | None = None,
    overwrite: bool = False,
) -> dict[str, Any] | None:
    """Run one method for one seed; returns its summary (None if stopped early by ``stop_after``,
    which simulates a killed run for tests).

    ``make_transport(algorithm, client_data, model_factory, seed, store)`` replaces the
    in-process transport (the Flower ServerApp passes one over its Grid)."""
    if cfg.flower.site_data and make_transport is None:
        raise ConfigError(
            "flower.site_data=true: each site's data stay on its SuperNode, so this run needs a "
            "`flwr run` deployment (scripts/flower_local_federation.sh with SITES=...); "
            "in process or in the simulation, leave it false"
        )
    target = run_dir(cfg, method, seed)
    out = write_dir(cfg, method, target, resume, overwrite)  # a sibling replaces a finished run
    summary_path = out / "summary.json"
    spill = spill_dir(cfg, method, seed, out)
    if resume:
        check_same_config(cfg, method, out)
    if resume and summary_path.exists():
        done: dict[str, Any] = json.loads(summary_path.read_text())
        return done
    if not resume and not overwrite:
        check_no_finished_run_of_another_config(cfg, method, out)
    # every check that can refuse the config runs before anything in the run folder is touched
    device = resolve_device(cfg.device)
    fed = fed if fed is not None else build_federation(cfg, seed)
    fed = fed.to(device)  # once per run: every client's data are slices made there
    check_model_fits_data(cfg.model.name, fed)
    check_tokenizer_matches_model(cfg, fed)
    check_eval(cfg, fed)
    fingerprint = fed.fingerprint()
    if resume:
        check_same_data(out, fingerprint)
    elif not overwrite and (kept := finished_run(cfg, method, seed, fingerprint)) is not None:
        return kept  # finished already: said, not trained again
    algo = make_algorithm(method, cfg)
    build = model_factory(cfg, fed, seed)
    eval_model = build()
    check_params(cfg, eval_model)
    state = start_server(algo, eval_model, generator(seed, SERVER_INIT), fed, method)
    privacy = make_privacy(cfg, algo, seed, max_weight=float(fed.client_sizes().max()))
    threads = use_threads(cfg.threads, recorded_threads(out) if resume else None)
    if device.type == "cpu":
        say_once("%d CPU thread%s (threads=%s)", threads, "" if threads == 1 else "s", cfg.threads)
    with RunLock(target), RunLock(out):  # the folders are this run's until it ends
        if not resume:  # a fresh run: nothing of an earlier run in this folder may survive
            if (out / "metrics.jsonl").exists():
                say("%s seed %d: starting over in %s (--resume would continue)", method, seed, out)
            for stale in (
                "summary.json",
                "checkpoint.pt",
                "checkpoint.pt.tmp",
                "config.json",
                LEDGER,
            ):
                (out / stale).unlink(missing_ok=True)
            shutil.rmtree(spill, ignore_errors=True)
        out.mkdir(parents=True, exist_ok=True)
        written = {
            **_run_config(cfg, method),
            "data_fingerprint": fingerprint,
            "hyper": resolved_hyper(algo),
            "ran_on": str(device),
            "ran_threads": threads,
            **platform_record(device),
        }
        if privacy is not None and privacy.dp is not None:
            written["dp_noise_multiplier"] = privacy.dp.noise_multiplier
            written["dp_noise_source"] = "seed (no privacy)" if privacy.reproducible else "os"
        write_json(out / "config.json", written)
        max_bytes = None if cfg.store.max_memory_mb is None else int(cfg.store.max_memory_mb * 1e6)
        store = ClientStore(max_bytes, spill, device)
        start = -int(getattr(algo, "setup_rounds", 0))
        metrics = MetricsWriter(out / "metrics.jsonl")
        ckpt_path = out / "checkpoint.pt"
        if resume and ckpt_path.exists():
            last, state, store = Checkpointer.load(ckpt_path, max_bytes, spill, device)
            if privacy is not None:  # the adaptive clip norm the killed run had reached
                privacy.restore(state)
            privacy = account_repeats(privacy, out, metrics.path, last)  # before the rows go
            metrics.truncate_after(last)
            start = last + 1
            say("%s seed %d: resuming after round %d (its checkpoint)", method, seed, last)
        else:
            if resume:
                say(
                    "%s seed %d: no checkpoint in %s; starting from the first round",
                    method,
                    seed,
                    out,
                )
                privacy = account_repeats(privacy, out, metrics.path, None)
            write_text(metrics.path, "")
        factory = make_transport if make_transport is not None else LocalTransport
        transport = factory(algo, fed.client, build, seed, store)

        tests = [fed.client(c).test for c in range(fed.num_clients)] if cfg.eval.clients else []
        tests = [t for t in tests if len(t)]
        pooled_tests = TensorSplit.concat(tests) if tests else None  # built once per run
        test_sizes = [len(t) for t in tests]

        def evaluate_state(s: State) -> dict[str, float]:
            load_model_arrays(eval_model, algo.global_arrays(s))
            bs, mc = cfg.eval.batch_size, cfg.eval.mc_samples
            res = evaluate(eval_model, fed.central_test, bs, mc)
            row: dict[str, float] = {
                k: res[k] for k in ("accuracy", "loss", "ece", "perplexity", "rmse") if k in res
            }
            if fed.selection is not None:  # the split hyperparameters are chosen on
                sel = evaluate(eval_model, fed.selection, bs, mc)
                for k in ("accuracy", "loss", "perplexity", "rmse"):
                    if k in sel:
                        row[f"selection_{k}"] = sel[k]
            if cfg.eval.clients:
                row.update(global_local_metrics(eval_model, pooled_tests, test_sizes, bs, mc))
            return row

        callbacks: list[Callback] = [metrics]
        if cfg.checkpoint:
            callbacks.append(Checkpointer(ckpt_path, store))
        callbacks.extend(extra_callbacks)
        bar = None
        if cfg.progress:
            bar = ProgressBar(f"{method} seed {seed}", 0, cfg.rounds - start, cfg.rounds)
            callbacks.append(bar)
        diagnoser = None
        if cfg.diagnostics.every > 0:
            diagnoser = Diagnoser(
                algo,
                eval_model,
                fed.client,
                fed.num_clients,
                cfg.diagnostics.every,
                cfg.diagnostics.batch_size,
                cfg.diagnostics.clients,
                seed,
                cfg.rank,
                uniform=cfg.weighting == "uniform",
            )
        loop = RoundLoop(
            algo,
            transport,
            client_sampler(cfg, seed, privacy),
            evaluate_state,
            cfg.eval.every,
            callbacks,
            diagnoser,
            norm_screen=cfg.robust.norm_screen,
            privacy=privacy,
        )
        end = cfg.rounds if stop_after is None else min(cfg.rounds, stop_after + 1)
        try:
            with training_precision(cfg.precision):
                loop.run(state, start, end)
        except Interrupted as e:  # a signal (fedlore.engine.interrupt): name the run and folder
            e.stopped_in(f"{method} seed {seed}", out)
            raise
        finally:
            if bar is not None:
                bar.close()
        if end < cfg.rounds:
            return None
        summary = summarize(method, seed, metrics.path)
        if fed.test_split is not None:  # no test split of its own: what was held out
            summary["data_test_split"] = fed.test_split
        if privacy is not None and privacy.dp is not None:  # the mechanism, beside its ε
            summary["dp_noise_multiplier"] = privacy.dp.noise_multiplier
            summary["dp_clip_norm"] = privacy.dp.clip_norm
            summary["dp_delta"] = privacy.dp.delta
            summary["dp_adjacency"] = ADJACENCY
            summary["dp_noise_source"] = "seed" if privacy.reproducible else "os"
            summary["dp_accountant"] = privacy.dp.accountant
            if privacy.adaptive:  # where adaptive clipping left C (dp_clip_norm: where it began)
                summary["dp_clip_norm_final"] = privacy.clip_norm
            if privacy.reproducible:
                summary["privacy"] = NO_PRIVACY
        write_json(summary_path, summary)
        # a finished run is never resumed: its spilled client states are no longer needed
        shutil.rmtree(spill, ignore_errors=True)
        swap_in(out, target)  # a replacement takes the finished run's place now, not before
        return summary


def global_local_metrics(
    model: nn.Module,
    pooled: TensorSplit | None,
    sizes: list[int],
    batch_size: int,
    mc_samples: int,
) -> dict[str, float]:
    """G-local (reference notes Part 0.8): the global model on every client's test split, one
    predictive pass over their concatenation ``pooled`` (client after client, ``sizes`` examples
    each; None when no client has a test split). Pooled ``client_accuracy``, ``client_loss``
    (NLL) and ``client_ece`` over all test examples, and ``client_accuracy_mean``, the unweighted
    mean over clients."""
    if pooled is None:
        return {}
    if is_regression(pooled.y):  # RMSE and NLL over every client's test example
        draws = predictive_draws(model, pooled.x, batch_size, mc_samples)
        reg = regression_metrics(draws, pooled.y)
        return {"client_rmse": reg["rmse"], "client_loss": reg["loss"]}
    log_probs = predictive_log_probs(model, pooled.x, batch_size, mc_samples)
    out = {f"client_{k}": v for k, v in classification_metrics(log_probs, pooled.y).items()}
    out.pop("client_num_examples")
    if not bool(torch.isfinite(log_probs).all()):  # a diverged model: no score is meaningful
        out["client_accuracy_mean"] = float("nan")
        return out
    hits = (log_probs.argmax(-1) == pooled.y).float()
    per = [float(h.mean()) for h in hits.split(sizes)]
    out["client_accuracy_mean"] = sum(per) / len(per)
    return out


def recorded_threads(out: Path) -> int | None:
    """The thread count a run in ``out`` started with (``ran_threads`` of its ``config.json``),
    None when there is none or it cannot be read."""
    try:
        n = json.loads((out / "config.json").read_text()).get("ran_threads")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def spill_dir(cfg: Config, method: str, seed: int, out: Path | None = None) -> Path:
    """Where a run's client states spill: ``client_states/`` in its run directory (``out``, by
    default :func:`run_dir`), or below ``store.spill_dir`` in a folder unique to the run
    directory (two runs never share one)."""
    out = run_dir(cfg, method, seed) if out is None else out
    if not cfg.store.spill_dir:
        return out / "client_states"
    tag = hashlib.sha1(str(out.resolve()).encode()).hexdigest()[:10]
    return Path(cfg.store.spill_dir) / f"{cfg.name}-{method}-seed{seed}-{tag}"


_NOT_RESULT_KEYS = (
    "progress", "algorithms", "seeds", "method", "store", "output_dir", "flower", "device",
    "threads",
)  # fmt: skip
"""Config keys that do not change a run's results (or, ``method``, are compared per method);
``device`` and ``threads`` change them by float rounding only, so a run may resume on another
device or with another thread count."""


def _run_config(cfg: Config, method: str) -> dict[str, Any]:
    raw = cfg.model_dump(mode="json")
    out = {k: v for k, v in raw.items() if k not in _NOT_RESULT_KEYS}
    out["method"] = raw["method"].get(method, {})
    return out


def check_same_config(cfg: Config, method: str, out: Path) -> None:
    """Refuse to resume a run that an earlier, different config started.

    Raises:
        ConfigError: naming the keys whose values differ from ``config.json`` in ``out``.
    """
    path = out / "config.json"
    if not path.exists():
        return
    raw = json.loads(path.read_text())
    if raw.get("hyper") is None and method in DEFAULTS_CHANGED:
        raise ConfigError(
            f"--resume: {out} was started by an earlier fedlore in which {method} behaved "
            f"differently by default ({DEFAULTS_CHANGED[method]}); resuming would mix the two "
            "in one run. Run without --resume to start over"
        )
    details = config_diff(cfg, method, raw)
    if details:
        raise ConfigError(
            f"--resume: {out} was started with a different config ({details}); run without "
            "--resume to start over, or restore the config"
        )


def config_diff(cfg: Config, method: str, recorded: dict[str, Any]) -> str:
    """How ``cfg`` (for ``method``) differs from a run's recorded ``config.json``, as
    ``key: before -> now`` items (the first five; empty when the same). Settings that decide no
    result (``device``, the data fingerprint, the record keys) are left out; a setting the record
    lacks counts as its default; with a recorded ``hyper`` the method's resolved settings are
    compared instead of how the config spelled them."""
    raw = dict(recorded)
    hyper_before = raw.pop("hyper", None)
    before = _flatten(raw)
    before.pop("data_fingerprint", None)  # compared by check_same_data
    before.pop("ran_on", None)  # a record: a run may resume on another device
    for key in ("ran_threads", *PLATFORM_KEYS):
        before.pop(key, None)
    before.pop("dp_noise_multiplier", None)  # a record: solved from the dp.* settings compared
    before.pop("dp_noise_source", None)  # a record of dp.reproducible_noise, which is compared
    now = _flatten(_run_config(cfg, method))
    if hyper_before is not None:  # the method's settings as resolved (types and defaults)
        before.pop("method", None)
        now.pop("method", None)
        before.update({f"hyper.{k}": v for k, v in hyper_before.items()})
        now.update(
            {f"hyper.{k}": v for k, v in resolved_hyper(make_algorithm(method, cfg)).items()}
        )
    # a setting added to fedlore after the run started is no difference while it keeps its
    # default (the run was made with that behaviour)
    defaults = _flatten(_run_config(Config(), method))
    cls = registry.get("algorithm", method)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            v = f.default
            defaults[f"hyper.{f.name}"] = json.loads(
                json.dumps(list(v) if isinstance(v, tuple) else v, default=str)
            )
    diff = sorted(
        k
        for k in set(before) | set(now)
        if before.get(k, defaults.get(k)) != now.get(k) and not (k in before and k not in now)
    )
    diff += sorted(k for k in set(before) - set(now))
    # ``hyper.lr`` repeats ``lr`` when the method takes the global setting: name it once
    diff = [k for k in diff if not (k.startswith("hyper.") and k.removeprefix("hyper.") in diff)]
    return "; ".join(f"{k}: {before.get(k, defaults.get(k))!r} -> {now.get(k)!r}" for k in diff[:5])


DEFAULTS_CHANGED = {
    "meta_bayfl": "the learning-rate search scores by seed Eq. 19 and trains on all of D",
    "meta_bayfl_mcd": "the learning-rate search scores by seed Eq. 19 and trains on all of D",
    "meta_fl": "the learning-rate search scores by seed Eq. 19 and trains on all of D",
    "lora_fair": "the server correction is solved to its minimum",
    "fedfomo": "P-local scores the federated model before local training",
    "fedlore": "candidate_svd is auto: wide matrices take the subspace route (issue 30)",
}
"""Methods whose default behaviour changed after fedlore began recording ``hyper`` in a run's
``config.json``: a run of theirs without that record was made by the older behaviour."""


def resolved_hyper(algo: Algorithm) -> dict[str, Any]:
    """An algorithm's hyperparameters as built (every field, defaults and normalized types:
    ``1e-3`` given as text is the number), JSON-ready: recorded in ``config.json`` so that
    ``--resume`` compares what the method will do, not how the config spelled it."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(algo):  # type: ignore[arg-type]
        v = getattr(algo, f.name)
        out[f.name] = list(v) if isinstance(v, tuple) else v
    return json.loads(json.dumps(out, default=str))


def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config mappings as dotted keys (``{"optim": {"name": "adam"}}`` ->
    ``{"optim.name": "adam"}``); the per-method ``method`` mapping stays one value."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k != "method" and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def check_same_data(out: Path, fingerprint: str) -> None:
    """Refuse to resume a run whose data changed since it started (the files under
    ``data.root``, a tokenizer folder): the same config would otherwise continue on other
    clients' data.

    Raises:
        ConfigError: naming the run folder and both fingerprints.
    """
    path = out / "config.json"
    if not path.exists():
        return
    before = json.loads(path.read_text()).get("data_fingerprint")
    if before is not None and before != fingerprint:
        raise ConfigError(
            f"--resume: the data of {out} changed since the run started (fingerprint {before} "
            f"-> {fingerprint}): files under data.root or the tokenizer differ. Restore them, or "
            "run without --resume to start over"
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


def preflight(cfg: Config, fed: Federation) -> None:
    """Refuse a config that would fail part-way: the model fits the data, the tokenizer is the
    model's, and every method accepts ``params`` and its hyperparameters on the real model
    (its server state is built once and dropped). Runs before any run folder is touched.

    Raises:
        ConfigError: naming the method and the problem.
    """
    check_model_fits_data(cfg.model.name, fed)
    check_tokenizer_matches_model(cfg, fed)
    check_eval(cfg, fed)
    build = model_factory(cfg, fed, cfg.seeds[0])
    check_params(cfg, build())
    problems: list[str] = []
    accepted: list[tuple[str, Algorithm]] = []
    for name in cfg.algorithms:  # every method's problems at once, not only the first's
        try:  # a fresh model per method: a method may convert its workspace (a BNN)
            rng = generator(cfg.seeds[0], SERVER_INIT)
            algo = make_algorithm(name, cfg)
            start_server(algo, build(), rng, fed, name)
            if cfg.secure_aggregation:  # its round checks, before any run folder
                make_privacy(cfg, algo, cfg.seeds[0], max_weight=float(fed.client_sizes().max()))
        except ValueError as e:  # ConfigError included
            text = str(e)
            prefix = f"method {name!r}"
            problems.append(text if text.startswith(prefix) else f"{prefix}: {e}")
            continue
        accepted.append((name, algo))
    if problems:
        raise ConfigError("\n".join(problems))
    for name, algo in accepted:
        describe_parameters(name, algo, build())
        if cfg.optim.name != "adam" and not hasattr(algo, "optimizer"):
            log.warning(
                "optim.name=%s sets the inner optimizer of the projected methods; %s keeps its "
                "own (method.%s.local_optimizer where it has one)",
                cfg.optim.name,
                name,
                name,
            )


def describe_parameters(name: str, algo: Algorithm, model: nn.Module) -> None:
    """Say once, at the start of a run (:func:`fedlore.progress.say`), which matrices ``algo``
    projects (FedLore, Local GaLore: ``plan``) or adapts (the LoRA methods: ``targets``) and
    which tensors train densely, and warn about every Linear/Conv weight outside
    ``params.exclude`` that is not projected because the rank covers it (``min(m, n) <= rank``):
    it trains densely, which a user asking for a projected method would not expect."""
    from fedlore.algorithms.lora_common import LoraMethod
    from fedlore.algorithms.lowrank import LowRankHyper

    params = dict(model.named_parameters())
    if isinstance(algo, LowRankHyper):
        plan = algo.plan(model)
        kind = f"projects (rank {algo.rank})"
        chosen = {k: f"{s.m}x{s.n}" for k, s in plan.items()}
        for mod_name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear | nn.Conv1d | nn.Conv2d | nn.Conv3d):
                continue
            weight = f"{mod_name}.weight" if mod_name else "weight"
            if weight in plan or algo.is_frozen(weight):
                continue
            if any(weight.startswith(p) for p in algo.exclude):
                continue
            shape = tuple(mod.weight.shape)
            log.warning(
                "%s: %s %s is not projected (min(m, n) = %d <= rank %d): it trains densely",
                name,
                weight,
                "x".join(map(str, (shape[0], int(mod.weight[0].numel())))),
                min(shape[0], int(mod.weight[0].numel())),
                algo.rank,
            )
    elif isinstance(algo, LoraMethod):
        targets = algo.targets(model)
        kind = f"adapts (rank {algo.rank})"
        chosen = {f"{k}.weight": f"{t.m}x{t.n}" for k, t in targets.items()}
    else:
        return
    frozen = [k for k in params if algo.is_frozen(k)]
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


def summarize(method: str, seed: int, metrics_path: Path) -> dict[str, Any]:
    """The ``summary.json`` of a finished run, computed from its ``metrics.jsonl``."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in rows if r["round"] >= 0]
    accs = [r["accuracy"] for r in train if r.get("accuracy") is not None]
    lm = lm_summary(train)
    return {
        "method": method,
        "seed": seed,
        "rounds": len(train),
        "final_accuracy": final_value(train, "accuracy"),
        "best_accuracy": max(accs) if accs else None,
        "final_loss": final_value(train, "loss"),
        "bytes_up_total": sum(r["bytes_up"] for r in rows),
        "bytes_down_total": sum(r["bytes_down"] for r in rows),
        "optimizer_state_bytes": max((r["optimizer_state_bytes"] for r in rows), default=0),
        **_peak(rows),
        "wall_s_per_round": sum(r["wall_s"] for r in train) / max(len(train), 1),
        "wall_s_total": sum(r["wall_s"] for r in rows),
        "rejected_total": sum(r.get("rejected", 0) for r in rows),
        "skipped_steps_total": sum(r.get("skipped_steps", 0) for r in rows),
        "diag_s_total": sum(r.get("diag_s", 0.0) for r in rows),
        "diag_bytes_up_total": sum(r.get("diag_bytes_up", 0) for r in rows),
        **(
            {"dp_clipped_total": sum(r.get("dp_clipped", 0) for r in rows)}
            if any("dp_clipped" in r for r in rows)
            else {}
        ),
        **lm,
        **_last_values(train),
        **divergence(train),
    }


SUMMARY_LAST = {
    "final_ece": "ece",
    "final_client_accuracy": "client_accuracy",
    "final_client_loss": "client_loss",
    "final_client_ece": "client_ece",
    "final_client_accuracy_mean": "client_accuracy_mean",
    "local_accuracy": "local_accuracy",
    "local_loss": "local_loss",
    "local_ece": "local_ece",
    "local_clients": "local_clients",
    "final_selection_accuracy": "selection_accuracy",
    "final_selection_loss": "selection_loss",
    "final_rmse": "rmse",
    "final_selection_rmse": "selection_rmse",
    "final_client_rmse": "client_rmse",
    "local_rmse": "local_rmse",
    "dp_epsilon": "dp_epsilon",
    "dp_epsilon_sample_known": "dp_epsilon_sample_known",
}
"""Summary key -> row key whose last recorded value it holds (when any round recorded it)."""


def _peak(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``peak_memory_bytes``: the largest peak device memory of any client's update in the run
    (CUDA only; absent on the CPU, where nothing measures it)."""
    peaks = [r["peak_memory_bytes"] for r in rows if r.get("peak_memory_bytes") is not None]
    return {"peak_memory_bytes": max(peaks)} if peaks else {}


def final_value(rows: list[dict[str, Any]], key: str) -> Any:
    """The value of ``key`` in the last row that recorded it (the last evaluation), None when
    that value was not finite (metrics.jsonl writes NaN and inf as null) or no row recorded it.
    Never an earlier round's value: a run that diverged at the end reports None, not the score
    it had before (so it can never win a learning-rate grid)."""
    return next((r[key] for r in reversed(rows) if key in r), None)


def _last_values(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's optional metrics: each :data:`SUMMARY_LAST` key that any row recorded,
    with its value in the last row that recorded it (None when not finite, see
    :func:`final_value`), ``final_selection_perplexity`` likewise, and
    ``client_train_s_per_round`` (mean seconds of local training per client per round)."""
    out: dict[str, Any] = {}
    for key, src in SUMMARY_LAST.items():
        if any(src in r for r in rows):
            out[key] = final_value(rows, src)
    if any("selection_perplexity" in r for r in rows):
        out["final_selection_perplexity"] = final_value(rows, "selection_perplexity")
    times = [r["client_train_s"] for r in rows if r.get("client_train_s") is not None]
    if times:
        out["client_train_s_per_round"] = sum(times) / len(times)
    return out


def check_output_dir(cfg: Config) -> None:
    """``<output_dir>/<name>`` can be a folder this process creates and writes: no part of the
    path is a file, and the deepest part that exists is a writable folder (nothing is created).

    Raises:
        ConfigError: naming ``output_dir`` (or ``name``) and the part of the path in the way.
    """
    target = Path(cfg.output_dir) / cfg.name
    for part in [target, *target.parents]:
        if not part.exists():
            continue
        if not part.is_dir():
            key = "name" if part == target else "output_dir"
            raise ConfigError(
                f"{key}: {part} is a file, not a folder (output_dir={cfg.output_dir!r}, "
                f"name={cfg.name!r}); choose another output_dir or name"
            )
        if not os.access(part, os.W_OK | os.X_OK):
            raise ConfigError(
                f"output_dir={cfg.output_dir!r}: cannot create or write {target} ({part} is "
                "not writable); choose another output_dir"
            )
        break


def make_output_dir(cfg: Config) -> None:
    """Create ``<output_dir>/<name>``.

    Raises:
        ConfigError: naming ``output_dir`` when the folder cannot be created.
    """
    target = Path(cfg.output_dir) / cfg.name
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(
            f"output_dir={cfg.output_dir!r}: cannot create {target} ({e.strerror or e}); "
            "choose another output_dir"
        ) from e


def run_experiment(
    cfg: Config, resume: bool = False, overwrite: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Every method x seed of ``cfg``; the federation of a seed is built once and shared, so all
    methods see identical client data. Returns method -> summaries.

    Before any work: ``output_dir`` must be a folder (or not exist yet); every method name and
    hyperparameter is checked and every problem reported at once; without ``resume`` or
    ``overwrite`` no finished run of another config may be in the way, and the finished runs of
    this config are reported and returned, not trained again.

    Raises:
        ConfigError: as above, naming each problem.
    """
    out: dict[str, list[dict[str, Any]]] = {m: [] for m in cfg.algorithms}
    # the config first (names, every method's settings): a typo is the problem to name, not a
    # run folder in the way
    problems = [*name_problems(cfg), *unused_method_problems(cfg)]
    for name in cfg.algorithms:
        try:
            make_algorithm(name, cfg)  # unknown methods and bad hyperparameters fail early
        except (KeyError, ValueError) as e:
            problems.append(f"{name}: {e.args[0] if e.args else e}")
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    check_output_dir(cfg)
    if not resume and not overwrite:
        for seed in cfg.seeds:
            for method in cfg.algorithms:
                check_no_finished_run_of_another_config(cfg, method, run_dir(cfg, method, seed))
    first = build_federation(cfg, cfg.seeds[0])
    preflight(cfg, first)  # every check runs before a run folder is created or touched
    make_output_dir(cfg)
    with contextlib.ExitStack() as held:
        # every folder this experiment will write is its own from the start: a second process
        # running the same experiment is refused now, not when it reaches a busy folder (after
        # having redone and rewritten the finished ones)
        for seed in cfg.seeds:
            for method in cfg.algorithms:
                held.enter_context(RunLock(run_dir(cfg, method, seed)))
        _run_all(cfg, first, resume, overwrite, out)
    return out


def _run_all(
    cfg: Config,
    first: Federation,
    resume: bool,
    overwrite: bool,
    out: dict[str, list[dict[str, Any]]],
) -> None:
    # engine=flower-sim: one Ray for every run, started by the first simulated one and stopped
    # when the last ends, fails or is interrupted (ray_session; nested ones are no-ops)
    in_session = False
    with contextlib.ExitStack() as ray:
        for seed in cfg.seeds:
            fed = first if seed == cfg.seeds[0] else build_federation(cfg, seed)
            done = {} if resume or overwrite else finished_runs(cfg, seed, fed)  # said, kept
            for method in cfg.algorithms:
                summary: dict[str, Any] | None = done.get(method)
                if summary is None and cfg.engine == "flower-sim":
                    from fedlore.flower.simulation import ray_session, run_simulated

                    if not in_session:  # the first simulated run opens the session
                        ray.enter_context(ray_session())
                        in_session = True
                    summary = run_simulated(cfg, method, seed, resume=resume, overwrite=overwrite)
                elif summary is None:
                    summary = run_one(
                        cfg, method, seed, fed=fed, resume=resume, overwrite=overwrite
                    )
                if summary is not None:
                    out[method].append(summary)
