"""What a person following a run sees: named startup steps and one line per round.

Messages go to the logger ``fedlore.progress`` (standard error, ``fedlore: ...``), which the
command line switches on with ``progress: true`` (the default): long startup steps say what they
do (building the federation, partition redraws, tokenizer training, loading a model), and a run
prints one line per round off a terminal (round, method, seed, accuracy or perplexity, seconds)
or a progress bar on one. A library user who never configures the logger sees nothing.

What a command says about the user's results (a finished run kept instead of trained, replaced,
continued from its checkpoint, a run that failed under ``--keep-going``) goes through
:func:`tell` instead, to the logger ``fedlore.notice``: the command line prints it whether or
not ``progress`` is on, in the same ``fedlore: ...`` form (``progress: false`` turns off the
bar and the step-by-step lines, not what happened to the results).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings
from collections.abc import Iterator

log = logging.getLogger("fedlore.progress")
notice = logging.getLogger("fedlore.notice")
"""Lines about the user's results (:func:`tell`): shown whatever ``progress`` says."""


def say(message: str, *args: object) -> None:
    """Tell the person following the run what happens now (a startup step, a redraw)."""
    log.info(message, *args)


def tell(message: str, *args: object) -> None:
    """Tell the user what happened to their results (a finished run kept or replaced, a run
    resumed or failed): one plain line, printed by the command line whether or not progress
    messages are (``progress: false`` silences :func:`say`, never this)."""
    notice.info(message, *args)


def tell_once(message: str, *args: object) -> None:
    """:func:`tell`, once per command (:func:`command`) for a given message, as
    :func:`say_once`."""
    text = message % args if args else message
    said = _said()
    key = f"\0tell {text}"  # apart from say_once's: a message may be said and told
    if key not in said:
        said.add(key)
        notice.info(text)


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
    """Print progress messages to standard error (``on``) or drop them (the default); the lines
    of :func:`tell` are printed either way (once this is called: the command line does)."""
    for logger in (log, notice):
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    told = _Stderr()
    told.setFormatter(logging.Formatter("fedlore: %(message)s"))
    notice.addHandler(told)
    notice.propagate = False
    notice.setLevel(logging.INFO)
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
