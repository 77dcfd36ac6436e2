"""The ε of a whole ``fedlore tune`` search under DP, from its trials' run folders.

Every trial trains on the same clients' data, and the search releases every trial's rows
(``metrics.jsonl``, each a noised model's evaluation) and the model it chooses, so what it
spends is the adaptive composition of every DP exchange of every trial that ran: finished,
pruned (the rounds it ran), failed (the rounds it released), and the releases a resumed trial
ran again (its ``dp_ledger.json``, :mod:`fedlore.engine.dp_ledger`). Rényi DP composes
additively at each order whatever each trial's settings, so the search's ε is
:func:`~fedlore.privacy.composition.composed_epsilon` of the trials' :class:`TrialSpend`
(their exchanges at their own σ, N and m), exactly as a run's
:meth:`~fedlore.privacy.aggregation.Privacy.epsilon_metrics` reports one run's: ``dp_epsilon``
against whoever sees the models and rows, ``dp_epsilon_sample_known`` against a party that
knows each round's sample (when clients are sampled), and under local DP the ε of the client
with the most exchanges over all trials.

A trial's exchanges are counted from its rows (the last round released, plus the method's setup
exchanges, and at least the number of rows), plus its ledger. A folder that contradicts how the
trial ended (a finished trial without its summary, rows missing before the last, a summary or
checkpoint ahead of the rows, a ledger that cannot be read) is counted at its configured
exchanges, never fewer than it shows, and named (:attr:`SearchPrivacy.overcounted`). What it
shows includes the ε it recorded (its rows' and summary's ``dp_epsilon``): a folder whose
ledger was lost is counted at no fewer exchanges than that ε proves (:func:`_proven`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedlore.checks import setup_rounds
from fedlore.config import Config
from fedlore.engine.checkpoint_io import load_tensors
from fedlore.engine.dp_ledger import repeated
from fedlore.engine.rundir import run_dir
from fedlore.experiment_parts import make_algorithm
from fedlore.experiment_privacy import NO_PRIVACY, dp_noise_multiplier
from fedlore.privacy.composition import Exchanges, composed_epsilon
from fedlore.privacy.dp import epsilon_spent
from fedlore.privacy.local_dp import UPLOADS_KEY, Uploads, local_epsilon

RTOL = 1e-9
"""A recorded ε above the ε of the exchanges counted by more than this (relative) means rows
are missing."""


@dataclass(frozen=True)
class TrialSpend:
    """What one trial spent.

    Attributes:
        number: the trial. sigma, num_clients, per_round: its mechanism (σ as the accountant is
            fed it: the total z under adaptive clipping).
        exchanges: its DP exchanges counted (setup, rounds released, repeats).
        clients: under local DP, each client's exchanges (None: unknown, every client is
            counted in every exchange).
        identity: what decides which data each client holds (trials of the same identity
            share their clients).
        overcounted: why the folder could not be read, so it was counted at its configured
            exchanges ("" when it was read).
        reproducible: it drew its noise and sample from the run seed (``dp.reproducible_noise``:
            no privacy).
    """

    number: int
    sigma: float
    num_clients: int
    per_round: int
    exchanges: int
    clients: dict[int, int] | None = None
    identity: str = ""
    overcounted: str = ""
    reproducible: bool = False

    def part(self) -> Exchanges:
        return Exchanges(self.sigma, self.num_clients, self.per_round, self.exchanges)

    def client_count(self, client: int) -> int:
        return self.exchanges if self.clients is None else self.clients.get(client, 0)


@dataclass(frozen=True)
class SearchPrivacy:
    """The search's ε (:func:`search_privacy`)."""

    epsilon: float
    sample_known: float | None
    delta: float
    local: bool
    spends: tuple[TrialSpend, ...] = field(default_factory=tuple)
    reproducible: bool = False
    """A trial drew its noise from the run seed (``dp.reproducible_noise``): the search has no
    privacy, whatever ε the accountant gives its exchanges."""

    @property
    def trials(self) -> int:
        """The trials that made at least one DP exchange."""
        return sum(1 for s in self.spends if s.exchanges > 0)

    @property
    def exchanges(self) -> int:
        return sum(s.exchanges for s in self.spends)

    @property
    def overcounted(self) -> list[str]:
        return [f"trial-{s.number}: {s.overcounted}" for s in self.spends if s.overcounted]

    def record(self) -> dict[str, Any]:
        """``best.json``'s entries."""
        out: dict[str, Any] = {"dp_epsilon_of_search": _json_float(self.epsilon)}
        if self.sample_known is not None:
            out["dp_epsilon_of_search_sample_known"] = _json_float(self.sample_known)
        out["dp_delta"] = self.delta
        out["dp_search_trials"] = self.trials
        out["dp_search_exchanges"] = self.exchanges
        out["dp_search_overcounted"] = self.overcounted
        if self.reproducible:
            out["privacy"] = NO_PRIVACY
        return out

    def line(self) -> str:
        """One line for the command's output."""
        known = (
            f" (against a party that knows each round's sample: {self.sample_known:.4g})"
            if self.sample_known is not None
            else ""
        )
        who = " for the busiest client (local DP)" if self.local else ""
        over = ""
        if self.overcounted:
            over = (
                f"; {len(self.overcounted)} damaged trial folder(s) counted at their configured "
                f"exchanges: {'; '.join(self.overcounted)}"
            )
        none = f"; {NO_PRIVACY}" if self.reproducible else ""
        return (
            f"ε of the search = {self.epsilon:.4g}{who} at δ = {self.delta:g}{known}: "
            f"{self.exchanges} DP exchanges of {self.trials} trial(s) composed{over}{none}"
        )


