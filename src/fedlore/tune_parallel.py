"""Processes for ``fedlore tune --workers W`` (:mod:`fedlore.tune_study`): W worker processes,
kept for the whole search (:func:`kept`), each taking one trial after another. A worker is a
fresh interpreter running ``python -m fedlore.tune_parallel`` (no torch threads or open
database connection inherited from this one, and, unlike ``multiprocessing``'s ``spawn``, no
second import of the caller's script: a script that calls
:func:`fedlore.tune_study.run_search` needs no ``if __name__ == "__main__"`` guard). Its jobs
(a module-level function and its arguments) come pickled on its standard input, after this
process's ``sys.path``; each job's report comes back as one JSON line on a pipe of its own.

* **Kept.** A worker imports once and keeps the last federation it built
  (:func:`fedlore.data.federation.keep_built`): a trial of the same data settings and seed gets
  a copy of it instead of loading and partitioning the data again. Nothing of one job reaches
  the next: each gets its own copy of the federation and the torch generator a fresh process
  starts with, and a worker whose job did not end ``done`` (an interrupt, an error) ends.
* **Replaced.** A worker that ended (killed, out of memory, after such a job) is replaced by a
  new one when a job needs it; a job it was running is reported as ``died``.
* **CPUs.** Each job sets its torch threads (and ``OMP_NUM_THREADS``) to its share of the
  CPUs, so ``threads: auto`` in a trial takes that share instead of every CPU; a trial's
  explicit ``threads`` still wins.
* **Output.** A job's progress messages are prefixed with its trial (``fedlore: trial 3:
  ...``) and shown as lines, never as a progress bar (several bars on one terminal overwrite
  each other).
* **Signals.** Each worker runs in a process group of its own, so Ctrl-C on the terminal
  reaches this process only; the first SIGINT or SIGTERM here (inside
  :func:`fedlore.engine.interrupt.handling`) is passed on to every worker with a job once, as
  SIGTERM, and each stops its trial between two rounds, as ``fedlore run`` does: the trials
  stay running in the study, for the same command to resume; no other job starts. A second
  signal here kills them all.
* **Never orphaned.** A worker ends at once when this process dies (SIGKILL, a crash): on Linux
  the kernel sends it SIGKILL (``PR_SET_PDEATHSIG``), elsewhere it looks for its parent every
  :data:`POLL_S` seconds. A killed search then leaves what a killed ``fedlore run`` leaves (each
  trial at its last checkpoint, running in the study), never a trial still training that the
  next command would find locked.
* **Outcome.** Each job reports how it ended: done, interrupted, an ``OSError`` (a full disk:
  its trial stays running) or another error (its trial is recorded as failed).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from fedlore import progress
from fedlore.device import THREADS_ENV, available_cpus
from fedlore.engine import interrupt

POLL_S = 0.2
"""Seconds between two looks at the processes and at this process's signal flag."""

CLOSE_S = 60.0
"""Seconds a closed pool waits for its workers to end (each ends its job first) before
killing them."""


@dataclass(frozen=True)
class Ended:
    """How one job ended: ``kind`` is ``done``, ``interrupted``, ``oserror``, ``error`` or
    ``died`` (the process ended without a report: killed, out of memory); ``message`` says
    what happened (the error's text, the exit status)."""

    label: str
    kind: str
    message: str = ""


def threads_each(workers: int, cpus: int | None = None) -> int:
    """Torch threads for each of ``workers`` processes: an equal share of the CPUs, at least 1."""
    cpus = available_cpus() if cpus is None else cpus
    return max(1, cpus // workers)


class _Lines:
    """Standard error as a stream that is not a terminal: progress comes as lines, not bars."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def isatty(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _die_with(parent: int) -> None:
    """End this process when process ``parent`` ends (see the module docstring)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        armed = libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux
        armed = False
    if os.getppid() != parent:  # it ended before this process asked
        os._exit(1)
    if not armed:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(POLL_S)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, daemon=True, name="fedlore-parent-watch").start()


