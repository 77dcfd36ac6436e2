"""DP-FedBuff runs end to end (``asynchronous.buffer`` with ``dp.clip_norm``;
:mod:`fedlore.privacy.buffer_dp`): clipped uploads, a fast client in one step at most, the
per-client ε in the rows, the contribution cap, kill-and-resume, and what stays refused."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from fedlore.cli import main
from fedlore.config import Config, ConfigError, load_config
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.rundir import run_dir
from fedlore.experiment import run_one
from fedlore.experiment_parts import make_algorithm
from fedlore.experiment_privacy import PrivacyWarning
from fedlore.privacy.buffer_dp import contribution_epsilon
from fedlore.privacy.local_dp import local_noise_for_epsilon

SMALL = ["num_clients=6", "local_steps=3", "batch_size=16", "progress=false", "lr=0.05",
         "model.kwargs={hidden: [16]}", "algorithms=[fedavg]", "rounds=6", "weighting=uniform",
         "asynchronous.buffer=2", "asynchronous.concurrency=4", "clients.speed=lognormal",
         "dp.clip_norm=0.5", "dp.noise_multiplier=1.0"]  # fmt: skip
SEED = 42


def _cfg(out: Path, *extra: str) -> Config:
    return load_config(None, [*SMALL, f"output_dir={out}", *extra])


def _rows(cfg: Config) -> list[dict[str, Any]]:
    path = run_dir(cfg, "fedavg", SEED) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _plain(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("wall_s", "eval_s", "client_train_s")}


def _counts(rows: list[dict[str, Any]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for r in rows:
        for c in r["accepted_clients"]:
            counts[c] = counts.get(c, 0) + 1
    return counts


def test_each_rows_epsilon_is_the_most_counted_clients_m_fold_gaussian(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    summary = run_one(cfg, "fedavg", SEED)
    assert summary is not None
    rows = _rows(cfg)
    for i, r in enumerate(rows):
        most = max(_counts(rows[: i + 1]).values())
        assert r["dp_contributions_max"] == most
        assert r["dp_epsilon"] == pytest.approx(contribution_epsilon(1.0, 1e-5, most))
        assert "dp_epsilon_sample_known" not in r  # nothing is amplified
    assert summary["dp_epsilon"] == rows[-1]["dp_epsilon"]
    assert summary["dp_accounting"].startswith("per-client steps, no amplification")
    assert max(r["staleness_max"] for r in rows) > 0  # stale updates were weighted


def test_every_upload_in_a_step_is_clipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server sums uploads within C: the clients clip (their broadcast carries C), and
    the combine sees every upload's norm at most C before the weights."""
    from fedlore.privacy import buffer_dp
    from fedlore.privacy.dp import upload_norm

    seen: list[tuple[float, float]] = []
    honest = buffer_dp.BufferDP.combine

    def spy(self: Any, version: int, spec: Any, buffer: Any, device: Any) -> Any:
        seen.extend((upload_norm(r.arrays), w) for _, r, w in buffer)
        return honest(self, version, spec, buffer, device)

    monkeypatch.setattr(buffer_dp.BufferDP, "combine", spy)
    cfg = _cfg(tmp_path, "dp.clip_norm=0.05", "lr=0.5")
    run_one(cfg, "fedavg", SEED)
    rows = _rows(cfg)
    assert len(seen) == 12 and all(n <= 0.05 * (1 + 1e-5) for n, _ in seen)
    assert any(w < 1 for _, w in seen)
    assert sum(r["dp_clipped"] for r in rows) == 12  # every upload was larger than 0.05


def _fast_client(tmp_path: Path, *extra: str) -> Config:
    tmp_path.mkdir(parents=True)
    trace = tmp_path / "speeds.json"
    trace.write_text(json.dumps([100.0, 1.0, 1.0]))
    return _cfg(
        tmp_path / "runs", "num_clients=3", "asynchronous.buffer=3", "asynchronous.concurrency=3",
        f"clients.speed_trace={trace}", "rounds=4", *extra,
    )  # fmt: skip


