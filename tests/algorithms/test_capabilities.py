"""Every registered method's :class:`~fedlore.algorithm.Capabilities`, written out, and the rules
of the record: frozen, inherited plainly and changed with ``replace()``, hyperparameter-dependent
values from ``caps()``, and :mod:`fedlore.checks` its one reader.

The table was recorded from the flags the record replaced (issue 31, deliverable 3), as their
old readers computed them: ``honours_transport_dtype`` and ``sum_aggregable`` counted only in a
class's own body (an inherited True did not count), ``supports_robust_aggregate``,
``supports_regression``, ``needs_server_data`` and ``individual_uploads`` through ``getattr``
with defaults (inherited), and FedLore's ``setup_rounds`` and FedMask's ``min_clients_per_round``
as properties of an instance built with defaults. Every value is the same. Changed since, on
purpose: FedPer, FedBN, FedRep and MOON are sum-aggregable (their ``individual_uploads`` is then
the unread default; ``tests/privacy/test_personal_methods.py`` attacks them under the modes), and
so is SCAFFOLD, under secure aggregation alone (its ``no_dp`` refuses DP).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

import pytest

import fedlore
from fedlore import checks, registry
from fedlore.algorithm import Algorithm, Capabilities
from fedlore.algorithms.base import Hyper
from fedlore.algorithms.fedavg import FedAvg
from fedlore.algorithms.fedlore import FedLore
from fedlore.algorithms.fedmask import FedMask
from fedlore.config import ConfigError, load_config
from fedlore.experiment_parts import make_algorithm
from fedlore.settings import LocalTraining


class Row(NamedTuple):
    setup: int  # setup_rounds
    sums: bool  # sum_aggregable
    b16: bool  # transport_16bit
    robust: bool  # robust_aggregate
    u: bool  # server_data
    regr: bool  # regression
    minc: int  # min_clients
    proj: str | None  # projects
    adapts: bool  # adapts
    uploads: str  # individual_uploads: "default" (Hyper's), "own" or "fedlore" (FedLore's)


T, F = True, False
# fmt: off
TABLE: dict[str, Row] = {
    #                       setup sums b16 robust u  regr minc proj      adapts uploads
    "apfl":           Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "bayfl":          Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "ditto":          Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "fedavg":         Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "fedavg_mcd":     Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "fedbe":          Row(0,    F,   F,  T,     T, F,   1,   None,     F,     "own"),
    "feddyn":         Row(0,    F,   F,  F,     F, T,   1,   None,     F,     "own"),
    "fedbn":          Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "fedfomo":        Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "fedfull":        Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "fedgalore":      Row(0,    F,   F,  T,     F, T,   1,   "client", F,     "own"),
    "fedit":          Row(0,    T,   T,  F,     F, T,   1,   None,     T,     "default"),
    "fedlore":        Row(1,    F,   T,  F,     F, T,   1,   "shared", F,     "own"),
    "fedlore_bayes":  Row(1,    F,   T,  F,     F, T,   1,   "shared", F,     "own"),
    "fedlore_bayfl":  Row(1,    F,   T,  F,     F, T,   1,   "shared", F,     "own"),
    "fedlore_fixed":  Row(1,    T,   T,  F,     F, T,   1,   "shared", F,     "fedlore"),
    "fedlore_random": Row(0,    T,   T,  F,     F, T,   1,   "shared", F,     "fedlore"),
    "fedlore_sketch": Row(1,    T,   T,  F,     F, T,   1,   "shared", F,     "fedlore"),
    "fedmask":        Row(0,    F,   F,  F,     F, T,   2,   None,     F,     "own"),
    "heterofl":       Row(0,    F,   F,  F,     F, T,   1,   None,     F,     "own"),
    "fednova":        Row(0,    F,   T,  F,     F, T,   1,   None,     F,     "own"),
    "fedper":         Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "fedprox":        Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "fedrep":         Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "fedslop":        Row(0,    T,   T,  F,     F, T,   1,   "shared", F,     "fedlore"),
    "ffa_lora":       Row(0,    T,   T,  F,     F, T,   1,   None,     T,     "default"),
    "flexlora":       Row(0,    F,   T,  F,     F, T,   1,   None,     T,     "own"),
    "flora":          Row(0,    F,   T,  F,     F, T,   1,   None,     T,     "own"),
    "frlora":         Row(0,    F,   T,  F,     F, T,   1,   None,     T,     "own"),
    "local_galore":   Row(0,    F,   F,  T,     F, T,   1,   "client", F,     "own"),
    "lora_fair":      Row(0,    F,   T,  F,     F, T,   1,   None,     T,     "own"),
    "meta_bayfl":     Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "meta_bayfl_mcd": Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "meta_fl":        Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "moon":           Row(0,    T,   T,  T,     F, T,   1,   None,     F,     "default"),
    "pfedbayes":      Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "perfedavg":      Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "pfedme":         Row(0,    F,   F,  T,     F, T,   1,   None,     F,     "own"),
    "qffl":           Row(0,    F,   T,  F,     F, T,   1,   None,     F,     "own"),
    "rolora":         Row(0,    F,   T,  F,     F, T,   1,   None,     T,     "own"),
    "scaffold":       Row(0,    T,   F,  F,     F, T,   1,   None,     F,     "default"),
}
# fmt: on

DEFAULT = Hyper.capabilities.individual_uploads


def row(caps: Capabilities) -> Row:
    uploads = (
        "default"
        if caps.individual_uploads == DEFAULT
        else "fedlore"
        if caps.individual_uploads == FedLore.capabilities.individual_uploads
        else "own"
    )
    return Row(
        caps.setup_rounds,
        caps.sum_aggregable,
        caps.transport_16bit,
        caps.robust_aggregate,
        caps.server_data,
        caps.regression,
        caps.min_clients,
        caps.projects,
        caps.adapts,
        uploads,
    )


def test_the_table_covers_every_registered_method() -> None:
    assert sorted(TABLE) == registry.names("algorithm")


@pytest.mark.parametrize("name", sorted(TABLE))
def test_capabilities_of_every_registered_method(name: str) -> None:
    """The record of the method built with its defaults, as the table says (FedLore's own
    reason counts as "own" for fedlore itself)."""
    algo = registry.get("algorithm", name)()
    assert isinstance(algo, Algorithm)
    got = row(algo.caps())
    want = TABLE[name]
    if name == "fedlore":
        got = got._replace(uploads="own")
    assert got == want
    # what the other modules ask checks.py agrees with the record
    assert checks.setup_rounds(algo) == want.setup
    assert checks.is_sum_aggregable(type(algo)) == want.sums
    assert checks.projects(algo) == want.proj
    assert checks.adapts(algo) == want.adapts


def test_the_defaults() -> None:
    assert Hyper.capabilities == Capabilities()
    assert dataclasses.asdict(Capabilities()) == {
        "setup_rounds": 0,
        "sum_aggregable": False,
        "individual_uploads": DEFAULT,
        "no_dp": "",
        "transport_16bit": False,
        "robust_aggregate": False,
        "server_optimizer": False,
        "compress_uploads": False,
        "server_data": False,
        "regression": True,
        "min_clients": 1,
        "projects": None,
        "adapts": False,
        "keeps_layers_local": False,
        "synchronous_only": (
            "its server does not step by a weighted mean of plain model deltas, which is all "
            "that buffered asynchronous aggregation (FedBuff) combines"
        ),
    }
    assert Hyper.per_client_metrics == ()
    assert registry.get("algorithm", "meta_bayfl").per_client_metrics == ("lr_chosen", "lr_picks")


def test_only_scaffold_refuses_dp_among_the_sum_aggregable_methods() -> None:
    """``no_dp``: a sum-aggregable method whose server would keep DP's noise for good."""
    refusing = {
        n: registry.get("algorithm", n).capabilities
        for n in registry.names("algorithm")
        if registry.get("algorithm", n).capabilities.no_dp
    }
    assert set(refusing) == {"scaffold"} and refusing["scaffold"].sum_aggregable


