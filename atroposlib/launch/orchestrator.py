"""Run a :class:`~atroposlib.launch.plan.RunPlan` on a backend: start, supervise, stop.

The order and the rules are the same on every backend:

1. ``run-api``, then wait for its ``/health``;
2. every inference server copy, then wait for each one's ``/health`` (in parallel);
3. every environment worker, each given the API's URL and **every** inference server's URL;
4. the trainer (if the run has one).

While it runs, :meth:`Run.check` looks at every process: an environment worker that fails is
restarted, up to its ``max_restarts``; anything else that fails stops the run with its log's
tail (:class:`RunFailed`). An environment worker that exits 0 is done (it sent what the run
needed). The run ends when the trainer exits 0 (or, without a trainer, when every environment
worker is done, or on Ctrl-C); :meth:`Run.stop` then reads the API's final counts
(``run_summary.json``: accepted, served, queued, dropped by reason) and stops everything,
trainer first, API last.

A backend only knows how to start one component somewhere (:class:`Backend`); see
``atroposlib.launch.local``, ``.ray_backend`` and ``.slurm``.
"""

from __future__ import annotations

import json
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from atroposlib.launch.plan import Component, RunPlan, plan_run, server_entry
from atroposlib.launch.spec import RunSpec

__all__ = ["Backend", "Handle", "Run", "RunFailed", "ComponentState"]

logger = logging.getLogger("atropos-launch")


class RunFailed(RuntimeError):
    """A component failed for good (its log's tail is in the message)."""


class Handle(Protocol):
    """A started component, wherever it runs."""

    component: Component

    @property
    def url(self) -> str | None:
        """``http://host:port`` it listens on, if any."""

    @property
    def node(self) -> str:
        """Where it runs (host name or Ray node)."""

    @property
    def log_location(self) -> str:
        """Where its log is."""

    def poll(self) -> int | None:
        """Exit status, or None while running."""

    def stop(self) -> None:
        """Stop it and what it spawned."""

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log."""


class Backend(ABC):
    """Where components run. Subclasses implement :meth:`start`."""

    name = "backend"

    @abstractmethod
    def start(self, component: Component, ctx: dict[str, Any], extra_env: dict[str, str]) -> Handle:
        """Start ``component`` with placeholders from ``ctx`` and ``extra_env`` added to its
        environment; return without waiting for readiness."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the backend holds (called once, after every component stopped)."""


@dataclass
class ComponentState:
    """What the run knows about one component, for the status view."""

    component: Component
    handle: Handle | None = None
    state: str = "pending"  # pending, starting, ready, running, done, failed, stopped, restarting
    restarts: int = 0
    exit_code: int | None = None
    ready_s: float | None = None
    detail: str = ""
    history: list[str] = field(default_factory=list)


