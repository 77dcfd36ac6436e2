"""Where a run starts in its folder: over from its first round (:func:`start_fresh`, which
clears what an earlier run left, and warns of an unfinished run's rounds it discards) or after
its checkpoint (:func:`resume_point`, once the rows reach it, :func:`check_rows_reach`).
:func:`rows_problem` also judges a finished run's rows (:mod:`fedlore.engine.rerun`)."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from fedlore.atomic import remove_temps, write_text
from fedlore.config import ConfigError
from fedlore.engine.callbacks import Checkpointer, MetricsWriter
from fedlore.engine.dp_ledger import LEDGER, account_repeats
from fedlore.engine.node_states import FOLDER as NODE_STATES
from fedlore.engine.rundir import RunFolder
from fedlore.engine.store import ClientStore, remove_spill_temps
from fedlore.privacy import Privacy
from fedlore.progress import say, tell
from fedlore.types import State


class StartOverWarning(UserWarning):
    """A fresh run discards the rounds of an unfinished run in its folder (shown whether or not
    progress messages are)."""


OWN_FILES = ("checkpoint.pt", "config.json", "summary.json", "metrics.jsonl", LEDGER)
"""The files of a run folder that a run replaces atomically (:mod:`fedlore.atomic`), each through
``<name>.tmp``."""


def remove_stale_temps(out: Path, spill: Path | None = None) -> None:
    """Delete what a write cut short by a kill left in the run folder ``out`` (held by this
    process's :class:`~fedlore.engine.lock.RunLock`, so no other run is writing there): the
    ``<name>.tmp`` of each of :data:`OWN_FILES`, and in the spill folder ``spill`` the
    ``<client>.<generation>.pt.tmp`` of a spilled client state
    (:func:`~fedlore.engine.store.remove_spill_temps`). Never read as the files they were to
    replace, they would otherwise stay beside the results; a file of any other name (a
    user's) is left alone."""
    gone = remove_temps(out, OWN_FILES)
    if spill is not None:
        gone += remove_spill_temps(spill)
    if gone:
        say("removed what a killed write left in %s: %s", out, ", ".join(sorted(gone)))


def start_fresh(out: Path, spill: Path, method: str, seed: int, keep_ledger: bool = False) -> None:
    """Clear what an earlier run left in ``out`` for a fresh run (nothing of it may survive;
    ``keep_ledger``: its DP ledger does, and its rows, for a resume from the first round to
    count them, :attr:`RunFolder.from_start`):
    its summary, checkpoint, config record and DP ledger, its spilled client states (in
    ``spill``, and in ``out/client_states`` when ``spill`` is elsewhere) and the states its
    clients kept themselves (``out/clients``, :mod:`fedlore.engine.node_states`); a
    :class:`StartOverWarning` when the folder held an unfinished run's rounds (``--resume``
    continues one of the same config)."""
    rows = out / "metrics.jsonl"
    lines = rows.read_text().splitlines() if rows.exists() and not keep_ledger else []
    done = sum(1 for line in lines if line.strip())
    if done:  # a warning, shown under progress: false too: those rounds are trained again
        warnings.warn(
            f"{method} seed {seed}: starting over in {out}, over an unfinished run whose "
            f"{done} round{'' if done == 1 else 's'} are discarded (--resume continues a run "
            "of the same config from its checkpoint)",
            StartOverWarning,
            stacklevel=2,
        )
    for stale in (
        "summary.json",
        "checkpoint.pt",
        "config.json",
        *(() if keep_ledger else (LEDGER,)),
    ):
        (out / stale).unlink(missing_ok=True)
    shutil.rmtree(spill, ignore_errors=True)
    # an earlier run's own spill folder, when this one spills elsewhere (store.spill_dir): its
    # files bear the names this run's store will give, and would be taken for this run's
    shutil.rmtree(out / "client_states", ignore_errors=True)
    # the states a simulated run's clients kept themselves (fedlore.engine.node_states)
    shutil.rmtree(out / NODE_STATES, ignore_errors=True)


def rows_problem(path: Path, first: int, last: int, torn_ok: bool = True) -> str | None:
    """What keeps ``metrics.jsonl`` at ``path`` from holding one row of each round from
    ``first`` to ``last`` (rows after ``last`` are not looked at), as words (``"lacks the rows
    of rounds 3 to 5"``, ``"holds round 2 twice"``, ``"has an unreadable line 7"``); None when it
    does. ``torn_ok``: a line that is no row is skipped (the torn last line of a killed run)
    rather than a problem."""
    seen: dict[int, int] = {}
    for i, line in enumerate(path.read_text().splitlines() if path.exists() else [], start=1):
        try:
            rnd = json.loads(line)["round"]
        except (json.JSONDecodeError, KeyError, TypeError):
            if torn_ok or not line.strip():
                continue
            return f"has an unreadable line {i}"
        if isinstance(rnd, int) and not isinstance(rnd, bool) and rnd <= last:
            seen[rnd] = seen.get(rnd, 0) + 1
    missing = [r for r in range(first, last + 1) if r not in seen]
    twice = sorted(r for r, n in seen.items() if n > 1)
    if missing:
        span = (
            f"round {missing[0]}" if len(missing) == 1 else f"rounds {missing[0]} to {missing[-1]}"
        )
        some = "" if len(missing) == missing[-1] - missing[0] + 1 else f" ({len(missing)} rows)"
        return f"lacks the rows of {span}{some}"
    if twice:
        return f"holds round {twice[0]} twice" + (
            f" (and {len(twice) - 1} more)" if len(twice) > 1 else ""
        )
    return None


def check_rows_reach(path: Path, first: int, last: int) -> None:
    """Refuse to resume when ``metrics.jsonl`` does not hold one row of each round from the
    run's first (``first``: negative for a method's setup rounds) to the checkpoint's ``last``
    (:func:`rows_problem`): the run would continue and its summary count traffic, rounds and
    curves without the missing rows, or twice with a repeated one (rows are on disk before
    each checkpoint, so only a file cut or edited by hand does this).

    Raises:
        ConfigError: naming the file and the rounds it lacks or repeats.
    """
    problem = rows_problem(path, first, last)
    if problem is None:
        return
    raise ConfigError(
        f"--resume: {path} {problem}, which its checkpoint (after round {last}) has passed: "
        "the file was cut or edited, and the run's summary would be wrong for those rounds. "
        "Restore the file, or run without --resume to start over"
    )


def resume_point(
    folder: RunFolder,
    metrics: MetricsWriter,
    state: State,
    store: ClientStore,
    privacy: Privacy | None,
    max_bytes: int | None,
    device: torch.device,
    method: str,
    seed: int,
    first_round: int = 0,
    restore: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[int | None, State, ClientStore, Privacy | None]:
    """Where a run continues: ``(last, state, store, privacy)``, with ``last`` the round of the
    checkpoint in ``folder.out`` that a resumed run continues after (its server state, client
    states and, under adaptive clipping, clip norm loaded; the metrics rows after it dropped), or
    None when the run starts from its first round (``metrics.jsonl`` emptied). Under DP the
    releases a resume repeats are counted (:func:`~fedlore.engine.dp_ledger.account_repeats`)
    before their rows go. ``first_round``: the run's first round (``-setup_rounds``), from
    which the rows must reach the checkpoint (:func:`check_rows_reach`); ``restore`` gets the
    checkpoint's entries besides the states (:meth:`Checkpointer.load`'s ``extra``)."""
    ckpt_path = folder.out / "checkpoint.pt"
    if folder.resume and ckpt_path.exists():
        last, state, store = Checkpointer.load(ckpt_path, max_bytes, folder.spill, device, restore)
        if privacy is not None:  # the adaptive clip norm the killed run had reached
            privacy.restore(state)
        check_rows_reach(metrics.path, first_round, last)
        privacy = account_repeats(privacy, folder.out, metrics.path, last)  # before the rows go
        metrics.truncate_after(last)
        tell(
            "%s seed %d: resuming after round %d (its checkpoint; rounds count from 0)",
            method,
            seed,
            last,
        )
        return last, state, store, privacy
    if folder.resume:  # told when rounds of the run are trained again, else a progress line
        rows = metrics.path.is_file() and metrics.path.stat().st_size > 0
        (tell if rows or folder.from_start else say)(
            "%s seed %d: %s; starting from the first round",
            method,
            seed,
            "its clients' states are not kept on this engine"
            if folder.from_start
            else f"no checkpoint in {folder.out}",
        )
        privacy = account_repeats(privacy, folder.out, metrics.path, None)
    write_text(metrics.path, "")
    return None, state, store, privacy
