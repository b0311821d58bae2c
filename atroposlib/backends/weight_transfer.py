"""Trainer -> vLLM weights without a disk round trip: vLLM's weight-transfer API over NCCL.

vLLM (>= 0.2x, launched with ``--weight-transfer-config '{"backend": "nccl"}'`` and
``VLLM_SERVER_DEV_MODE=1``) lets a trainer join a process group with its workers and broadcast
the parameters into the running model. The protocol, over HTTP plus the group:

1. once, at start: ``GET /get_world_size`` (W workers), then concurrently
   ``POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
   "rank_offset": 1, "world_size": W + 1, "packed": false}}`` (the workers block in the
   rendezvous) and the trainer joins the group as rank 0;
2. each sync: ``POST /pause?mode=wait``, ``POST /start_weight_update``, then concurrently
   ``POST /update_weights {"update_info": {"names", "dtype_names", "shapes"}}`` and one
   broadcast per parameter from rank 0 in that order; ``POST /finish_weight_update
   {"weight_version": "N"}`` (vLLM's native version, which ``GET /policy_version`` reports),
   ``POST /reset_prefix_cache``, ``POST /resume``.

The trainer side of the group is a :class:`Transport`. ``VLLMNcclTransport`` is vLLM's own
(``vllm.distributed.weight_transfer.nccl_common.trainer_init``: a ``StatelessProcessGroup``
rendezvous and a ``PyNcclCommunicator``), so it needs vLLM importable in the trainer's
environment and a GPU; it has not been measured here (no GPU). ``GlooTransport`` speaks the same
protocol over torch's gloo backend on a CPU; the tests drive the whole exchange with it against
a stand-in server.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import httpx

from atroposlib.backends.weight_sync import (
    InferenceLaunchError,
    VLLMReload,
    VLLMRestart,
    _request,
    server_policy_version,
)

logger = logging.getLogger(__name__)


class Transport(Protocol):
    """The trainer's end of the trainer + workers process group (rank 0, the sender)."""

    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        """Join the group as rank 0 (blocks until every worker joined)."""

    def broadcast(self, tensor: Any) -> None:
        """Send ``tensor`` (contiguous, on the transport's device) from rank 0 to every worker."""

    def close(self) -> None:
        """Leave the group."""


class VLLMNcclTransport:
    """vLLM's trainer endpoint: ``StatelessProcessGroup`` rendezvous + ``PyNcclCommunicator``.

    Needs ``vllm`` importable here and the model's tensors on the current CUDA device.
    """

    def __init__(self) -> None:
        self.group: Any = None

    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.group = trainer_init(
            {"master_address": master_address, "master_port": master_port, "world_size": world_size}
        )

    def broadcast(self, tensor: Any) -> None:
        import torch

        self.group.broadcast(tensor, src=0, stream=torch.cuda.current_stream())

    def close(self) -> None:
        if self.group is not None:
            self.group.destroy()
            self.group = None


