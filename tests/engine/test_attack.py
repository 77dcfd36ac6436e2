"""Attack clients (:mod:`fedlore.engine.attack`): who attacks, what each attack does to an upload
or to the data, and that a robust aggregate withstands what breaks the mean."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import ConfigError, load_config
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.attack import attacked, choose_attackers, corrupt, flip_labels
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.types import Broadcast, Reply


def test_the_attackers_are_a_seeded_share_of_the_clients() -> None:
    a = choose_attackers(20, 0.3, 42)
    assert len(a) == 6 and a <= set(range(20))
    assert choose_attackers(20, 0.3, 42) == a  # the same for every method of a seed
    assert choose_attackers(20, 0.3, 43) != a
    assert choose_attackers(20, 0.1, 42) <= a  # the same permutation's first ones
    assert choose_attackers(20, 0.0, 42) == frozenset()


def test_update_attacks_corrupt_only_the_uploaded_delta() -> None:
    delta = torch.tensor([1.0, -2.0, 3.0])
    reply = Reply({"update.w": delta, "update.n": torch.tensor([4]), "diag.H": delta},
                  {"num_examples": 5})  # fmt: skip
    g = torch.Generator().manual_seed(0)
    flipped = corrupt(reply, "sign_flip", 1.0, g)
    assert torch.equal(flipped.arrays["update.w"], -delta)
    assert torch.equal(corrupt(reply, "scale", 10.0, g).arrays["update.w"], 10 * delta)
    for out in (flipped, corrupt(reply, "gaussian", 3.0, g)):
        assert torch.equal(out.arrays["update.n"], torch.tensor([4]))  # integers untouched
        assert torch.equal(out.arrays["diag.H"], delta)  # measurements untouched
        assert out.metrics == {"num_examples": 5}
    big = Reply({"update.w": torch.zeros(20_000)})
    noise = corrupt(big, "gaussian", 3.0, torch.Generator().manual_seed(1)).arrays["update.w"]
    assert float(noise.std()) == pytest.approx(3.0, rel=0.03)
    with pytest.raises(ValueError, match="unknown update attack"):
        corrupt(reply, "backdoor", 1.0, g)


def _client(cid: int) -> ClientData:
    y = torch.tensor([0, 1, 2, 9])
    return ClientData(cid, TensorSplit(torch.zeros(4, 2), y), TensorSplit(torch.zeros(4, 2), y))


def test_label_flip_poisons_only_the_attackers_training_labels() -> None:
    seen: dict[int, ClientData] = {}

    class Fake:
        def __init__(self, algo: Any, data: Any, *rest: Any) -> None:
            self.data = data

        def send(
            self, rnd: int, messages: dict[int, Broadcast]
        ) -> dict[int, Reply | BaseException]:
            for cid in messages:
                seen[cid] = self.data(cid)
            return {}

    make = attacked(Fake, "label_flip", 0.5, 1.0, num_clients=4, num_classes=10)
    make(None, _client, None, 42, None).send(0, {c: Broadcast({}, {"round": 0}) for c in range(4)})
    bad = choose_attackers(4, 0.5, 42)
    for cid, data in seen.items():
        want = torch.tensor([9, 8, 7, 0]) if cid in bad else torch.tensor([0, 1, 2, 9])
        assert torch.equal(data.train.y, want), cid
        assert torch.equal(data.test.y, torch.tensor([0, 1, 2, 9]))
    with pytest.raises(ValueError, match="class labels"):
        flip_labels(ClientData(0, TensorSplit(torch.zeros(2, 1), torch.zeros(2)),
                               TensorSplit(torch.zeros(2, 1), torch.zeros(2))), 10)  # fmt: skip


def test_update_attacks_need_dense_deltas_and_the_local_engine() -> None:
    with pytest.raises(ConfigError, match="the attack is not defined for it"):
        make_algorithm(
            "fedlore", load_config(None, ["attack.kind=sign_flip", "attack.fraction=0.1"])
        )
    make_algorithm("fedlore", load_config(None, ["attack.kind=label_flip", "attack.fraction=0.1"]))
    with pytest.raises(ConfigError, match="engine=local"):
        cfg = load_config(None, ["attack.kind=scale", "attack.fraction=0.2", "engine=flower-sim"])
        make_algorithm("fedavg", cfg)


def test_krum_withstands_a_sign_flip_that_breaks_the_mean(tmp_path: Path) -> None:
    """30 % of 10 digits clients upload -10·Δ: FedAvg's mean is driven away from any useful
    model, Krum (f = 3) and the coordinate-wise median keep learning."""
    base = ["num_clients=10", "rounds=8", "local_steps=5", "progress=false", "lr=0.3",
            "algorithms=[fedavg]", "partition.name=iid", "attack.kind=sign_flip",
            "attack.fraction=0.3", "attack.scale=10", "robust.norm_screen=null",
            "model.kwargs={hidden: [32]}"]  # fmt: skip
    acc = {}
    for rule in ("mean", "krum", "median"):
        cfg = load_config(None, [*base, f"robust.aggregate={rule}", "robust.num_byzantine=3",
                                 f"output_dir={tmp_path / rule}"])  # fmt: skip
        summary = run_one(cfg, "fedavg", 42)
        assert summary is not None
        acc[rule] = summary["final_accuracy"]
    assert acc["mean"] < 0.3, acc
    # Krum about 0.74, the median about 0.63 (30 % attackers bias every coordinate's median)
    assert acc["krum"] > 0.65 and acc["median"] > 0.5, acc
