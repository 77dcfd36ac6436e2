"""Every registered algorithm on Flower's Simulation Engine (Ray backend) equals its in-process run.

Each method runs one simulated round (plus its setup exchange; FedLore, FedFull, Meta-BayFL,
FedDyn, FedPer, FedBN, FedRep, MOON and APFL two): the global model and the byte counts must equal
those of the in-process transport (same seeds, same data, same ``client_update``). So do a
pre-training run (LLaMA on the C4 fixture) and FedLore's diagnostics. One Ray serves the whole
module (:func:`fedlore.flower.simulation.ray_session`, as ``fedlore run`` holds one around all
its runs; a simulation's actors are killed at its end, so each method starts in fresh worker
processes): a Ray start per method cost ~10 s of CI each. The digits come from the
``digits_npz`` fixture (the same federation; every Ray actor would import scikit-learn for
``data.name=digits``, ~2 s of CPU each). FedPer, MOON and SCAFFOLD (its control variates
too) also run under secure aggregation (SecAgg+ over the actors) against fedlore's in-process
protocol.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="needs the [flower] extra: pip install -e '.[flower]'")
from sim_helpers import SMALL, assert_matches, rows, sim_cfg

from fedlore import registry
from fedlore.algorithms.scaffold import CONTROL
from fedlore.config import load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.flower.simulation import ray_session, run_simulated

# one worker runs the whole module, so the module's one Ray starts once (spread over two
# pytest-xdist workers, each started its own)
pytestmark = [pytest.mark.flower, pytest.mark.xdist_group("ray-methods")]


@pytest.fixture(scope="module", autouse=True)
def one_ray() -> Iterator[None]:
    with ray_session():
        yield


# Variants that only switch hyperparameters of a class tested here run no transport-specific
# code of their own (each Ray start costs ~15 s of CI): FedProx is FedAvg with a loss term, the
# Meta-BayFL family is one class (``meta_bayfl`` covers the BNN, the search, per-client
# learning rates in the reply metrics and the in-place model conversion on a fresh ClientApp),
# and fedlore_bayfl is fedlore_bayes without the search.
SAME_CLASS_AS_TESTED = {
    "fedprox", "bayfl", "meta_bayfl_mcd", "fedavg_mcd", "meta_fl", "fedlore_bayfl",
}  # fmt: skip
# FedFull and FedAvg are compared with their in-process runs by the two-method experiment test
# (one Ray start for both: test_an_experiment_starts_ray_once_and_its_runs_equal_runs_alone)
IN_EXPERIMENT_TEST = {"fedfull", "fedavg"}
TWO_ROUNDS = {
    "fedlore", "fedfull", "meta_bayfl", "feddyn", "fedper", "fedbn", "fedrep", "moon", "apfl",
}  # fmt: skip


@pytest.mark.parametrize(
    ("method", "rounds"),
    [
        # FedDyn: two rounds, so that its clients read their h_k back in the second; FedPer,
        # FedBN and FedRep: a second round, where clients overlay their own layers
        # (Context.state) on a broadcast without them; MOON: a second round, where clients
        # contrast with their previous model (Context.state); APFL: a second round, where
        # clients read their v_i and alpha_i back (Context.state)
        (m, 2 if m in TWO_ROUNDS else 1)
        for m in registry.names("algorithm")
        if m not in SAME_CLASS_AS_TESTED | IN_EXPERIMENT_TEST
    ],
)
def test_simulation_matches_in_process(
    tmp_path: Path,
    method: str,
    rounds: int,
    capfd: pytest.CaptureFixture[str],
    digits_npz: list[str],
) -> None:
    local = sim_cfg(tmp_path, "local", rounds, method, digits_npz)
    sim = sim_cfg(tmp_path, "sim", rounds, method, digits_npz)
    run_one(local, method, 42)
    summary = run_simulated(sim, method, 42)
    # Flower's DEBUG lines and deprecation notices go to the run's flower.log, not the console
    console = capfd.readouterr().err
    assert "DEBUG flwr" not in console and "DEPRECATED" not in console
    assert "flwr" in (run_dir(sim, method, 42) / "flower.log").read_text()
    assert_matches(local, sim, method, summary)


def test_pretraining_simulation_matches_in_process(tmp_path: Path) -> None:
    """LLaMA on the C4 fixture (source groups, per-client streams, perplexity) over Flower."""
    c4 = Path(__file__).parents[1] / "fixtures" / "c4"
    pre = [
        "data.name=c4",
        f"data.root={c4}",
        "data.max_length=16",
        "data.vocab_size=300",
        "partition.name=source_dirichlet",
        "model.name=llama",
        "model.kwargs={size: micro, hidden: 32, intermediate: 64, heads: 2}",
        "rank=4",
        "batch_size=4",
    ]
    runs = {}
    for engine in ("local", "sim"):
        cfg = load_config(
            None,
            [
                *SMALL[:-2],
                *pre,
                "flower.num_cpus=2",
                "rounds=2",
                "algorithms=[fedlore]",
                f"output_dir={tmp_path / engine}",
            ],
        )
        summary = (
            run_one(cfg, "fedlore", 42) if engine == "local" else run_simulated(cfg, "fedlore", 42)
        )
        assert summary is not None
        runs[engine] = summary
    assert runs["sim"]["final_perplexity"] == pytest.approx(runs["local"]["final_perplexity"])
    assert runs["sim"]["bytes_up_total"] == runs["local"]["bytes_up_total"]


def test_simulation_carries_diagnostics(tmp_path: Path, digits_npz: list[str]) -> None:
    """FedLore's candidate gradients cross Flower's wire; the diagnostics equal in-process ones."""
    extra = ["diagnostics.every=1", "diagnostics.batch_size=16", *digits_npz]
    local = load_config(None, [*SMALL, "rounds=2", f"output_dir={tmp_path / 'l'}", *extra])
    sim = load_config(None, [*SMALL, "rounds=2", f"output_dir={tmp_path / 's'}", *extra])
    run_one(local, "fedlore", 42)
    run_simulated(sim, "fedlore", 42)
    a, b = rows(local, "fedlore"), rows(sim, "fedlore")
    assert a[1]["diag_bytes_up"] == b[1]["diag_bytes_up"] > 0  # round 0 uploads H_i
    for key in ("diag.retained_energy", "diag.rho2", "diag.d_r", "diag.certificate2"):
        assert b[-1][key] == pytest.approx(a[-1][key], rel=1e-4), key


def test_fednova_under_local_epochs_matches_in_process(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """FedNova's clients of different sizes take different numbers of steps under
    ``local_epochs``, so its server really divides each delta by that client's own ``a_norm``,
    a reply metric that crosses Flower's wire (under ``local_steps`` every ``a_norm`` is the
    same and the division changes nothing)."""
    local, sim = (
        sim_cfg(tmp_path, engine, 2, "fednova", digits_npz).model_copy(
            update={"local_steps": None, "local_epochs": 1}
        )
        for engine in ("local", "sim")
    )
    run_one(local, "fednova", 42)
    summary = run_simulated(sim, "fednova", 42)
    assert_matches(local, sim, "fednova", summary)
    for a, b in zip(rows(local, "fednova"), rows(sim, "fednova"), strict=True):
        assert b["tau_eff_lr"] == pytest.approx(a["tau_eff_lr"], rel=1e-12)
        assert a["accepted"] == 3


def test_qffl_weighs_each_client_by_the_loss_it_sent_over_flower(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """q-FFL's server weighs each client's delta by ``qffl_loss``, a reply metric that crosses
    Flower's wire; at q = 5 a loss that arrived otherwise would move the model elsewhere and
    change the round's ``qffl_step_share`` (two rounds: the second starts from a q-step)."""
    local, sim = (
        sim_cfg(tmp_path, engine, 2, "qffl", digits_npz).model_copy(
            update={"method": {"qffl": {"q": 5.0}}}
        )
        for engine in ("local", "sim")
    )
    run_one(local, "qffl", 42)
    summary = run_simulated(sim, "qffl", 42)
    assert_matches(local, sim, "qffl", summary)
    for a, b in zip(rows(local, "qffl"), rows(sim, "qffl"), strict=True):
        assert b["qffl_loss_max"] == pytest.approx(a["qffl_loss_max"], rel=1e-6)
        assert b["qffl_step_share"] == pytest.approx(a["qffl_step_share"], rel=1e-6)
        assert 0 < a["qffl_step_share"] < 1 and a["accepted"] == 3


