"""Clean stops on SIGINT and SIGTERM, on every engine.

While :func:`handling` is active (``fedlore run`` holds it around an experiment; the Flower
ServerApp of a deployment around its run) the main thread's handlers of SIGINT and SIGTERM are
fedlore's own:

* **First signal, inside** :func:`deferred` (the round loop, a simulation): only a flag is set.
  The round loop (:meth:`fedlore.engine.loop.RoundLoop.run`) checks it before each round and
  once a round's work is done, before anything of the round is recorded; the transports check
  it between clients and while they wait for replies. :func:`check` raises
  :class:`Interrupted` there, so no round starts after the signal and a round in progress when
  it arrives is discarded (not in ``metrics.jsonl``, not in the checkpoint): clients lost to the
  interrupt are never recorded as failed clients of a round, and the last checkpoint stays the
  last complete round, from which ``--resume`` continues exactly.
* **First signal, outside** :func:`deferred` (loading data, between runs): nothing is being
  recorded, so the handler raises :class:`Interrupted` at once.
* **Second signal**: every process this one started is killed and the process ends at once with
  ``os._exit(128 + signal)``.

The exit status of an interrupted ``fedlore run`` is ``128 + signal``: 130 for SIGINT (Ctrl-C),
143 for SIGTERM; it prints one line saying where the run stopped and how to resume
(:meth:`Interrupted.describe`) and ends at once (:func:`exit_now`). Libraries that replace the
SIGTERM handler (``ray.init`` does) are followed by :func:`reinstall`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A run stopped by a signal.

    Attributes:
        signum: the signal (SIGINT or SIGTERM).
        last_round: the last round recorded by the run that was going (its last row of
            ``metrics.jsonl`` and its checkpoint); None: none was going, or unknown.
        run: which run was going (``"fedfull seed 42"``); None: none.
        folder: that run's folder.
        starts_over: the run resumes from round 0 (a simulated run whose clients keep no
            states to resume from: FedBuff on the wall clock,
            :func:`fedlore.engine.node_states.kept_by_clients`).
    """

    def __init__(self, signum: int, last_round: int | None = None) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum
        self.last_round = last_round
        self.run: str | None = None
        self.folder: Path | None = None
        self.starts_over = False

    @property
    def status(self) -> int:
        """The exit status: ``128 + signum`` (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum

    def stopped_in(self, run: str, folder: Path) -> None:
        """Name the run that was going (kept when an inner frame named it first)."""
        if self.run is None:
            self.run, self.folder = run, folder

    def describe(self, resume: str) -> str:
        """One line: the signal, where the run stopped and how ``resume`` (a command, or
        words) continues it."""
        name = signal.Signals(self.signum).name
        if self.run is None:
            return f"interrupted ({name}); {resume} continues unfinished runs"
        if self.last_round is None or self.last_round < 0:
            where = f"{self.run} stopped before its first round was complete"
        else:
            n = self.last_round + 1
            kept = "metrics.jsonl ends"
            if self.folder is not None and (self.folder / "checkpoint.pt").exists():
                kept = "metrics.jsonl and the checkpoint end"
            where = (
                f"{self.run} stopped after {n} complete round{'' if n == 1 else 's'} "
                f"({self.folder}: {kept} at round {self.last_round}, counting from 0; a round "
                "in progress was discarded)"
            )
        if self.starts_over:
            then = (
                f"{resume} keeps the finished runs and runs this one again from round 0 "
                "(a simulated run whose clients keep no states to resume from)"
            )
        else:
            then = f"{resume} continues from there"
        return f"interrupted ({name}): {where}; {then}"


_received: int | None = None
"""The first signal received while :func:`handling` is active (None: none yet)."""
_depth = 0
_deferred = 0
_deferred_lock = threading.Lock()
_previous: dict[int, Any] = {}
_hint: list[Callable[[], str]] = []  # what continues the command (said by force_exit too)


def say_on_force_exit(hint: Callable[[], str]) -> None:
    """Have :func:`force_exit` end its line with ``hint()`` (the ``fedlore`` command's
    ``fedlore run ... --resume``), as the first signal's stop does."""
    _hint[:] = [hint]


_count = 0
"""How many signals this process has counted (:func:`startup_handler` and :func:`handling`'s
handler; never reset)."""


_label: str | None = None
"""Set in a process that trains one job of another's (``fedlore tune --workers``,
:func:`speak_as`): its lines name the job, and a signal reaches it from that process."""


def speak_as(label: str) -> None:
    """Prefix this process's signal lines with ``label`` (``fedlore: trial 3: ...``), without
    the signal's name or the Ctrl-C hint: the signal was passed on by the process the terminal
    reaches, which said both."""
    global _label
    _label = label


def received() -> int | None:
    """The signal that asked the run to stop, or None."""
    return _received


def signals() -> int:
    """How many signals this process has counted (:func:`startup_handler`, :func:`handling`'s
    handler): the ``fedlore`` command compares it before and after its work, so an error raised
    by code a signal cut short is reported as the interrupt it is."""
    return _count


def check(last_round: int | None = None) -> None:
    """Raise :class:`Interrupted` when a signal asked the run to stop.

    Args:
        last_round: the last round the run recorded (for the message).
    """
    if _received is not None:
        raise Interrupted(_received, last_round)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _say(text: str) -> None:
    """A line on standard error written with ``os.write``: safe in a signal handler (no
    buffer, no lock of a progress display)."""
    head = "\nfedlore: " if _label is None else f"fedlore: {_label}: "  # a job's: lines, no bar
    with contextlib.suppress(OSError):
        os.write(2, f"{head}{text}\n".encode())


