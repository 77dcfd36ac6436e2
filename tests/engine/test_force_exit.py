"""A second signal's forced exit (:func:`fedlore.engine.interrupt.force_exit`) kills what the
process started before anything else, and a slow hint cannot hold it up: the processes are
gone before the hint runs, and past ``HINT_WAIT`` the line ends without the hint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import os, signal, subprocess, sys, time
    from fedlore.engine import interrupt

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(sys.argv[1], "w").write(str(child.pid))
    time.sleep(0.3)

    def state():
        return open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0]

    def hint():
        # the child must be dead (killed, or a zombie waiting for us) when the hint runs: a
        # SIGKILL is delivered when the child is next scheduled, so on a loaded machine it can
        # still be running for a moment; it dies within 0.8 s only if it was killed before
        # (a kill after the hint leaves it asleep in its time.sleep(60))
        end = time.monotonic() + 0.8
        while state() not in ("Z", "X") and time.monotonic() < end:
            time.sleep(0.01)
        seen = state()
        time.sleep(float(sys.argv[2]))
        return f"child state {seen}"

    interrupt.say_on_force_exit(hint)
    interrupt.force_exit(signal.SIGINT)
    """
)


def _force(tmp_path: Path, hint_sleep: float) -> tuple[int, str, float, int]:
    pid_file = tmp_path / "child.pid"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    t0 = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(pid_file), str(hint_sleep)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    return done.returncode, done.stderr, time.monotonic() - t0, int(pid_file.read_text())


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def test_the_kill_comes_before_the_hint(tmp_path: Path) -> None:
    rc, err, _, child = _force(tmp_path, 0.0)
    assert rc == 130, err
    line = err.split("SIGINT again: quitting now", 1)[1].splitlines()[0]
    assert line in ("; child state Z", "; child state X"), err  # killed before the hint ran
    assert _gone(child)


def test_a_slow_hint_does_not_hold_up_the_exit(tmp_path: Path) -> None:
    rc, err, took, child = _force(tmp_path, 30.0)
    assert rc == 130, err
    assert took < 15.0, (took, err)  # the hint alone would take 30 s
    assert "SIGINT again: quitting now\n" in err, err  # the line ends without the hint
    assert _gone(child)


def test_a_hint_that_raises_ends_the_line_without_it(tmp_path: Path) -> None:
    """A hint that raises (even ``KeyboardInterrupt``, which printed a thread's traceback) is
    no reason not to quit, nor to say more than the one line."""
    for error in ("ValueError('no config')", "KeyboardInterrupt()"):
        script = (
            "import signal\nfrom fedlore.engine import interrupt\n"
            f"def hint():\n    raise {error}\n"
            "interrupt.say_on_force_exit(hint)\ninterrupt.force_exit(signal.SIGTERM)\n"
        )
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env
        )
        assert done.returncode == 143, done.stderr
        assert done.stderr.strip() == "fedlore: SIGTERM again: quitting now", done.stderr
