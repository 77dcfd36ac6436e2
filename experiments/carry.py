"""Carry the unfinished runs of a long grid from one machine to the next, through git.

The seed-table grids of ``experiments/reruns.sh`` outlast one sitting. Their finished runs are
committed under ``experiments/runs/`` and reused anywhere, but a run in progress keeps its
checkpoint out of git (``experiments/runs/.gitignore``), so a fresh clone trains it again from
its first round: on two cores that is up to two hours lost per run a sitting leaves open.

``pack`` writes the resumable files of every unfinished run under ROOT (a ``seed-*`` folder with
a ``checkpoint.pt`` and no ``summary.json``: its ``config.json``, ``metrics.jsonl``,
``checkpoint.pt`` and spilled ``client_states/``) into one archive, ``ROOT/in-progress.tar.gz``,
to commit; with none left it removes the archive. ``unpack`` (the first step of
``experiments/reruns.sh``) restores each run of the archive whose folder has neither a
``summary.json`` nor a ``checkpoint.pt``, so the queue's ``--resume`` continues it after the packed
round and reaches the result an uninterrupted run reaches; a run that finished or got further
here is left as it is.

Pack after stopping the queue (Ctrl-C): a run still training is packed too (its checkpoint is
read before its rows, and a resume drops rows past the checkpoint), except one whose client
states are spilled to disk, which could change under the copy; it is named and left out.

    python experiments/carry.py pack   [--root experiments/runs]
    python experiments/carry.py unpack [--root experiments/runs]
"""

from __future__ import annotations

import argparse
import fcntl
import io
import os
import sys
import tarfile
from pathlib import Path

from fedlore.atomic import write_bytes

ARCHIVE = "in-progress.tar.gz"
FILES = ("config.json", "metrics.jsonl", "checkpoint.pt")
"""What a resumed run reads, besides the spilled client states (``client_states/``)."""


def unfinished(root: Path) -> list[Path]:
    """The run folders under ``root`` with a checkpoint and no ``summary.json``, sorted."""
    return sorted(
        ckpt.parent
        for ckpt in root.rglob("checkpoint.pt")
        if ckpt.parent.name.startswith("seed-") and not (ckpt.parent / "summary.json").exists()
    )


def training(folder: Path) -> bool:
    """Whether a process holds the run's ``run.lock`` (:class:`fedlore.engine.lock.RunLock`)."""
    lock = folder / "run.lock"
    if not lock.exists():
        return False
    with open(lock, "a") as fd:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(mtime), 0o644
    tar.addfile(info, io.BytesIO(data))


def pack(root: Path) -> int:
    """Write ``root/in-progress.tar.gz`` (atomically); the number of runs it holds."""
    runs, buf = [], io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for folder in unfinished(root):
            spilled = sorted((folder / "client_states").glob("*"))
            if spilled and training(folder):
                print(f"left out (still training, client states spilled to disk): {folder}")
                continue
            # the checkpoint before the rows: rows past its round are dropped on resume
            members = [folder / "checkpoint.pt", folder / "config.json", folder / "metrics.jsonl"]
            members += [p for p in spilled if p.is_file()]
            if not all(p.is_file() for p in members):
                print(f"left out (no config.json or metrics.jsonl beside the checkpoint): {folder}")
                continue
            for path in members:
                _add(
                    tar, path.relative_to(root).as_posix(), path.read_bytes(), path.stat().st_mtime
                )
            runs.append(folder)
    archive = root / ARCHIVE
    if not runs:
        if archive.exists():
            archive.unlink()
            print(f"no unfinished run under {root}: removed {archive}")
        else:
            print(f"no unfinished run under {root}: nothing to pack")
        return 0
    write_bytes(archive, buf.getvalue())
    for folder in runs:
        print(f"packed {folder.relative_to(root)}")
    print(f"{archive}: {len(runs)} unfinished run(s), {archive.stat().st_size / 1e6:.2f} MB")
    return len(runs)


def unpack(root: Path) -> int:
    """Restore the archive's runs whose folders have no summary and no checkpoint; how many."""
    archive = root / ARCHIVE
    if not archive.exists():
        print(f"no {archive}: nothing to restore")
        return 0
    restored = 0
    with tarfile.open(archive, mode="r:gz") as tar:
        by_run: dict[Path, list[tarfile.TarInfo]] = {}
        for member in tar.getmembers():
            rel = Path(member.name)
            if not member.isfile() or rel.is_absolute() or ".." in rel.parts:
                raise SystemExit(f"{archive}: refusing member {member.name!r}")
            run = rel.parent.parent if rel.parent.name == "client_states" else rel.parent
            by_run.setdefault(run, []).append(member)
        for run, members in sorted(by_run.items()):
            folder = root / run
            if (folder / "summary.json").exists() or (folder / "checkpoint.pt").exists():
                print(f"kept as it is (finished or further along here): {run}")
                continue
            # the checkpoint last: an unpack cut short leaves no checkpoint without its rows
            for member in sorted(members, key=lambda m: m.name.endswith("/checkpoint.pt")):
                source = tar.extractfile(member)
                assert source is not None  # a regular file
                target = root / member.name
                target.parent.mkdir(parents=True, exist_ok=True)
                write_bytes(target, source.read())
                os.utime(target, (member.mtime, member.mtime))
            restored += 1
            print(f"restored {run}")
    return restored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("pack", "unpack"))
    parser.add_argument("--root", type=Path, default=Path("experiments/runs"))
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"carry.py: no runs folder {args.root}", file=sys.stderr)
        return 2
    (pack if args.action == "pack" else unpack)(args.root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