@pytest.mark.filterwarnings("ignore::fedlore.experiment_privacy.PrivacyWarning")  # eval.local's
@pytest.mark.parametrize("method", ["fedper", "moon"])
def test_secure_simulation_matches_the_in_process_secure_run(
    tmp_path: Path, method: str, digits_npz: list[str]
) -> None:
    """Under secure aggregation: flwr's SecAgg+ over Ray actors, each client's kept layers
    (FedPer; FedBN and FedRep are the same class) or previous model (MOON) held in its node's
    ``Context.state`` across the two rounds, against fedlore's in-process protocol: the same
    global model to SecAgg+'s quantization, the same P-local scores (``eval.local``, the
    measurement the run warns of), no training loss in either run's rows."""
    secure = ["secure_aggregation=true", "lr=0.1", "eval.local=true"]
    local, sim = (
        sim_cfg(tmp_path, engine, 2, method, [*digits_npz, *secure]) for engine in ("local", "sim")
    )
    run_one(local, method, 42)
    run_simulated(sim, method, 42)
    a = Checkpointer.load(run_dir(local, method, 42) / "checkpoint.pt")[1].arrays
    b = Checkpointer.load(run_dir(sim, method, 42) / "checkpoint.pt")[1].arrays
    first = rows(local, method)[0]
    assert first["train_loss"] is None and first["secagg_aborted"] == 0
    for k, v in a.items():
        if k.startswith("model.") and v.is_floating_point():
            torch.testing.assert_close(b[k], v, rtol=0, atol=1e-5, msg=k)
    want, got = rows(local, method)[-1], rows(sim, method)[-1]
    assert got["accepted"] == want["accepted"] == 3 and got["train_loss"] is None
    assert got["local_clients"] == want["local_clients"] == 3
    assert got["local_accuracy"] == pytest.approx(want["local_accuracy"], abs=1e-6)


