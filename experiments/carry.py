"""Carry the unfinished runs of a long grid from one machine to the next, through git.

The seed-table grids of ``experiments/reruns.sh`` outlast one sitting. Their finished runs are
committed under ``experiments/runs/`` and reused anywhere, but a run in progress keeps its
checkpoint out of git (``experiments/runs/.gitignore``), so a fresh clone trains it again from
its first round: on two cores that is up to two hours lost per run a sitting leaves open.

``pack`` writes the resumable files of every unfinished run under ROOT (a ``seed-*`` folder with
a ``checkpoint.pt`` and no ``summary.json``: its ``config.json``, ``metrics.jsonl``,
``checkpoint.pt``, spilled ``client_states/`` and, for a DP run, ``dp_ledger.json``) into one
archive, ``ROOT/in-progress.tar.gz``, to commit. What the archive already holds is kept unless
it is superseded: a run packed here replaces its archived copy when it got as far (a checkpoint
of the same or a later round), and a run finished here leaves the archive; the archive is
removed once it holds nothing. An archived copy made with other settings than the run here (its
``config.json`` differs) is neither replaced nor dropped: pack names it, and leaves the run here
out (exit 1) when that one is unfinished.
``unpack`` (the first step of ``experiments/reruns.sh``) restores each archived run that is not
training here, not finished here, not another config's run here (its ``config.json`` differs in a
setting, or cannot be read), not unreadable here (a damaged ``checkpoint.pt``) and not as far
along here, so the queue's ``--resume`` continues it after the packed round and reaches the result
an uninterrupted run reaches; what it keeps it names, with the way on (move the folder away).
An archive with a member pack never writes (another file name, a link, a path out of its run
folder) or a file that cannot be read is refused whole, in one line, before anything is written;
so is a failed read or write (a full disk), after which every file is whole: run it again. Over a
DP run's own attempt here, the releases that attempt made and the archive lacks stay counted in
the restored ``dp_ledger.json`` (they were released: ε must count them).

Pack after stopping the queue (Ctrl-C): a run still training is packed too (its checkpoint is
read before its rows, and a resume drops rows past the checkpoint), except one whose client
states are spilled to disk, which could change under the copy: it is named, its archived copy
kept, and pack exits 1. So is a run whose checkpoint names spilled states its folder lacks (with
``store.spill_dir`` they live outside it, where the archive cannot take them).

    python experiments/carry.py pack   [--root experiments/runs]
    python experiments/carry.py unpack [--root experiments/runs]
"""

from __future__ import annotations

import argparse
import fcntl
import io
import json
import os
import sys
import tarfile
import time
from pathlib import Path, PurePosixPath

import torch

from fedlore.atomic import ADVICE, write_bytes
from fedlore.config_unset import FOLDERS_RECORD
from fedlore.engine.dp_ledger import LEDGER, repeated
from fedlore.engine.resume_changes import CHANGES

ARCHIVE = "in-progress.tar.gz"
PACKED = ("checkpoint.pt", "config.json", "metrics.jsonl", LEDGER)
"""The files of a run folder pack writes (besides its ``client_states/``): an archive member of
another name (a ``summary.json`` would pass an unfinished run off as finished) is refused."""
RECORD_ONLY = ("name", CHANGES, FOLDERS_RECORD)
"""``config.json`` keys that record where and how a run ran, not its settings (with every
``ran_*`` key): two machines' copies of one run differ in them."""
Files = dict[str, tuple[bytes, float]]
"""A run's files: name relative to the root -> (content, modification time)."""


class ArchiveError(Exception):
    """The archive cannot be read, or holds a member no run folder may hold."""


def unfinished(root: Path) -> list[Path]:
    """The run folders under ``root`` with a checkpoint and no ``summary.json``, sorted."""
    return sorted(
        ckpt.parent
        for ckpt in root.rglob("checkpoint.pt")
        if ckpt.parent.name.startswith("seed-") and not (ckpt.parent / "summary.json").exists()
    )


