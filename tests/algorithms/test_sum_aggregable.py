"""Which methods run under secure aggregation and central DP (issue 20, item 3).

A method is sum-aggregable when its server needs only the weighted sums ``Σ p_i x_i`` and
``Σ p_i`` of the uploads (:attr:`~fedlore.algorithm.Capabilities.sum_aggregable`); every other
registered method names, in its capabilities, what its server does with each client's upload
(:attr:`~fedlore.algorithm.Capabilities.individual_uploads`, not the default), and refuses
``upload_increments`` with that reason. FedIT and FFA-LoRA with ``upload_increments`` (increments
from the round's start, summed onto the global values) reach the same global adapter and model as
with values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fedlore.algorithms  # noqa: F401  (registers every method)
from fedlore import registry
from fedlore.algorithms.base import Hyper
from fedlore.algorithms.fedavg import FedAvg, FedFull, FedProx
from fedlore.algorithms.fedrep import FedRep
from fedlore.algorithms.lora_common import LoraMethod
from fedlore.algorithms.lora_fedit import FedIT
from fedlore.algorithms.lora_ffa import FFALoRA
from fedlore.algorithms.lora_rolora import RoLoRA
from fedlore.algorithms.moon import Moon
from fedlore.algorithms.partial import FedBN, FedPer
from fedlore.algorithms.scaffold import Scaffold
from fedlore.checks import is_sum_aggregable
from fedlore.data.client_data import ClientData, TensorSplit
from fedlore.engine.loop import validate_reply
from fedlore.seeding import CLIENT, generator
from fedlore.settings import LocalTraining
from fedlore.tensors import select
from fedlore.types import Reply, State

ISSUE_LIST = {
    "fedavg",
    "fedfull",
    "fedprox",
    "fedit",
    "ffa_lora",
    "fedlore_sketch",
    "fedlore_random",
    "fedlore_fixed",
    "fedslop",  # issue 35: FedLore-Random's uploads and server, another client optimizer
    # FedAvg's increments and server, their clients keeping layers (or a model) to themselves:
    # tests/privacy/test_personal_methods.py
    "fedper",
    "fedbn",
    "fedrep",
    "moon",
    "scaffold",  # secure aggregation alone: DP refused (tests/privacy/test_scaffold_secure.py)
}
"""Issue 20, item 3: the methods whose server needs only weighted sums of the uploads (and
FedSLoP, issue 35; FedPer, FedBN, FedRep and MOON, whose servers are FedAvg's; SCAFFOLD, under
secure aggregation alone)."""
OWN = {"fedavg", "fedfull", "fedprox", "fedit", "ffa_lora"}
"""The five of them outside the FedLore family (:mod:`fedlore.algorithms.fedlore`)."""
FEDLORE_FAMILY = {"fedlore", "fedlore_sketch", "fedlore_random", "fedlore_fixed"}


def checked_names() -> list[str]:
    """The registered methods this file checks: all of them once FedLore-Sketch is registered
    (the FedLore family's flags land with it), the others before."""
    names = registry.names("algorithm")
    if "fedlore_sketch" in names:
        return names
    return [n for n in names if n not in FEDLORE_FAMILY]


def test_every_method_is_sum_aggregable_or_says_why_it_needs_individual_uploads() -> None:
    default = Hyper.capabilities.individual_uploads
    for name in checked_names():
        cls = registry.get("algorithm", name)
        if is_sum_aggregable(cls):
            continue
        own = cls.capabilities.individual_uploads
        assert isinstance(own, str) and own.strip(), f"{name}: no individual_uploads"
        assert own != default, f"{name}: individual_uploads is the Hyper default"
        assert own.startswith("its "), f"{name}: the reason follows 'refused: ' ({own!r})"


def test_the_sum_aggregable_methods_are_exactly_the_issues_list() -> None:
    names = checked_names()
    aggregable = {n for n in names if is_sum_aggregable(registry.get("algorithm", n))}
    assert aggregable == ISSUE_LIST & set(names)
    assert aggregable >= OWN


def test_reasons_are_class_specific() -> None:
    """No two non-aggregable classes share a reason (each names what its own server does)."""
    reasons: dict[str, str] = {}
    for name in checked_names():
        cls = registry.get("algorithm", name)
        if not is_sum_aggregable(cls):
            reason = cls.capabilities.individual_uploads
            assert reason not in reasons.values(), (name, reason)
            reasons[name] = reason


@pytest.mark.parametrize(
    "name", [n for n in registry.names("algorithm") if n not in ISSUE_LIST | FEDLORE_FAMILY]
)
def test_upload_increments_is_refused_with_the_reason(name: str) -> None:
    cls = registry.get("algorithm", name)
    cls()  # the defaults are valid
    with pytest.raises(ValueError, match="upload_increments") as err:
        cls.of(upload_increments=True)
    assert cls.capabilities.individual_uploads in str(err.value)


@pytest.mark.parametrize(
    "cls", [FedFull, FedAvg, FedProx, FedIT, FFALoRA, FedPer, FedBN, FedRep, Moon, Scaffold]
)
def test_sum_aggregable_methods_accept_upload_increments(cls: type[Hyper]) -> None:
    assert cls.of(upload_increments=True).train.upload_increments


def test_the_subclasses_of_aggregable_methods_withdraw_the_flag() -> None:
    """RoLoRA's base LoraMethod claims nothing; Ditto, FedBE etc. subclass FedAvg and state
    ``sum_aggregable=False`` in their ``replace(FedAvg.capabilities, ...)``."""
    assert not is_sum_aggregable(RoLoRA)
    # mypy refuses an abstract class for type[Protocol] even where it is never instantiated
    # (python/mypy#4717); is_sum_aggregable only reads the class's capabilities
    assert not is_sum_aggregable(LoraMethod)  # type: ignore[type-abstract]
    for name in ("ditto", "fedbe", "fedfomo", "pfedme", "apfl", "perfedavg"):
        cls = registry.get("algorithm", name)
        assert issubclass(cls, FedAvg) and not is_sum_aggregable(cls)


@pytest.mark.parametrize("rule", ["median", "trimmed_mean"])
def test_robust_aggregation_is_refused_with_increments(rule: str) -> None:
    FedAvg(train=LocalTraining(robust_aggregate=rule))
    with pytest.raises(ValueError, match=f"robust_aggregate='{rule}'.*on its own"):
        FedAvg(train=LocalTraining(robust_aggregate=rule, upload_increments=True))


# ------------------------------------------------------- FedIT / FFA-LoRA with increments

IN, HID, NCLS = 6, 5, 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.head = nn.Linear(HID, NCLS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc1(x)))