def test_the_record_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        FedAvg.capabilities.sum_aggregable = False  # type: ignore[misc]


def test_values_that_depend_on_hyperparameters_come_from_caps() -> None:
    assert checks.setup_rounds(FedLore()) == 1  # P^0 from client gradients: one setup exchange
    assert checks.setup_rounds(FedLore(init_basis="random")) == 0
    assert FedLore.capabilities.setup_rounds == 0  # the class record holds the default
    assert FedMask(min_overlap=3).caps().min_clients == 3
    cfg = load_config(None, ["num_clients=4", "participation=0.5"])  # 2 clients per round
    checks.check_min_clients("fedmask", FedMask(min_overlap=2), cfg)
    with pytest.raises(ValueError, match="fedmask needs at least 3 clients per round"):
        checks.check_min_clients("fedmask", FedMask(min_overlap=3), cfg)


@dataclass(frozen=True)
class Inherits(FedAvg):
    """States no ``capabilities``: FedAvg's record, every field."""


@dataclass(frozen=True)
class Withdraws(FedAvg):
    """Uploads something else than FedAvg's deltas: withdraws the claims about them."""

    capabilities = replace(
        FedAvg.capabilities,
        sum_aggregable=False,
        transport_16bit=False,
        individual_uploads="its server uses each upload on its own",
    )


