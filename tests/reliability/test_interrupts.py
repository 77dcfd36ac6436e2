"""Interrupts are clean on every engine (issue 29, item 2).

``fedlore run`` in its own session, the signal sent to its whole process group as a terminal's
Ctrl-C or ``kill -- -PGID`` would: the run stops before starting another round, the round in
progress is discarded (``metrics.jsonl`` and the checkpoint hold only complete rounds, equal to
an uninterrupted run's first rounds, with no client lost to the interrupt), the exit status is
130 for SIGINT and 143 for SIGTERM, one line says where the run stopped and how to resume,
``--resume`` continues it (in process and on the simulation: exactly where it stopped, the
simulated clients reading their states from the run folder), and no process of the run
survives it (Ray's agents and workers included). A second signal ends the run at once, Ray
included. In process, with the signal placed mid-round: the round is discarded and resuming
repeats it; on a Flower transport the wait for replies stops and a deployed ServerApp hands the
signal on to Flower's own handler.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from fedlore.config import load_config
from fedlore.engine import interrupt
from fedlore.engine.callbacks import Checkpointer
from fedlore.engine.interrupt import Interrupted, Process, alive, descendants
from fedlore.engine.transport import LocalTransport
from fedlore.experiment import run_experiment, run_one
from fedlore.types import Broadcast

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
METHOD, SEED = "fedfull", 42
TINY = [
    "name=ctrlc",
    "num_clients=3",
    "local_steps=100",
    "batch_size=16",
    "model.kwargs={hidden: [16]}",
    f"algorithms=[{METHOD}]",
    f"seeds=[{SEED}]",
    "progress=false",
    "flower.num_cpus=2",
]
ROUNDS = 8  # the signals come after 2 to 5 complete rounds: the run is far from its end


def _start(out: Path, *extra: str) -> tuple[subprocess.Popen[bytes], Path]:
    """``fedlore run`` in a new session (its PID is its process group's id); standard error
    goes to ``out/stderr-<n>``. The tests pass the ``digits_npz`` fixture's overrides: the run
    and its Ray actors read digits without importing scikit-learn (~2 s of CPU each)."""
    out.mkdir(parents=True, exist_ok=True)
    err = out / f"stderr-{len(list(out.glob('stderr-*')))}"
    args = [
        sys.executable,
        "-m",
        "fedlore",  # the command's own entry point (fedlore.console)
        "run",
        str(QUICKSTART),
        *TINY,
        f"rounds={ROUNDS}",
        f"output_dir={out}",
        *extra,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    with err.open("wb") as f:
        proc = subprocess.Popen(
            args, env=env, stdout=subprocess.DEVNULL, stderr=f, start_new_session=True
        )
    return proc, err


def _metrics(out: Path) -> Path:
    return out / "ctrlc" / METHOD / f"seed-{SEED}" / "metrics.jsonl"


def _rows(path: Path) -> list[dict[str, Any]]:
    """The complete lines of ``metrics.jsonl`` (a run may be writing the next one)."""
    text = path.read_text()
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines() if line]


def _wait_for_rows(proc: subprocess.Popen[bytes], path: Path, k: int, err: Path) -> None:
    """Until ``path`` holds ``k`` rounds (k = 0: until the run has created it)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, err.read_text()[-3000:]
        if path.exists() and path.read_bytes().count(b"\n") >= k:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {k} rounds in {path} after 180 s")


def _signal(proc: subprocess.Popen[bytes], *signals: int, gap: float = 0.0) -> list[Process]:
    """Send ``signals`` to the run's process group (``gap`` seconds apart); returns the
    processes the run had started, seen just before."""
    started = descendants(proc.pid)
    for i, sig in enumerate(signals):
        if i:
            time.sleep(gap)
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, sig)
    return started


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies are dead: an init slow to reap
    them keeps them listed for a while)."""
    if not os.path.isdir("/proc"):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return []
        return [pgid]
    members = []
    for name in os.listdir("/proc"):
        try:
            raw = Path(f"/proc/{name}/stat").read_bytes() if name.isdigit() else b""
        except OSError:
            continue
        fields = raw[raw.rfind(b")") + 2 :].split()  # state, ppid, pgid, ...
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            members.append(int(name))
    return members


def _assert_nothing_left(pgid: int, started: list[Process]) -> None:
    """No process of the run's group, none of the processes it had started (Ray's own
    sessions included), is alive a moment after it exited."""
    deadline = time.monotonic() + 3
    while True:
        left = [p for p in started if alive(p)]
        group = _group(pgid)
        if not left and not group:
            return
        assert time.monotonic() < deadline, f"left behind: group {group}, {left}"
        time.sleep(0.1)


STABLE = ("_s",)  # timings differ between runs; everything else repeats exactly


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    keys = {k for k in (*a, *b) if not k.endswith(STABLE)}
    for k in keys:
        x, y = a.get(k), b.get(k)
        if isinstance(x, float) and isinstance(y, float):
            if x != pytest.approx(y, rel=1e-6, abs=1e-9):
                return False
        elif x != y:
            return False
    return True


def _check_stopped(out: Path, err: Path, rc: int, status: int, k: int) -> list[dict[str, Any]]:
    """The interrupted run's exit status, its one line, and complete rounds only: returns
    the rows it wrote."""
    text = err.read_text()
    assert rc == status, text[-3000:]
    rows = _rows(_metrics(out))
    assert len(rows) >= k and [r["round"] for r in rows] == list(range(len(rows)))
    assert len(rows) < ROUNDS, "the run ended before the signal"
    for r in rows:  # no client lost to the interrupt in a written round
        assert r["rejected"] == 0 and r["accepted"] == r["clients"], r
    last, _, _ = Checkpointer.load(_metrics(out).with_name("checkpoint.pt"))
    assert last == rows[-1]["round"]  # the checkpoint is the last complete round
    n = last + 1
    assert f"{METHOD} seed {SEED} stopped after {n} complete rounds" in text, text[-2000:]
    assert f"end at round {last}" in text
    assert "--resume" in text
    assert "Traceback" not in text, text[-3000:]
    assert not (_metrics(out).parent / "summary.json").exists()
    return rows


def _resume(out: Path, *extra: str) -> list[dict[str, Any]]:
    """The run resumed (``fedlore run ... --resume``, in this process, without the report) to
    its end; its rows."""
    cfg = load_config(QUICKSTART, [*TINY, f"rounds={ROUNDS}", f"output_dir={out}", *extra])
    assert run_experiment(cfg, resume=True)[METHOD]
    rows = _rows(_metrics(out))
    assert len(rows) == ROUNDS and (_metrics(out).parent / "summary.json").exists()
    return rows


def _uninterrupted(tmp: Path, *extra: str) -> list[dict[str, Any]]:
    cfg = load_config(QUICKSTART, [*TINY, f"rounds={ROUNDS}", f"output_dir={tmp / 'ref'}", *extra])
    assert run_one(cfg, METHOD, SEED) is not None
    return _rows(tmp / "ref" / "ctrlc" / METHOD / f"seed-{SEED}" / "metrics.jsonl")


def _force(proc: subprocess.Popen[bytes], err: Path, first: int) -> None:
    """A SIGINT while the stop the ``first`` signal asked for is under way (a client still
    training, Ray shutting down) ends the run at once, killing what it started. The SIGINT is
    sent once the run has said it is stopping (up to 5 s): two signals that reach a process
    busy in one C call are handled once by Python, so a fixed gap made this test flaky."""
    started = _signal(proc, first)
    deadline = time.monotonic() + 5.0
    while "stopping before the next round" not in err.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            break
        time.sleep(0.02)
    _signal(proc, signal.SIGINT)
    t0 = time.monotonic()
    rc = proc.wait(timeout=30)
    text = err.read_text()
    assert time.monotonic() - t0 < 2.0 and rc == 130, text[-2000:]
    assert "SIGINT again: quitting now" in text, text[-2000:]
    # with the command that continues it, as the first signal's stop says it
    again = text.split("SIGINT again: quitting now", 1)[1].splitlines()[0]
    assert again.startswith("; `fedlore run ") and "--resume" in again, again
    assert again.endswith("` continues unfinished runs from their last checkpoint"), again
    _assert_nothing_left(proc.pid, started)


def test_local_sigint_stops_between_rounds_and_resume_continues_exactly(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    out = tmp_path / "run"
    proc, err = _start(out, *digits_npz)
    _wait_for_rows(proc, _metrics(out), 3, err)
    started = _signal(proc, signal.SIGINT)
    rc = proc.wait(timeout=30)
    _assert_nothing_left(proc.pid, started)
    rows = _check_stopped(out, err, rc, 130, 3)
    reference = _uninterrupted(tmp_path, *digits_npz)
    assert all(_same(a, b) for a, b in zip(rows, reference, strict=False))
    resumed = _resume(out, *digits_npz)  # continues after the checkpoint's round: the same rounds
    assert all(_same(a, b) for a, b in zip(resumed, reference, strict=True))


def test_local_sigterm_exits_143_and_a_second_sigint_quits_at_once(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    out = tmp_path / "term"
    proc, err = _start(out, *digits_npz)
    _wait_for_rows(proc, _metrics(out), 2, err)
    started = _signal(proc, signal.SIGTERM)
    rc = proc.wait(timeout=30)
    _assert_nothing_left(proc.pid, started)
    _check_stopped(out, err, rc, 143, 2)
    out = tmp_path / "twice"
    # clients of ten seconds or more: the second SIGINT (0.1 s after the first) must find a
    # client still training, so the run cannot have stopped between clients in the meantime
    proc, err = _start(out, "local_steps=30000", *digits_npz)
    _wait_for_rows(proc, _metrics(out), 0, err)
    time.sleep(0.3)  # into the first round
    _force(proc, err, signal.SIGINT)


def _ray(started: list[Process]) -> list[Process]:
    return [p for p in started if p.command.startswith("ray::") or "/ray/" in p.command]


@pytest.mark.flower
def test_flower_sim_interrupts_are_clean_and_leave_no_ray_process(
    tmp_path: Path, digits_npz: list[str]
) -> None:
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    sim = "engine=flower-sim"
    # SIGINT to the group: no round starts after it, the round in progress is discarded
    out = tmp_path / "sim"
    proc, err = _start(out, sim, *digits_npz)
    _wait_for_rows(proc, _metrics(out), 3, err)
    started = _signal(proc, signal.SIGINT)
    rc = proc.wait(timeout=60)
    assert _ray(started), started  # Ray's processes were up, and none survives
    _assert_nothing_left(proc.pid, started)
    rows = _check_stopped(out, err, rc, 130, 3)
    assert "continues from there" in err.read_text()  # from its checkpoint, as in process
    # --resume continues after the checkpoint (the clients keep their states in the run
    # folder): the same rounds. SIGTERM, then SIGINT while Ray shuts down: fedlore's SIGTERM
    # handler (not the one ray.init installs) began a clean stop, the SIGINT ends it at once,
    # Ray included
    proc, err = _start(out, sim, "--resume", *digits_npz)
    _wait_for_rows(proc, _metrics(out), len(rows) + 1, err)
    again = _rows(_metrics(out))
    assert all(_same(a, b) for a, b in zip(rows, again, strict=False)), (rows, again)
    assert all(r["rejected"] == 0 for r in again)
    _force(proc, err, signal.SIGTERM)


# --- in process: where the signal lands is chosen -------------------------------------------

QUICK = ["rounds=4", "local_steps=10"]


class _SignalInRound:
    """The in-process transport; in round ``at`` SIGINT arrives after the first client
    trained (the next ones are lost to the interrupt), or with ``last`` after every client
    answered (only the round loop's own check then discards the round)."""

    def __init__(self, at: int, *args: Any, last: bool = False) -> None:
        self.at = at
        self.last = last
        self.inner = LocalTransport(*args)

    def send(self, rnd: int, messages: dict[int, Broadcast]) -> dict[int, Any]:
        if rnd != self.at:
            return self.inner.send(rnd, messages)
        if self.last:
            replies = self.inner.send(rnd, messages)
            os.kill(os.getpid(), signal.SIGINT)
            return replies
        first = min(messages)
        out = dict(self.inner.send(rnd, {first: messages[first]}))
        os.kill(os.getpid(), signal.SIGINT)
        out.update(self.inner.send(rnd, {c: m for c, m in messages.items() if c != first}))
        return out


@pytest.mark.parametrize("last", [False, True], ids=["mid-round", "after-every-reply"])
def test_a_round_in_progress_is_discarded_and_resume_repeats_it(tmp_path: Path, last: bool) -> None:
    cfg = load_config(QUICKSTART, [*TINY, *QUICK, f"output_dir={tmp_path / 'run'}"])
    with interrupt.handling(), pytest.raises(Interrupted) as stop:
        run_one(cfg, METHOD, SEED, make_transport=lambda *a: _SignalInRound(2, *a, last=last))
    e = stop.value
    assert (e.signum, e.status, e.last_round, e.run) == (signal.SIGINT, 130, 1, "fedfull seed 42")
    assert "stopped after 2 complete rounds" in e.describe("`fedlore run ... --resume`")
    path = tmp_path / "run" / "ctrlc" / METHOD / f"seed-{SEED}" / "metrics.jsonl"
    assert [r["round"] for r in _rows(path)] == [0, 1]  # round 2 is not recorded
    assert Checkpointer.load(path.with_name("checkpoint.pt"))[0] == 1
    assert interrupt.received() is None  # the handlers are gone with the block
    assert run_one(cfg, METHOD, SEED, resume=True) is not None  # round 2 again, then 3
    ref = load_config(QUICKSTART, [*TINY, *QUICK, f"output_dir={tmp_path / 'ref'}"])
    assert run_one(ref, METHOD, SEED) is not None
    reference = _rows(tmp_path / "ref" / "ctrlc" / METHOD / f"seed-{SEED}" / "metrics.jsonl")
    assert all(_same(a, b) for a, b in zip(_rows(path), reference, strict=True))


def _importing_torch(pid: int) -> bool:
    """Whether process ``pid`` has begun loading torch's library (its import is under way)."""
    with contextlib.suppress(OSError):
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    return False


@pytest.mark.parametrize("delay", [None, 1.0, 2.0])
def test_ctrl_c_while_the_command_starts_ends_in_one_line(
    tmp_path: Path, delay: float | None
) -> None:
    """A Ctrl-C while torch loads (``delay=None``: as soon as its library is mapped), or a
    second or two in (the libraries, the config, the data), ends with exit status 130 and one
    line: before the startup handler, an interrupted import printed a traceback of ``import
    torch`` (once a RecursionError inside numpy, exit status 1). (A signal in the first
    milliseconds, while Python itself starts, is Python's to report.)"""
    if delay is None and not Path("/proc/self/maps").is_file():
        pytest.skip("no /proc/<pid>/maps here to see when torch starts loading")
    proc, err = _start(tmp_path)
    if delay is None:
        deadline = time.monotonic() + 60
        while not _importing_torch(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()
            time.sleep(0.002)
    else:
        time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(timeout=120) == 130, err.read_text()
    lines = err.read_text().strip().splitlines()
    assert "Traceback" not in err.read_text() and lines, err.read_text()
    assert lines[-1].startswith("fedlore: interrupted"), lines
    if delay is None:  # still importing: nothing else was said
        assert lines == ["fedlore: interrupted while starting; nothing was run or written"]


def test_an_error_after_a_signal_is_reported_as_the_interrupt(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An import cut short by Ctrl-C may raise anything; after a counted signal the command
    says it was interrupted and how to resume (exit 130); without one the error propagates."""
    from fedlore import cli

    def cut_short(argv: list[str], command: bool) -> int:
        with contextlib.suppress(KeyboardInterrupt):
            interrupt.startup_handler(signal.SIGINT, None)
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(cli, "_main", cut_short)
    assert cli.main(["run", "a.yaml", "rounds=2"]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "fedlore: interrupted; `fedlore run a.yaml rounds=2 --resume` continues unfinished runs "
        "from their last checkpoint"
    ]
    monkeypatch.setattr(cli, "_main", lambda argv, command: 1 // 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["run", "a.yaml"])


def test_a_signal_outside_the_round_loop_stops_at_once() -> None:
    with interrupt.handling(), pytest.raises(Interrupted) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # loading data, say
    assert stop.value.status == 143 and stop.value.run is None
    assert "continues unfinished runs" in stop.value.describe("`x`")


class _SilentGrid:
    """A Flower grid whose clients never answer."""

    pull_interval = 0.01

    def push_messages(self, messages: Any) -> list[str]:
        return ["m1"]

    def pull_messages(self, ids: Any) -> list[Any]:
        return []


@pytest.mark.flower
def test_flower_transport_stops_waiting_and_a_deployment_hands_the_signal_to_flower() -> None:
    pytest.importorskip("flwr")
    from fedlore.flower.transport import send_and_receive

    seen: list[int] = []
    flowers = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))  # flwr-serverapp's
    try:
        with pytest.raises(Interrupted) as stop, interrupt.handling(), interrupt.deferred():
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
            send_and_receive(_SilentGrid(), [], timeout=None)  # type: ignore[arg-type]
        assert seen == []  # fedlore's handler had it: the wait stopped, nothing was recorded
        interrupt.pass_on(stop.value)  # what the deployed ServerApp does next
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, flowers)


def test_a_ctrl_c_caught_inside_the_command_ends_it_with_130_not_python_shutdown(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt the command catches (a Ctrl-C while it loads a config or the data,
    before a run takes the signals) ends the ``fedlore`` process at once with 130: through
    Python's shutdown it sometimes ended killed by SIGINT (exit status -2) instead."""
    from fedlore import cli

    def cut(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt

    ended: list[int] = []

    def exit_now(status: int) -> None:
        ended.append(status)

    monkeypatch.setattr(cli, "load_config", cut)
    monkeypatch.setattr(interrupt, "exit_now", exit_now)
    assert cli._main(["run", "a.yaml", "rounds=2"], command=True) == 130
    assert ended == [130]
    assert "fedlore: interrupted; `fedlore run a.yaml rounds=2 --resume`" in capsys.readouterr().err
    ended.clear()
    assert cli._main(["run", "a.yaml"], command=False) == 130 and not ended  # a call from Python


def test_ctrl_c_while_the_final_report_is_written_says_the_runs_had_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every run has finished and the report is being written: the line says so and gives
    `fedlore report`, which writes it, not the `--resume` hint of an interrupted training."""
    from fedlore import cli
    from fedlore.results import report as reporting

    def cut_short(folder: Path) -> str:
        raise KeyboardInterrupt

    monkeypatch.setattr(reporting, "report", cut_short)
    argv = ["run", str(QUICKSTART), *TINY, "rounds=1", "local_steps=2", f"output_dir={tmp_path}"]
    assert cli.main(argv) == 130
    err = capsys.readouterr().err.strip().splitlines()
    folder = tmp_path / "ctrlc"
    assert err[-1] == (
        f"fedlore: interrupted while writing the report; every run had finished (in {folder}/), "
        f"and `fedlore report {folder}` writes the report"
    )
    assert (folder / METHOD / f"seed-{SEED}" / "summary.json").is_file()