def _json_float(v: float) -> float | str:
    return v if math.isfinite(v) else "inf"


def search_privacy(
    cfg: Config, trials: Sequence[TrialSpend], accountant: str | None = None
) -> SearchPrivacy:
    """The search's ε from its trials' spends (``cfg``: the search's config, for δ, the mode
    and the accountant)."""
    dp = cfg.dp
    acc = accountant or dp.accountant
    delta = dp.delta
    seeded = dp.reproducible_noise or any(s.reproducible for s in trials if s.exchanges > 0)
    if dp.mode == "local":
        return SearchPrivacy(_local(trials, delta, acc), None, delta, True, tuple(trials), seeded)
    parts = [s.part() for s in trials]
    eps = composed_epsilon(parts, delta, accountant=acc)
    sampled = any(p.per_round < p.num_clients for p in parts if p.count)
    known = composed_epsilon([p.known() for p in parts], delta, accountant=acc) if sampled else None
    return SearchPrivacy(eps, known, delta, False, tuple(trials), seeded)


def _local(trials: Sequence[TrialSpend], delta: float, accountant: str) -> float:
    """The largest ε over the clients, each composed over its exchanges in every trial (when
    the trials share their clients; else every trial's busiest client is counted as one)."""
    ran = [s for s in trials if s.exchanges > 0]
    if len({s.identity for s in ran}) > 1:  # client k is not the same data in every trial
        vectors = {tuple(max(s.clients.values(), default=0) if s.clients is not None
                         else s.exchanges for s in ran)}  # fmt: skip
    else:
        ids = set().union(*(s.clients or {} for s in ran)) or {0}
        vectors = {tuple(s.client_count(c) for s in ran) for c in ids}
    return max(
        (
            composed_epsilon(
                [Exchanges(s.sigma, 1, 1, n) for s, n in zip(ran, v, strict=True)],
                delta,
                accountant=accountant,
            )
            for v in vectors
        ),
        default=0.0,
    )


def planned(cfg: Config, method: str, trials: int) -> SearchPrivacy:
    """The search's ε if each of ``trials`` trials runs every exchange of ``cfg`` (the
    trials' own settings may differ: the space may change rounds or sampling)."""
    setup = setup_rounds(make_algorithm(method, cfg))
    sigma = dp_noise_multiplier(cfg, setup)
    one = TrialSpend(0, sigma, cfg.num_clients, cfg.clients_per_round(), cfg.rounds + setup)
    return search_privacy(cfg, [one] * trials)