def test_a_fast_client_is_in_a_step_once_under_dp(tmp_path: Path) -> None:
    """Client 0 of 3 is 100 times faster: without DP it comes back and fills the buffer alone
    (FedBuff allows it); under DP it waits for the step, so every step has 3 distinct clients
    and its sensitivity stays C."""
    plain = _fast_client(tmp_path / "plain", "dp.clip_norm=null", "dp.noise_multiplier=null")
    run_one(plain, "fedavg", SEED)
    assert all(r["accepted_clients"] == [0, 0, 0] for r in _rows(plain))
    private = _fast_client(tmp_path / "dp")
    run_one(private, "fedavg", SEED)
    rows = _rows(private)
    assert all(sorted(set(r["accepted_clients"])) == sorted(r["accepted_clients"]) for r in rows)
    assert all(len(r["accepted_clients"]) == 3 for r in rows)
    assert rows[-1]["dp_contributions_max"] == 4  # the fast client: in every step, once


def test_the_contribution_cap_bounds_every_clients_steps(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "dp.max_contributions=2")
    summary = run_one(cfg, "fedavg", SEED)
    assert summary is not None and summary["dp_max_contributions"] == 2
    rows = _rows(cfg)
    assert max(_counts(rows).values()) == 2 and len(rows) == 6
    assert summary["dp_epsilon"] == pytest.approx(contribution_epsilon(1.0, 1e-5, 2))
    uncapped = _cfg(tmp_path / "free")
    run_one(uncapped, "fedavg", SEED)
    assert max(_counts(_rows(uncapped)).values()) > 2  # the cap changed who trained


def test_dp_epsilon_solves_sigma_for_a_client_in_every_step_or_the_caps(tmp_path: Path) -> None:
    from fedlore.experiment_privacy import dp_noise_multiplier

    every = _cfg(tmp_path, "dp.noise_multiplier=null", "dp.epsilon=8")
    assert dp_noise_multiplier(every, 0) == local_noise_for_epsilon(8.0, 1e-5, 6)
    capped = _cfg(tmp_path, "dp.noise_multiplier=null", "dp.epsilon=8", "dp.max_contributions=3")
    sigma = dp_noise_multiplier(capped, 0)
    assert sigma == local_noise_for_epsilon(8.0, 1e-5, 3)
    assert contribution_epsilon(sigma, 1e-5, 3) <= 8.0
    summary = run_one(capped, "fedavg", SEED)
    assert summary is not None and summary["dp_epsilon"] <= 8.0


def test_a_killed_run_resumes_to_the_same_rows_and_epsilon(tmp_path: Path) -> None:
    """With reproducible noise the resumed run's rows and model are the uninterrupted run's;
    its counts come back from the checkpoint, so ε goes on from the killed run's."""
    extra = ("dp.reproducible_noise=true",)
    whole = _cfg(tmp_path / "whole", *extra)
    cut = _cfg(tmp_path / "cut", *extra)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)  # the no-privacy mode says so
        run_one(whole, "fedavg", SEED)
        assert run_one(cut, "fedavg", SEED, stop_after=2) is None
        run_one(cut, "fedavg", SEED, resume=True)
    assert [_plain(r) for r in _rows(cut)] == [_plain(r) for r in _rows(whole)]
    _, a, _ = Checkpointer.load(run_dir(whole, "fedavg", SEED) / "checkpoint.pt")
    _, b, _ = Checkpointer.load(run_dir(cut, "fedavg", SEED) / "checkpoint.pt")
    assert all(torch.equal(a.arrays[k], b.arrays[k]) for k in a.arrays)
    assert a.values["privacy.contributions"] == b.values["privacy.contributions"]


def test_with_os_noise_a_resume_keeps_the_schedule_and_the_epsilon(tmp_path: Path) -> None:
    whole = _cfg(tmp_path / "whole")
    run_one(whole, "fedavg", SEED)
    cut = _cfg(tmp_path / "cut")
    assert run_one(cut, "fedavg", SEED, stop_after=3) is None
    run_one(cut, "fedavg", SEED, resume=True)
    keys = ("accepted_clients", "staleness", "dp_epsilon", "dp_contributions_max")
    assert [{k: r[k] for k in keys} for r in _rows(cut)] == [
        {k: r[k] for k in keys} for r in _rows(whole)
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["secure_aggregation=true"], "secure_aggregation: "),
        (["dp.mode=local"], "dp.mode=local"),
        (["dp.target_quantile=0.5"], "dp.target_quantile"),
        (["dp.max_contributions=1"], "dp.max_contributions=1: 6 clients"),
        (["dp.clip_norm=null", "dp.noise_multiplier=null", "dp.max_contributions=3"],
         "dp.max_contributions but no dp.clip_norm"),
        (["asynchronous.clock=wall"], "dp and asynchronous.clock=wall: DP-FedBuff is tested "
         "on the simulated clock only"),
    ],
)  # fmt: skip
def test_what_dp_fedbuff_refuses(tmp_path: Path, extra: list[str], message: str) -> None:
    cfg = _cfg(tmp_path, *extra)
    with pytest.raises(ConfigError, match=message) as e:
        make_algorithm("fedavg", cfg)
    assert str(e.value).startswith("asynchronous.buffer (FedBuff) with ")


