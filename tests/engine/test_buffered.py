"""FedBuff's rules (:mod:`fedlore.engine.buffered`) on a one-number method whose clients answer
at once: staleness, its weights, the buffer's mean, who arrives when, who replaces whom."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.config import AsynchronousConfig
from fedlore.engine.buffered import (
    REPEAT,
    AsyncState,
    BufferedLoop,
    durations,
    staleness_weight,
    weighted,
)
from fedlore.seeding import CLIENT, generator
from fedlore.types import Broadcast, Reply, State


class Scalar:
    """w <- w + Σ p_i u_i / Σ p_i of its clients' uploads u_i (p_i = num_examples); a client
    uploads ``delta(cid, rng)`` (1 by default). Records every aggregate's replies."""

    per_client_metrics: tuple[str, ...] = ()

    def __init__(self, delta: Callable[[int, torch.Generator], float] | None = None) -> None:
        self.delta = delta or (lambda cid, rng: 1.0)
        self.seen: list[list[tuple[int, Reply | None]]] = []

    def init(self) -> State:
        return State(arrays={"model.w": torch.zeros(1, dtype=torch.float64)})

    def broadcast(self, state: State, rnd: int, cid: int) -> Broadcast:
        return Broadcast({"model.w": state.arrays["model.w"]}, {"round": rnd})

    def client_update(self, msg: Broadcast, cid: int, rng: torch.Generator) -> Reply:
        d = torch.tensor([self.delta(cid, rng)], dtype=torch.float64)
        return Reply({"update.w": d}, {"num_examples": 1, "version": msg.config["round"]})

    def expected_reply(self, state: State, rnd: int, cid: int | None = None) -> Any:
        return {"update.w": ((1,), torch.float64)}

    def global_arrays(self, state: State) -> dict[str, torch.Tensor]:
        return {"w": state.arrays["model.w"]}

    def aggregate(
        self, state: State, replies: list[tuple[int, Reply | None]], rnd: int
    ) -> tuple[State, dict[str, Any]]:
        self.seen.append(list(replies))
        ok = [r for _, r in replies if r is not None]
        step = sum(float(r.arrays["update.w"]) for r in ok) / len(ok)
        return State(arrays={"model.w": state.arrays["model.w"] + step}), {}


class Clients:
    """A transport running :class:`Scalar`'s clients at once; records each start."""

    def __init__(self, algo: Scalar, seed: int = 0, flights: AsyncState | None = None) -> None:
        self.algo, self.seed, self.flights = algo, seed, flights
        self.starts: list[tuple[int, int]] = []  # (client, generator round)
        self.sends: list[tuple[int, list[int]]] = []  # (generator round, clients) per exchange

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Reply | BaseException]:
        out: dict[int, Reply | BaseException] = {}
        self.sends.append((rnd, list(messages)))
        for cid, msg in messages.items():
            if self.flights is not None:  # a client is never started while in flight
                assert cid not in {f.cid for f in self.flights.flights}
            self.starts.append((cid, rnd))
            out[cid] = self.algo.client_update(msg, cid, generator(self.seed, CLIENT, rnd, cid))
        return out


def _loop(
    algo: Scalar,
    times: dict[int, float],
    buffer: int,
    concurrency: int,
    seed: int = 0,
    **settings: Any,
) -> tuple[BufferedLoop, Clients]:
    progress = AsyncState()
    clients = Clients(algo, seed, progress)
    loop = BufferedLoop(
        algo,  # type: ignore[arg-type]
        clients,
        AsynchronousConfig(buffer=buffer, concurrency=concurrency, **settings),
        concurrency,
        lambda c: times[c],
        lambda v: sorted(times),
        seed,
        progress,
    )
    return loop, clients


def _rounds(loop: BufferedLoop, algo: Scalar, n: int) -> tuple[State, list[dict[str, Any]]]:
    state, rows = algo.init(), []
    for r in range(n):
        state, row = loop.run_round(state, r, n - 1)
        rows.append(row)
    return state, rows


