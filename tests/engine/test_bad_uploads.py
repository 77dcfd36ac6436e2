"""Bad client uploads are rejected by the round loop and never enter the model.

A Transport wrapper around :class:`LocalTransport` corrupts one client's reply in one round.
The round must complete, the row must report exactly that rejection with a reason naming the
problem, and the new server state must equal the state of a run where that reply was simply
dropped (and the aggregate of the remaining clients only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from fedlore.checks import setup_rounds
from fedlore.config import Config, load_config
from fedlore.data.client_data import ClientData
from fedlore.data.federation import Federation, build_federation
from fedlore.engine.loop import RoundLoop, validate_reply
from fedlore.engine.sampling import sample_clients
from fedlore.engine.store import ClientStore
from fedlore.engine.transport import LocalTransport
from fedlore.experiment_parts import make_algorithm, model_factory
from fedlore.seeding import SERVER_INIT, generator
from fedlore.types import Broadcast, Reply, Scalars, State

SEED = 0
VICTIM = 1
NUM_CLIENTS = 4
LAST_ROUND = 1  # rounds 0 and 1 (plus FedLore's setup round -1)


@pytest.fixture(scope="module")
def cfg() -> Config:
    return load_config(
        None,
        [
            f"num_clients={NUM_CLIENTS}",
            f"rounds={LAST_ROUND + 1}",
            "local_steps=2",
            "batch_size=16",
            "lr=3e-3",
            "rank=4",
            "model.kwargs={hidden: [32]}",
            "partition.min_size=10",
            "progress=false",
        ],
    )


@pytest.fixture(scope="module")
def fed(cfg: Config) -> Federation:
    return build_federation(cfg, SEED)


# ------------------------------------------------------------------------ corruptions


def _first_float_key(r: Reply) -> str:
    return sorted(k for k, v in r.arrays.items() if v.is_floating_point())[0]


def _replace(r: Reply, key: str, value: torch.Tensor) -> Reply:
    return Reply({**r.arrays, key: value}, dict(r.metrics))


def _nan(r: Reply) -> Reply:
    k = _first_float_key(r)
    t = r.arrays[k].clone()
    t.view(-1)[t.numel() // 2] = float("nan")
    return _replace(r, k, t)


def _inf(r: Reply) -> Reply:
    k = _first_float_key(r)
    t = r.arrays[k].clone()
    t.view(-1)[0] = float("-inf")
    return _replace(r, k, t)


def _missing(r: Reply) -> Reply:
    k = sorted(r.arrays)[0]
    return Reply({x: v for x, v in r.arrays.items() if x != k}, dict(r.metrics))


def _extra(r: Reply) -> Reply:
    return _replace(r, "update.smuggled", torch.zeros(3))


def _shape(r: Reply) -> Reply:
    k = _first_float_key(r)
    t = r.arrays[k]
    return _replace(r, k, torch.zeros((t.shape[0] + 1, *t.shape[1:]), dtype=t.dtype))


def _dtype(r: Reply) -> Reply:
    k = _first_float_key(r)
    return _replace(r, k, r.arrays[k].to(torch.float64))


def _metric(value: Any) -> Callable[[Reply], Reply]:
    def corrupt(r: Reply) -> Reply:
        return Reply(dict(r.arrays), {**r.metrics, "num_examples": value})

    return corrupt


def _no_weight(r: Reply) -> Reply:
    return Reply(dict(r.arrays), {k: v for k, v in r.metrics.items() if k != "num_examples"})


def _expected_reason(kind: str, clean: Reply) -> str:
    """The substring the rejection reason must contain for ``kind`` (computed from the clean
    reply, so it names the exact key)."""
    fk = _first_float_key(clean)
    return {
        "nan": f"{fk}: contains NaN or Inf",
        "inf": f"{fk}: contains NaN or Inf",
        "missing": f"missing [{sorted(clean.arrays)[0]!r}]",
        "extra": "unexpected ['update.smuggled']",
        "shape": f"{fk}: shape",
        "dtype": f"{fk}: dtype torch.float64",
        "zero_examples": "num_examples must be a positive integer, got 0",
        "negative_examples": "num_examples must be a positive integer, got -5",
        "fractional_examples": "num_examples must be a positive integer, got 2.5",
        "bool_examples": "num_examples must be a positive integer, got True",
        "inf_examples": "num_examples must be a positive integer, got inf",
        "no_examples": "num_examples must be a positive integer, got None",
        "raises": "RuntimeError: disk on fire",
    }[kind]


CORRUPTIONS: dict[str, Callable[[Reply], Reply] | None] = {
    "nan": _nan,
    "inf": _inf,
    "missing": _missing,
    "extra": _extra,
    "shape": _shape,
    "dtype": _dtype,
    "zero_examples": _metric(0),
    "negative_examples": _metric(-5),
    "fractional_examples": _metric(2.5),
    "bool_examples": _metric(True),
    "inf_examples": _metric(float("inf")),
    "no_examples": _no_weight,
    "raises": None,  # the client itself raises inside client_update
}


def _scaled(r: Reply) -> Reply:
    """Valid but absurd: every floating array 1e6 times larger (finite, right shapes)."""
    return Reply(
        {k: v * 1e6 if v.is_floating_point() else v for k, v in r.arrays.items()},
        dict(r.metrics),
    )


ABSURD: dict[str, Callable[[Reply], Reply]] = {"scaled": _scaled}


# ------------------------------------------------------------------------ harness


class FlakyData:
    """Client data whose victim raises while ``active``."""

    def __init__(self, fed: Federation) -> None:
        self.fed = fed
        self.active = False

    def __call__(self, cid: int) -> ClientData:
        if self.active and cid == VICTIM:
            raise RuntimeError("disk on fire")
        return self.fed.client(cid)


@dataclass
class Tamper:
    """Transport wrapper: in ``bad_round``, corrupt, drop or crash the victim's reply."""

    inner: LocalTransport
    data: FlakyData
    bad_round: int
    mode: str  # "clean", "drop", "raises" or a key of CORRUPTIONS
    clean_replies: dict[int, Reply] = field(default_factory=dict)
    replies: dict[int, dict[int, Reply]] = field(default_factory=dict)  # round -> as sent

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        hit = rnd == self.bad_round
        self.data.active = hit and self.mode == "raises"
        try:
            out = self.inner.send(rnd, messages)
        finally:
            self.data.active = False
        self.replies[rnd] = {c: r for c, r in out.items() if isinstance(r, Reply)}
        if hit and VICTIM in out:
            res = out[VICTIM]
            if isinstance(res, Reply):
                self.clean_replies[rnd] = res
            if self.mode == "drop":
                del out[VICTIM]
            elif self.mode not in ("clean", "raises"):
                corrupt = {**CORRUPTIONS, **ABSURD}[self.mode]
                assert corrupt is not None and isinstance(res, Reply)
                out[VICTIM] = corrupt(res)
        return out