class Run:
    """One run of a run description on a backend (a context manager that stops everything).

    Args:
        spec: the run description.
        backend: where the components run.
        on_event: called with one line per event (started, ready, restarted, exited).
    """

    def __init__(self, spec: RunSpec, backend: Backend, on_event: Any = None) -> None:
        self.spec = spec
        self.plan: RunPlan = plan_run(spec)
        self.backend = backend
        self.api_key = spec.resolved_api_key()
        self.output = Path(self.plan.output)
        self.output.mkdir(parents=True, exist_ok=True)
        self.states: dict[str, ComponentState] = {
            c.name: ComponentState(c) for c in self.plan.components
        }
        self.ctx: dict[str, Any] = {"bind_host": self.plan.bind_host, "output": str(self.output)}
        self.on_event = on_event or (lambda line: logger.info("%s", line))
        self.started = time.monotonic()
        self.finished = False
        self.summary: dict[str, Any] | None = None
        self._stopped = False

    # ---------------------------------------------------------------------------- starting

    @property
    def extra_env(self) -> dict[str, str]:
        """What every component gets in its environment from the run."""
        return {"ATROPOS_API_KEY": self.api_key} if self.api_key else {}

    def headers(self) -> dict[str, str]:
        """Headers for requests to the API (the key, when the run has one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _start(self, component: Component) -> ComponentState:
        st = self.states[component.name]
        st.state = "starting"
        st.exit_code = None
        st.handle = self.backend.start(component, dict(self.ctx), self.extra_env)
        st.history.append(f"{time.strftime('%H:%M:%S')} started")
        self.on_event(f"{component.name}: started on {st.handle.node} (log: "
                      f"{st.handle.log_location})")  # fmt: skip
        return st

    def _wait_ready(self, states: list[ComponentState]) -> None:
        """Poll each one's health URL until 200; fail with its log if it exits or times out."""
        pending = {st.component.name: st for st in states if st.component.health_path}
        for st in states:
            if not st.component.health_path:
                st.state = "running"
        began = time.monotonic()
        # /health is open on every server the launcher starts; the key goes along regardless
        with httpx.Client(timeout=2.0, headers=self.headers()) as client:
            while pending:
                for name, st in list(pending.items()):
                    assert st.handle is not None
                    code = st.handle.poll()
                    if code is not None:
                        st.state, st.exit_code = "failed", code
                        raise RunFailed(
                            f"{name} exited with status {code} before it was ready. Log "
                            f"({st.handle.log_location}):\n{st.handle.log_tail()}"
                        )
                    url = f"{st.handle.url}{st.component.health_path}"
                    try:
                        ok = client.get(url).status_code == 200
                    except httpx.TransportError:
                        ok = False
                    if ok:
                        st.state, st.ready_s = "ready", time.monotonic() - began
                        self.on_event(f"{name}: ready at {st.handle.url} ({st.ready_s:.0f} s)")
                        del pending[name]
                    elif time.monotonic() - began > st.component.startup_timeout:
                        st.state = "failed"
                        raise RunFailed(
                            f"{name} did not answer {url} within "
                            f"{st.component.startup_timeout:.0f} s. Log "
                            f"({st.handle.log_location}):\n{st.handle.log_tail()}"
                        )
                if pending:
                    names = ", ".join(sorted(pending))
                    waited = time.monotonic() - began
                    if int(waited) % 30 == 0 and waited > 1:
                        logger.info("waiting for %s to answer /health (%.0f s)", names, waited)
                    time.sleep(0.5)

    def start_api(self) -> str:
        """Start run-api and wait for it; returns its URL."""
        st = self._start(self.plan.api)
        self._wait_ready([st])
        assert st.handle is not None and st.handle.url
        self.ctx["api_url"] = st.handle.url
        return st.handle.url

    def start_inference(self) -> list[str]:
        """Start every inference server copy, wait for all; returns their root URLs."""
        started = []
        for component in self.plan.inference:
            if component.external_url:
                st = self.states[component.name]
                st.state, st.detail = "external", component.external_url
                continue
            started.append(self._start(component))
        self._wait_ready(started)
        roots: list[str] = []
        synced: list[str] = []
        servers: list[dict[str, Any]] = []
        for component in self.plan.inference:
            st = self.states[component.name]
            if component.external_url:
                base = component.external_url.rstrip("/")
                root = base.removesuffix("/v1")
            else:
                assert st.handle is not None and st.handle.url
                root = st.handle.url
                base = root + component.url_suffix
            roots.append(root)
            if component.synced:
                synced.append(root)
            servers.append(
                server_entry(component.backend or component.kind, base, component.model_name)
            )
        self.ctx["inference_urls"] = ",".join(roots)
        self.ctx["synced_inference_urls"] = ",".join(synced)
        self.ctx["inference_url"] = roots[0] if roots else ""
        self.ctx["openai_servers"] = servers
        return roots

    def start_services(self) -> None:
        """The API and the inference servers, ready."""
        self.start_api()
        self.start_inference()

    def start_environments(self) -> None:
        """Every environment worker (they need the API and inference URLs)."""
        self.ctx.setdefault("openai_servers", [])
        for component in self.plan.environments:
            self._start(component).state = "running"

    def stop_environments(self) -> list[str]:
        """Stop every environment worker still running, keeping the API and the inference
        servers: once the trainer has taken its last step their rollouts are no longer needed,
        and on a small machine they would slow a final evaluation down. A stopped worker is not
        restarted or reported as failed. Returns the names of the workers it stopped."""
        stopped = []
        for component in reversed(self.plan.environments):
            st = self.states[component.name]
            if st.handle is None or st.state in ("done", "failed", "stopped"):
                continue
            st.state = "stopped"  # first: the supervisor leaves it alone from now on
            self._stop_one(component)
            stopped.append(component.name)
        return stopped

    def start_trainer(self) -> None:
        """The trainer, if the run has one."""
        if self.plan.trainer is not None:
            self._start(self.plan.trainer).state = "running"

    def start(self) -> Run:
        """Everything, in order."""
        self.start_services()
        self.start_environments()
        self.start_trainer()
        return self

    # --------------------------------------------------------------------------- supervising

    def check(self) -> bool:
        """Look at every process once; restart failed environment workers within their
        budget. Returns True when the run is over (the trainer finished, or every worker is
        done when there is no trainer).

        Raises:
            RunFailed: a component failed and may not be restarted.
        """
        for name, st in self.states.items():
            if st.handle is None or st.state in ("done", "failed", "stopped"):
                continue
            code = st.handle.poll()
            if code is None:
                continue
            st.exit_code = code
            role = st.component.role
            if code == 0 and role in ("env", "trainer"):
                st.state = "done"
                st.history.append(f"{time.strftime('%H:%M:%S')} exited 0")
                self.on_event(f"{name}: finished")
                continue
            tail = st.handle.log_tail()
            if role == "env" and st.restarts < st.component.max_restarts:
                st.restarts += 1
                st.history.append(f"{time.strftime('%H:%M:%S')} exited {code}, restarted")
                self.on_event(
                    f"{name}: exited with status {code}; restarting "
                    f"({st.restarts}/{st.component.max_restarts})"
                )
                st.handle.stop()
                self._start(st.component).state = "running"
                continue
            st.state = "failed"
            why = "" if role != "env" else f" after {st.restarts} restart(s)"
            raise RunFailed(
                f"{name} exited with status {code}{why}. Log ({st.handle.log_location}):\n{tail}"
            )
        trainer = self.states.get("trainer")
        if trainer is not None:
            self.finished = trainer.state == "done"
        else:
            envs = [s for s in self.states.values() if s.component.role == "env"]
            self.finished = bool(envs) and all(s.state == "done" for s in envs)
        return self.finished

    def wait(self, interval: float = 1.0, on_tick: Any = None) -> None:
        """Supervise until the run is over (:meth:`check`); ``on_tick`` runs each round."""
        while not self.check():
            if on_tick is not None:
                on_tick()
            time.sleep(interval)

    def api_numbers(self) -> dict[str, Any] | None:
        """The API's ``/metrics`` (JSON), or None when it does not answer."""
        url = self.ctx.get("api_url")
        if not url:
            return None
        try:
            r = httpx.get(f"{url}/metrics", params={"format": "json"}, headers=self.headers(),
                          timeout=3.0)  # fmt: skip
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    # ------------------------------------------------------------------------------ stopping

    def stop(self) -> dict[str, Any] | None:
        """Read the API's final counts, then stop everything (trainer and environments first,
        the API last); writes ``OUTPUT/run_summary.json``. Safe to call twice."""
        if self._stopped:
            return self.summary
        self._stopped = True
        order = [self.plan.trainer] if self.plan.trainer else []
        order += list(reversed(self.plan.environments))
        for component in order:
            self._stop_one(component)
        numbers = self.api_numbers()
        for component in [*reversed(self.plan.inference), self.plan.api]:
            self._stop_one(component)
        try:
            self.backend.close()
        finally:
            self.summary = self._write_summary(numbers)
        return self.summary

    def _stop_one(self, component: Component) -> None:
        st = self.states[component.name]
        if st.handle is None:
            return
        try:
            st.handle.stop()
        except Exception as exc:  # noqa: BLE001 - stopping must go on for the others
            logger.warning("stopping %s: %s", component.name, exc)
        if st.state not in ("done", "failed"):
            st.state = "stopped"

    def _write_summary(self, numbers: dict[str, Any] | None) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "name": self.plan.name,
            "backend": self.backend.name,
            "seconds": round(time.monotonic() - self.started, 1),
            "finished": self.finished,
            "components": {
                name: {
                    "state": st.state,
                    "restarts": st.restarts,
                    "exit_code": st.exit_code,
                    "node": st.handle.node if st.handle else None,
                }  # fmt: skip
                for name, st in self.states.items()
            },
        }
        if numbers is not None:
            summary["api"] = {
                k: numbers.get(k)
                for k in (
                    "accepted_groups",
                    "accepted_sequences",
                    "batches_served",
                    "groups_served",
                    "sequences_served",
                    "queue_groups",
                    "buffered_groups",
                    "dropped",
                    "refused",
                    "step",
                )  # fmt: skip
            }
        (self.output / "run_summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