def test_staleness_weights() -> None:
    assert staleness_weight(0, "sqrt") == 1.0
    assert staleness_weight(3, "sqrt") == pytest.approx(0.5)
    assert staleness_weight(8, "sqrt") == pytest.approx(1 / 3)
    assert staleness_weight(5, "constant") == 1.0
    assert staleness_weight(3, "polynomial", 1.0) == pytest.approx(0.25)
    assert staleness_weight(3, "polynomial", 2.0) == pytest.approx(1 / 16)
    assert staleness_weight(0, "polynomial", 2.0) == 1.0
    with pytest.raises(ValueError, match="staleness must be >= 0"):
        staleness_weight(-1, "sqrt")
    with pytest.raises(ValueError, match="unknown"):
        staleness_weight(1, "linear")


def test_a_client_that_started_at_v_and_arrives_at_v_prime_has_staleness_v_prime_minus_v() -> None:
    # two clients, both always in flight; client 0 takes 1 s, client 1 takes 3.5 s; K = 1:
    # client 0 arrives at t = 1, 2, 3 (each a server step), client 1 (from version 0) at 3.5
    algo = Scalar()
    loop, _ = _loop(algo, {0: 1.0, 1: 3.5}, buffer=1, concurrency=2)
    _, rows = _rounds(loop, algo, 4)
    assert [r["accepted_clients"] for r in rows] == [[0], [0], [0], [1]]
    assert [r["staleness"] for r in rows] == [[0], [0], [0], [3]]
    assert [r["sim_time_s"] for r in rows] == [1.0, 2.0, 3.0, 3.5]
    assert rows[3]["staleness_mean"] == 3 and rows[3]["staleness_max"] == 3
    # its upload reached the server scaled by w(3) = 1/sqrt(4)
    ((cid, reply),) = algo.seen[3]
    assert cid == 1 and reply is not None
    assert float(reply.arrays["update.w"]) == pytest.approx(0.5)
    assert reply.metrics["version"] == 0  # it trained from the model of version 0


def test_the_server_steps_by_the_buffers_staleness_weighted_mean() -> None:
    # K = 2 from three clients of different speeds: every step is the mean of w(s_i) * 1
    algo = Scalar()
    loop, _ = _loop(algo, {0: 1.0, 1: 1.7, 2: 2.9}, buffer=2, concurrency=3)
    state, rows = _rounds(loop, algo, 6)
    want = 0.0
    for row in rows:
        assert len(row["staleness"]) == 2
        want += sum(1 / math.sqrt(1 + s) for s in row["staleness"]) / 2
    assert any(s > 0 for row in rows for s in row["staleness"])  # the weights mattered
    assert float(state.arrays["model.w"]) == pytest.approx(want, rel=1e-12)


def test_polynomial_and_constant_weights_reach_the_server() -> None:
    for kind, exponent, w in (("polynomial", 2.0, 1 / 16), ("constant", 0.5, 1.0)):
        algo = Scalar()
        loop, _ = _loop(
            algo, {0: 1.0, 1: 3.5}, buffer=1, concurrency=2, staleness=kind,
            staleness_exponent=exponent,
        )  # fmt: skip
        _rounds(loop, algo, 4)
        ((_, reply),) = algo.seen[3]
        assert reply is not None and float(reply.arrays["update.w"]) == pytest.approx(w)


def test_max_staleness_drops_an_update_staler_than_it() -> None:
    algo = Scalar()
    loop, _ = _loop(algo, {0: 1.0, 1: 3.5}, buffer=1, concurrency=2, max_staleness=2)
    _, rows = _rounds(loop, algo, 4)
    # client 1 arrives at 3.5 with staleness 3 > 2: dropped; the 4th step is client 0's at t = 4
    assert rows[3]["accepted_clients"] == [0] and rows[3]["sim_time_s"] == 4.0
    assert rows[3]["rejected"] == 1
    assert "1: stale: 3 server steps > asynchronous.max_staleness 2" in rows[3]["rejected_reasons"]
    assert algo.seen[3][0] == (1, None)  # the method hears of it as a lost client


def test_faster_clients_contribute_more_updates() -> None:
    times = {0: 1.0, 1: 2.0, 2: 3.0, 3: 5.0}
    algo = Scalar()
    loop, _ = _loop(algo, times, buffer=1, concurrency=4)
    _, rows = _rounds(loop, algo, 40)
    counts = [sum(r["accepted_clients"].count(c) for r in rows) for c in range(4)]
    assert counts[0] > counts[1] > counts[2] > counts[3] > 0
    # in simulated time T every client arrived floor(T / d_i) times
    end = rows[-1]["sim_time_s"]
    assert counts == [math.floor(end / times[c] + 1e-9) for c in range(4)]