def test_scaffold_under_secure_simulation_matches_the_in_process_secure_run(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """SCAFFOLD under secure aggregation: flwr's SecAgg+ over Ray actors masks each client's
    ``[Δc_i, Δy]``, and each client's ``c_i`` lives in its node's ``Context.state`` from round
    0 to round 1 (it corrects round 1's steps and is the base of round 1's Δc_i), against
    fedlore's in-process protocol: after two rounds the global model x *and* the server's
    control variate c are the in-process run's to SecAgg+'s quantization (the tolerance of the
    methods above). With every client in every round c is the clients' weighted mean of their
    c_i, so a ``c_i`` lost or altered between the rounds would show in c (and in x)."""
    secure = ["secure_aggregation=true", "lr=0.1"]
    local, sim = (
        sim_cfg(tmp_path, engine, 2, "scaffold", [*digits_npz, *secure])
        for engine in ("local", "sim")
    )
    run_one(local, "scaffold", 42)
    run_simulated(sim, "scaffold", 42)
    a = Checkpointer.load(run_dir(local, "scaffold", 42) / "checkpoint.pt")[1].arrays
    b = Checkpointer.load(run_dir(sim, "scaffold", 42) / "checkpoint.pt")[1].arrays
    controls = [k for k in a if k.startswith(CONTROL)]
    assert controls and {k for k in a if k.startswith("model.")}
    for k, v in a.items():
        if k.startswith(("model.", CONTROL)) and v.is_floating_point():
            torch.testing.assert_close(b[k], v, rtol=0, atol=1e-5, msg=k)
    moved = max(float(a[k].abs().max()) for k in controls)  # c starts at 0
    assert moved > 100 * 1e-5, moved  # not a comparison of two control variates left at 0
    for want, got in zip(rows(local, "scaffold"), rows(sim, "scaffold"), strict=True):
        assert got["accepted"] == want["accepted"] == 3
        assert got["secagg_aborted"] == want["secagg_aborted"] == 0
        assert got["train_loss"] is None  # nothing of a client in the clear


@pytest.mark.parametrize("levels", [False, True], ids=["global", "eval_levels"])
def test_heterofl_static_batch_norm_query_over_flower_matches_in_process(
    tmp_path: Path, digits_npz: list[str], levels: bool
) -> None:
    """HeteroFL on the BatchNorm MLP at three widths: the statistics query after each round
    travels as a second exchange of the round over Flower and ends with the in-process run's
    global model (running statistics included), bytes and query bytes; only the one client of
    rate 1 can run the full model, so it alone is pooled into it. With ``eval_levels`` each
    client is sent every level it can run, and every level's scores are the in-process ones."""

    def cfg(engine: str) -> Any:
        return load_config(
            None,
            [
                *SMALL,
                *digits_npz,
                "model.kwargs={hidden: [16], norm: batch}",
                "method.heterofl.rates=[1.0, 0.5, 0.25]",
                f"method.heterofl.eval_levels={str(levels).lower()}",
                "rounds=2",
                "algorithms=[heterofl]",
                f"output_dir={tmp_path / engine}",
            ],
        )

    local, sim = cfg("local"), cfg("sim")
    run_one(local, "heterofl", 42)
    summary = run_simulated(sim, "heterofl", 42)
    assert_matches(local, sim, "heterofl", summary)
    for a, b in zip(rows(local, "heterofl"), rows(sim, "heterofl"), strict=True):
        assert a["query_bytes_up"] == b["query_bytes_up"] > 0 and b["sbn_clients"] == 1
        assert a["query_bytes_down"] == b["query_bytes_down"]
        if levels:
            assert set(b["levels"]) == {"1.0", "0.5", "0.25"}
            for rate, want in a["levels"].items():
                got = b["levels"][rate]
                assert got["accuracy"] == pytest.approx(want["accuracy"], abs=1e-6), rate
                assert got["loss"] == pytest.approx(want["loss"], rel=1e-4), rate
        else:
            assert "levels" not in b


def test_heterofl_dynamic_levels_and_label_masks_over_flower_match_in_process(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    """HeteroFL's dynamic assignment and label masking on the BatchNorm MLP: each round's level
    reaches the ClientApp in the broadcast's ``rate`` (and its query in the sub-models sent), the
    label set comes back as the reply's ``labels``; the run ends with the in-process run's model,
    bytes and every round's per-client levels."""

    def cfg(engine: str) -> Any:
        return load_config(
            None,
            [
                *SMALL,
                *digits_npz,
                "model.kwargs={hidden: [16], norm: batch}",
                "method.heterofl.rates=[1.0, 0.5]",
                "method.heterofl.shares=[3, 1]",
                "method.heterofl.assignment=dynamic",
                "method.heterofl.mask_labels=true",
                "rounds=3",
                "algorithms=[heterofl]",
                f"output_dir={tmp_path / engine}",
            ],
        )

    local, sim = cfg("local"), cfg("sim")
    run_one(local, "heterofl", 42)
    summary = run_simulated(sim, "heterofl", 42)
    assert_matches(local, sim, "heterofl", summary)
    levels = [r["width_rate"] for r in rows(local, "heterofl")]
    assert levels == [r["width_rate"] for r in rows(sim, "heterofl")]
    assert len({tuple(sorted(x.items())) for x in levels}) > 1  # the levels moved
