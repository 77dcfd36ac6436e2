"""``scripts/flower_local_federation.sh`` when ``flwr run`` itself fails (the SuperLink killed
mid-run: Flower prints its connection error and exits 1): the script still ends with its own
line saying the run did not finish and where the logs are, and stops what it started. Stub
``flower-superlink`` / ``flower-supernode`` / ``flwr`` programs stand in for Flower (seconds,
not a deployment); before the fix ``set -e`` ended the script on ``flwr``'s status, silently."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SUPERLINK = f"""#!{sys.executable}
import os, socket, time
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(os.environ["BASE_PORT"])))
s.listen(8)
while True:
    s.accept()
"""
SUPERNODE = "#!/bin/sh\nexec sleep 120\n"
FLWR = "#!/bin/sh\necho 'Connection to the SuperLink is unavailable.' >&2\nexit 7\n"


def test_a_failing_flwr_run_still_ends_with_the_scripts_own_line(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (
        ("flower-superlink", SUPERLINK),
        ("flower-supernode", SUPERNODE),
        ("flwr", FLWR),
    ):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "BIN": str(bin_dir), "BASE_PORT": str(port)}
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "flower_local_federation.sh"), "2", "rounds=1",
         f"output_dir={tmp_path / 'runs'}"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "fedlore: the deployed run did not finish (flwr run exited with status 7; its error is "
        "above; logs in /tmp/fedlore-flower."
    ), out.stderr
    assert "results in" not in out.stdout
    work = Path(last.rsplit("logs in ", 1)[1].rstrip(")"))
    assert (work / "superlink.log").exists()  # a failed run keeps its logs
    pids = [int(p) for p in re.findall(r"(?:SuperLink|SuperNode \d+) pid (\d+)", out.stdout)]
    assert len(pids) == 3, out.stdout
    for pid in pids:  # every process the script started is stopped (and reaped)
        assert not Path(f"/proc/{pid}").exists(), pid
    subprocess.run(["rm", "-rf", str(work)], check=False)