def test_replacements_are_uniform_over_idle_clients_and_never_one_in_flight() -> None:
    # 5 of 6 clients in flight: every start must be the one idle client or the one just finished
    times = {c: 1.0 + 0.37 * c for c in range(6)}
    algo = Scalar()
    loop, clients = _loop(algo, times, buffer=2, concurrency=5, seed=3)
    _, rows = _rounds(loop, algo, 30)  # Clients.send asserts the started client is not in flight
    # after the last step the clients of the group that filled the buffer are not replaced
    # (nothing would use them): 1 or 2 of them with K = 2 (here 1)
    assert len({f.cid for f in loop.progress.flights}) == len(loop.progress.flights) == 4
    assert rows[-1]["in_flight"] == 5  # as many as the next step would start
    started = [c for c, _ in clients.starts]
    assert set(started) == set(range(6))  # every client gets drawn
    # uniform among the idle: with C = N = 4 everyone is always in flight, so each start is
    # the client that just finished
    algo2 = Scalar()
    loop2, clients2 = _loop(algo2, {c: 1.0 + 0.5 * c for c in range(4)}, 1, 4)
    _, rows = _rounds(loop2, algo2, 10)
    # (the last step's client is not replaced: the run ends)
    assert [c for c, _ in clients2.starts[4:]] == [r["accepted_clients"][0] for r in rows[:-1]]


def test_a_group_arriving_together_is_replaced_after_the_server_step_from_the_new_model() -> None:
    # equal times, C = K = 3: each version's clients arrive together; the replacements start
    # from the next version, never from the one they replace
    algo = Scalar()
    loop, clients = _loop(algo, {c: 1.0 for c in range(5)}, buffer=3, concurrency=3)
    _, rows = _rounds(loop, algo, 4)
    assert all(r["staleness"] == [0, 0, 0] for r in rows)
    assert [r["sim_time_s"] for r in rows] == [1.0, 2.0, 3.0, 4.0]
    # the replacements of the last step (version 4) never start: nothing would use them
    assert [rnd for _, rnd in clients.starts] == [v for v in range(4) for _ in range(3)]


def test_a_group_larger_than_the_buffer_is_buffered_over_two_steps() -> None:
    # C = 4 clients arrive together at t = 1 with K = 2: two steps at t = 1, the second two
    # updates one step stale
    algo = Scalar()
    loop, _ = _loop(algo, {c: 1.0 for c in range(4)}, buffer=2, concurrency=4)
    _, rows = _rounds(loop, algo, 2)
    assert [r["sim_time_s"] for r in rows] == [1.0, 1.0]
    assert [r["staleness"] for r in rows] == [[0, 0], [1, 1]]


def test_a_client_starting_again_from_the_same_version_draws_a_new_generator() -> None:
    # K = 3 with a fast client 0: it finishes twice before the server steps
    algo = Scalar(lambda cid, rng: float(torch.rand(1, generator=rng)))
    loop, clients = _loop(algo, {0: 1.0, 1: 2.5, 2: 2.7}, buffer=3, concurrency=3)
    _rounds(loop, algo, 1)
    zero = [(i, rnd) for i, (c, rnd) in enumerate(clients.starts) if c == 0]
    assert zero[0][1] == 0 and zero[1][1] == REPEAT + zero[1][0]
    ups = [float(r.arrays["update.w"]) for c, r in algo.seen[0] if c == 0 and r is not None]
    assert len(ups) == 2 and ups[0] != ups[1]


def test_the_norm_screen_screens_the_buffer() -> None:
    algo = Scalar(lambda cid, rng: 1e6 if cid == 2 else 1.0)
    loop, _ = _loop(algo, {0: 1.0, 1: 1.0, 2: 1.0}, buffer=3, concurrency=3)
    loop.norm_screen = 1000.0
    state, rows = _rounds(loop, algo, 1)
    assert rows[0]["accepted_clients"] == [0, 1] and rows[0]["rejected"] == 1
    assert (2, None) in algo.seen[0]  # the method hears of it as a rejected client
    assert float(state.arrays["model.w"]) == 1.0


