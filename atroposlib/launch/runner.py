"""Start one component on the host this code runs on (used by every backend).

:class:`HostProcess` picks the component's port on this host, writes its config files, fills in
its placeholders and starts it as an owned :class:`~atroposlib.utils.processes.ChildProcess`
with its log in ``OUTPUT/logs/NAME.log``. The local backend calls it directly; the Ray backend
calls it inside an actor on the chosen node; the Slurm backend runs
``python -m atroposlib.launch.runner`` as an ``srun`` step, which starts the component, writes
where it listens to a report file, and waits for it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from atroposlib.launch.plan import Component, env_config_data, render
from atroposlib.launch.spec import LOOPBACK
from atroposlib.utils.processes import ChildProcess

__all__ = ["HostProcess", "advertised_host", "free_port", "main"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as sock:
        sock.bind((host if host not in ("", "0.0.0.0") else "0.0.0.0", 0))
        return sock.getsockname()[1]


def advertised_host(bind_host: str) -> str:
    """The address other nodes reach a component bound to ``bind_host`` at."""
    if bind_host in LOOPBACK:
        return "127.0.0.1"
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:  # the address of the interface that routes outwards (no packet is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect(("10.255.255.255", 1))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class HostProcess:
    """One component running on this host.

    Args:
        component: what to run.
        ctx: the run's placeholder values (``api_url``, ``inference_urls``, ``output`` ...);
            ``host`` and ``port`` are added here.
        extra_env: environment variables on top of the component's (e.g. ATROPOS_API_KEY).
    """

    def __init__(
        self, component: Component, ctx: dict[str, Any], extra_env: dict[str, str] | None = None
    ) -> None:
        self.component = component
        bind = str(ctx.get("bind_host", "127.0.0.1"))
        self.host = str(ctx.get("node_host") or advertised_host(bind))
        self.port: int | None = None
        if component.port is not None:
            self.port = component.port or free_port("127.0.0.1" if bind in LOOPBACK else bind)
        self.ctx = {**ctx, "host": self.host, "port": self.port or "",
                    "name": component.name, "index": component.index}  # fmt: skip
        self.output = Path(str(ctx["output"]))
        self.log_path = self.output / "logs" / f"{component.name}.log"
        self.extra_env = dict(extra_env or {})
        self.child: ChildProcess | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str | None:
        """``http://host:port`` (plus the component's suffix, e.g. ``/v1``), if it listens."""
        if self.component.external_url:
            return self.component.external_url
        if self.port is None:
            return None
        return f"http://{self.host}:{self.port}"

    def start(self) -> HostProcess:
        """Write the config files and start the process (does not wait for readiness)."""
        for rel, data in self.component.files.items():
            path = self.output / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            import yaml

            content = (
                env_config_data(data, self.ctx)
                if isinstance(data, dict) and "openai_overrides" in data
                else render(data, self.ctx)
            )
            path.write_text(yaml.safe_dump(content, sort_keys=False))
        argv = [str(a) for a in render(self.component.argv, self.ctx)]
        env = {k: str(v) for k, v in render(self.component.env, self.ctx).items()}
        env.update(self.extra_env)
        # the run's key reaches an inference server the way that server reads it
        key = self.extra_env.get("ATROPOS_API_KEY", "")
        if key:
            for name in self.component.api_key_env:
                env[name] = key
            if self.component.api_key_flag:
                argv += [self.component.api_key_flag, key]
        self.child = ChildProcess(
            self.component.name,
            argv,
            self.log_path,
            env=env,
            cwd=self.component.cwd,
            secrets=[key],
        ).start()
        self.started_at = time.monotonic()
        return self

    def poll(self) -> int | None:
        """The exit status, or None while it runs."""
        if self.child is None or self.child.proc is None:
            return None
        return self.child.proc.poll()

    @property
    def pid(self) -> int | None:
        """The process id (None before start)."""
        return None if self.child is None or self.child.proc is None else self.child.proc.pid

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM it (and what it spawned), SIGKILL after ``timeout`` s."""
        return None if self.child is None else self.child.stop(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log."""
        return "(not started)" if self.child is None else self.child.log_tail(chars)


def main(argv: list[str] | None = None) -> None:
    """``python -m atroposlib.launch.runner``: start one component here, report where it
    listens, and wait for it (an ``srun`` step of the Slurm backend)."""
    parser = argparse.ArgumentParser(prog="python -m atroposlib.launch.runner")
    parser.add_argument("--component", required=True, help="the Component as JSON")
    parser.add_argument("--ctx", required=True, help="placeholder values as JSON")
    parser.add_argument(
        "--report", required=True, help="file to write {url, host, port, pid, node, slurm_step}"
    )
    args = parser.parse_args(argv)
    component = Component.model_validate_json(args.component)
    ctx = json.loads(args.ctx)
    proc = HostProcess(component, ctx, extra_env=_key_env())

    # The handler only interrupts the wait below: stopping the child from inside it would wait
    # on the Popen lock the interrupted wait() holds (15 + 10 s, then a traceback).
    def _interrupt(*_: object) -> None:
        raise _Stopped

    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        proc.start()
        report = Path(args.report)
        report.parent.mkdir(parents=True, exist_ok=True)
        tmp = report.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": proc.url, "host": proc.host, "port": proc.port,
                                   "pid": proc.pid, "node": socket.gethostname(),
                                   "slurm_step": os.environ.get("SLURM_STEP_ID")}))  # fmt: skip
        os.replace(tmp, report)
        assert proc.child is not None and proc.child.proc is not None
        code = proc.child.proc.wait()
    except _Stopped:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        proc.stop()
        sys.exit(143)
    proc.stop()
    sys.exit(code)


class _Stopped(Exception):
    """SIGTERM or SIGINT reached the runner."""


def _key_env() -> dict[str, str]:
    key = os.environ.get("ATROPOS_API_KEY")
    return {"ATROPOS_API_KEY": key} if key else {}


if __name__ == "__main__":
    main()