def build() -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Net()


def client_data(cid: int, n: int = 24) -> ClientData:
    g = torch.Generator().manual_seed(100 + cid)
    x = torch.randn(n, IN, generator=g) + 0.3 * cid
    y = torch.randint(0, NCLS, (n,), generator=g)
    return ClientData(cid, TensorSplit(x, y), TensorSplit(x[:4], y[:4]))


def run(algo: LoraMethod, rounds: int) -> tuple[State, list[list[Reply]]]:
    """Broadcast -> client_update -> aggregate for clients 0-2 (unequal data sizes), client 2
    missing round 1 (it then catches up from its held adapter)."""
    state = algo.init_server(build(), torch.Generator().manual_seed(7))
    scratch, store = build(), dict[int, State]()
    uploads = []
    for rnd in range(rounds):
        ids = [0, 1] if rnd == 1 else [0, 1, 2]
        replies = []
        for c in ids:
            reply, store[c] = algo.client_update(
                algo.broadcast(state, rnd, c),
                store.get(c),
                scratch,
                client_data(c, 16 + 8 * c),
                generator(0, CLIENT, rnd, c),
            )
            assert validate_reply(reply, algo.expected_reply(state, rnd, c)) is None
            replies.append((c, reply))
        uploads.append([r for _, r in replies])
        state, _ = algo.aggregate(state, list(replies), rnd)
    return state, uploads


@pytest.mark.parametrize("cls", [FedIT, FFALoRA])
def test_increments_reach_the_same_global_adapter_and_model_as_values(
    cls: type[LoraMethod],
) -> None:
    """3 rounds, client 2 missing round 1: the global factors and merged model with
    ``upload_increments`` equal those with values to 1e-6, and the uploads are increments."""
    kw = {"rank": 2, "lora_alpha": 4.0, "local_steps": 3, "lr": 3e-2, "batch_size": 8}
    plain: LoraMethod = cls.of(**kw)
    summed: LoraMethod = cls.of(upload_increments=True, **kw)
    values, sent_values = run(plain, 3)
    incs, sent_incs = run(summed, 3)
    for k, v in select(values.arrays, "lora.").items():
        torch.testing.assert_close(incs.arrays["lora." + k], v, rtol=0, atol=1e-6)
    ref, got = plain.global_arrays(values), summed.global_arrays(incs)
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)
    start = plain.init_server(build(), torch.Generator().manual_seed(7))
    moved = ref["fc1.weight"] - plain.global_arrays(start)["fc1.weight"]
    assert float(moved.abs().max()) > 1e-3  # the adapter trained
    # round 0's uploads: each the value minus the round's start (the initial global tensors)
    for rv, ri in zip(sent_values[0], sent_incs[0], strict=True):
        assert rv.arrays.keys() == ri.arrays.keys()
        for key, v in rv.arrays.items():
            origin = start.arrays[key if key.startswith("lora.") else "model." + key[6:]]
            assert float((v - origin).abs().max()) > 0, key
            torch.testing.assert_close(ri.arrays[key], v - origin, rtol=0, atol=1e-6)