def test_only_available_clients_start() -> None:
    algo = Scalar()
    progress = AsyncState()
    clients = Clients(algo, 0, progress)
    pool = {0: [0, 1], 1: [2, 3]}
    loop = BufferedLoop(
        algo,  # type: ignore[arg-type]
        clients, AsynchronousConfig(buffer=2, concurrency=2), 2, lambda c: 1.0,
        lambda v: pool[v % 2], 0, progress,
    )  # fmt: skip
    _rounds(loop, algo, 3)
    assert [(c, r) for c, r in clients.starts[:4]] == [(0, 0), (1, 0), (2, 1), (3, 1)]


def test_weighted_scales_only_the_update_at_the_models_dtype() -> None:
    r = Reply({"update.w": torch.ones(2, dtype=torch.bfloat16), "x": torch.ones(1)}, {"n": 1})
    out = weighted(r, 0.3, {"w": torch.float32})
    assert out.arrays["update.w"].dtype == torch.float32
    assert torch.equal(out.arrays["update.w"], torch.full((2,), 0.3))
    assert torch.equal(out.arrays["x"], torch.ones(1))
    assert weighted(r, 1.0, {"w": torch.float32}) is r


def test_a_client_needs_its_rounds_work_times_step_s_over_its_speed(tmp_path: Path) -> None:
    """K = n local steps and 2 optimizer steps besides (``round_work``): n + 2 steps of work."""
    from fedlore.config import load_config

    trace = tmp_path / "speeds.json"
    trace.write_text(json.dumps([1.0, 2.0, 0.5]))
    cfg = load_config(None, ["num_clients=3", f"clients.speed_trace={trace}"])

    class Algo:
        def round_steps(self, n: int) -> int:
            return n

        def round_work(self, n: int, steps: int) -> int:
            return steps + 2

    class Data:
        def __init__(self, n: int) -> None:
            self.num_examples = n

    d = durations(cfg, Algo(), lambda c: Data(10 * (c + 1)), 0)
    assert [d(c) for c in range(3)] == pytest.approx([12 * 0.05, 22 * 0.05 / 2, 32 * 0.05 / 0.5])

    class Own:  # a method of one's own with only local_steps: charged those
        def local_steps(self, n: int) -> int:
            return n

    d = durations(cfg, Own(), lambda c: Data(10 * (c + 1)), 0)
    assert [d(c) for c in range(3)] == pytest.approx([10 * 0.05, 20 * 0.05 / 2, 30 * 0.05 / 0.5])


def test_an_update_exactly_max_staleness_stale_is_kept() -> None:
    algo = Scalar()
    loop, _ = _loop(algo, {0: 1.0, 1: 3.5}, buffer=1, concurrency=2, max_staleness=3)
    _, rows = _rounds(loop, algo, 4)
    assert rows[3]["accepted_clients"] == [1] and rows[3]["staleness"] == [3]


def test_the_loop_resumes_from_its_checkpoint_entry_to_the_same_steps(tmp_path: Path) -> None:
    # a fast client restarts from the same version all the time (its generator then differs),
    # so the resumed loop must know who started from the current version
    times = {0: 1.0, 1: 2.5, 2: 2.7, 3: 0.6}

    def rand(cid: int, rng: torch.Generator) -> float:
        return float(torch.rand(1, generator=rng))

    algo = Scalar(rand)
    loop, clients = _loop(algo, times, buffer=3, concurrency=3, seed=5)
    state, rows = _rounds(loop, algo, 8)
    assert any(rnd >= REPEAT for _, rnd in clients.starts[10:])
    for at in range(1, 8):  # cut after every round
        algo2 = Scalar(rand)
        cut, _ = _loop(algo2, times, buffer=3, concurrency=3, seed=5)
        half, first = _rounds(cut, algo2, at)
        torch.save(cut.progress.checkpoint_entry(), tmp_path / "ckpt.pt")
        progress = AsyncState()
        progress.restore(torch.load(tmp_path / "ckpt.pt", weights_only=True))
        algo3 = Scalar(rand)
        resumed, _ = _loop(algo3, times, buffer=3, concurrency=3, seed=5)
        resumed.progress = progress
        resumed.transport = Clients(algo3, 5, progress)
        for r in range(at, 8):
            half, row = resumed.run_round(half, r, 7)
            first.append(row)
        strip = [{k: v for k, v in r.items() if k != "wall_s"} for r in first]
        assert strip == [{k: v for k, v in r.items() if k != "wall_s"} for r in rows], at
        assert torch.equal(half.arrays["model.w"], state.arrays["model.w"])


