"""``ServerManager``: one environment's view of its inference servers.

It builds the server clients from configs, routes each request to the most available healthy
server, splits large ``n`` into several requests, and hands out ``ManagedServer`` sessions.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import shutil
import subprocess
import warnings
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion
from pydantic import BaseModel, Field

from atroposlib.envs.server_handling.managed_server import (
    DummyManagedServer,
    ManagedServer,
    RetokenizingManagedServer,
)
from atroposlib.envs.server_handling.openai_server import OpenAIServer, merge_choices
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)
from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.envs.server_handling.sglang_server import SGLangServer
from atroposlib.envs.server_handling.trl_vllm_server import TrlVllmServer
from atroposlib.envs.server_handling.vllm_server import VLLMServer

logger = logging.getLogger(__name__)

SERVER_CLASSES: dict[str, type[APIServer]] = {
    "openai": OpenAIServer,
    "trl": TrlVllmServer,
    "sglang": SGLangServer,
    "vllm": VLLMServer,
    # atropos-serve speaks vLLM's /generate: the same client, named for what it talks to
    "atropos-serve": VLLMServer,
}

#: Ports of the locally generated servers (one per GPU of a 4+4 split).
LOCAL_PORTS = range(9004, 9008)
#: GPUs per inference node under SLURM; servers use ports 9000 + i.
GPUS_PER_NODE = 8
#: Fallback re-check interval of ``ServerManager.wait_for_sem`` (releases wake it at once).
SEM_POLL_INTERVAL = 0.1


class ServerManagerConfig(BaseModel):
    """Options of the ``ServerManager`` (un-prefixed on the command line)."""

    slurm: bool = Field(
        default=False, description="Whether environment is running on slurm or not."
    )
    testing: bool = Field(
        default=False, description="If set to True, environment uses mock OpenAI data."
    )
    max_n_completions: int = Field(
        default=8,
        description=(
            "The maximum number of completions to request at once per server call. "
            "Will split any n larger than this into multiple calls. "
            "This is to help load balance servers."
        ),
    )
    proxy_url: str | None = Field(
        default=None,
        description=(
            "URL of the ManagedServer OpenAI proxy (e.g. 'http://localhost:9100'). "
            "When set, managed_server() routes through this proxy. "
            "Can also be set via ATROPOS_PROXY_URL environment variable."
        ),
    )


def server_class_for(server_type: str) -> type[APIServer]:
    """The client class for ``server_type`` (openai, trl, sglang, vllm, atropos-serve)."""
    try:
        return SERVER_CLASSES[server_type]
    except KeyError:
        raise ValueError(f"Invalid server type: {server_type}") from None


def slurm_nodelist() -> list[str]:
    """Host names of this SLURM job (``scontrol show hostnames``); empty outside SLURM."""
    spec = os.environ.get("SLURM_JOB_NODELIST")
    if not spec or shutil.which("scontrol") is None:
        return []
    result = subprocess.run(
        ["scontrol", "show", "hostnames", spec], capture_output=True, text=True, check=False
    )
    return [line.strip() for line in result.stdout.splitlines() if line.strip()]


def slurm_inference_urls(nodelist: list[str]) -> list[str]:
    """``http://{node}:{9000+i}/v1`` for every node after the first ``NUM_TRAINING_NODES``,
    with ``8 // INFER_TP`` servers per node."""
    training_nodes = os.environ.get("NUM_TRAINING_NODES")
    if training_nodes is None:
        raise ValueError(
            "NUM_TRAINING_NODES must be set to find the inference nodes of a SLURM job"
        )
    infer_tp = int(os.environ.get("INFER_TP", "1"))
    if infer_tp < 1:
        raise ValueError(f"INFER_TP must be a positive integer, got {infer_tp}")
    per_node = max(1, GPUS_PER_NODE // infer_tp)
    return [
        f"http://{node}:{9000 + i}/v1"
        for node in nodelist[int(training_nodes) :]
        for i in range(per_node)
    ]


class ServerManager:
    """Routes requests over a pool of inference servers.

    ``configs`` may be:

    * a list of ``APIServerConfig``: one server each (with ``slurm=True``, the first config is
      a template copied to every SLURM inference node and port),
    * a single ``APIServerConfig``: that one server, as given,
    * a bare ``ServerBaseline``: a template for generated servers on
      ``http://localhost:9004-9007/v1``, or on the SLURM inference nodes when the job has at
      least two nodes.

    ``testing=True`` uses one ``ServerHarness`` instead. Routing only needs ``servers``,
    ``max_n_completions`` and ``reasoning_config``.
    """

    def __init__(
        self,
        configs: ServerBaseline | APIServerConfig | list[APIServerConfig],
        server_class: type[APIServer] = APIServer,
        slurm: bool = False,
        testing: bool = False,
        max_n_completions: int = 8,
        reasoning_config: ReasoningConfig | None = None,
        proxy_url: str | None = None,
        use_proxy: bool = False,
        tool_parser: str | None = None,
    ) -> None:
        self.max_n_completions = max_n_completions
        self.reasoning_config = reasoning_config
        self.proxy_url = proxy_url or os.environ.get("ATROPOS_PROXY_URL")
        self.use_proxy = use_proxy or bool(self.proxy_url)
        self.tool_parser = tool_parser
        self.servers: list[Any]
        if testing:
            self.servers = [ServerHarness()]
            return
        if isinstance(configs, list):
            if not configs:
                raise ValueError("ServerManager needs at least one server config")
            first = configs[0]
        else:
            first = configs
        if inspect.isabstract(server_class):
            server_class = server_class_for(first.server_type)

        def build(config_list: list[APIServerConfig]) -> list[Any]:
            return [server_class(c, reasoning_config=reasoning_config) for c in config_list]

        if isinstance(configs, ServerBaseline) and not isinstance(configs, APIServerConfig):
            self.servers = build(self._generated_configs(configs))
        else:
            config_list = configs if isinstance(configs, list) else [configs]
            if slurm:
                config_list = self._slurm_configs(config_list)
            self.servers = build(config_list)

    @staticmethod
    def _generated_configs(baseline: ServerBaseline) -> list[APIServerConfig]:
        nodes = slurm_nodelist()
        if len(nodes) >= 2:
            urls = slurm_inference_urls(nodes)
        else:
            urls = [f"http://localhost:{port}/v1" for port in LOCAL_PORTS]
        return [
            APIServerConfig(
                base_url=url,
                api_key="x",
                timeout=baseline.timeout,
                num_max_requests_at_once=baseline.num_max_requests_at_once,
                num_requests_for_eval=baseline.num_requests_for_eval,
                model_name=baseline.model_name,
                rolling_buffer_length=baseline.rolling_buffer_length,
                server_type=baseline.server_type,
                tokenizer_name=baseline.tokenizer_name,
            )
            for url in urls
        ]

    @staticmethod
    def _slurm_configs(configs: list[APIServerConfig]) -> list[APIServerConfig]:
        nodes = slurm_nodelist()
        if len(nodes) < 2:
            logger.warning(
                "Not enough SLURM nodes to distribute to; using the server configs as given."
            )
            return configs
        return [
            configs[0].model_copy(update={"base_url": url}, deep=True)
            for url in slurm_inference_urls(nodes)
        ]

    # ------------------------------------------------------------------ routing

    async def update_weight(self, weight: float) -> None:
        """Give this env ``weight`` of every server's concurrency."""
        for server in self.servers:
            await server.update_weight(weight)

    def _get_server_base_url(self, server_idx: int = 0) -> str | None:
        """The ``base_url`` of server ``server_idx`` (None when unknown)."""
        if not self.servers:
            return None
        return getattr(getattr(self.servers[server_idx], "config", None), "base_url", None)

    def _available_slots(self, is_training: bool) -> list[float]:
        slots = []
        for server in self.servers:
            eval_free = server.eval_sem._value - server.eval_sem.min_val()
            if is_training:
                eval_in_use = max(0, server.eval_sem.max_val - server.eval_sem._value)
                train_free = server.sem._value - server.sem.min_val()
                slots.append(max(0, train_free - eval_in_use))
            else:
                slots.append(max(0, eval_free))
        return slots

    async def wait_for_sem(self, is_training: bool) -> None:
        """Wait until some server has a free slot (train slots exclude eval slots in use).

        Woken as soon as any server's semaphore is released or reweighted, with a re-check
        every ``SEM_POLL_INTERVAL`` seconds as a fallback (health or foreign semaphores)."""
        while all(slot <= 0 for slot in self._available_slots(is_training)):
            freed = asyncio.get_running_loop().create_future()
            for server in self.servers:
                for sem in (getattr(server, "sem", None), getattr(server, "eval_sem", None)):
                    notify = getattr(sem, "notify_on_release", None)
                    if notify is not None:
                        notify(freed)
            try:
                await asyncio.wait_for(freed, SEM_POLL_INTERVAL)
            except asyncio.TimeoutError:
                pass

    def _most_available_index(self, is_training: bool = True) -> int:
        """The healthy server with the most free raw slots (lowest index on ties; 0 when
        none is healthy)."""
        best, best_slots = 0, None
        for i, server in enumerate(self.servers):
            if not getattr(server, "server_healthy", True):
                continue
            slots = server.sem._value if is_training else server.eval_sem._value
            if best_slots is None or slots > best_slots:
                best, best_slots = i, slots
        return best

    async def _route(self, method: str, kwargs: dict[str, Any]) -> Any:
        is_training = kwargs.pop("split", "train") == "train"
        await self.wait_for_sem(is_training)
        server = self.servers[self._most_available_index(is_training)]
        if not is_training:
            kwargs["split"] = "eval"
        return await getattr(server, method)(**kwargs)

    async def _split_n(
        self, call: Callable[..., Awaitable[Any]], kwargs: dict[str, Any]
    ) -> list[Any] | None:
        """Run ``call`` in concurrent chunks of ``max_n_completions`` when ``n`` is larger;
        None when no split is needed."""
        n = kwargs.get("n") or 1
        if n <= self.max_n_completions:
            return None
        chunks = []
        remaining = n
        while remaining > 0:
            size = min(remaining, self.max_n_completions)
            chunks.append(call(**{**kwargs, "n": size}))
            remaining -= size
        return list(await asyncio.gather(*chunks))

    async def chat_completion(self, **kwargs: Any) -> ChatCompletion:
        """Chat completion on the most available server (``split``: train or eval; reasoning
        is injected by the server unless ``skip_reasoning=True``)."""
        parts = await self._split_n(self.chat_completion, kwargs)
        if parts is not None:
            return merge_choices(parts)
        return await self._route("chat_completion", kwargs)

    async def completion(self, **kwargs: Any) -> Completion:
        """Text completion on the most available server."""
        parts = await self._split_n(self.completion, kwargs)
        if parts is not None:
            return merge_choices(parts)
        return await self._route("completion", kwargs)

    async def tokens_and_logprobs_completion(self, **kwargs: Any) -> tuple[list, list, list, list]:
        """``(prompt_tokens, output_tokens, output_logprobs, finish_reasons)`` from the most
        available server; chunks of a split ``n`` are concatenated."""
        parts = await self._split_n(self.tokens_and_logprobs_completion, kwargs)
        if parts is not None:
            prompt_tokens = parts[0][0]
            tokens, logprobs, reasons = [], [], []
            for _, out_tokens, out_logprobs, out_reasons in parts:
                tokens.extend(out_tokens)
                logprobs.extend(out_logprobs)
                reasons.extend(out_reasons)
            return prompt_tokens, tokens, logprobs, reasons
        return await self._route("tokens_and_logprobs_completion", kwargs)

    async def get_logprobs(self, **kwargs: Any) -> dict[str, Any]:
        """Prompt logprobs ``{prompt_tokens, prompt_topk_token_ids, prompt_topk_logprobs}``
        from the most available server."""
        return await self._route("get_logprobs", kwargs)

    @asynccontextmanager
    async def dedicated_server(self, split: str = "train") -> AsyncIterator[Any]:
        """Hold one slot of the most available server for the block: a training slot, or an
        eval slot with ``split="eval"`` (chosen as requests are routed: once some server has
        a free slot of that kind)."""
        is_training = split == "train"
        await self.wait_for_sem(is_training)
        server = self.servers[self._most_available_index(is_training)]
        async with server.sem if is_training else server.eval_sem:
            yield server

    def _select_for_session(self, base_url: str | None, session_id: str | None) -> Any:
        """The pinned server (``base_url``) if it exists and is healthy, else a stable
        choice among healthy servers for ``session_id``, else the most available one."""
        if base_url:
            wanted = base_url.rstrip("/")
            for server in self.servers:
                url = getattr(getattr(server, "config", None), "base_url", None) or ""
                if url.rstrip("/") == wanted:
                    if getattr(server, "server_healthy", True):
                        return server
                    warnings.warn(
                        f"Pinned server {base_url} is unhealthy; using the most available one",
                        stacklevel=4,
                    )
                    break
            else:
                warnings.warn(
                    f"No server with base_url {base_url}; using the most available one",
                    stacklevel=4,
                )
        elif session_id is not None:
            healthy = [s for s in self.servers if getattr(s, "server_healthy", True)]
            if healthy:
                return healthy[zlib.crc32(session_id.encode()) % len(healthy)]
        return self.servers[self._most_available_index(True)]

    @asynccontextmanager
    async def managed_server(
        self,
        tokenizer: Any = None,
        base_url: str | None = None,
        preserve_think_blocks: bool = False,
        session_id: str | None = None,
        *,
        tool_parser: str | None = None,
        tokens: Literal["server", "auto", "local"] = "server",
    ) -> AsyncIterator[Any]:
        """A ``ManagedServer`` session, reset on exit.

        The server is the one at ``base_url`` when given and healthy (a warning and the
        most available server otherwise), or a stable pick for ``session_id`` (the same id
        maps to the same server while the healthy set is unchanged), or the most available.

        ``tool_parser`` (e.g. ``"hermes"``) parses ``tools`` calls in this session only; it
        defaults to the manager's ``tool_parser``.

        ``tokens`` says where the session's token ids come from:

        * ``"server"`` (upstream's behaviour): from the server. Plain OpenAI endpoints give
          none: this raises ``NotImplementedError`` unless
          ``ATROPOS_ALLOW_DUMMY_MANAGED_SERVER`` is 1/true/yes, which yields a
          ``DummyManagedServer`` with placeholder tokens (not for training).
        * ``"auto"``: from the server when it provides them, else a
          ``RetokenizingManagedServer`` (the chat re-tokenized locally with ``tokenizer``,
          no logprobs): one code path for token servers and OpenAI endpoints.
        * ``"local"``: always re-tokenized locally (prompts a text chat template cannot
          render exactly, such as image content parts).

        With a proxy configured, the session is created on the proxy instead.
        """
        if tokens not in ("server", "auto", "local"):
            raise ValueError(f"tokens must be 'server', 'auto' or 'local', got {tokens!r}")
        parser = tool_parser if tool_parser is not None else getattr(self, "tool_parser", None)
        if getattr(self, "use_proxy", False):
            if not self.proxy_url:
                raise ValueError("use_proxy=True requires proxy_url or ATROPOS_PROXY_URL")
            from atroposlib.envs.server_handling.proxy_client import create_proxy_session

            model_name = getattr(getattr(self.servers[0], "config", None), "model_name", "unknown")
            session = await create_proxy_session(
                proxy_url=self.proxy_url,
                base_url=base_url,
                tool_parser=parser or "hermes",
                model_name=model_name,
            )
            try:
                yield session
            finally:
                await session.cleanup()
            return

        server = self._select_for_session(base_url, session_id)
        provides_tokens = getattr(server, "provides_token_logprobs", True)
        if tokens == "local" or (tokens == "auto" and not provides_tokens):
            managed: Any = RetokenizingManagedServer(server=self, tokenizer=tokenizer)
        elif not provides_tokens:
            allow = os.environ.get("ATROPOS_ALLOW_DUMMY_MANAGED_SERVER", "").lower()
            if allow not in ("1", "true", "yes"):
                raise NotImplementedError(
                    "OpenAI endpoints do not support token IDs or logprobs required for "
                    "ManagedServer. Use server_type 'vllm', 'atropos-serve', 'sglang' or 'trl' "
                    "(docs/backends.md), or, if placeholder "
                    "tokens are fine (evaluation only), set ATROPOS_ALLOW_DUMMY_MANAGED_SERVER=1."
                )
            warnings.warn(
                "Using DummyManagedServer with an OpenAI endpoint: token IDs and logprobs are "
                "placeholders and NOT suitable for training.",
                stacklevel=3,
            )
            managed = DummyManagedServer(server=server, tokenizer=tokenizer)
        else:
            managed = ManagedServer(
                server=server,
                tokenizer=tokenizer,
                tool_parser=parser,
                preserve_think_blocks=preserve_think_blocks,
            )
        try:
            yield managed
        finally:
            managed.reset()

    async def close(self) -> None:
        """Stop health loops and close the servers' HTTP clients."""
        for server in self.servers:
            close = getattr(server, "close", None)
            if close is not None:
                await close()