def test_inheritance_is_plain_and_replace_is_explicit() -> None:
    """The rule in :mod:`fedlore.algorithm`: a class without its own ``capabilities`` has its
    parent's record (an inherited ``sum_aggregable``/``transport_16bit`` counts, unlike the old
    own-body rule); a class that withdraws them says so in its ``replace()``, and is then refused
    ``upload_increments``, a 16-bit transport, secure aggregation and DP."""
    assert Inherits.capabilities is FedAvg.capabilities
    assert checks.is_sum_aggregable(Inherits)
    assert Inherits(train=LocalTraining(upload_increments=True, transport_dtype="bf16"))

    assert not checks.is_sum_aggregable(Withdraws)
    assert Withdraws.capabilities.robust_aggregate  # the rest is FedAvg's
    with pytest.raises(ValueError, match="upload_increments=True: its server uses each upload"):
        Withdraws(train=LocalTraining(upload_increments=True))
    with pytest.raises(ValueError, match="transport_dtype='fp16'"):
        Withdraws(train=LocalTraining(transport_dtype="fp16"))
    with pytest.raises(ConfigError, match="secure_aggregation: method 'w' cannot run under it"):
        checks.check_privacy("w", Withdraws, load_config(None, ["secure_aggregation=true"]))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_the_config_refusals_follow_the_record(name: str) -> None:
    cls = registry.get("algorithm", name)
    want = TABLE[name]
    for setting, allowed in (
        ("transport_dtype=fp16", want.b16),
        ("robust.aggregate=median", want.robust),
    ):
        cfg = load_config(None, [setting])
        if allowed:
            checks.check_method_settings(name, cls, cfg, {})
        else:
            with pytest.raises(ConfigError, match=setting.partition("=")[0]):
                checks.check_method_settings(name, cls, cfg, {})
    cfg = load_config(None, ["dp.clip_norm=1", "dp.noise_multiplier=1.0", "weighting=uniform"])
    if want.sums and cls.capabilities.no_dp:  # secure aggregation alone (SCAFFOLD)
        checks.check_privacy(name, cls, load_config(None, ["secure_aggregation=true"]))
        with pytest.raises(ConfigError, match=f"dp: method '{name}' cannot run under it: its "):
            checks.check_privacy(name, cls, cfg)
    elif want.sums:
        checks.check_privacy(name, cls, cfg)
    else:
        with pytest.raises(ConfigError, match=f"dp: method '{name}' cannot run under it") as e:
            checks.check_privacy(name, cls, cfg)
        # the methods it names as the way out are those of the record that run under DP, every
        # one of them (not SCAFFOLD: secure aggregation alone)
        able = str(e.value).rpartition("needs only weighted sums: ")[2].rstrip(")").split(", ")
        dp_ok = [
            m
            for m, w in TABLE.items()
            if w.sums and not registry.get("algorithm", m).capabilities.no_dp
        ]
        assert sorted(able) == sorted(dp_ok) and "scaffold" not in able


OLD = (
    "honours_transport_dtype",
    "supports_robust_aggregate",
    "supports_regression",
    "needs_server_data",
    "min_clients_per_round",
    "diagnostic_kind",
)