def test_the_availability_trace_gives_each_version_its_clients(tmp_path: Path) -> None:
    from fedlore.config import load_config
    from fedlore.engine.buffered import pools

    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps([[0, 1, 2], [3, 4]]))
    cfg = load_config(None, ["num_clients=5", f"clients.availability={trace}"])
    pool = pools(cfg)
    assert [pool(v) for v in range(3)] == [[0, 1, 2], [3, 4], [0, 1, 2]]
    assert pools(load_config(None, ["num_clients=3"]))(7) == [0, 1, 2]


def test_a_run_that_ends_trains_no_client_whose_update_no_step_uses() -> None:
    # the replacements of a step's clients start when the next step begins: after a run's last
    # step no client has started from its final version, every start either arrived in a step
    # or is still in flight, and a further step starts the replacements from the last model
    for n in (1, 2, 5):
        algo = Scalar()
        loop, clients = _loop(algo, {c: 1.0 + 0.3 * c for c in range(6)}, 2, concurrency=3)
        state, rows = _rounds(loop, algo, n)
        p = loop.progress
        assert p.version == n and all(f.version < n for f in p.flights), n
        assert len(clients.starts) == sum(r["clients"] for r in rows) + len(p.flights)
        assert len(p.flights) < 3 and [r["in_flight"] for r in rows] == [3] * n
        before = len(clients.starts)
        loop.run_round(state, n, n)
        assert [v for _, v in clients.starts[before : before + 3 - len(p.flights)]] != []
        assert clients.starts[before][1] == n  # from the model of the last step


def test_clients_starting_from_one_version_go_out_in_one_exchange() -> None:
    """Equal times, C = K = 4: each step's four replacements are first starts from one version,
    sent to the transport in one exchange (Flower's engines train them at once), not four."""
    algo = Scalar()
    loop, clients = _loop(algo, {c: 1.0 for c in range(4)}, buffer=4, concurrency=4)
    _rounds(loop, algo, 3)
    assert clients.sends == [(v, [0, 1, 2, 3]) for v in range(3)]


def test_grouped_starts_keep_each_clients_key_and_place() -> None:
    """Starts are grouped by key for the transport, but each flight keeps its place: its
    sequence number in the order the clients were drawn, its finish time, and, for a repeat
    (a client started again from one version), the generator round ``REPEAT + seq``. Checked
    at every top-up of a run with repeats and groups (3 clients of one speed, C = 2, K = 4: a
    step takes two pairs, and a pair drawn again from one version is two repeats)."""
    times = {c: 1.0 for c in range(3)}
    algo = Scalar(lambda cid, rng: float(torch.rand(1, generator=rng)))
    loop, clients = _loop(algo, times, buffer=4, concurrency=2, seed=1)
    launch, tops = loop._launch, []

    def checked(starts: list[tuple[int, int, Broadcast]]) -> None:
        before = len(loop.progress.flights)
        seq = loop.progress.seq
        launch(starts)
        new = loop.progress.flights[before:]
        assert [f.cid for f in new] == [c for _, c, _ in starts]
        assert [f.seq for f in new] == list(range(seq, seq + len(starts)))
        for (key, cid, _), f in zip(starts, new, strict=True):
            assert key == (f.version if key < REPEAT else REPEAT + f.seq), (key, f)
            assert f.finish == f.start + times[cid]
        tops.append([(key, cid) for key, cid, _ in starts])

    loop._launch = checked  # type: ignore[method-assign]
    _rounds(loop, algo, 12)
    assert any(sum(k >= REPEAT for k, _ in top) >= 2 for top in tops)  # two repeats at once
    assert any(len(c) > 1 for _, c in clients.sends)  # and a group in one exchange
    assert all(len(c) == 1 for k, c in clients.sends if k >= REPEAT)
    # each client trained with its own key (its generator's round)
    assert sorted(clients.starts) == sorted((c, k) for top in tops for k, c in top)
