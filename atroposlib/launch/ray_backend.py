"""The ``ray`` backend: every component is a process started by a Ray actor on a node Ray picks.

``atropos-launch RUN.yaml --backend ray`` connects to ``ray.address`` of the run description,
else to ``RAY_ADDRESS``, else starts a local Ray for the run (stopped at the end). Each component
(run-api, each inference server copy, each environment worker, the trainer) is one
:class:`ComponentActor`:

* **Placement.** Each component group (``run-api``, an ``inference`` entry's copies, an
  environment's workers, the trainer) gets one placement group with one bundle per copy:
  ``{CPU: cpus, GPU: gpus, **resources}``. Groups of several copies use the ``SPREAD``
  strategy (copies go to different nodes where the cluster has room, so a run's environment
  workers spread over the CPU nodes and its inference copies over the GPU nodes); single
  components use ``PACK``. Creating a group waits for the cluster to have room and fails
  with what it asked for and what the cluster has, rather than leaving a run half started.
  ``resources`` (e.g. ``{env_pool: 1}``) place a group on nodes started with
  ``ray start --resources='{"env_pool": 100}'``.
* **The process.** The actor (holding the reservation) starts the component with
  :class:`~atroposlib.launch.runner.HostProcess` on its node: a free port there, config files
  and its log ``OUTPUT/logs/NAME.log`` written on that node, reached at the node's IP (or at
  127.0.0.1 when ``bind_host`` is loopback). The process inherits the Ray worker's
  environment: ``CUDA_VISIBLE_DEVICES`` for the GPUs Ray assigned, and ``OMP_NUM_THREADS``
  as Ray sets it for the reserved CPUs. ``ATROPOS_API_KEY`` is passed to each component.
* **Failures.** :meth:`RayHandle.poll` reports the process's exit status, or
  :data:`ACTOR_LOST` when the actor itself is gone (its node died, or someone killed it): the
  orchestrator then restarts an environment worker within its ``max_restarts`` budget in a new
  actor, which Ray places again (in the same placement-group bundle, which Ray moves to a live
  node when the old one is lost). If an actor dies, its process goes with it
  (:mod:`atroposlib.utils.processes`' reaper); the actors belong to the launcher, so a
  launcher that dies takes the run with it.
* **Logs.** Each log stays on its node; :meth:`RayHandle.log_tail` reads it through the actor
  (shown when a component fails), and ``log_location`` says ``NODE_IP (node id):PATH``.

Every node must have the same installation as the launcher: the components run with the
launcher's Python interpreter path (``sys.executable``, or an entry's ``python``), and the
actor code is imported from ``atroposlib`` on the node. No ``runtime_env`` is used (installing
torch or vLLM per job would take minutes); a shared filesystem for the output folder is
convenient (logs and checkpoints in one place) but not required.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import time
from collections import Counter
from pathlib import Path
from typing import Any

from atroposlib.launch.orchestrator import Backend, RunFailed
from atroposlib.launch.plan import Component, plan_run
from atroposlib.launch.runner import HostProcess
from atroposlib.launch.spec import LOOPBACK, RunSpec
from atroposlib.utils.processes import ProcessLaunchError

__all__ = ["ACTOR_LOST", "ComponentActor", "RayBackend", "RayHandle"]

logger = logging.getLogger("atropos-launch")

#: Exit status :meth:`RayHandle.poll` reports when the actor (or its node) is gone.
ACTOR_LOST = 255

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as exc:  # pragma: no cover - exercised by a core install
    raise ImportError("the ray backend needs Ray: pip install 'atroposlib[ray]'") from exc


class _ComponentActor:
    """Runs on a node: starts one component there and answers for it (see the module doc).

    Args:
        component: the component (``Component.model_dump()``).
        ctx: the run's placeholder values; ``node_host`` is set here to this node's address.
        extra_env: environment variables on top of the component's (ATROPOS_API_KEY).
    """

    def __init__(
        self, component: dict[str, Any], ctx: dict[str, Any], extra_env: dict[str, str]
    ) -> None:
        comp = Component.model_validate(component)
        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        bind = str(ctx.get("bind_host", "127.0.0.1"))
        ctx = {**ctx, "node_host": "127.0.0.1" if bind in LOOPBACK else self.node_ip}
        if comp.cwd and not Path(comp.cwd).is_dir():  # the launcher's folder is not here
            comp = comp.model_copy(update={"cwd": str(ctx["output"])})
        self.proc = HostProcess(comp, ctx, extra_env)

    def start(self) -> dict[str, Any]:
        """Start the process; where it runs and listens."""
        try:
            Path(str(self.proc.ctx["output"])).mkdir(parents=True, exist_ok=True)
            if self.proc.component.cwd:
                Path(self.proc.component.cwd).mkdir(parents=True, exist_ok=True)
            self.proc.start()
        except OSError as exc:  # e.g. the output folder is not writable on this node
            raise ProcessLaunchError(
                f"{self.proc.component.name}: {exc} (on the Ray node at {self.node_ip})"
            ) from None
        except ProcessLaunchError as exc:  # e.g. its Python is not installed on this node
            raise ProcessLaunchError(f"{exc} (on the Ray node at {self.node_ip})") from None
        return {
            "url": self.proc.url,
            "host": self.proc.host,
            "port": self.proc.port,
            "pid": self.proc.pid,
            "node_ip": self.node_ip,
            "node_id": self.node_id,
            "log_path": str(self.proc.log_path),
            "actor_pid": os.getpid(),
        }

    def poll(self) -> int | None:
        """The process's exit status, or None while it runs."""
        return self.proc.poll()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the process (and what it spawned), SIGKILL after ``timeout`` s."""
        return self.proc.stop(timeout)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the process's log on this node."""
        return self.proc.log_tail(chars)


