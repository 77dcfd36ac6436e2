"""Server optimizers (:mod:`fedlore.optim.server`): FedAvgM, FedAdagrad, FedAdam and FedYogi
through a method's real aggregation, checked against Flower's own strategies on identical
inputs; the formulas checked on hand-computable cases; the moments checkpointed; methods that
cannot take a server optimizer refuse it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fedlore.algorithms.fedavg import FedFull
from fedlore.config import ConfigError, load_config
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.optim.server import ServerOpt
from fedlore.types import Reply

ROUNDS = 4
SIZES = (10, 20, 45)  # the clients' n_i: FedAvg's weights


def _clients(x: dict[str, torch.Tensor], rnd: int) -> list[dict[str, torch.Tensor]]:
    """Three clients' trained models near the global model ``x`` (float64)."""
    g = torch.Generator().manual_seed(100 + rnd)
    return [{k: v + 0.1 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in x.items()}
            for _ in SIZES]  # fmt: skip


def _fedlore_rounds(**settings: Any) -> list[dict[str, torch.Tensor]]:
    """The global model after each of ``ROUNDS`` rounds of FedFull's real ``aggregate`` with
    the server optimizer ``settings``."""
    algo = FedFull.of(lr=1e-3, **settings)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    state = algo.init_server(model, torch.Generator())
    out = []
    for rnd in range(ROUNDS):
        x = algo.global_arrays(state)
        replies = [
            (i, Reply({f"update.{k}": v - x[k] for k, v in c.items()}, {"num_examples": n}))
            for i, (c, n) in enumerate(zip(_clients(x, rnd), SIZES, strict=True))
        ]
        state, _ = algo.aggregate(state, replies, rnd)  # type: ignore[arg-type]
        out.append({k: v.clone() for k, v in algo.global_arrays(state).items()})
    return out


def _flwr_rounds(strategy_cls: type, rounds_from: int, **kw: Any) -> list[dict[str, np.ndarray]]:
    """The same rounds through Flower's strategy ``strategy_cls`` (its ``aggregate_fit``)."""
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays

    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    names = list(model.state_dict())
    x = {k: v.detach().clone() for k, v in model.state_dict().items()}
    init = ndarrays_to_parameters([x[k].numpy() for k in names])
    strategy = strategy_cls(initial_parameters=init, **kw)
    out = []
    for rnd in range(ROUNDS):
        results = [
            (
                None,
                FitRes(
                    Status(Code.OK, ""),
                    ndarrays_to_parameters([c[k].numpy() for k in names]),
                    n,
                    {},
                ),
            )
            for c, n in zip(_clients(x, rnd), SIZES, strict=True)
        ]
        params, _ = strategy.aggregate_fit(rounds_from + rnd, results, [])
        arrays = parameters_to_ndarrays(params)
        x = {k: torch.from_numpy(a.copy()) for k, a in zip(names, arrays, strict=True)}
        out.append(x)
    return out


def _close(ours: list[dict[str, torch.Tensor]], theirs: list[dict[str, Any]]) -> float:
    err = 0.0
    for a, b in zip(ours, theirs, strict=True):
        for k in a:
            err = max(err, float((a[k] - torch.as_tensor(b[k])).abs().max()))
    return err


pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs", "rounds_from"),
    [
        # FedAvgM: Flower numbers rounds from 1 and starts its momentum in round 1
        ({"server_optimizer": "momentum", "server_eta": 0.7, "server_betas": (0.9, 0.99)},
         "FedAvgM", {"server_learning_rate": 0.7, "server_momentum": 0.9}, 1),
        # FedAdagrad: Flower's has no first-moment momentum (beta1 = 0) and v starts at 0
        ({"server_optimizer": "adagrad", "server_eta": 0.1, "server_betas": (0.0, 0.0),
          "server_tau": 1e-3, "server_v0": 0.0},
         "FedAdagrad", {"eta": 0.1, "tau": 1e-3}, 1),
        ({"server_optimizer": "yogi", "server_eta": 0.05, "server_betas": (0.9, 0.99),
          "server_tau": 1e-3, "server_v0": 0.0},
         "FedYogi", {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, 1),
        # FedAdam: Flower corrects the bias with t = server_round + 1, so its round t - 1 is
        # our t-th step
        ({"server_optimizer": "adam", "server_eta": 0.05, "server_betas": (0.9, 0.99),
          "server_tau": 1e-3, "server_v0": 0.0, "server_bias_correction": True},
         "FedAdam", {"eta": 0.05, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, 0),
    ],
)  # fmt: skip
def test_server_optimizers_equal_flowers_strategies(
    ours: dict[str, Any], theirs: str, kwargs: dict[str, Any], rounds_from: int
) -> None:
    import flwr.server.strategy as fs

    got = _fedlore_rounds(**ours)
    want = _flwr_rounds(getattr(fs, theirs), rounds_from, **kwargs)
    moved = _close(got, [{k: v for k, v in g.items()} for g in _fedlore_rounds()])
    assert moved > 1e-3  # the optimizer changed the trajectory: the comparison means something
    assert _close(got, want) < 1e-12


def test_fedadam_without_bias_correction_is_reddi_and_differs_from_flower() -> None:
    """Reddi et al.'s FedAdam (no bias correction, the default) is not Flower's: the
    cross-check above needs ``server_bias_correction``."""
    import flwr.server.strategy as fs

    ours = _fedlore_rounds(server_optimizer="adam", server_eta=0.05, server_v0=0.0)
    flwr = _flwr_rounds(fs.FedAdam, 0, eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)
    assert _close(ours, flwr) > 1e-4


def test_plain_sgd_at_lr_one_is_fedavg_bit_for_bit_and_keeps_no_state() -> None:
    plain = _fedlore_rounds()
    same = _fedlore_rounds(server_optimizer="sgd", server_eta=1.0)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(plain, same, strict=True) for k in a)
    algo = FedFull.of()
    state = algo.init_server(nn.Linear(2, 2), torch.Generator())
    assert not [k for k in state.arrays if k.startswith("sopt.")]


def test_the_formulas_on_one_coordinate() -> None:
    """Δ = 2 then Δ = -1 on a single weight, by hand (Reddi et al. Algorithm 2, Hsu et al.)."""
    d1 = {"w": torch.tensor([2.0], dtype=torch.float64)}
    d2 = {"w": torch.tensor([-1.0], dtype=torch.float64)}
    tau, b1, b2, eta = 0.1, 0.5, 0.75, 0.2

    def run(kind: str, **kw: Any) -> list[float]:
        opt = ServerOpt(kind, eta, (b1, b2), tau, **kw)  # type: ignore[arg-type]
        s1, m = opt.step(d1, {}, 1)
        s2, _ = opt.step(d2, m, 2)
        return [float(s1["w"]), float(s2["w"])]

    assert run("sgd") == pytest.approx([0.4, -0.2])
    assert run("momentum") == pytest.approx([0.4, eta * (b1 * 2 - 1)])  # m = 2, then 0
    v0 = tau**2
    m1, m2 = (1 - b1) * 2, b1 * (1 - b1) * 2 + (1 - b1) * -1
    va = [v0 + 4, v0 + 5]
    vd = [b2 * v0 + (1 - b2) * 4]
    vd.append(b2 * vd[0] + (1 - b2) * 1)
    vy = [v0 + (1 - b2) * 4]  # v0 < 4: sign(v - Δ²) = -1
    vy.append(vy[0] - (1 - b2) * 1 * np.sign(vy[0] - 1))
    for kind, v in (("adagrad", va), ("adam", vd), ("yogi", vy)):
        want = [eta * m1 / (v[0] ** 0.5 + tau), eta * m2 / (v[1] ** 0.5 + tau)]
        assert run(kind) == pytest.approx(want, rel=1e-12), kind
    corr = [eta * (1 - b2**t) ** 0.5 / (1 - b1**t) for t in (1, 2)]
    want = [corr[0] * m1 / (vd[0] ** 0.5 + tau), corr[1] * m2 / (vd[1] ** 0.5 + tau)]
    assert run("adam", bias_correction=True) == pytest.approx(want, rel=1e-12)
    assert run("adam", v0=0.0)[0] == pytest.approx(eta * m1 / ((1 - b2) ** 0.5 * 2 + tau))
    with pytest.raises(ValueError, match="t must be"):
        ServerOpt("adam").step(d1, {}, 0)