def test_the_cap_without_a_buffer_is_refused(tmp_path: Path) -> None:
    cfg = load_config(None, [*SMALL[:9], f"output_dir={tmp_path}", "dp.clip_norm=1",
                             "dp.noise_multiplier=1", "dp.max_contributions=2"])  # fmt: skip
    with pytest.raises(ConfigError, match=r"dp\.max_contributions is set but asynchronous"):
        make_algorithm("fedavg", cfg)
    make_algorithm("fedavg", _cfg(tmp_path))  # DP-FedBuff itself runs


def test_a_client_that_skips_clipping_is_rejected(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A broken client 0 sends its upload unclipped, 100 times larger: the server refuses it
    (its norm above C), so it never enters a step's sum."""
    from fedlore.engine import transport
    from fedlore.types import Reply

    honest = transport.privatize
    clips: list[Any] = []

    def broken(reply: Reply, config: Any, noise: Any, rnd: int, cid: int) -> Reply:
        clips.append(config.get("privacy.clip_norm"))
        out = honest(reply, config, noise, rnd, cid)
        if cid != 0:
            return out
        return Reply({k: 100 * v for k, v in reply.arrays.items()}, out.metrics)

    monkeypatch.setattr(transport, "privatize", broken)
    cfg = _cfg(tmp_path)
    run_one(cfg, "fedavg", SEED)
    rows = _rows(cfg)
    assert all(0 not in r["accepted_clients"] for r in rows)
    reasons = [x for r in rows for x in r.get("rejected_reasons", [])]
    assert reasons and all(x.startswith("0: upload norm") for x in reasons)
    assert all("exceeds the clip norm 0.5" in x for x in reasons)
    assert clips and set(clips) == {0.5}  # every broadcast carried the clip


def test_a_step_whose_every_upload_is_rejected_ends_the_run_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every client sends its upload unclipped: no step could ever fill (the loop ran forever).
    After 10 rejections per client in flight, none accepted between, the run ends with one line
    naming the last reason; an honest run with its clipped uploads never comes near it."""
    from fedlore.engine import transport
    from fedlore.engine.buffered import REJECTED_IN_A_ROW
    from fedlore.types import Reply

    honest = transport.privatize

    def broken(reply: Reply, config: Any, noise: Any, rnd: int, cid: int) -> Reply:
        out = honest(reply, config, noise, rnd, cid)
        return Reply({k: 100 * v for k, v in reply.arrays.items()}, out.metrics)

    monkeypatch.setattr(transport, "privatize", broken)
    cfg = _cfg(tmp_path)
    with pytest.raises(ValueError) as e:
        run_one(cfg, "fedavg", SEED)
    limit = REJECTED_IN_A_ROW * 4  # asynchronous.concurrency=4
    assert str(e.value).startswith(
        f"asynchronous.buffer={cfg.asynchronous.buffer}: round 0 (counting from 0) rejected "
        f"{limit} uploads in a row without filling its buffer (the last, "
    )
    assert "exceeds the clip norm 0.5): the clients' uploads cannot be used" in str(e.value)


def test_a_cap_that_runs_out_of_clients_stops_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 clients, K = 2, cap 2, 3 steps: the 6 places fit (3 x 2), but client 2 is 100 times
    slower, so clients 0 and 1 fill steps 1 and 2 and reach the cap; step 3 gets client 2
    alone. The replayed schedule refuses it before training (tests/engine/
    test_cap_schedule.py); past that check (as after an upload the schedule could not
    foresee), the run says why it stops, in one line of the command (no traceback), with the
    two rounds it ran saved."""
    monkeypatch.setattr("fedlore.engine.buffered.check_loop", lambda loop, end: None)
    trace = tmp_path / "speeds.json"
    trace.write_text(json.dumps([1.0, 1.0, 0.01]))
    extra = ["num_clients=3", "asynchronous.concurrency=3", "rounds=3", "dp.max_contributions=2",
             f"clients.speed_trace={trace}", "seeds=[42]"]  # fmt: skip
    cfg = _cfg(tmp_path, *extra)
    why = (
        "asynchronous.buffer=2: round 2 (counting from 0) holds 1 update(s) and no client is in "
        "flight or can start: every other client is in the buffer or at dp.max_contributions=2; "
        "finish it with --resume and a raised dp.max_contributions or fewer rounds (the rounds "
        "before it are saved)"
    )
    with pytest.raises(ValueError) as e:
        run_one(cfg, "fedavg", SEED)
    assert str(e.value) == why
    assert [r["accepted_clients"] for r in _rows(cfg)] == [[0, 1], [0, 1]]
    args = ["run", *SMALL, f"output_dir={tmp_path}", *extra, "name=cli"]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"fedlore: error: {why}"


def test_clients_availability_that_leaves_none_to_start_names_it() -> None:
    from fedlore.engine.async_clients import starved

    assert starved(3, 4, 1, None) == (
        "asynchronous.buffer=3: round 4 (counting from 0) holds 1 update(s) and no client is in "
        "flight or can start: clients.availability leaves none; make more clients available (the "
        "rounds before it are saved)"
    )


def test_releases_a_resume_repeats_count_for_every_client(tmp_path: Path) -> None:
    """Without checkpoints a resume runs every released step again with fresh noise: the DP
    ledger counts the 3 discarded rows, for every client (who was in them is not assumed)."""
    cfg = _cfg(tmp_path, "checkpoint=false")
    assert run_one(cfg, "fedavg", SEED, stop_after=2) is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrivacyWarning)
        summary = run_one(cfg, "fedavg", SEED, resume=True)
    assert summary is not None and summary["dp_repeated_exchanges"] == 3
    rows = _rows(cfg)
    assert len(rows) == 6
    for i, r in enumerate(rows):
        most = max(_counts(rows[: i + 1]).values())
        assert r["dp_epsilon"] == pytest.approx(contribution_epsilon(1.0, 1e-5, most + 3))