def training(folder: Path) -> bool:
    """Whether a process holds the run's ``run.lock`` (:class:`fedlore.engine.lock.RunLock`)."""
    try:  # never created here: a run removes its lock file when it ends
        fd = open(folder / "run.lock", "rb")  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        return False
    with fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def checkpoint_round(data: bytes) -> int:
    """The round a checkpoint was written after."""
    return int(torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)["round"])


def spilled_elsewhere(folder: Path) -> list[str]:
    """The spilled client states the run's checkpoint names that its ``client_states/`` lacks
    (a run with ``store.spill_dir`` keeps them outside its folder, where pack cannot see
    them; a resume without them fails), sorted."""
    raw = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)
    named = {
        e["spilled"]
        for e in raw.get("clients", {}).values()
        if isinstance(e, dict) and isinstance(e.get("spilled"), str)
    }
    return sorted(f for f in named if not (folder / "client_states" / f).is_file())


def run_of(name: str) -> PurePosixPath:
    """The run folder an archive member belongs to (``.../seed-<s>[.overwrite]``).

    Raises:
        ArchiveError: for a member outside a run folder, absolute, or climbing out with ``..``.
    """
    path = PurePosixPath(name)
    run = path.parent.parent if path.parent.name == "client_states" else path.parent
    if path.is_absolute() or ".." in path.parts or not run.name.startswith("seed-"):
        raise ArchiveError(f"refusing member {name!r}: not a file of a seed-* run folder")
    if run == path.parent and path.name not in PACKED:
        raise ArchiveError(f"refusing member {name!r}: pack writes no such file")
    return run