def test_checks_is_the_one_reader_and_the_old_flags_are_gone() -> None:
    """No module but :mod:`fedlore.checks` reads a field of a record (``.capabilities.<field>``
    or ``.caps().<field>``), and no source file names a replaced flag."""
    src = Path(fedlore.__file__).parent
    read = re.compile(r"(\.capabilities|\.caps\(\))\.\w")
    for path in sorted(src.rglob("*.py")):
        text = path.read_text()
        if path.relative_to(src).parts[0] not in ("checks", "checks.py"):
            assert not read.search(text), path
        for flag in OLD:
            assert flag not in text, (path, flag)


def test_the_methods_that_take_a_server_optimizer() -> None:
    """Those whose server adds an averaged dense delta through DenseServer.aggregate
    (fedlore.optim.server), and FedLore's family in its shared coordinates; FedFomo forwards
    models and FedBE distils, so they do not, nor do the merge-based LoRA methods and FedMask."""
    takes = {
        n
        for n in registry.names("algorithm")
        if registry.get("algorithm", n).capabilities.server_optimizer
    }
    assert takes == {
        "bayfl", "ditto", "fedavg", "fedavg_mcd", "fedfull", "fedprox", "local_galore",
        "meta_bayfl", "meta_bayfl_mcd", "meta_fl", "pfedbayes", "pfedme", "scaffold", "fednova",
        "fedper", "fedbn", "fedrep", "moon", "apfl", "perfedavg",
        "fedlore", "fedlore_fixed", "fedlore_random", "fedlore_sketch", "fedit", "ffa_lora",
        "fedgalore", "fedslop", "fedlore_bayes", "fedlore_bayfl",
    }  # fmt: skip


def test_only_the_partial_personalization_methods_keep_layers_local() -> None:
    """``keeps_layers_local`` excuses a method's global model from the conformance suite's
    accuracy check (its server's copy of the kept layers is their initialization): only FedPer,
    FedBN and FedRep, whose replies leave those layers out, claim it."""
    from fedlore.algorithms.partial import PartialFedAvg

    keep = {
        n
        for n in registry.names("algorithm")
        if checks.keeps_layers_local(registry.get("algorithm", n)())
    }
    assert keep == {"fedper", "fedbn", "fedrep"}
    assert all(issubclass(registry.get("algorithm", n), PartialFedAvg) for n in keep)


def test_only_the_methods_whose_uploads_are_fedfulls_compress_them() -> None:
    """Upload compression encodes FedFull's plain dense deltas; a subclass whose server builds
    state from each upload (SCAFFOLD, FedDyn), rescales it (FedNova, q-FFL), keeps layers local
    (FedPer, FedBN, FedRep), trains on another loss untested with it (MOON) or uploads something
    else withdraws it, and says so for its settings."""
    compressing = {
        n
        for n in registry.names("algorithm")
        if registry.get("algorithm", n).capabilities.compress_uploads
    }
    assert compressing == {"fedfull", "fedavg", "fedprox"}
    for name in ("scaffold", "feddyn", "fednova", "fedper", "fedbn", "fedrep", "moon", "qffl"):
        with pytest.raises(ValueError, match=f"method '{name}' does not offer upload compression"):
            make_algorithm(name, load_config(None, [f"method.{name}.compression=topk"]))


def test_only_fedfull_fedavg_and_fedprox_run_buffered_asynchronous_aggregation() -> None:
    """FedBuff (``asynchronous.buffer``) needs a server that adds a weighted mean of plain deltas;
    every other method names why not (FedLore's shared basis, SCAFFOLD's control variates, ...)."""
    got = {
        name
        for name in registry.names("algorithm")
        if not registry.get("algorithm", name).capabilities.synchronous_only
    }
    assert got == {"fedfull", "fedavg", "fedprox"}
    caps = {n: registry.get("algorithm", n).capabilities for n in registry.names("algorithm")}
    assert "shared basis" in caps["fedlore"].synchronous_only
    assert "shared basis" in caps["fedlore_random"].synchronous_only
    assert "control variates" in caps["scaffold"].synchronous_only