@dataclass
class Recorder:
    rows: dict[int, dict[str, Any]] = field(default_factory=dict)
    states: dict[int, State] = field(default_factory=dict)

    def on_round_end(self, rnd: int, row: dict[str, Any], state: State) -> None:
        self.rows[rnd] = row
        self.states[rnd] = state


@dataclass
class Outcome:
    rows: dict[int, dict[str, Any]]
    states: dict[int, State]
    clean_replies: dict[int, Reply]
    replies: dict[int, dict[int, Reply]] = field(default_factory=dict)


def _run(
    cfg: Config,
    fed: Federation,
    method: str,
    bad_round: int,
    mode: str,
    exclude_victim: bool = False,
    norm_screen: float | None = None,
) -> Outcome:
    algo = make_algorithm(method, cfg)
    build = model_factory(cfg, fed, SEED)
    state = algo.init_server(build(), generator(SEED, SERVER_INIT))
    data = FlakyData(fed)
    transport = Tamper(
        LocalTransport(algo, data, build, SEED, ClientStore()), data, bad_round, mode
    )

    def sampler(rnd: int) -> list[int]:
        ids = sample_clients(cfg.num_clients, cfg.clients_per_round(), SEED, rnd)
        return [c for c in ids if c != VICTIM] if exclude_victim and rnd == bad_round else ids

    rec = Recorder()
    RoundLoop(algo, transport, sampler, None, 1, [rec], norm_screen=norm_screen).run(
        state, -setup_rounds(algo), cfg.rounds
    )
    return Outcome(rec.rows, rec.states, transport.clean_replies, transport.replies)


