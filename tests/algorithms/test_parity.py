"""One rule for non-adapted parameters under every method (reference notes section 13.3).

The ten methods of the seed's Table 1 train the same parameters: the Linear weights outside
``params.exclude`` are projected (FedLore, Local GaLore), adapted (LoRA methods) or trained
densely (FedFull); every other parameter trains densely unless ``params.freeze`` names it; frozen
tensors never change, are never uploaded, and after a client's first contact are not sent again.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from fedlore.checks import setup_rounds
from fedlore.config import Config, ConfigError, load_config
from fedlore.data.federation import build_federation
from fedlore.engine.loop import RoundLoop
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_experiment
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator
from fedlore.types import Broadcast, Reply, State

TABLE1 = [
    "fedfull",
    "local_galore",
    "fedlore",
    "fedlore_random",
    "fedit",
    "ffa_lora",
    "flexlora",
    "lora_fair",
    "rolora",
    "flora",
    "frlora",
]
SEED, N, ROUNDS = 5, 3, 3


def _cfg(*extra: str) -> Config:
    return load_config(
        None,
        [
            "name=parity",
            f"num_clients={N}",
            f"rounds={ROUNDS}",
            "local_steps=2",
            "batch_size=16",
            "rank=2",
            "lr=0.01",
            "model.kwargs={hidden: [16]}",
            "partition.min_size=10",
            "progress=false",
            *extra,
        ],
    )


class Recording(LocalTransport):
    """The in-process transport, keeping every broadcast and reply it carried."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent: list[tuple[int, int, Broadcast]] = []
        self.got: list[Reply] = []

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out = super().send(rnd, messages)
        self.sent.extend((rnd, c, m) for c, m in messages.items())
        self.got.extend(r for r in out.values() if isinstance(r, Reply))
        return out


def _run(
    name: str, cfg: Config, sampler: Callable[[int], list[int]] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], Recording]:
    fed = build_federation(cfg, SEED)
    algo = make_algorithm(name, cfg)
    build = model_factory(cfg, fed, SEED)
    state = algo.init_server(build(), generator(SEED, SERVER_INIT))
    first = {k: v.clone() for k, v in algo.global_arrays(state).items()}
    transport = Recording(algo, fed.client, build, SEED, ClientStore())
    loop = RoundLoop(algo, transport, sampler or (lambda _: list(range(N))))
    for rnd in range(-setup_rounds(algo), cfg.rounds):
        state, row = loop.run_round(state, rnd, cfg.rounds - 1)
        assert row["rejected"] == 0, row.get("rejected_reasons")
    return first, algo.global_arrays(state), transport


@pytest.mark.parametrize("name", TABLE1)
def test_every_method_trains_biases_and_head_densely(name: str) -> None:
    first, last, _ = _run(name, _cfg())
    for key in ("body.0.weight", "body.0.bias", "head.weight", "head.bias"):
        assert not torch.equal(first[key], last[key]), f"{name} did not train {key}"


@pytest.mark.parametrize("name", TABLE1)
def test_frozen_tensors_never_change_never_go_up_and_come_down_once(name: str) -> None:
    first, last, transport = _run(name, _cfg("params.freeze=[body.0.bias]"))
    assert torch.equal(first["body.0.bias"], last["body.0.bias"])
    for key in ("body.0.weight", "head.weight", "head.bias"):
        assert not torch.equal(first[key], last[key]), f"{name} did not train {key}"
    assert transport.got
    for reply in transport.got:
        assert not [k for k in reply.arrays if k.endswith("body.0.bias")], name
    carried: dict[int, list[tuple[int, bool]]] = {}
    for rnd, c, msg in transport.sent:
        has = any(k.endswith("body.0.bias") for k in msg.arrays)
        carried.setdefault(c, []).append((rnd, has))
    for c, seq in carried.items():
        assert seq[0][1], f"{name}: client {c}'s first broadcast lacks the frozen tensor"
        assert not any(has for _, has in seq[1:]), f"{name}: frozen tensor sent again to {c}"


def test_freeze_patterns_are_checked_against_the_model() -> None:
    for name in ("fedfull", "fedlore", "fedit"):
        cfg = _cfg("params.freeze=[body.9.*]")
        fed = build_federation(cfg, SEED)
        model = model_factory(cfg, fed, SEED)()
        with pytest.raises(ValueError, match="match no tensor"):
            make_algorithm(name, cfg).init_server(model, generator(SEED, SERVER_INIT))
        cfg = _cfg("params.freeze=['*']")
        with pytest.raises(ValueError, match="every"):
            make_algorithm(name, cfg).init_server(model, generator(SEED, SERVER_INIT))


