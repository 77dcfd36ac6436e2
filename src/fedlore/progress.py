"""What a person following a run sees: named startup steps and one line per round.

Messages go to the logger ``fedlore.progress`` (standard error, ``fedlore: ...``), which the
command line switches on with ``progress: true`` (the default): long startup steps say what they
do (building the federation, partition redraws, tokenizer training, loading a model), and a run
prints one line per round off a terminal (round, method, seed, accuracy or perplexity, seconds)
or a progress bar on one. A library user who never configures the logger sees nothing.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

log = logging.getLogger("fedlore.progress")


def say(message: str, *args: object) -> None:
    """Tell the person following the run what happens now (a startup step, a redraw)."""
    log.info(message, *args)


_SAID: set[str] = set()
_COMMANDS: list[set[str]] = []  # the messages said in the command under way (a stack of one)


@contextlib.contextmanager
def command() -> Iterator[None]:
    """One command's scope (:func:`fedlore.experiment.run_experiment` is in one: ``fedlore run``
    and every run of its sweep): within it :func:`say_once` and :func:`warn_once` say a message
    once for the command, and the next command says it again (a notebook's second experiment
    is told too, where Python's warning filters let a warning through twice: by default they
    show one once per place in the code). Outside any command they say it once per process. A
    command inside another is part of it. Usable as a decorator."""
    if _COMMANDS:
        yield
        return
    _COMMANDS.append(set())
    try:
        yield
    finally:
        _COMMANDS.pop()


def in_command() -> bool:
    """Whether a :func:`command` is under way (a message said once is said once for it)."""
    return bool(_COMMANDS)


def _said() -> set[str]:
    """The messages said already: the command's, or the process's outside any command."""
    return _COMMANDS[-1] if _COMMANDS else _SAID


def say_once(message: str, *args: object) -> None:
    """:func:`say`, once per command (:func:`command`; once per process outside any) for a
    given message (a model loaded again for each of a run's copies is announced the first
    time)."""
    text = message % args if args else message
    said = _said()
    if text not in said:
        said.add(text)
        log.info(text)


def warn_once(message: str, category: type[Warning]) -> None:
    """A warning that shows whether or not progress messages do (``progress: false`` silences
    :func:`say`, never this), once per command (once per process outside any) as
    :func:`say_once`: every run of a sweep would repeat it."""
    said = _said()
    if message not in said:
        said.add(message)
        warnings.warn(message, category, stacklevel=3)


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when a message is emitted, not as it was
    when the handler was made: a caller that redirects or replaces the stream later (a test's
    capture, a notebook, ``contextlib.redirect_stderr``) gets the messages, and no message goes
    to a stream closed since."""

    @property
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:
        pass


def enable(on: bool) -> None:
    """Print progress messages to standard error (``on``) or drop them (the default)."""
    for handler in list(log.handlers):
        log.removeHandler(handler)
    log.propagate = False
    if on:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("fedlore: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    else:
        log.addHandler(logging.NullHandler())
        log.setLevel(logging.WARNING)


def enabled() -> bool:
    """Whether progress messages are printed."""
    return log.isEnabledFor(logging.INFO) and any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.NullHandler)
        for h in log.handlers
    )
