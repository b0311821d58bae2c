"""The ``local`` backend: every component is a process on this machine."""

from __future__ import annotations

import socket
from typing import Any

from atroposlib.launch.orchestrator import Backend
from atroposlib.launch.plan import Component
from atroposlib.launch.runner import HostProcess

__all__ = ["LocalBackend", "LocalHandle"]


class LocalHandle:
    """A component started on this machine (a :class:`HostProcess`)."""

    def __init__(self, proc: HostProcess) -> None:
        self.proc = proc
        self.component = proc.component

    @property
    def url(self) -> str | None:
        """``http://host:port`` it listens on."""
        return self.proc.url

    @property
    def node(self) -> str:
        """This machine's name."""
        return socket.gethostname()

    @property
    def log_location(self) -> str:
        """Its log file."""
        return str(self.proc.log_path)

    @property
    def pid(self) -> int | None:
        """Its process id."""
        return self.proc.pid

    def poll(self) -> int | None:
        """Exit status, or None while running."""
        return self.proc.poll()

    def stop(self) -> None:
        """Stop it and what it spawned."""
        self.proc.stop()

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log file."""
        return self.proc.log_tail(chars)


class LocalBackend(Backend):
    """Processes on this machine, owned by the launcher (stopped with it, even on SIGKILL:
    see :mod:`atroposlib.utils.processes`). Resources (cpus, gpus) are not enforced."""

    name = "local"

    def start(
        self, component: Component, ctx: dict[str, Any], extra_env: dict[str, str]
    ) -> LocalHandle:
        """Start ``component`` here."""
        return LocalHandle(HostProcess(component, ctx, extra_env).start())