def startup_handler(signum: int, frame: FrameType | None) -> None:
    """SIGINT while the ``fedlore`` command starts (:mod:`fedlore.console`): count it
    (:func:`signals`), then raise ``KeyboardInterrupt`` as Python's own handler would."""
    global _count
    _count += 1
    raise KeyboardInterrupt


def _handler(signum: int, frame: FrameType | None) -> None:
    global _received, _count
    _count += 1
    if _received is not None:
        force_exit(signum)
    _received = signum
    if _deferred:
        stop = "stopping before the next round (a round in progress is discarded)"
        if _label is None:
            name = signal.Signals(signum).name  # a SIGTERM comes from kill, not a terminal
            again = "press Ctrl-C" if signum == signal.SIGINT else f"send {name}"
            stop = f"{name}: {stop}; {again} again to quit at once"
        _say(stop)
        return
    raise Interrupted(signum)


def reinstall() -> None:
    """Put fedlore's handlers back while :func:`handling` is active (after a library replaced
    one: ``ray.init`` sets its own SIGTERM handler); elsewhere nothing."""
    if _depth and _main_thread():
        for sig in SIGNALS:
            signal.signal(sig, _handler)


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Handle SIGINT and SIGTERM as the module docstring says while inside (nested: the
    outermost one installs and restores; outside the main thread: nothing)."""
    global _depth, _received
    if not _main_thread():
        yield
        return
    if _depth == 0:
        _received = None
        for sig in SIGNALS:
            _previous[sig] = signal.signal(sig, _handler)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            for sig in SIGNALS:
                signal.signal(sig, _previous.pop(sig))
            _received = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Inside, a first signal only sets the flag that :func:`check` raises on (from any
    thread: a simulation's round loop runs in a thread of Flower's)."""
    global _deferred
    with _deferred_lock:
        _deferred += 1
    try:
        yield
    finally:
        with _deferred_lock:
            _deferred -= 1


def exit_now(status: int) -> NoReturn:
    """End the process with ``status`` once standard output, standard error and the logs are
    flushed, skipping Python's own shutdown (seconds once torch is loaded, during which a
    second Ctrl-C would meet Python's default handler). For the ``fedlore`` command after an
    interrupt: every file of the run is closed by then, Ray is down."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    logging.shutdown()
    os._exit(status)


def pass_on(e: Interrupted) -> None:
    """Call the handler that was in place before :func:`handling` for ``e``'s signal (a
    Flower process's own: it reports the run stopped and exits), else re-raise ``e``."""
    handler = signal.getsignal(e.signum)
    if callable(handler) and handler is not _handler:
        handler(e.signum, None)
        return
    raise e


HINT_WAIT = 1.0
"""Seconds :func:`force_exit` waits for its hint (``--overwrite``'s rereads the config, and a
stalled network file system must not keep a forced exit waiting): past it, the line ends
without the hint."""


def force_exit(signum: int) -> None:
    """Kill every process this one started, then say so (with the hint of
    :func:`say_on_force_exit`, given :data:`HINT_WAIT` seconds) and end this one now with
    ``128 + signum``. The kill comes first: nothing the hint does can delay it."""
    with contextlib.suppress(Exception):
        kill(descendants())
    then: list[str] = []

    def _compute() -> None:
        with contextlib.suppress(BaseException):  # a hint, never a reason not to quit
            then.append(f"; {_hint[0]()}")

    if _hint:
        with contextlib.suppress(Exception):
            worker = threading.Thread(target=_compute, name="fedlore-hint", daemon=True)
            worker.start()
            worker.join(HINT_WAIT)
    _say(f"{signal.Signals(signum).name} again: quitting now{then[0] if then else ''}")
    os._exit(128 + signum)


# --- the processes a run started -------------------------------------------------------------


@dataclass(frozen=True)
class Process:
    """A process: its PID, when it started (tells it from a later process given the same
    PID) and its command line."""

    pid: int
    started: float
    command: str


def _psutil() -> Any:
    try:
        import psutil
    except ImportError:
        return None
    return psutil


def _proc_stat(pid: int) -> tuple[str, int, float] | None:
    """(state, parent PID, start time in clock ticks) from ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) "
    return fields[0].decode(), int(fields[1]), float(fields[19])


def _proc_command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(root: int | None = None) -> list[Process]:
    """Every live descendant of process ``root`` (default: this one), found with psutil when
    it is installed, else from ``/proc``; [] where neither works."""
    root = os.getpid() if root is None else root
    ps = _psutil()
    if ps is not None:
        out = []
        try:
            children = ps.Process(root).children(recursive=True)
        except ps.Error:
            return []
        for p in children:
            with contextlib.suppress(ps.Error):
                out.append(Process(p.pid, p.create_time(), " ".join(p.cmdline())))
        return out
    if not os.path.isdir("/proc"):
        return []
    kids: dict[int, list[tuple[int, float]]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (stat := _proc_stat(int(name))) is not None:
            kids.setdefault(stat[1], []).append((int(name), stat[2]))
    found: list[Process] = []
    todo = [root]
    while todo:
        for pid, started in kids.get(todo.pop(), []):
            found.append(Process(pid, started, _proc_command(pid)))
            todo.append(pid)
    return found


def alive(p: Process) -> bool:
    """Whether ``p`` still runs (the same process, not a zombie)."""
    ps = _psutil()
    if ps is not None:
        try:
            q = ps.Process(p.pid)
            return bool(q.create_time() == p.started and q.status() != ps.STATUS_ZOMBIE)
        except ps.Error:
            return False
    stat = _proc_stat(p.pid)
    return stat is not None and stat[2] == p.started and stat[0] != "Z"


def kill(processes: Iterable[Process], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``processes`` that is still the same process."""
    for p in processes:
        if alive(p):
            with contextlib.suppress(OSError):
                os.kill(p.pid, sig)
