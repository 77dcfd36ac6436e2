"""Processes for ``fedlore tune --workers W`` (:mod:`fedlore.tune_study`): each trial of a batch
trains in a process of its own, a fresh interpreter running ``python -m fedlore.tune_parallel``
(no torch threads or open database connection inherited from this one, and, unlike
``multiprocessing``'s ``spawn``, no second import of the caller's script: a script that calls
:func:`fedlore.tune_study.run_search` needs no ``if __name__ == "__main__"`` guard). The job
(a module-level function and its arguments) goes to it pickled on its standard input, with this
process's ``sys.path``; its report comes back as one JSON line on a pipe of its own.

* **CPUs.** Each process sets its torch threads (and ``OMP_NUM_THREADS``) to its share of the
  CPUs, so ``threads: auto`` in a trial takes that share instead of every CPU; a trial's
  explicit ``threads`` still wins.
* **Output.** A process's progress messages are prefixed with its trial (``fedlore: trial 3:
  ...``) and shown as lines, never as a progress bar (several bars on one terminal overwrite
  each other).
* **Signals.** Each process runs in a process group of its own, so Ctrl-C on the terminal
  reaches this process only; the first SIGINT or SIGTERM here (inside
  :func:`fedlore.engine.interrupt.handling`) is passed on to every process once, as SIGTERM,
  and each stops its trial between two rounds, as ``fedlore run`` does: the trials stay
  running in the study, for the same command to resume. A second signal here kills them all.
* **Never orphaned.** A process ends at once when this one dies (SIGKILL, a crash): on Linux
  the kernel sends it SIGKILL (``PR_SET_PDEATHSIG``), elsewhere it looks for its parent every
  :data:`POLL_S` seconds. A killed search then leaves what a killed ``fedlore run`` leaves (each
  trial at its last checkpoint, running in the study), never a trial still training that the
  next command would find locked.
* **Outcome.** Each process reports how its job ended: done, interrupted, an ``OSError`` (a
  full disk: its trial stays running) or another error (its trial is recorded as failed).
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fedlore import progress
from fedlore.device import THREADS_ENV, available_cpus
from fedlore.engine import interrupt

POLL_S = 0.2
"""Seconds between two looks at the processes and at this process's signal flag."""


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


def _child(
    target: Callable[..., None],
    args: tuple[Any, ...],
    label: str,
    threads: int,
    show: bool,
    parent: int,
) -> tuple[str, str]:
    """A job's process: bound to ``parent``'s life, its own process group, its share of
    threads, prefixed progress lines, fedlore's signal handling; returns how ``target(*args)``
    ended: ``(kind, message)``."""
    _die_with(parent)
    os.setpgrp()
    os.environ[THREADS_ENV] = str(threads)
    import torch

    torch.set_num_threads(threads)
    sys.stderr = _Lines(sys.stderr)
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
    """``python -m fedlore.tune_parallel``: run the job pickled on standard input, write how it
    ended to the file descriptor it names."""
    ref, args, label, threads, show, parent, fd = pickle.load(sys.stdin.buffer)
    module, _, name = ref.partition(":")
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    kind, message = _child(target, args, label, threads, show, parent)
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps([kind, message]) + "\n")


def _prefixed(label: str) -> Any:
    import logging

    return logging.Formatter(f"fedlore: {label}: %(message)s")


def run_jobs(
    target: Callable[..., None],
    jobs: Sequence[tuple[str, tuple[Any, ...]]],
    workers: int,
) -> list[Ended]:
    """Run ``target(*args)`` for each ``(label, args)`` of ``jobs``, ``workers`` processes at a
    time (``target`` and ``args`` must pickle: a module-level function and plain data); wait for
    all of them. A signal received here stops the jobs running, and no other starts.

    Returns:
        How each job that started ended, in the order of ``jobs``.
    """
    threads = threads_each(min(workers, len(jobs)))
    show = progress.enabled()
    ended: list[Ended] = []
    queue = list(jobs)
    with interrupt.deferred():  # a first signal sets the flag: passed on, then raised
        while queue and interrupt.received() is None:
            chunk, queue = queue[:workers], queue[workers:]
            ended += _run_chunk(target, chunk, threads, show)
    return ended


def _run_chunk(
    target: Callable[..., None],
    chunk: Sequence[tuple[str, tuple[Any, ...]]],
    threads: int,
    show: bool,
) -> list[Ended]:
    ref = f"{target.__module__}:{target.__qualname__}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    started = []
    for label, args in chunk:
        theirs, mine = os.pipe()  # read end here, write end there
        proc = subprocess.Popen(
            [sys.executable, "-m", "fedlore.tune_parallel"],
            stdin=subprocess.PIPE,
            env=env,
            pass_fds=(mine,),
        )
        os.close(mine)
        assert proc.stdin is not None
        with proc.stdin:
            pickle.dump((ref, args, label, threads, show, os.getpid(), mine), proc.stdin)
        started.append((label, proc, theirs))
    try:
        passed_on = False
        while any(p.poll() is None for _, p, _ in started):
            time.sleep(POLL_S)
            if interrupt.received() is not None and not passed_on:
                passed_on = True
                _signal(started, signal.SIGTERM)
    except BaseException:  # this process stops here (no fedlore handling): so do they
        _signal(started, signal.SIGTERM)
        for _, proc, _ in started:
            proc.wait()
        raise
    out = []
    for label, proc, fd in started:
        with os.fdopen(fd) as report:
            text = report.read()
        try:
            kind, message = json.loads(text)
        except ValueError:  # no report: it was killed, or its interpreter failed
            kind, message = "died", f"exit status {proc.returncode}"
        out.append(Ended(label, str(kind), str(message)))
    return out


def _signal(started: Sequence[tuple[str, Any, Any]], sig: int) -> None:
    for _, proc, _ in started:
        if proc.poll() is None:
            proc.send_signal(sig)


if __name__ == "__main__":
    _main()