def test_frozen_linear_is_neither_projected_nor_adapted() -> None:
    cfg = _cfg("model.kwargs={hidden: [16, 16]}", "params.freeze=[body.0.*]")
    fed = build_federation(cfg, SEED)
    model = model_factory(cfg, fed, SEED)()
    fedlore = make_algorithm("fedlore", cfg)
    assert "body.0.weight" not in fedlore.plan(model)  # type: ignore[attr-defined]
    fedit = make_algorithm("fedit", cfg)
    assert "body.0" not in fedit.targets(model)  # type: ignore[attr-defined]
    assert "body.0.bias" not in fedit.dense_keys(model, fedit.targets(model))  # type: ignore[attr-defined]


def test_dense_client_without_its_cache_is_told_plainly() -> None:
    cfg = _cfg("params.freeze=[body.0.bias]")
    fed = build_federation(cfg, SEED)
    algo = make_algorithm("fedfull", cfg)
    model = model_factory(cfg, fed, SEED)()
    state = algo.init_server(model, generator(SEED, SERVER_INIT))
    state = State(state.arrays, {**state.values, "seen.0": 1})
    msg = algo.broadcast(state, 1, 0)
    assert "model.body.0.bias" not in msg.arrays
    with pytest.raises(RuntimeError, match="holds none"):
        algo.client_update(msg, None, model, fed.client(0), torch.Generator().manual_seed(0))


def _carried_once(name: str, transport: Recording) -> None:
    carried: dict[int, list[bool]] = {}
    for _, c, msg in transport.sent:
        carried.setdefault(c, []).append(any(k.endswith("body.0.bias") for k in msg.arrays))
    for c, seq in carried.items():
        assert seq[0] and not any(seq[1:]), f"{name}: client {c} got the frozen tensor {seq}"


@pytest.mark.parametrize("name", ["fedlore", "flora", "frlora"])
def test_dense_fallback_after_a_long_absence_leaves_frozen_tensors_out(name: str) -> None:
    """log_rounds=1 and each client back every third round: the server falls back to the dense
    model, which must not carry the frozen tensors the client already holds."""
    cfg = _cfg("params.freeze=[body.0.bias]", f"method.{name}.log_rounds=1", "rounds=7")
    first, last, transport = _run(name, cfg, lambda rnd: [rnd % N] if rnd >= 0 else [0, 1, 2])
    assert torch.equal(first["body.0.bias"], last["body.0.bias"])
    assert not torch.equal(first["head.weight"], last["head.weight"])
    modes = [str(m.config.get("mode")) for r, _, m in transport.sent if r >= N]
    assert "dense" in modes, modes  # the fallback did happen
    _carried_once(name, transport)


def test_params_are_one_rule_for_all_methods() -> None:
    for key in ("freeze", "exclude"):
        with pytest.raises(ValueError, match=f"set params.{key} instead"):
            make_algorithm("fedlore", _cfg(f"method.fedlore.{key}=[head.]"))
    with pytest.raises(ConfigError):
        _cfg("params.exclude=['']")


def test_nothing_to_project_is_refused() -> None:
    cfg = _cfg("params.freeze=[body.0.*]")
    fed = build_federation(cfg, SEED)
    model = model_factory(cfg, fed, SEED)()
    for name in ("fedlore", "local_galore"):
        with pytest.raises(ValueError, match="no Linear/Conv weight to project"):
            make_algorithm(name, cfg).init_server(model, generator(SEED, SERVER_INIT))


def test_a_bad_config_is_refused_before_any_run_folder_is_touched(tmp_path: Path) -> None:
    base = ["rounds=1", f"output_dir={tmp_path}", "algorithms=[fedfull, fedit]"]
    run_experiment(_cfg(*base))
    done = sorted(tmp_path.rglob("summary.json"))
    assert len(done) == 2
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for bad in ("params.freeze=[typo.*]", "params.exclude=[head., typo.]"):
        with pytest.raises(ConfigError, match="typo"):
            run_experiment(_cfg(*base, bad))
        after = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
        assert after == before, bad