def test_integer_tensors_take_the_plain_delta() -> None:
    step, moments = ServerOpt("adam", 0.1).step({"n": torch.tensor([3])}, {}, 1)
    assert torch.equal(step["n"], torch.tensor([3])) and not moments


def test_a_resumed_run_continues_the_servers_moments(tmp_path: Path) -> None:
    """The moments are server state: a run killed after round 2 and resumed ends where the run
    that was never stopped ends (FedAdam on FedAvg)."""
    base = [
        "num_clients=3", "local_steps=2", "progress=false", "algorithms=[fedavg]",
        "server.optimizer=adam", "server.lr=0.01", "model.kwargs={hidden: [16]}",
    ]  # fmt: skip
    full = load_config(None, [*base, "rounds=4", f"output_dir={tmp_path / 'a'}"])
    whole = run_one(full, "fedavg", 42)
    part = load_config(None, [*base, "rounds=4", f"output_dir={tmp_path / 'b'}"])

    assert run_one(part, "fedavg", 42, stop_after=2) is None  # killed after round 1
    resumed = run_one(part, "fedavg", 42, resume=True)
    assert whole is not None and resumed is not None
    assert resumed["final_accuracy"] == whole["final_accuracy"]
    assert resumed["final_loss"] == whole["final_loss"]


def test_methods_without_an_averaged_dense_step_refuse_a_server_optimizer() -> None:
    for name in ("flexlora", "fedfomo", "fedbe", "fedmask"):
        cfg = load_config(None, ["server.optimizer=adam", f"algorithms=[{name}]"])
        with pytest.raises(ConfigError, match="no server optimizer applies"):
            make_algorithm(name, cfg)
    cfg = load_config(None, ["method.flora.server_eta=0.5"])
    with pytest.raises(ConfigError, match=r"server\.lr=0\.5"):
        make_algorithm("flora", cfg)
    algo = make_algorithm("fedavg", load_config(None, ["server.optimizer=yogi", "server.lr=0.1"]))
    assert isinstance(algo, FedFull)
    assert (algo.train.server_optimizer, algo.train.server_eta) == ("yogi", 0.1)
    assert isinstance(algo.server_opt(), ServerOpt)


@pytest.mark.parametrize("name", ["fedit", "ffa_lora"])
def test_lora_methods_that_average_factors_step_from_the_averaged_change(
    name: str, tmp_path: Path
) -> None:
    """FedIT and FFA-LoRA average the factors themselves: a server optimizer steps from their
    averaged change (and the dense tensors'), the clients' merged models stay in sync (the run
    rejects nothing), and the result differs from plain averaging; the merge-based LoRA methods
    refuse it."""
    base = ["num_clients=3", "rounds=3", "local_steps=2", "progress=false", f"algorithms=[{name}]",
            "model.kwargs={hidden: [16]}", "rank=2"]  # fmt: skip
    plain = run_one(load_config(None, [*base, f"output_dir={tmp_path / 'a'}"]), name, 42)
    cfg = load_config(None, [*base, "server.optimizer=adam", "server.lr=0.05",
                             f"output_dir={tmp_path / 'b'}"])  # fmt: skip
    stepped = run_one(cfg, name, 42)
    assert plain is not None and stepped is not None
    assert stepped["rejected_total"] == 0
    assert stepped["final_loss"] != plain["final_loss"]
    import torch as _t

    ckpt = _t.load(tmp_path / "b" / "experiment" / name / "seed-42" / "checkpoint.pt",
                   weights_only=False)  # fmt: skip
    keys = [k for k in ckpt["server"]["arrays"] if k.startswith("sopt.m.lora.")]
    assert keys and all(k.endswith(".B") or name == "fedit" for k in keys)
    for merged in ("flexlora", "flora", "frlora", "rolora", "lora_fair"):
        with pytest.raises(ConfigError, match="no server optimizer applies"):
            make_algorithm(merged, load_config(None, ["server.optimizer=adam"]))
