"""How the inference server gets the trainer's new weights: the weight-sync strategies.

Every strategy has ``start(model, policy_version=None)``, ``sync(checkpoint, policy_version=None)
-> seconds``, ``pause(mode)``/``resume()`` and ``close()``. ``policy_version`` is the trainer step
whose weights the server serves from then on; every server reports it at ``GET /policy_version``
(``{"policy_version": <int>}``) so environments can stamp the groups they sample with it.

- ``VLLMRestart`` (upstream's): stop vLLM, relaunch it on the new checkpoint under the same
  served model name, wait for ``/health``. Slow (a full start per sync) but works with any vLLM.
- ``VLLMReload``: the running vLLM loads the checkpoint in place through its own
  ``reload_weights`` (vLLM >= 0.2x, ``POST /collective_rpc`` with ``VLLM_SERVER_DEV_MODE=1``),
  between ``POST /pause?mode=wait`` and ``POST /resume``, and takes the version as its native
  weight version. Falls back to a restart when the server lacks those endpoints.
- ``VLLMWeightTransfer``: the trainer sends its tensors straight to vLLM's workers with vLLM's
  weight-transfer API (``--weight-transfer-config '{"backend": "nccl"}'``: ``/start_weight_update``,
  ``/update_weights``, ``/finish_weight_update``), no checkpoint read back from disk. GPUs only;
  see ``example_trainer.weight_transfer``.
- ``AtroposServeReload``: ``POST /reload_weights`` on a running ``atropos-serve``.
- ``SGLangReload``: ``POST /update_weights_from_disk`` on a running SGLang server.
- ``NoSync``: checkpoints only.

The vLLM strategies launch vLLM with ``--middleware atropos_policy_version.PolicyVersionMiddleware``
(``example_trainer/vllm_plugins``, put on the child's ``PYTHONPATH``), which serves
``GET /policy_version``. ``docs/compat.md`` ("Weight sync without a restart") explains the choice.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from example_trainer.inference_process import ChildProcess, InferenceLaunchError
from example_trainer.vllm_plugins import PLUGIN_DIR

if TYPE_CHECKING:
    from example_trainer.config import TrainingConfig

logger = logging.getLogger(__name__)

POLICY_VERSION_MIDDLEWARE = "atropos_policy_version.PolicyVersionMiddleware"
"""``--middleware`` value that gives vLLM ``GET /policy_version``."""
POLICY_VERSION_ENV = "ATROPOS_POLICY_VERSION"
"""Environment variable the middleware reports until vLLM's engine holds a version."""


class WeightSync:
    """How the inference server gets the trainer's new weights."""

    description = "none"
    outlives_trainer = True
    """Whether the server keeps running after the trainer exits (worth a final sync)."""
    policy_version: int | None = None
    """The version the server serves after the last ``start``/``sync`` (None: not told)."""

    def start(self, model: str, policy_version: int | None = None) -> None:
        """Bring the inference side up serving ``model`` (a folder or model id) as
        ``policy_version`` (the trainer step of those weights; 0 for the base model)."""
        self.policy_version = policy_version

    def attach(self, model: Any) -> None:
        """The model being trained, for strategies that send its tensors directly (the others
        ignore it)."""

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """Make the inference server serve ``checkpoint``, the weights of trainer step
        ``policy_version``; returns the seconds it took."""
        self.policy_version = policy_version
        return 0.0

    def close(self) -> None:
        """Stop whatever ``start`` launched."""

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
    """``PYTHONPATH`` for a vLLM child that can import ``example_trainer/vllm_plugins``."""
    current = (base if base is not None else os.environ).get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(PLUGIN_DIR), current) if p)}


def _request(
    method: str,
    url: str,
    what: str,
    *,
    timeout: float,
    ok: Callable[[httpx.Response], bool] = lambda r: r.status_code == 200,
    **kwargs: Any,
) -> httpx.Response:
    """One HTTP call to an inference server; ``InferenceLaunchError`` when it fails."""
    try:
        response = httpx.request(method, url, timeout=timeout, **kwargs)
    except httpx.TransportError as exc:
        raise InferenceLaunchError(f"{what}: {url} unreachable: {exc}") from exc
    if not ok(response):
        raise InferenceLaunchError(
            f"{what}: HTTP {response.status_code} from {url}: {response.text[:500]}"
        )
    return response