def trial_spend(
    number: int, state: str, note: str, cfg: Config | None, method: str, run_seed: int
) -> TrialSpend:
    """What trial ``number`` spent, from its run folder (module docstring).

    Args:
        state: how it ended (``complete``, ``pruned``, ``failed``, ``running``).
        note: its note (a pruned trial's ``after round r``).
        cfg: its config (None: the config refused its settings, so it never ran).
    """
    if cfg is None:
        return TrialSpend(number, 0.0, 1, 1, 0)
    try:
        setup = setup_rounds(make_algorithm(method, cfg))
        sigma = dp_noise_multiplier(cfg, setup)
    except (ValueError, KeyError):  # the run refuses it the same way: nothing ran
        return TrialSpend(number, 0.0, 1, 1, 0)
    local = cfg.dp.mode == "local"
    identity = json.dumps(
        [cfg.num_clients, cfg.data.model_dump(mode="json"), cfg.partition.model_dump(mode="json")],
        sort_keys=True,
    )
    run = run_dir(cfg, method, run_seed)
    rows, torn = _rounds(run / "metrics.jsonl")
    ran = max(max(rows) + 1 + setup, len(rows)) if rows else 0
    problems: list[str] = []
    try:
        repeats = repeated(run)
    except ValueError:
        repeats = 0
        problems.append("dp_ledger.json cannot be read (its repeated releases are not counted)")
    summary = _summary(run / "summary.json")
    if isinstance(summary.get("dp_repeated_exchanges"), int):
        repeats = max(repeats, summary["dp_repeated_exchanges"])
    checkpoint = _checkpoint(run / "checkpoint.pt") if local else None  # its client counts
    problems += _problems(run, state, note, rows, torn, summary, checkpoint)
    total = ran + repeats
    found = (summary.get("dp_epsilon"), *rows.values())
    recorded = [float(v) for v in found if isinstance(v, int | float) and not isinstance(v, bool)]
    clients = None
    if local and checkpoint is not None and not problems:
        last, uploads = checkpoint
        after = (max(rows) - last) if rows else 0  # rows a cut-off attempt wrote after it
        # a client the counts leave out took part in no exchange before the checkpoint, but
        # may have in every one after it and in every repeat
        everyone = set(range(cfg.num_clients)) | set(uploads.counts)
        clients = {c: uploads.counts.get(c, 0) + after + repeats for c in everyone}
    most = total if clients is None else max(clients.values(), default=0)
    mine = (
        composed_epsilon([Exchanges(sigma, 1, 1, most)], cfg.dp.delta, accountant=cfg.dp.accountant)
        if local
        else composed_epsilon(
            [Exchanges(sigma, cfg.num_clients, cfg.clients_per_round(), total)],
            cfg.dp.delta,
            accountant=cfg.dp.accountant,
        )
    )
    if recorded and max(recorded) > mine * (1 + RTOL):
        problems.append(f"it recorded ε = {max(recorded):.6g}, more than its rows account for")
    if problems:
        total = max(total, cfg.rounds + setup + repeats, _proven(recorded, sigma, cfg, local))
        clients = None
    return TrialSpend(
        number, sigma, cfg.num_clients, cfg.clients_per_round(), total, clients, identity,
        "; ".join(problems), cfg.dp.reproducible_noise,
    )  # fmt: skip