_CACHE: dict[tuple[str, int, str, bool], Outcome] = {}


def _reference(cfg: Config, fed: Federation, method: str, bad_round: int, mode: str) -> Outcome:
    """Cached reference runs: ``drop`` (reply removed) and ``exclude`` (victim not sampled)."""
    exclude = mode == "exclude"
    key = (method, bad_round, mode, exclude)
    if key not in _CACHE:
        _CACHE[key] = _run(cfg, fed, method, bad_round, "clean" if exclude else mode, exclude)
    return _CACHE[key]


def _assert_states_equal(a: State, b: State, values: bool = True) -> None:
    assert a.arrays.keys() == b.arrays.keys()
    for k in a.arrays:
        assert torch.equal(a.arrays[k], b.arrays[k]), k
    if values:
        assert a.values == b.values


CASES = [
    ("fedfull", 0),
    ("fedlore", -1),  # the setup exchange (candidate bases for P^0)
    ("fedlore", 0),
]


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
@pytest.mark.parametrize(("method", "bad_round"), CASES)
def test_bad_reply_is_rejected_and_left_out(
    cfg: Config, fed: Federation, method: str, bad_round: int, kind: str
) -> None:
    bad = _run(cfg, fed, method, bad_round, kind)
    dropped = _reference(cfg, fed, method, bad_round, "drop")
    alone = _reference(cfg, fed, method, bad_round, "exclude")
    clean = dropped.clean_replies[bad_round]

    # every round completed, and only the bad round saw a rejection
    start = -1 if method == "fedlore" else 0
    assert sorted(bad.rows) == list(range(start, LAST_ROUND + 1))
    row = bad.rows[bad_round]
    assert row["clients"] == NUM_CLIENTS
    assert row["rejected"] == 1 and row["accepted"] == NUM_CLIENTS - 1
    assert row["aggregated"] == NUM_CLIENTS - 1
    (reason,) = row["rejected_reasons"]
    assert reason.startswith(f"{VICTIM}: ")
    assert _expected_reason(kind, clean) in reason, reason
    for rnd, r in bad.rows.items():
        if rnd != bad_round:
            assert r["rejected"] == 0 and r["accepted"] == NUM_CLIENTS, (rnd, r)

    # rejected uploads still crossed the wire; a client that raised uploaded nothing
    if kind in ("nan", "inf", "dtype") or kind.endswith("examples"):
        dtype_growth = 4 * clean.arrays[_first_float_key(clean)].numel() if kind == "dtype" else 0
        assert row["bytes_up"] == dropped.rows[bad_round]["bytes_up"] + _nbytes(clean) + (
            dtype_growth
        )
    if kind == "raises":
        assert row["bytes_up"] == dropped.rows[bad_round]["bytes_up"]

    # the bad reply never entered the model: identical to dropping it, in this and later rounds
    for rnd in bad.states:
        _assert_states_equal(bad.states[rnd], dropped.states[rnd])
        assert _strip(bad.rows[rnd]) == _strip(dropped.rows[rnd])
    # ... and the new server arrays are the aggregate of the other clients only
    _assert_states_equal(bad.states[bad_round], alone.states[bad_round], values=False)
    for t in bad.states[LAST_ROUND].arrays.values():
        assert bool(torch.isfinite(t).all())


def _nbytes(r: Reply) -> int:
    return sum(t.numel() * t.element_size() for t in r.arrays.values())


def _strip(row: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v
        for k, v in row.items()
        if k not in ("wall_s", "client_train_s", "rejected_reasons", "bytes_up", "train_loss")
    }