def _job(
    target: Callable[..., None],
    args: tuple[Any, ...],
    label: str,
    threads: int,
    show: bool,
    fresh: Any,
) -> tuple[str, str]:
    """One job in a worker: its share of threads, prefixed progress lines, fedlore's signal
    handling, the torch generator as a fresh process has it (``fresh``); returns how
    ``target(*args)`` ended: ``(kind, message)``."""
    import torch

    os.environ[THREADS_ENV] = str(threads)
    torch.set_num_threads(threads)
    torch.random.set_rng_state(fresh)  # as in a fresh process: nothing drawn by an earlier job
    interrupt.speak_as(label)
    progress.enable(show)
    for handler in progress.log.handlers:
        handler.setFormatter(_prefixed(label))
    try:
        with interrupt.handling():
            target(*args)
    except interrupt.Interrupted as e:
        return ("interrupted", str(e.signum))
    except OSError as e:
        return ("oserror", str(e))
    except BaseException as e:  # reported, then this process ends
        return ("error", f"{type(e).__name__}: {e}")
    return ("done", "")


def _main() -> None:
    """``python -m fedlore.tune_parallel``: a worker. Standard input brings, pickled, the
    parent's PID and the file descriptor to report on, then one job after another
    ``(target, args, label, threads, show)``; after each, one JSON line ``[kind, message]`` on
    that descriptor. It ends at the end of its input, or once a job did not end ``done`` (an
    interrupt, an error: nothing of it may reach a later job)."""
    stdin = sys.stdin.buffer
    parent, fd = pickle.load(stdin)
    _die_with(parent)
    os.setpgrp()
    import torch

    from fedlore.data.federation import keep_built

    fresh = torch.random.get_rng_state()
    sys.stderr = _Lines(sys.stderr)
    keep_built()  # one federation for every trial of the same data (each gets a copy)
    with os.fdopen(fd, "w") as out:
        while True:
            try:
                ref, args, label, threads, show = pickle.load(stdin)
            except EOFError:  # the pool is closed
                break
            module, _, name = ref.partition(":")
            target: Any = importlib.import_module(module)
            for part in name.split("."):
                target = getattr(target, part)
            kind, message = _job(target, args, label, threads, show, fresh)
            out.write(json.dumps([kind, message]) + "\n")
            out.flush()
            if kind != "done":
                break
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # every file of its jobs is closed: no interpreter shutdown (seconds with torch)


def _prefixed(label: str) -> Any:
    import logging

    return logging.Formatter(f"fedlore: {label}: %(message)s")


def run_jobs(
    target: Callable[..., None],
    jobs: Sequence[tuple[str, tuple[Any, ...]]],
    workers: int,
) -> list[Ended]:
    """Run ``target(*args)`` for each ``(label, args)`` of ``jobs``, on at most ``workers``
    processes at once (``target`` and ``args`` must pickle: a module-level function and plain
    data); wait for all of them. A signal received here stops the jobs running, and no other
    starts. Inside :func:`kept` of the same ``workers``, its processes; else processes started
    for this call and ended before it returns.

    Returns:
        How each job that started ended, in the order of ``jobs``.
    """
    if _open is not None and _open.size == workers:
        return _open.run(target, jobs)
    pool = Pool(workers)
    try:
        return pool.run(target, jobs)
    finally:
        pool.close()


_open: Pool | None = None
"""The pool of :func:`kept` (None: outside it)."""


@contextlib.contextmanager
def kept(workers: int) -> Iterator[None]:
    """Inside, :func:`run_jobs` at ``workers`` keeps its processes from one call to the next
    (a search's batches): each imports once and keeps its federation; they end when it ends."""
    global _open
    outer, _open = _open, Pool(workers)
    try:
        yield
    finally:
        pool, _open = _open, outer
        pool.close()


@dataclass
class _Worker:
    """One worker process: its input, the read end of its reports, and its job (an index of
    the jobs of :meth:`Pool.run`; None: idle)."""

    proc: subprocess.Popen[bytes]
    reports: int
    job: int | None = None
    pending: bytes = b""


