"""A real Ray cluster of two nodes on this machine, for the Ray backend's tests.

``ray start --head`` and a second ``ray start --address=HEAD`` (a worker node with a custom
resource ``node2`` so a test can place things on it), both on 127.0.0.1 with every port chosen
free, no dashboard, a small object store, and their own temp folder. :meth:`RayCluster.stop`
ends exactly the processes these two commands started (found by that temp folder in their
command lines, plus their process groups), never other Ray instances on the machine.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RayCluster:
    """A head node and one worker node (``node2`` resource) of Ray, on 127.0.0.1.

    Args:
        head_cpus: logical CPUs of the head node.
        node2_cpus: logical CPUs of the second node.
    """

    def __init__(self, head_cpus: int = 3, node2_cpus: int = 3) -> None:
        # short: Ray's unix sockets live under it (paths are limited to ~107 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="rt", dir="/tmp")
        self.port = _free_port()
        self.head_ip, self.node2_ip = "127.0.0.2", "127.0.0.3"
        self.address = f"{self.head_ip}:{self.port}"
        self.head_cpus = head_cpus
        self.node2_cpus = node2_cpus
        # Ray's token authentication off, said explicitly to every node and every driver
        # (the test process, launchers it starts: :attr:`auth_env`): left unset, Ray picks a
        # mode from whether ~/.ray/auth_token exists, differently for a head and a joining
        # node, and a driver reads it when ray is imported.
        self.auth_env = {"RAY_AUTH_MODE": "disabled"}
        self.env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            **self.auth_env,
        }
        self.env.pop("RAY_ADDRESS", None)
        self.log = Path(self.temp_dir) / "ray-start.log"

    def _node_flags(self) -> list[str]:
        ports = {
            "--node-manager-port": _free_port(),
            "--object-manager-port": _free_port(),
            "--metrics-export-port": _free_port(),
            "--runtime-env-agent-port": _free_port(),
            "--dashboard-agent-listen-port": _free_port(),
            "--dashboard-agent-grpc-port": _free_port(),
        }
        flags = [f"--temp-dir={self.temp_dir}", "--object-store-memory=100000000",
                 "--disable-usage-stats"]  # fmt: skip
        return flags + [f"{k}={v}" for k, v in ports.items()]

    def _ray_start(self, *flags: str) -> None:
        with open(self.log, "ab") as log:
            # a session of its own: Ray's daemons must not share pytest's process group
            done = subprocess.run(
                [RAY, "start", *flags, *self._node_flags()],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=str(REPO),
                timeout=90,
                start_new_session=True,
            )
        if done.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{self.log.read_text()[-3000:]}")

    def start(self) -> RayCluster:
        """Start both nodes; returns once the second one has joined (on failure, what was
        started is stopped)."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        # Every node on a loopback address of its own (127.0.0.2, 127.0.0.3), so no traffic
        # leaves loopback: Ray turns 127.0.0.1 (and localhost) into the machine's outward
        # address, but keeps other 127.x addresses.
        self._ray_start("--head", f"--port={self.port}", f"--num-cpus={self.head_cpus}",
                        f"--node-ip-address={self.head_ip}", "--include-dashboard=false",
                        f"--dashboard-port={_free_port()}")  # fmt: skip
        self._ray_start(f"--address={self.address}", f"--node-ip-address={self.node2_ip}",
                        f"--num-cpus={self.node2_cpus}", '--resources={"node2": 100}')  # fmt: skip

    def _pids(self) -> set[int]:
        """Processes whose command line names this cluster's temp folder, and their
        descendants (Ray's workers rename themselves ``ray::...``)."""
        found, parents = set(), {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            if self.temp_dir.encode() in cmdline:
                found.add(int(entry.name))
        grew = True
        while grew:
            more = {pid for pid, ppid in parents.items() if ppid in found} - found
            found |= more
            grew = bool(more)
        return found

    def stop(self) -> None:
        """End this cluster's processes (SIGTERM, SIGKILL after 2 s), then delete its temp
        folder."""
        pids = self._pids()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + (2 if sig == signal.SIGTERM else 5)
            while time.monotonic() < deadline and self._pids() & pids:
                time.sleep(0.1)
            pids = self._pids() | (pids & self._pids())
        shutil.rmtree(self.temp_dir, ignore_errors=True)