#: The actor class (``max_concurrency`` > 1: a slow ``stop`` never blocks ``poll``).
ComponentActor = ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)(_ComponentActor)


class RayHandle:
    """A component started by a :class:`ComponentActor`; every call goes through the actor.

    Args:
        component: what runs.
        actor: the actor's handle.
        info: what the actor's ``start`` returned (url, pid, node, log path).
        call_timeout: seconds to wait for the actor to answer one call.
    """

    def __init__(
        self, component: Component, actor: Any, info: dict[str, Any], call_timeout: float
    ) -> None:
        self.component = component
        self.actor = actor
        self.info = info
        self.call_timeout = call_timeout
        self.lost: str | None = None
        self._stopped = False

    @property
    def url(self) -> str | None:
        """``http://host:port`` it listens on (the node's address), if it listens."""
        return self.info.get("url")

    @property
    def node(self) -> str:
        """The Ray node: ``IP (first 8 hex digits of the node id)``."""
        return f"{self.info['node_ip']} ({self.info['node_id'][:8]})"

    @property
    def node_id(self) -> str:
        """The Ray node id (hex)."""
        return str(self.info["node_id"])

    @property
    def pid(self) -> int | None:
        """The process id on its node."""
        return self.info.get("pid")

    @property
    def actor_pid(self) -> int:
        """The actor's (Ray worker's) process id on its node."""
        return int(self.info["actor_pid"])

    @property
    def log_location(self) -> str:
        """``NODE:PATH`` of its log file (readable through :meth:`log_tail`)."""
        return f"{self.node}:{self.info['log_path']}"

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout or
                       self.call_timeout)  # fmt: skip

    def poll(self) -> int | None:
        """Exit status, :data:`ACTOR_LOST` if the actor or its node is gone, None while it
        runs (or while the actor does not answer within ``call_timeout``)."""
        if self.lost is not None:
            return ACTOR_LOST
        try:
            return self._call("poll")
        except RayActorError as exc:
            self.lost = f"the Ray actor of {self.component.name} is gone ({_first_line(exc)})"
            logger.warning("%s", self.lost)
            return ACTOR_LOST
        except GetTimeoutError:
            logger.warning("%s: its actor did not answer within %.0f s", self.component.name,
                           self.call_timeout)  # fmt: skip
            return None

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL), then the actor. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if self.lost is None:
            try:
                self._call("stop", 15.0, timeout=30.0 + self.call_timeout)
            except (RayActorError, GetTimeoutError) as exc:
                logger.warning("stopping %s: %s", self.component.name, _first_line(exc))
        ray.kill(self.actor, no_restart=True)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of its log, read on its node through the actor (or here, when the actor
        is gone and the file is reachable from this machine)."""
        if self.lost is None:
            try:
                return self._call("log_tail", chars)
            except (RayActorError, GetTimeoutError) as exc:
                self.lost = self.lost or f"the actor does not answer ({_first_line(exc)})"
        path = Path(self.info["log_path"])
        try:
            text = path.read_text(errors="replace")[-chars:]
        except OSError:
            text = f"(log {self.log_location} is not reachable from this machine)"
        return f"[{self.lost}]\n{text}"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _check_address(address: str, where: str, timeout: float = 5.0) -> None:
    """Fail at once, naming ``where``, when nothing listens at a ``HOST:PORT`` address (Ray
    itself retries for minutes). Other forms (``auto``, ``ray://...``) are left to Ray."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RunFailed(
            f"{where} {address}: no Ray cluster answers there ({exc}). Start one with "
            "`ray start --head`, or fix the address."
        ) from None