class Pool:
    """At most ``size`` worker processes, started when a job needs one and kept for the next;
    one that ended (killed, or after a job that did not end ``done``) is replaced by a new one
    when a job needs it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._workers: list[_Worker] = []
        self._ended: list[_Worker] = []

    def _start(self) -> _Worker:
        reports, mine = os.pipe()  # read end here, write end there
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedlore.tune_parallel"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(mine,),
        )
        os.close(mine)
        worker = _Worker(proc, reports)
        self._workers.append(worker)
        self._send(worker, (os.getpid(), mine))
        return worker

    @staticmethod
    def _send(worker: _Worker, message: object) -> bool:
        """Whether ``message`` reached the worker's input (not: it has ended)."""
        assert worker.proc.stdin is not None
        try:
            pickle.dump(message, worker.proc.stdin)
            worker.proc.stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True

    def _retire(self, worker: _Worker) -> None:
        if worker in self._workers:
            self._workers.remove(worker)
            self._ended.append(worker)

    def _idle(self) -> _Worker | None:
        """A worker without a job (one that ended refuses the job: :meth:`run`), else a new
        one when fewer than ``size`` are kept."""
        idle = next((w for w in self._workers if w.job is None), None)
        if idle is None and len(self._workers) < self.size:
            idle = self._start()
        return idle

    def run(
        self, target: Callable[..., None], jobs: Sequence[tuple[str, tuple[Any, ...]]]
    ) -> list[Ended]:
        """:func:`run_jobs` on this pool's processes."""
        ref = f"{target.__module__}:{target.__qualname__}"
        threads = threads_each(min(self.size, len(jobs)))
        show = progress.enabled()
        ended: dict[int, Ended] = {}
        todo = list(enumerate(jobs))
        with interrupt.deferred():  # a first signal sets the flag: passed on, then raised
            try:
                passed_on = False
                while True:
                    while todo and interrupt.received() is None:
                        worker = self._idle()
                        if worker is None:
                            break
                        i, (label, args) = todo[0]
                        if self._send(worker, (ref, args, label, threads, show)):
                            worker.job = i
                            todo.pop(0)
                        else:  # it ended (killed while idle, after a job): replaced
                            self._retire(worker)
                    busy = [w for w in self._workers if w.job is not None]
                    if not busy:
                        break
                    if interrupt.received() is not None and not passed_on:
                        passed_on = True
                        _signal(busy, signal.SIGTERM)
                    self._collect(busy, jobs, ended)
            except BaseException:  # this process stops here (no fedlore handling): so do they
                busy = [w for w in self._workers if w.job is not None]
                _signal(busy, signal.SIGTERM)
                for w in busy:
                    w.proc.wait()
                raise
        return [ended[i] for i in sorted(ended)]

    def _collect(
        self,
        busy: Sequence[_Worker],
        jobs: Sequence[tuple[str, tuple[Any, ...]]],
        ended: dict[int, Ended],
    ) -> None:
        """Wait up to :data:`POLL_S` for reports; record each job that ended."""
        ready, _, _ = select.select([w.reports for w in busy], [], [], POLL_S)
        for w in busy:
            if w.reports not in ready or w.job is None:
                continue
            data = os.read(w.reports, 1 << 16)
            w.pending += data
            label = jobs[w.job][0]
            if b"\n" in w.pending:
                line, _, w.pending = w.pending.partition(b"\n")
                try:
                    kind, message = json.loads(line)
                except ValueError:  # not a report: the job's own output on it
                    kind, message = "error", f"unreadable report {line[:200]!r}"
                ended[w.job] = Ended(label, str(kind), str(message))
                w.job = None
                if kind != "done":  # it ends after such a job
                    self._retire(w)
            elif not data:  # no report, and it ended: killed, or its interpreter failed
                ended[w.job] = Ended(label, "died", f"exit status {w.proc.wait()}")
                w.job = None  # ended: its input refuses the next job, and it is replaced

    def close(self) -> None:
        """End every worker: its input closed (it ends after its job), then waited for; one
        still alive after :data:`CLOSE_S` seconds is killed."""
        for w in self._workers:
            assert w.proc.stdin is not None
            with contextlib.suppress(OSError):
                w.proc.stdin.close()
        every, self._workers, self._ended = [*self._workers, *self._ended], [], []
        deadline = time.monotonic() + CLOSE_S
        for w in every:
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            if w.proc.stdin is not None:
                with contextlib.suppress(OSError):
                    w.proc.stdin.close()
            os.close(w.reports)


def _signal(workers: Sequence[_Worker], sig: int) -> None:
    for w in workers:
        if w.proc.poll() is None:
            w.proc.send_signal(sig)


if __name__ == "__main__":
    _main()
