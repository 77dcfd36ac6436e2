"""A Flower deployment on 127.0.0.1 (one SuperLink, N SuperNodes) for demos, tests and the
deployment benchmark: real ``flower-superlink`` / ``flower-supernode`` processes and
``flwr run`` of fedlore's app (``[tool.flwr.app]`` in ``pyproject.toml``). Every process it
starts is stopped by PID in :meth:`LoopbackFederation.close`. Insecure (no TLS) by design: it
only listens on loopback; see ``scripts/flower_local_federation.sh`` for the TLS and
node-authentication flags of a real deployment.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from fedlore.atomic import write_text

ROOT = Path(__file__).resolve().parents[3]
BIN = Path(sys.executable).parent
TASK_POLL_S = "0.2"
"""``FLWR_SUPEREXEC_TASK_POLL_INTERVAL`` of the deployment's processes (seconds; Flower: 1)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LoopbackFederation:
    """Processes of a loopback deployment, stopped by PID on :meth:`close`.

    Args:
        work: a fresh folder for ``FLWR_HOME``, the SuperLink database and the logs.
        num_nodes: SuperNodes, with ``partition-id`` 0..num_nodes-1.
        data_roots: site-local data (``flower.site_data``): SuperNode i gets
            ``data-root=data_roots[i]`` in its node config; None: every node takes its partition
            of the central data set.
        node_config: more ``key=value`` node-config entries per SuperNode (e.g.
            ``{1: "fault-drop-round=1"}``, :data:`fedlore.flower.secure.DROP_ROUND_KEY`).
    """

    def __init__(
        self,
        work: Path,
        num_nodes: int,
        data_roots: list[Path] | None = None,
        node_config: dict[int, str] | None = None,
    ) -> None:
        if data_roots is not None and len(data_roots) != num_nodes:
            raise ValueError(f"{len(data_roots)} data roots for {num_nodes} SuperNodes")
        self.work = work
        self.num_nodes = num_nodes
        self.data_roots = data_roots
        self.node_config = dict(node_config or {})
        self.port = _free_port()
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(work / "flwr"),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            # the SuperExecs of the SuperLink and SuperNodes ask for a new task (a ServerApp or
            # ClientApp process to start) every 0.2 s instead of Flower's 1 s
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": TASK_POLL_S,
        }
        (work / "flwr").mkdir(parents=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.superlink: subprocess.Popen[bytes] | None = None
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}

    def _start(self, args: list[str], log: str) -> subprocess.Popen[bytes]:
        out = (self.work / log).open("ab")
        p = subprocess.Popen(args, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        self.procs.append(p)
        return p

    def start_superlink(self) -> None:
        self.superlink = self._start(
            [
                str(BIN / "flower-superlink"),
                "--insecure",
                "--database",
                str(self.work / "state.db"),
                "--disable-runtime-dependency-installation",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
            ],
            "superlink.log",
        )
        write_text(
            self.work / "flwr" / "config.toml",
            '[superlink]\ndefault = "local"\n\n[superlink.local]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n',
        )

    def start_node(self, pid: int) -> None:
        node_config = f"partition-id={pid} num-partitions={self.num_nodes}"
        if self.data_roots is not None:
            node_config += f' data-root="{Path(self.data_roots[pid]).resolve()}"'  # TOML string
        if pid in self.node_config:
            node_config += " " + self.node_config[pid]
        self.nodes[pid] = self._start(
            [
                str(BIN / "flower-supernode"),
                "--insecure",
                "--superlink",
                f"127.0.0.1:{self.port}",
                "--host",
                "127.0.0.1",
                "--port",
                str(_free_port()),
                "--node-config",
                node_config,
            ],
            f"supernode-{pid}.log",
        )

    def wait_for_superlink(self, timeout: float = 120.0) -> None:
        """Return once the SuperLink accepts connections on its port (its API is served then).

        Raises:
            RuntimeError: when the SuperLink exited or did not listen within ``timeout`` seconds
                (with the end of its log), or was not started (:meth:`start_superlink`).
        """
        link = self.superlink
        if link is None:
            raise RuntimeError("the SuperLink was not started")
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1.0).close()
                return
            except OSError:
                pass
            if link.poll() is not None or time.monotonic() > deadline:
                log = (self.work / "superlink.log").read_text(errors="replace")[-3000:]
                state = "exited" if link.poll() is not None else f"not listening after {timeout} s"
                raise RuntimeError(f"the SuperLink {state}:\n{log}")
            time.sleep(0.1)

    def start(self) -> None:
        """Start the SuperLink and, once it listens, every SuperNode. Returns without waiting
        for the SuperNodes to connect: a ServerApp waits ``flower.wait_for_nodes_s`` for
        ``num_clients`` of them."""
        self.start_superlink()
        self.wait_for_superlink()
        for pid in range(self.num_nodes):
            self.start_node(pid)

    def app_dir(self) -> Path:
        """The folder ``flwr run`` packs as the app: fedlore's ``pyproject.toml`` alone (its
        ``[tool.flwr.app]``). Every process of this deployment imports fedlore from this
        environment, so the app needs no other file, and ``flwr run`` on the project itself
        would walk every file of the checkout, a ``.venv`` inside it included, before keeping
        the few it packs (about 10 s on two cores)."""
        app = self.work / "app"
        if not app.is_dir():
            app.mkdir()
            shutil.copy(ROOT / "pyproject.toml", app / "pyproject.toml")
        return app

    def submit(
        self, config: Path, method: str, seed: int, overrides: str, resume: bool = False
    ) -> None:
        """``flwr run`` of fedlore's app (:meth:`app_dir`) with this config (returns once the
        run is submitted); ``resume``: the run config's ``resume=true``, continuing the run's
        folder from its checkpoint.

        Raises:
            RuntimeError: with flwr's output when the submission fails.
        """
        run_config = (
            f"config='{Path(config).resolve()}' method='{method}' seed={seed} "
            f"overrides='{overrides}'" + (" resume=true" if resume else "")
        )
        res = subprocess.run(
            [str(BIN / "flwr"), "run", str(self.app_dir()), "local", "--run-config", run_config],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if res.returncode != 0:
            raise RuntimeError(f"flwr run failed:\n{res.stdout}\n{res.stderr}")

    def kill_node(self, pid: int) -> None:
        self.nodes[pid].send_signal(signal.SIGKILL)
        self.nodes[pid].wait(timeout=30)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