def test_rejections_count_in_a_row_and_an_accepted_upload_starts_the_count_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One client in flight (limit 10 rejections): 9 rejected, 1 accepted, 9 rejected, 1
    accepted fill a buffer of 2 (18 rejections in the step, never 10 in a row); 10 in a row end
    the run."""
    from fedlore.config import AsynchronousConfig
    from fedlore.engine.buffered import (
        REJECTED_IN_A_ROW,
        AsyncState,
        Buffered,
        BufferedLoop,
        Flight,
    )
    from fedlore.types import Reply

    def collect(script: str) -> int:
        arrivals = iter(script)
        loop = BufferedLoop(
            algorithm=None,  # type: ignore[arg-type]
            transport=None,  # type: ignore[arg-type]
            settings=AsynchronousConfig(buffer=2),
            concurrency=1,
            duration=lambda c: 1.0,
            pool=lambda v: [0],
            seed=0,
            progress=AsyncState(),
        )
        reply = Reply({}, {})

        def top_up(state: Any) -> None:
            p = loop.progress
            p.flights.append(Flight(0, p.version, p.clock, p.clock + 1.0, p.seq, reply))
            p.seq += 1

        def arrive(f: Flight, state: Any, rnd: int) -> tuple[Buffered | None, str, int]:
            ok = next(arrivals) == "A"
            return (Buffered(0, reply, 0, 1.0), "", 0) if ok else (None, "bad", 0)

        monkeypatch.setattr(loop, "_top_up", top_up)
        monkeypatch.setattr(loop, "_arrive", arrive)
        top_up(None)
        _, rejected, _, _ = loop._collect(None, 0)  # type: ignore[arg-type]
        return len(rejected)

    assert REJECTED_IN_A_ROW == 10
    assert collect("R" * 9 + "A" + "R" * 9 + "A") == 18
    with pytest.raises(ValueError, match="rejected 10 uploads in a row"):
        collect("R" * 10 + "A")