def _wait_healthy(url: str, timeout: float, hint: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise InferenceLaunchError(f"{url} is not healthy; {hint}")
        time.sleep(0.5)


class VLLMRestart(WeightSync):
    """Upstream's weight sync: stop the vLLM server, relaunch it on the new checkpoint.

    Args:
        build_command: ``model -> argv``; normally ``vllm_command`` with the config's flags. The
            served model name must stay the same across launches so environments keep working.
        url: the server's base URL (``/health`` is polled there).
        log_path: vLLM's log file (appended across restarts).
        startup_timeout: seconds to wait for ``/health`` after each launch.
        served_model_name: checked against ``/v1/models`` after each launch.
        env: extra environment variables for vLLM.
        policy_version_endpoint: add ``--middleware`` for ``GET /policy_version`` (and the plugin
            folder to ``PYTHONPATH``); each launch reports the version it was given.
    """

    description = "vLLM restart"
    outlives_trainer = False

    def __init__(
        self,
        build_command: Callable[[str], list[str]],
        url: str,
        log_path: str | os.PathLike[str],
        *,
        startup_timeout: float = 600.0,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        policy_version_endpoint: bool = True,
    ) -> None:
        self.build_command = build_command
        self.url = url.rstrip("/")
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.served_model_name = served_model_name
        self.env = dict(env or {})
        self.policy_version_endpoint = policy_version_endpoint
        self.process: ChildProcess | None = None
        self.launches = 0
        self.policy_version = None

    def command(self, model: str) -> list[str]:
        """The argv of one launch on ``model``."""
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

    def start(self, model: str, policy_version: int | None = None) -> None:
        """Launch vLLM on ``model`` and wait until it is healthy (and serves the right name)."""
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
            models = httpx.get(self.url + "/v1/models", timeout=10).json()
            names = [entry.get("id") for entry in models.get("data", [])]
        except (httpx.HTTPError, ValueError) as exc:
            raise InferenceLaunchError(f"vLLM /v1/models did not answer: {exc}") from exc
        if self.served_model_name not in names:
            self.close()
            raise InferenceLaunchError(
                f"vLLM serves {names}, not {self.served_model_name!r}; environments would fail"
            )

    def stop(self) -> None:
        """Stop the running vLLM (its GPU memory is free once this returns)."""
        if self.process is not None:
            self.process.stop()
            self.process = None

    def restart(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """Stop vLLM, relaunch it on ``checkpoint``, wait for ``/health``; seconds taken."""
        started = time.monotonic()
        self.stop()
        self.start(str(checkpoint), policy_version)
        return time.monotonic() - started

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """Stop vLLM, relaunch it on ``checkpoint``, wait for ``/health``; seconds taken."""
        return self.restart(checkpoint, policy_version)

    def close(self) -> None:
        self.stop()


class VLLMReload(VLLMRestart):
    """In-place weight update of a running vLLM from a checkpoint folder; no restart.

    The trainer launches vLLM as ``VLLMRestart`` does, with ``VLLM_SERVER_DEV_MODE=1`` (vLLM's RL
    and dev endpoints). Each sync is, over HTTP:

    1. ``POST /pause?mode=wait``: sequences already generating finish on the old weights;
       requests that arrive meanwhile wait in vLLM's queue (nothing is refused or lost); the
       prefix cache is cleared once drained. Skipped when the trainer already paused the server
       (``pause_generation``), whose mode then applies.
    2. ``POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}``:
       every worker reloads the checkpoint in place (vLLM's ``Worker.reload_weights``, the
       layerwise checkpoint-format reload, which also reprocesses kernel layouts).
    3. ``POST /reset_prefix_cache``: no cached key/values of the old weights survive.
    4. ``POST /update_weight_version {"new_version": "N"}``: vLLM's native weight version, which
       ``GET /policy_version`` reports, changes before any token of the new weights is produced.
    5. ``POST /resume``.

    If the server lacks an endpoint (an older vLLM, dev mode off) and ``fallback_to_restart`` is
    set, this sync and every later one restart vLLM instead, with a warning.
    """

    description = "vLLM in-place reload"

    def __init__(
        self,
        build_command: Callable[[str], list[str]],
        url: str,
        log_path: str | os.PathLike[str],
        *,
        startup_timeout: float = 600.0,
        served_model_name: str | None = None,
        env: Mapping[str, str] | None = None,
        policy_version_endpoint: bool = True,
        request_timeout: float = 600.0,
        fallback_to_restart: bool = True,
    ) -> None:
        super().__init__(
            build_command,
            url,
            log_path,
            startup_timeout=startup_timeout,
            served_model_name=served_model_name,
            env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
            policy_version_endpoint=policy_version_endpoint,
        )
        self.request_timeout = request_timeout
        self.fallback_to_restart = fallback_to_restart
        self.in_place = True
        """False once an in-place sync failed and syncs restart vLLM instead."""
        self.paused = False
        self.last_steps: dict[str, float] = {}
        """Seconds of each HTTP step of the last in-place sync."""

    def _post(self, path: str, what: str, **kwargs: Any) -> httpx.Response:
        return _request("POST", self.url + path, what, timeout=self.request_timeout, **kwargs)

    def pause(self, mode: str = "abort") -> None:
        """``POST /pause?mode=MODE``: nothing generates until :meth:`resume`."""
        self._post("/pause", "vLLM pause", params={"mode": mode})
        self.paused = True

    def resume(self) -> None:
        """``POST /resume``."""
        self._post("/resume", "vLLM resume")
        self.paused = False

    def reload_in_place(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """Steps 1-5 of the class docstring; seconds taken. Raises ``InferenceLaunchError``."""
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
            self._post(
                "/collective_rpc",
                f"vLLM reload_weights of {path}",
                json={"method": "reload_weights", "kwargs": {"weights_path": path}},
            )
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

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """Reload ``checkpoint`` in place (restart if that is impossible); seconds taken."""
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


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


class _RunningServerReload(WeightSync):
    """A server the user started (not this process) that reloads a checkpoint folder in place
    over HTTP; subclasses give the request in :meth:`sync`."""

    #: How to start the server, for the error when it is not healthy at :meth:`start`.
    start_hint = ""
    #: Seconds one reload request may take (the constructor's default).
    default_timeout = 300.0

    def __init__(self, url: str, *, timeout: float | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = self.default_timeout if timeout is None else timeout
        self.last_reply: dict | None = None

    def start(self, model: str, policy_version: int | None = None) -> None:
        """Check the server is up (it is started by the user or the quick start, not here)."""
        _wait_healthy(self.url, 60, f"start it first ({self.start_hint})")
        self.policy_version = policy_version


class AtroposServeReload(_RunningServerReload):
    """Hot reload on a running ``atropos-serve``: ``POST {url}/reload_weights {"path": ...}``.

    The reply comes once the new weights are live; requests in flight finish on the old ones.
    The body carries ``"policy_version"`` when the trainer gives one.
    """

    description = "atropos-serve reload"
    start_hint = "atropos-serve --model ... --port ..."

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float:
        started = time.monotonic()
        body: dict[str, Any] = {"path": str(Path(checkpoint).resolve())}
        if policy_version is not None:
            body["policy_version"] = policy_version
        response = _request(
            "POST",
            self.url + "/reload_weights",
            f"atropos-serve reload of {checkpoint}",
            timeout=self.timeout,
            json=body,
        )
        self.last_reply = response.json()
        self.policy_version = policy_version
        return time.monotonic() - started

    def pause(self, mode: str = "abort") -> None:
        """``POST /pause?mode=MODE``: nothing generates until :meth:`resume`."""
        _request(
            "POST",
            self.url + "/pause",
            "atropos-serve pause",
            timeout=self.timeout,
            params={"mode": mode},
        )

    def resume(self) -> None:
        """``POST /resume``."""
        _request("POST", self.url + "/resume", "atropos-serve resume", timeout=self.timeout)


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

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float:
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
            json=body,
        )
        reply = _json(response)
        if response.status_code != 200 or not reply.get("success"):
            raise InferenceLaunchError(
                f"SGLang refused the update to {checkpoint}: HTTP {response.status_code} "
                f"{reply.get('message') or response.text[:500]}"
            )
        self.last_reply = reply
        self.policy_version = policy_version
        return time.monotonic() - started


# ------------------------------------------------------------------------------ from the config


def make_weight_sync(config: TrainingConfig) -> WeightSync:
    """The weight-sync strategy ``config.inference`` and ``config.weight_sync`` name."""
    if config.inference == "atropos-serve":
        return AtroposServeReload(config.inference_url)
    if config.inference == "sglang":
        return SGLangReload(config.inference_url)
    if config.inference != "vllm":
        return NoSync()

    def build(model: str) -> list[str]:
        return vllm_command(
            model,
            served_model_name=config.model_alias,
            host=config.vllm_host,
            port=config.vllm_port,
            python=config.vllm_python,
            gpu_memory_utilization=config.vllm_gpu_memory_utilization,
            extra_args=config.vllm_extra_args,
        )

    common: dict[str, Any] = {
        "url": f"http://{config.vllm_host}:{config.vllm_port}",
        "log_path": config.vllm_log or config.save_dir() / "logs" / "vllm.log",
        "startup_timeout": config.vllm_startup_timeout,
        "served_model_name": config.model_alias,
    }
    if config.weight_sync == "restart":
        return VLLMRestart(build, **common)
    if config.weight_sync == "nccl":
        from example_trainer.weight_transfer import VLLMWeightTransfer

        return VLLMWeightTransfer(build, **common)
    return VLLMReload(build, **common)
