"""A real single-node Slurm cluster for tests: slurmctld and slurmd from Debian's ``slurm-wlm``,
started as this process's children on free ports, with their state in a temporary folder.

No munge and no systemd/cgroups are needed: Slurm 22.05 (Debian 12) still ships ``auth/none``
and ``cred/none``, processes are tracked by ``proctrack/linuxproc`` and tasks are not bound
(``task/none``). Both daemons run as root (``SlurmUser=root``), which is what a CI container
gives us. Clients (sbatch, srun, squeue, scontrol, scancel) find the cluster through the
``SLURM_CONF`` environment variable: :meth:`SlurmCluster.environ` returns it.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from atroposlib.utils.processes import ChildProcess

DAEMONS = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def missing_tools() -> list[str]:
    """What this machine lacks to run the cluster: Slurm programs (``slurm-wlm``), root."""
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if os.geteuid() != 0:
        missing.append("root (slurmd runs jobs as their user)")
    return missing


class SlurmCluster:
    """One node (this host, ``cpus`` CPUs) in one partition ``debug``.

    Args:
        root: folder for the config, state, spool and daemon logs.
        cpus: CPUs the node advertises (at most what the machine has is safest).
    """

    def __init__(self, root: Path, cpus: int = 2) -> None:
        self.root = Path(root)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.partition = "debug"
        self.conf = self.root / "slurm.conf"
        self.procs: list[ChildProcess] = []

    def environ(self) -> dict[str, str]:
        """``os.environ`` plus ``SLURM_CONF`` pointing at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        """Write slurm.conf (free ports, state folders under :attr:`root`)."""
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        r = self.root
        lines = [
            "ClusterName=atropostest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/none",
            "CredType=cred/none",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "ReturnToService=2",
            "JobCompType=jobcomp/none",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "KillWait=5",
            "MinJobAge=300",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 "
            "State=UNKNOWN",
            f"PartitionName={self.partition} Nodes={self.node} Default=YES MaxTime=INFINITE "
            "State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Start slurmctld, then slurmd; wait until the node is idle."""
        self.write_conf()
        for daemon in ("slurmctld", "slurmd"):
            argv = [daemon, "-D", "-f", str(self.conf)]
            if daemon == "slurmctld":
                argv.append("-c")  # a clean state: job ids from 1
            else:
                argv += ["-N", self.node]
            # owned children: stopped with their session even if the test process is killed
            self.procs.append(
                ChildProcess(
                    daemon,
                    argv,
                    self.root / "log" / f"{daemon}.out",
                    env={"SLURM_CONF": str(self.conf)},
                ).start()
            )
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            for proc in self.procs:
                if not proc.running:
                    self.stop()
                    raise RuntimeError(f"{proc.name} exited:\n{self.logs()}")
            state = self.node_state()
            if state.startswith("idle"):
                return self
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"node not idle after {timeout:.0f} s (state {state!r}):\n{self.logs()}")

    def node_state(self) -> str:
        """The node's state as sinfo shows it (idle, alloc, mix, down*...), '' if unknown."""
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], env=self.environ(), capture_output=True, text=True
        )
        return out.stdout.strip() if out.returncode == 0 else ""

    def jobs(self) -> list[str]:
        """Ids of the jobs squeue lists (pending, running, completing)."""
        out = subprocess.run(
            ["squeue", "-h", "-o", "%i"], env=self.environ(), capture_output=True, text=True
        )
        return out.stdout.split()

    def logs(self, chars: int = 4000) -> str:
        """The daemons' log tails."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "slurmctld.out", "slurmd.out"):
            path = self.root / "log" / name
            if path.exists():
                parts.append(f"--- {name}\n{path.read_text(errors='replace')[-chars:]}")
        return "\n".join(parts)

    def stop(self) -> None:
        """Cancel every job, wait for them to go, then stop both daemons."""
        if self.procs and all(proc.running for proc in self.procs):
            subprocess.run(["scancel", "-p", self.partition], env=self.environ(),
                           capture_output=True)  # fmt: skip
            deadline = time.monotonic() + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.5)
        for proc in reversed(self.procs):  # slurmd first, then slurmctld
            proc.stop(timeout=15)
        self.procs.clear()