def _proven(recorded: list[float], sigma: float, cfg: Config, local: bool) -> int:
    """The fewest exchanges whose ε (the trial's σ, N, m, δ and accountant, as the run
    records it: :func:`~fedlore.privacy.dp.epsilon_spent`, or
    :func:`~fedlore.privacy.local_dp.local_epsilon` for the busiest client under local DP)
    reaches the largest ε the trial recorded (within :data:`RTOL`): what its own records
    prove it spent, whatever else of its folder is lost."""
    target = max((e for e in recorded if math.isfinite(e) and e > 0), default=0.0)
    if target <= 0:
        return 0
    dp = cfg.dp

    def eps(n: int) -> float:
        if local:
            return local_epsilon(sigma, dp.delta, n, accountant=dp.accountant)
        return epsilon_spent(
            sigma, dp.delta, n, cfg.num_clients, cfg.clients_per_round(), accountant=dp.accountant
        )

    def reaches(n: int) -> bool:
        return eps(n) >= target * (1 - RTOL)

    high = 1
    while not reaches(high):
        if high >= _MOST_PROVEN:  # a recorded ε no count reaches: the most searched
            return high
        high *= 2
    low = high // 2  # does not reach (0 never does: ε of no exchange is 0 < target)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if reaches(mid) else (mid, high)
    return high


_MOST_PROVEN = 1 << 20
"""The largest count :func:`_proven` searches."""


def _real(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _rounds(path: Path) -> tuple[dict[int, float | None], bool]:
    """The DP rows of ``metrics.jsonl`` (round -> its ``dp_epsilon``), and whether a line
    before the last is not a row (a torn last line is one a kill left)."""
    if not path.is_file():
        return {}, False
    rows: dict[int, float | None] = {}
    lines = path.read_text("utf-8", errors="replace").splitlines()
    torn = False
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
            rnd = int(row["round"])
        except (ValueError, KeyError, TypeError):
            torn = torn or i < len(lines) - 1
            continue
        if "dp_epsilon" in row:
            eps = row["dp_epsilon"]
            rows[rnd] = float(eps) if _real(eps) else None
    return rows, torn


def _summary(path: Path) -> dict[str, Any]:
    """The summary (``{}`` when there is none; ``{"unreadable": True}`` when it is damaged)."""
    if not path.exists():
        return {}
    try:
        out = json.loads(path.read_text("utf-8"))
        return out if isinstance(out, dict) else {"unreadable": True}
    except (ValueError, UnicodeDecodeError):
        return {"unreadable": True}


def _checkpoint(path: Path) -> tuple[int, Uploads] | None:
    """(its last round, local DP's counts of exchanges) of the checkpoint; None when there is
    none, it cannot be read or it holds no counts."""
    if not path.is_file():
        return None
    try:
        raw = load_tensors(path, "cpu")
        uploads = Uploads()
        # a local DP run always checkpoints its counts: a file without them is foreign
        uploads.restore(str(raw["server"]["values"][UPLOADS_KEY]))
        return int(raw["round"]), uploads
    except Exception:  # a torn or foreign file: counted without it
        return None


def _problems(
    run: Path,
    state: str,
    note: str,
    rows: dict[int, float | None],
    torn: bool,
    summary: dict[str, Any],
    checkpoint: tuple[int, Uploads] | None,
) -> list[str]:
    """Why the folder contradicts how the trial ended (empty when it does not)."""
    problems = []
    if not run.is_dir():
        # a failed trial may have stopped before its folder: this one cannot tell
        return [f"no run folder {run.name}/ for a {state} trial"]
    if torn:
        problems.append("metrics.jsonl has unreadable lines before its last")
    if summary.get("unreadable"):
        problems.append("summary.json cannot be read")
    elif state == "complete" and not (run / "summary.json").exists():
        problems.append("a complete trial without summary.json")
    saved = (run / "summary.json").exists() or (run / "checkpoint.pt").exists()
    if not rows and (state in ("complete", "pruned") or saved):
        problems.append("no DP rows in metrics.jsonl")
    if rows and checkpoint is not None and checkpoint[0] > max(rows):
        problems.append("its checkpoint is ahead of its rows")
    if state == "pruned" and note.startswith("after round "):
        try:
            if not rows or max(rows) < int(note.removeprefix("after round ")):
                problems.append(f"pruned {note}, but its rows end before")
        except ValueError:
            pass
    return problems