def _schedulable(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and custom resources (not memory, node ids or placement-group bookkeeping,
    which Ray names ``NAME_group_[INDEX_]ID``)."""
    hidden = ("node:", "memory", "object_store_memory", "accelerator_type:")
    return {
        k: v
        for k, v in sorted(resources.items())
        if not k.startswith(hidden) and "_group_" not in k
    }


def _bundle(component: Component) -> dict[str, float]:
    bundle = {"CPU": float(component.cpus), **component.resources}
    if component.gpus:
        bundle["GPU"] = float(component.gpus)
    return {k: v for k, v in bundle.items() if v > 0}


class RayBackend(Backend):
    """Components as Ray actors (see the module docstring).

    Args:
        spec: the run description (``ray.address``, ``ray.namespace``, resources).
        placement_timeout: seconds to wait for the cluster to have room for a component group
            (default: the run description's ``ray.placement_timeout``).
        call_timeout: seconds to wait for an actor to answer ``poll`` / ``log_tail``.
    """

    name = "ray"

    def __init__(
        self,
        spec: RunSpec,
        *,
        placement_timeout: float | None = None,
        call_timeout: float = 30.0,
    ) -> None:
        self.spec = spec
        self.placement_timeout = placement_timeout or spec.ray.placement_timeout
        self.call_timeout = call_timeout
        self.started_local = False
        self._initialized_here = False
        plan = plan_run(spec)
        # copies per component group (external inference servers are never started)
        self._copies = Counter(c.group for c in plan.components if not c.external_url)
        self._groups: dict[str, Any] = {}
        self._handles: list[RayHandle] = []
        self._starts = 0
        #: names this run's actors and placement groups (several runs of one description may
        #: share a cluster and a namespace)
        self.run_id = f"{spec.name}-{secrets.token_hex(3)}"
        address = spec.ray.address or os.environ.get("RAY_ADDRESS") or None
        if ray.is_initialized():
            logger.info("ray backend: using the Ray this process is already connected to")
        elif address:
            _check_address(address, "ray.address" if spec.ray.address else "RAY_ADDRESS")
            ray.init(address=address, namespace=spec.ray.namespace, log_to_driver=False)
            self._initialized_here = True
        else:
            needed = sum(c.cpus for c in plan.components if not c.external_url)
            local: dict[str, Any] = {
                "address": "local",
                "namespace": spec.ray.namespace,
                "num_cpus": max(os.cpu_count() or 1, int(needed + 0.999)),
                "include_dashboard": False,
                "log_to_driver": False,
            }
            ray.init(**local)
            self._initialized_here = self.started_local = True
        self.address = address or "local"
        logger.info(
            "ray backend: %s, namespace %s, %d node(s), %s",
            "a local Ray started for the run" if self.started_local else f"cluster {address}",
            spec.ray.namespace,
            len([n for n in ray.nodes() if n.get("Alive")]),
            ray.cluster_resources(),
        )
        self._check_reachable(spec.bind_host)

    def _check_reachable(self, bind_host: str) -> None:
        """Loopback binding only works when every node is this machine."""
        if bind_host not in LOOPBACK:
            return
        here = ray.util.get_node_ip_address()
        ips = sorted(
            ip
            for ip in {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
            if ip != here and not ip.startswith("127.") and ip not in ("localhost", "::1")
        )
        if ips:
            self.close()
            raise RunFailed(
                f"bind_host is {bind_host} (loopback) but the Ray cluster has nodes on other "
                f"machines ({', '.join(ips)}): components there could not be reached. Set "
                "bind_host: 0.0.0.0 in the run description (an api_key is then made for the run)."
            )

    def _placement_group(self, component: Component) -> Any:
        """The component's group's placement group (created and waited for on first use)."""
        pg = self._groups.get(component.group)
        if pg is not None:
            return pg
        copies = max(self._copies.get(component.group, 1), component.index + 1)
        bundles = [_bundle(component) for _ in range(copies)]
        strategy = "SPREAD" if copies > 1 else "PACK"
        pg = placement_group(bundles, strategy=strategy,
                             name=f"{self.run_id}:{component.group}")  # fmt: skip
        try:
            ray.get(pg.ready(), timeout=self.placement_timeout)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise RunFailed(
                f"{component.group}: the Ray cluster has no room for {copies} x {bundles[0]} "
                f"within {self.placement_timeout:.0f} s (free now: "
                f"{_schedulable(ray.available_resources())}; in all: "
                f"{_schedulable(ray.cluster_resources())}). Lower its cpus/gpus/resources, or "
                "add nodes that have them."
            ) from None
        self._groups[component.group] = pg
        return pg

    def start(
        self, component: Component, ctx: dict[str, Any], extra_env: dict[str, str]
    ) -> RayHandle:
        """Start ``component`` in a new actor placed by Ray; returns once the process runs
        (not once it is ready)."""
        pg = self._placement_group(component)
        if component.cwd is None:  # as with the local backend: the launcher's folder
            component = component.model_copy(update={"cwd": os.getcwd()})
        self._starts += 1
        actor = ComponentActor.options(
            name=f"{self.run_id}:{component.name}:{self._starts}",
            num_cpus=component.cpus,
            num_gpus=component.gpus,
            resources=dict(component.resources) or None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=component.index
            ),
        ).remote(component.model_dump(), ctx, extra_env)
        try:
            info = ray.get(actor.start.remote(), timeout=self.placement_timeout)
        except GetTimeoutError:
            ray.kill(actor, no_restart=True)
            raise RunFailed(
                f"{component.name}: its Ray actor did not start within "
                f"{self.placement_timeout:.0f} s"
            ) from None
        except ray.exceptions.RayTaskError as exc:
            ray.kill(actor, no_restart=True)
            cause = str(exc.cause if isinstance(exc.cause, Exception) else exc)
            if not cause.startswith(f"{component.name}:"):
                cause = f"{component.name}: {cause}"
            raise ProcessLaunchError(cause) from None
        except RayActorError as exc:
            raise RunFailed(f"{component.name}: its Ray actor died at start: {exc}") from None
        handle = RayHandle(component, actor, info, self.call_timeout)
        self._handles.append(handle)
        return handle

    def close(self) -> None:
        """Kill every actor still alive, remove the placement groups, and disconnect (and
        stop the local Ray, if this backend started it)."""
        if not ray.is_initialized():
            return
        for handle in self._handles:
            try:
                ray.kill(handle.actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - the others must still go
                logger.debug("killing %s: %s", handle.component.name, exc)
        for pg in self._groups.values():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # noqa: BLE001
                logger.debug("removing a placement group: %s", exc)
        self._groups.clear()
        if self._initialized_here:
            # give the actors a moment to take their processes down before the raylet goes
            time.sleep(0.5 if self.started_local else 0.0)
            ray.shutdown()