class GlooTransport:
    """The same exchange over torch's gloo backend (CPU tensors): a ``TCPStore`` this process
    hosts and a ``ProcessGroupGloo``, no global ``torch.distributed`` state."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self.store: Any = None
        self.group: Any = None

    def connect(self, master_address: str, master_port: int, world_size: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.store = dist.TCPStore(
            master_address,
            master_port,
            world_size,
            is_master=True,
            timeout=timedelta(seconds=self.timeout),
        )
        self.group = dist.ProcessGroupGloo(
            self.store, 0, world_size, timedelta(seconds=self.timeout)
        )

    def broadcast(self, tensor: Any) -> None:
        self.group.broadcast(tensor, 0).wait()

    def close(self) -> None:
        self.group = None
        self.store = None


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class VLLMWeightTransfer(VLLMReload):
    """Broadcast the trainer's parameters into the running vLLM (module docstring).

    Call :meth:`attach` with the model being trained before the first sync; ``sync`` then sends
    its current parameters (the checkpoint folder is still written by the trainer, for resuming,
    but not read). Without an attached model, or if the transfer fails and
    ``fallback_to_restart`` is set, a sync falls back to :class:`VLLMReload`'s in-place reload
    from the checkpoint (and that, if it fails too, to a restart of a vLLM this client
    launched). ``build_command=None`` (or :meth:`VLLMReload.for_running_server`) attaches to a
    vLLM someone else started with ``--weight-transfer-config '{"backend": "nccl"}'`` and
    ``VLLM_SERVER_DEV_MODE=1`` (``trl vllm-serve`` starts it so).

    Args:
        transport: the trainer's end of the group (default: ``VLLMNcclTransport``).
        master_address: address the workers reach the trainer's rendezvous on.
        master_port: its port (default: a free one).
        send_dtype: cast parameters to this torch dtype name before sending (e.g.
            ``"bfloat16"`` for a bf16 server and fp32 training: half the bytes); None sends them
            as they are. vLLM converts to its own dtype on load either way.
    """

    description = "vLLM NCCL weight transfer"
    transport = "nccl"

    def __init__(
        self,
        build_command: Callable[[str], list[str]] | None,
        url: str,
        log_path: str | os.PathLike[str] | None = None,
        *,
        transport: Transport | None = None,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        send_dtype: str | None = None,
        backend: str = "nccl",
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
            env=env,
            policy_version_endpoint=policy_version_endpoint,
            request_timeout=request_timeout,
            fallback_to_restart=fallback_to_restart,
            api_key=api_key,
        )
        self.fallback_to_reload = fallback_to_restart
        """Whether a failed transfer (or a group that cannot open) falls back to reloading the
        checkpoint folder."""
        self.transport: Transport = transport or VLLMNcclTransport()
        self.master_address = master_address
        self.master_port = master_port
        self.send_dtype = send_dtype
        self.backend = backend
        self.model: Any = None
        self.connected = False

    def attach(self, model: Any) -> None:
        """The ``torch.nn.Module`` whose ``named_parameters()`` each sync sends (before the
        first sync; the trainer calls it once its model is loaded)."""
        self.model = model

    def command(self, model: str) -> list[str]:
        return [
            *super().command(model),
            "--weight-transfer-config",
            json.dumps({"backend": self.backend}),
        ]

    def start(self, model: str | None = None, policy_version: int | None = None) -> None:
        """Launch vLLM (or check the running one), then open the transfer group with its
        workers; a running server on another version gets the attached model's weights (or
        ``model``'s folder) at once."""
        if self.launches_server:
            VLLMRestart.start(self, model, policy_version)
            self._open_group()
            return
        self._check_running()
        self.policy_version = policy_version
        self._open_group()
        self._catch_up(model, policy_version)

    def _open_group(self) -> None:
        try:
            self.connect()
        except InferenceLaunchError as exc:
            if not self.fallback_to_reload:
                raise
            logger.warning("no weight transfer group (%s): syncs reload from checkpoints", exc)

    def _catch_up(self, model: str | None, policy_version: int | None) -> None:
        if policy_version is None:
            return
        if server_policy_version(self.url, api_key=self.api_key) == policy_version:
            return
        if self.model is not None and self.connected:
            self.transfer(policy_version)
        else:
            super()._catch_up(model, policy_version)

    def connect(self) -> None:
        """Step 1 of the module docstring: the workers and the trainer join one group."""
        reply = self._get("/get_world_size", "vLLM get_world_size")
        workers = int(reply.json()["world_size"])
        port = self.master_port or _free_port(self.master_address)
        init_info = {
            "master_address": self.master_address,
            "master_port": port,
            "rank_offset": 1,
            "world_size": workers + 1,
            "packed": False,
        }
        errors: list[BaseException] = []

        def init_workers() -> None:
            try:
                self._post(
                    "/init_weight_transfer_engine",
                    "vLLM init_weight_transfer_engine",
                    json={"init_info": init_info},
                )
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=init_workers, daemon=True)
        thread.start()
        self.transport.connect(self.master_address, port, workers + 1)
        thread.join(self.request_timeout)
        if errors:
            raise errors[0]
        self.connected = True
        logger.info(
            "weight transfer group open: trainer + %d vLLM worker(s) on port %d", workers, port
        )

    def _get(self, path: str, what: str) -> httpx.Response:
        return _request(
            "GET", self.url + path, what, timeout=self.request_timeout, api_key=self.api_key
        )

    def _tensors(self) -> list[tuple[str, Any]]:
        import torch

        dtype = getattr(torch, self.send_dtype) if self.send_dtype else None
        out = []
        for name, param in self.model.named_parameters():
            tensor = param.detach()
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            out.append((name, tensor.contiguous()))
        return out

    def transfer(self, policy_version: int | None = None) -> float:
        """Step 2 of the module docstring; seconds taken. Raises ``InferenceLaunchError``."""
        started = time.monotonic()
        steps: dict[str, float] = {}
        paused_here = not self.paused
        if paused_here:
            self._post("/pause", "vLLM pause before the transfer", params={"mode": "wait"})
        try:
            t = time.monotonic()
            self._post("/start_weight_update", "vLLM start_weight_update")
            tensors = self._tensors()
            update_info = {
                "names": [name for name, _ in tensors],
                "dtype_names": [str(tensor.dtype).removeprefix("torch.") for _, tensor in tensors],
                "shapes": [list(tensor.shape) for _, tensor in tensors],
            }
            errors: list[BaseException] = []

            def receive() -> None:
                try:
                    self._post(
                        "/update_weights",
                        "vLLM update_weights",
                        json={"update_info": update_info},
                    )
                except BaseException as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            thread = threading.Thread(target=receive, daemon=True)
            thread.start()
            for _, tensor in tensors:
                self.transport.broadcast(tensor)
            thread.join(self.request_timeout)
            if errors:
                raise errors[0]
            if thread.is_alive():
                raise InferenceLaunchError("vLLM update_weights did not answer after the broadcast")
            steps["transfer"] = time.monotonic() - t
            t = time.monotonic()
            body = {"weight_version": str(policy_version)} if policy_version is not None else None
            self._post("/finish_weight_update", "vLLM finish_weight_update", json=body)
            self._post("/reset_prefix_cache", "vLLM reset_prefix_cache")
            steps["finish"] = time.monotonic() - t
        except BaseException:
            if paused_here:
                try:
                    self._post("/resume", "vLLM resume after a failed transfer")
                except InferenceLaunchError as exc:
                    logger.warning("%s", exc)
            raise
        if paused_here:
            self._post("/resume", "vLLM resume after the transfer")
        self.policy_version = policy_version
        self.last_steps = steps
        return time.monotonic() - started

    def sync(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """Broadcast the attached model (else reload ``checkpoint`` from disk); seconds taken."""
        if self.model is not None and self.connected and self.in_place:
            try:
                return self.transfer(policy_version)
            except InferenceLaunchError as exc:
                if not self.fallback_to_reload:
                    raise
                self.connected = False
                logger.warning("weight transfer failed, reloading from the checkpoint: %s", exc)
        elif self.model is None:
            logger.warning("no model attached for the weight transfer: reloading from disk")
        return super().sync(checkpoint, policy_version)

    def restart(self, checkpoint: Path, policy_version: int | None = None) -> float:
        """A relaunch drops the group: the transport is closed and reopened with the new workers."""
        started = time.monotonic()
        self.transport.close()
        self.connected = False
        super().restart(checkpoint, policy_version)
        return time.monotonic() - started

    def close(self) -> None:
        self.transport.close()
        self.connected = False
        super().close()