@pytest.mark.parametrize(("method", "bad_round"), CASES)
def test_dropping_a_reply_changes_the_model(
    cfg: Config, fed: Federation, method: str, bad_round: int
) -> None:
    """Guard for the test above: the victim's reply matters, so 'equal to the dropped run' is
    a real check, and a clean run is not rejected."""
    clean = _run(cfg, fed, method, bad_round, "clean")
    dropped = _reference(cfg, fed, method, bad_round, "drop")
    assert all(r["rejected"] == 0 for r in clean.rows.values())
    assert dropped.rows[bad_round]["rejected"] == 1
    assert dropped.rows[bad_round]["rejected_reasons"] == [f"{VICTIM}: no reply"]
    a, b = clean.states[bad_round].arrays, dropped.states[bad_round].arrays
    assert any(not torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------- validate_reply unit checks

SPEC = {
    "update.w": ((2, 3), torch.float32),
    "update.b": ((3,), torch.float32),
    "dense.count": ((), torch.int64),
}


def _good(**metrics: Any) -> Reply:
    return Reply(
        {
            "update.w": torch.ones(2, 3),
            "update.b": torch.zeros(3),
            "dense.count": torch.tensor(4),
        },
        {"num_examples": 12, "train_loss": 0.5, **metrics},
    )


def test_validate_reply_accepts_a_good_reply() -> None:
    assert validate_reply(_good(), SPEC) is None
    assert validate_reply(_good(num_examples=3.0), SPEC) is None  # integral float is fine
    assert validate_reply(Reply({}, {"num_examples": 1}), {}) is None


@pytest.mark.parametrize(
    ("reply", "needle"),
    [
        (_good(num_examples=0), "num_examples must be a positive integer, got 0"),
        (_good(num_examples=-1), "got -1"),
        (_good(num_examples=2.5), "got 2.5"),
        (_good(num_examples=True), "got True"),
        (_good(num_examples="12"), "got '12'"),
        (_good(num_examples=float("nan")), "got nan"),
        (_good(num_examples=float("inf")), "got inf"),
        (Reply(_good().arrays, {}), "got None"),
        (Reply({"update.w": torch.ones(2, 3)}, {"num_examples": 1}), "missing ['dense.count', "),
        (Reply({**_good().arrays, "personal.x": torch.ones(1)}, {"num_examples": 1}), "personal.x"),
        (
            Reply({**_good().arrays, "update.w": torch.ones(3, 2)}, {"num_examples": 1}),
            "update.w: shape (3, 2), expected (2, 3)",
        ),
        (
            Reply(
                {**_good().arrays, "update.b": torch.zeros(3, dtype=torch.float16)},
                {"num_examples": 1},
            ),
            "update.b: dtype torch.float16, expected torch.float32",
        ),
        (
            Reply(
                {**_good().arrays, "update.b": torch.tensor([0.0, float("nan"), 0.0])},
                {"num_examples": 1},
            ),
            "update.b: contains NaN or Inf",
        ),
        (
            Reply(
                {**_good().arrays, "update.w": torch.full((2, 3), float("inf"))},
                {"num_examples": 1},
            ),
            "update.w: contains NaN or Inf",
        ),
    ],
)
def test_validate_reply_rejects(reply: Reply, needle: str) -> None:
    reason = validate_reply(reply, SPEC)
    assert reason is not None and needle in reason, reason


# ------------------------------------------------------- valid but absurd: the norm screen


@pytest.mark.parametrize(("method", "bad_round"), [("fedfull", 0), ("fedlore", 0)])
def test_a_1e6_upload_is_screened_and_cannot_move_the_model(
    cfg: Config, fed: Federation, method: str, bad_round: int
) -> None:
    screened = _run(cfg, fed, method, bad_round, "scaled", norm_screen=1000.0)
    dropped = _reference(cfg, fed, method, bad_round, "drop")
    row = screened.rows[bad_round]
    assert row["rejected"] == 1 and row["aggregated"] == NUM_CLIENTS - 1
    (reason,) = row["rejected_reasons"]
    assert reason.startswith(f"{VICTIM}: upload norm ") and "x the round's median" in reason
    assert "robust.norm_screen=1000" in reason
    for rnd in screened.states:  # exactly as if the reply had never arrived
        _assert_states_equal(screened.states[rnd], dropped.states[rnd])
    # guard: the screen is what keeps it out; without it the upload wrecks the model
    unscreened = _run(cfg, fed, method, bad_round, "scaled")
    assert unscreened.rows[bad_round]["rejected"] == 0
    a, b = unscreened.states[bad_round].arrays, dropped.states[bad_round].arrays
    assert max(float((a[k].double() - b[k].double()).abs().max()) for k in a) > 1e2
    # honest clients are never screened
    clean = _run(cfg, fed, method, bad_round, "clean", norm_screen=1000.0)
    assert all(r["rejected"] == 0 for r in clean.rows.values())


@pytest.mark.parametrize(("rule", "trim"), [("median", 0.1), ("trimmed_mean", 0.25)])
def test_a_robust_aggregate_keeps_one_absurd_client_inside_the_honest_range(
    cfg: Config, fed: Federation, rule: str, trim: float
) -> None:
    robust_cfg = cfg.model_copy(
        update={"robust": cfg.robust.model_copy(update={"aggregate": rule, "trim_fraction": trim})}
    )
    bad_round = 0
    attacked = _run(robust_cfg, fed, "fedfull", bad_round, "scaled")
    assert attacked.rows[bad_round]["rejected"] == 0  # no screen: the robust rule alone
    # the honest clients' deltas of that round (the victim's was scaled after it was recorded)
    honest = [r for c, r in attacked.replies[bad_round].items() if c != VICTIM]
    assert len(honest) == NUM_CLIENTS - 1
    start = make_algorithm("fedfull", cfg).init_server(
        model_factory(cfg, fed, SEED)(), generator(SEED, SERVER_INIT)
    )
    new = attacked.states[bad_round].arrays
    for key, w0 in start.arrays.items():
        if not w0.is_floating_point():
            continue
        deltas = torch.stack([r.arrays["update." + key[len("model.") :]] for r in honest])
        step = new[key] - w0
        # every coordinate's step lies within the honest clients' range of that coordinate
        assert bool((step >= deltas.min(0).values - 1e-6).all()), key
        assert bool((step <= deltas.max(0).values + 1e-6).all()), key


def test_robust_aggregate_is_refused_by_methods_without_dense_deltas(cfg: Config) -> None:
    from fedlore.config import ConfigError

    median = cfg.model_copy(
        update={"robust": cfg.robust.model_copy(update={"aggregate": "median"})}
    )
    make_algorithm("fedavg", median)  # dense deltas: accepted
    with pytest.raises(
        ConfigError, match=r"robust.aggregate=median: method 'fedlore' offers no robust"
    ):
        make_algorithm("fedlore", median)


def test_combine_updates_by_hand() -> None:
    from fedlore.robust import combine_updates

    ups = [{"w": torch.tensor([1.0, -4.0])}, {"w": torch.tensor([2.0, 0.0])},
           {"w": torch.tensor([3.0, 1.0])}, {"w": torch.tensor([1e6, 2.0])}]  # fmt: skip
    w = [1.0, 1.0, 1.0, 1.0]
    assert torch.equal(combine_updates(ups, w, "median")["w"], torch.tensor([2.5, 0.5]))
    trimmed = combine_updates(ups, w, "trimmed_mean", 0.25)["w"]
    assert torch.equal(trimmed, torch.tensor([2.5, 0.5]))  # drops 1 at each end of 4
    assert torch.equal(combine_updates(ups[:3], w[:3], "median")["w"], torch.tensor([2.0, 0.0]))
    mean = combine_updates(ups, [1.0, 1.0, 1.0, 0.0], "mean")["w"]
    assert torch.allclose(mean, torch.tensor([2.0, -1.0]))


def test_validate_reply_names_the_first_problem_in_key_order() -> None:
    """The finiteness of all keys is checked at once, but the reason is the first problem in the
    spec's key order, as when each key was checked in turn."""
    n: Scalars = {"num_examples": 1}
    nan_w = torch.full((2, 3), float("nan"))
    first_nan = Reply({**_good().arrays, "update.w": nan_w, "update.b": torch.zeros(4)}, n)
    assert validate_reply(first_nan, SPEC) == "update.w: contains NaN or Inf"
    nan_b = torch.tensor([0.0, float("nan"), 0.0])
    first_shape = Reply({**_good().arrays, "update.w": torch.ones(3, 2), "update.b": nan_b}, n)
    assert validate_reply(first_shape, SPEC) == "update.w: shape (3, 2), expected (2, 3)"