def unreadable(e: Exception) -> str:
    """An exception as one short line."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0].split('. ')[0][:120] if text else ''}"


def config_differs(folder: Path, files: Files, run: PurePosixPath) -> str:
    """Why the run ``folder`` holds is not the archived copy's config ('' when it is, or holds
    no ``config.json``): the settings that differ, or that its ``config.json`` cannot be read.
    The ``ran_*`` keys and :data:`RECORD_ONLY` are left out."""

    def settings(data: bytes) -> dict[str, object]:
        raw = json.loads(data)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        return {k: v for k, v in raw.items() if k not in RECORD_ONLY and not k.startswith("ran_")}

    record = folder / "config.json"
    if not record.is_file():
        return ""
    try:
        here = settings(record.read_bytes())
    except (OSError, ValueError) as e:
        return f"its config.json here cannot be read ({unreadable(e)})"
    theirs = settings(files[f"{run}/config.json"][0]) if f"{run}/config.json" in files else here
    keys = sorted(k for k in here.keys() | theirs.keys() if here.get(k) != theirs.get(k))
    return f"another config here: {', '.join(keys[:5])} differ" if keys else ""


def read_archive(archive: Path) -> dict[PurePosixPath, Files]:
    """The archive's runs and their files (empty when there is no archive).

    Raises:
        ArchiveError: naming the archive when it cannot be read or holds a foreign member.
    """
    if not archive.exists():
        return {}
    runs: dict[PurePosixPath, Files] = {}
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            for member in tar.getmembers():
                if not member.isfile():
                    raise ArchiveError(f"refusing member {member.name!r}: not a regular file")
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                files = runs.setdefault(run_of(member.name), {})
                files[member.name] = (source.read(), float(member.mtime))
    except (OSError, EOFError, tarfile.TarError) as e:
        raise ArchiveError(f"cannot read it ({type(e).__name__}: {e})") from None
    for run, files in runs.items():
        if f"{run}/checkpoint.pt" not in files:
            raise ArchiveError(f"its run {run} has no checkpoint.pt")
        for name, (data, _) in files.items():
            if why := unreadable_file(name, data):
                raise ArchiveError(f"its {name} cannot be read ({why})")
    return runs


def unreadable_file(name: str, data: bytes) -> str:
    """Why a run's file ``name`` holding ``data`` cannot be read back ('' when it can): a
    checkpoint torch cannot load, a ``.json`` (config.json, the DP ledger) that is no object."""
    try:
        if name.endswith("/checkpoint.pt"):
            checkpoint_round(data)
        elif name.endswith(".json") and not isinstance(json.loads(data), dict):
            raise ValueError("not a JSON object")
    except Exception as e:  # torch.load raises many kinds
        return unreadable(e)
    return ""


def local_files(root: Path, folder: Path) -> Files:
    """A run folder's resumable files, the checkpoint read first (rows past it are dropped on
    resume)."""
    paths = [folder / "checkpoint.pt", folder / "config.json", folder / "metrics.jsonl"]
    if (folder / LEDGER).is_file():  # a DP run's repeated releases: ε must go on counting them
        paths.append(folder / LEDGER)
    paths += sorted(p for p in (folder / "client_states").glob("*") if p.is_file())
    return {p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime) for p in paths}


def _round(files: Files) -> int:
    ckpt = next(data for name, (data, _) in files.items() if name.endswith("/checkpoint.pt"))
    return checkpoint_round(ckpt)


def pack(root: Path) -> tuple[int, list[Path]]:
    """Update ``root/in-progress.tar.gz`` (atomically); (the runs it holds, the runs left out).

    Raises:
        ArchiveError: when the archive there cannot be read (nothing is written).
    """
    archive = root / ARCHIVE
    runs = read_archive(archive)
    left_out: list[Path] = []
    for run in list(runs):
        if (root / run / "summary.json").exists():
            if why := config_differs(root / run, runs[run], run):  # another table's progress
                print(f"kept the archived copy ({why}, finished: move it away to go on): {run}")
                continue
            print(f"finished here, dropped from the archive: {run}")
            del runs[run]
    for folder in unfinished(root):
        run = PurePosixPath(folder.relative_to(root).as_posix())
        if any((folder / "client_states").glob("*")) and training(folder):
            print(f"left out (still training, client states spilled to disk): {run}")
            left_out.append(folder)
            continue
        if not all((folder / f).is_file() for f in ("config.json", "metrics.jsonl")):
            print(f"left out (no config.json or metrics.jsonl beside the checkpoint): {run}")
            left_out.append(folder)
            continue
        try:
            missing = spilled_elsewhere(folder)
        except Exception as e:  # torch.load raises many kinds
            print(f"left out (its checkpoint.pt cannot be read: {unreadable(e)}): {run}")
            left_out.append(folder)
            continue
        if missing:
            print(
                f"left out ({len(missing)} spilled client states its checkpoint names are not in "
                f"its client_states/, e.g. {missing[0]}: store.spill_dir keeps them elsewhere; "
                f"resume it on this machine, or run it without store.spill_dir): {run}"
            )
            left_out.append(folder)
            continue
        if run in runs and (why := config_differs(folder, runs[run], run)):
            print(f"left out, the archived copy kept ({why}; move one of them away): {run}")
            left_out.append(folder)
            continue
        files = local_files(root, folder)
        # one the archive could not be read back with: every later pack and unpack refused it
        torn = [(n, why) for n, (d, _) in files.items() if (why := unreadable_file(n, d))]
        if torn:
            print(f"left out (its {torn[0][0]} cannot be read: {torn[0][1]}): {run}")
            left_out.append(folder)
            continue
        here = _round(files)
        if run in runs and (archived := _round(runs[run])) > here:
            print(f"kept the archived copy (round {archived}; round {here} here): {run}")
            continue
        runs[run] = files
        print(f"packed {run} (after round {here})")
    if not runs:
        if archive.exists() and not left_out:
            archive.unlink()
            print(f"no unfinished run under {root}: removed {archive}")
        elif not left_out:
            print(f"no unfinished run under {root}: nothing to pack")
        return 0, left_out
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for run in sorted(runs):
            for name, (data, mtime) in sorted(runs[run].items()):
                info = tarfile.TarInfo(name)
                info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
                tar.addfile(info, io.BytesIO(data))
    write_bytes(archive, buf.getvalue())
    print(f"{archive}: {len(runs)} unfinished run(s), {archive.stat().st_size / 1e6:.2f} MB")
    return len(runs), left_out


def own_releases(folder: Path, files: Files) -> int:
    """DP releases this machine's attempt of a run made that the archived copy does not hold
    (its ``metrics.jsonl`` rows with ``dp_epsilon`` not among the archive's rows, plus its own
    ledger's count): they were released, so restoring the archive over them must keep them in
    the ledger (a resume then counts them in ε)."""
    metrics = folder / "metrics.jsonl"
    if not metrics.is_file():
        return 0
    archived = next((d for n, (d, _) in files.items() if n.endswith("/metrics.jsonl")), b"")
    theirs = set(archived.decode("utf-8", "replace").splitlines())
    mine = [line for line in metrics.read_text("utf-8", "replace").splitlines() if line.strip()]
    new = sum(1 for line in mine if line not in theirs and '"dp_epsilon"' in line)
    ledger = folder / LEDGER
    same = next((d for n, (d, _) in files.items() if n.endswith(f"/{LEDGER}")), None)
    if not ledger.is_file() or ledger.read_bytes() == same:  # none, or the archive's own
        return new
    try:
        return new + repeated(folder)
    except ValueError:  # a damaged ledger here: its rows still count
        return new


def with_ledger(files: Files, run: PurePosixPath, extra: int) -> Files:
    """``files`` whose ``dp_ledger.json`` counts ``extra`` more repeated releases."""
    name = f"{run}/{LEDGER}"
    total = extra
    if name in files:
        total += int(json.loads(files[name][0])["repeated_exchanges"])
    data = json.dumps({"repeated_exchanges": total}).encode()
    return {**files, name: (data, files.get(name, (b"", 0.0))[1] or time.time())}


def unpack(root: Path) -> int:
    """Restore the archive's runs that are not training, finished, another config's, damaged or
    further along here; how many were restored.

    Raises:
        ArchiveError: when the archive cannot be read (nothing is written).
    """
    restored = 0
    for run, files in sorted(read_archive(root / ARCHIVE).items()):
        folder = root / run
        archived = _round(files)
        if (folder / "summary.json").exists():
            print(f"kept as it is (finished here): {run}")
            continue
        if training(folder):
            print(f"kept as it is (training here now): {run}")
            continue
        if why := config_differs(folder, files, run):
            print(f"kept as it is ({why}; move it away to restore the archived one): {run}")
            continue
        if (folder / "checkpoint.pt").exists():
            try:
                here = checkpoint_round((folder / "checkpoint.pt").read_bytes())
            except Exception as e:  # torch.load raises many kinds
                print(
                    f"kept as it is (its checkpoint.pt here cannot be read: {unreadable(e)}; "
                    f"move it away to restore the archived round {archived}): {run}"
                )
                continue
            if here >= archived:
                print(f"kept as it is (round {here} here; archived: round {archived}): {run}")
                continue
            (folder / "checkpoint.pt").unlink()  # first: never a checkpoint beside other rows
        extra = own_releases(folder, files)  # DP rows made here that the archive lacks
        if extra:
            files = with_ledger(files, run, extra)
        # the checkpoint last: an unpack cut short leaves no checkpoint without its rows
        for name, (data, mtime) in sorted(files.items(), key=lambda f: f[0].endswith(".pt")):
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            write_bytes(target, data)
            os.utime(target, (mtime, mtime))
        restored += 1
        print(f"restored {run} (after round {archived})")
    if not restored:
        print(f"nothing to restore under {root}")
    return restored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("--root", type=Path, default=Path("experiments/runs"))
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"carry.py: no runs folder {args.root}", file=sys.stderr)
        return 2
    try:
        if args.action == "unpack":
            unpack(args.root)
            return 0
        _, left_out = pack(args.root)
    except ArchiveError as e:
        print(
            f"carry.py: {args.root / ARCHIVE}: {e}; nothing was written (restore it with "
            "`git checkout -- <it>`, or move it away to start those runs over)",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:  # each file is whole (written atomically); unpack: rows first
        print(
            f"carry.py: {args.action} interrupted; every file is whole: run it again",
            file=sys.stderr,
        )
        return 130
    except OSError as e:  # a failed read or write: each file is whole (written atomically)
        what = ADVICE.get(e.errno or 0, "fix the cause")
        print(f"carry.py: {args.action}: {e}; {what} and run it again", file=sys.stderr)
        return 2
    return 1 if left_out else 0


if __name__ == "__main__":
    sys.exit(main())
