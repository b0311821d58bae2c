"""``OpenAIServer``: any OpenAI-compatible endpoint.

Plain (non-streaming) chat and text completions go through a lean keep-alive ``aiohttp``
path (``LeanOpenAIClient``) that returns the SDK's own ``ChatCompletion`` / ``Completion``
objects and raises the SDK's own exceptions; anything that path does not handle (streaming,
arguments it does not know, bodies that are not plain JSON) goes through ``openai.AsyncClient``
(``server.openai``), unchanged. The lean path exists because the SDK's request pipeline
(transforms, httpx connection-pool bookkeeping, lenient response construction) costs several
milliseconds of CPU per request, which dominated the runtime overhead of rollouts.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import ssl
import sys
import urllib.parse
import urllib.request
import warnings
from typing import Any, ClassVar

import aiohttp
import openai
import pydantic
from openai.resources.chat.completions import AsyncCompletions as _AsyncChatCompletions
from openai.resources.completions import AsyncCompletions as _AsyncTextCompletions
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion

from atroposlib.envs.server_handling import policy_version as _policy
from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)

__all__ = [
    "APIServerConfig",
    "LeanOpenAIClient",
    "OpenAIServer",
    "ServerConfigError",
    "resolve_openai_configs",
]

_NOT_SENT = tuple(
    t for t in (getattr(openai, "NotGiven", None), getattr(openai, "Omit", None)) if t
)


def env_proxy_for(url: str) -> str | None:
    """The proxy the environment (``HTTP_PROXY``, ``HTTPS_PROXY``, ``ALL_PROXY``,
    ``NO_PROXY``) sets for ``url``, as httpx would use it; None for a direct connection."""
    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return None
    return proxy


@functools.cache
def _ssl_context() -> ssl.SSLContext | bool:
    try:
        import certifi
    except ImportError:
        return True  # aiohttp's default verification
    return ssl.create_default_context(cafile=certifi.where())


def _sdk_params(method: Any) -> frozenset[str]:
    return frozenset(inspect.signature(method).parameters) - {"self"}


class LeanOpenAIClient:
    """A minimal client for ``POST {base_url}/chat/completions`` and ``/completions``.

    Same wire request as the SDK (JSON body of the keyword arguments, ``extra_body`` merged
    in, ``extra_headers`` added, the SDK client's default and auth headers), same results
    (``ChatCompletion`` / ``Completion``, validated, or built leniently like the SDK does when
    a provider's answer does not validate) and same errors (``openai.APIStatusError``
    subclasses, ``openai.APIConnectionError``, ``openai.APITimeoutError``), at a fraction of
    the CPU. ``create`` returns ``None`` for requests it leaves to the SDK.

    Args:
        sdk: The ``openai.AsyncClient`` whose base URL, API key, headers and timeout are used.
    """

    _ROUTES: ClassVar[dict[str, tuple[str, type, frozenset[str]]]] = {
        "chat": ("chat/completions", ChatCompletion, _sdk_params(_AsyncChatCompletions.create)),
        "text": ("completions", Completion, _sdk_params(_AsyncTextCompletions.create)),
    }

    def __init__(self, sdk: openai.AsyncClient) -> None:
        self.sdk = sdk
        self.base_url = str(sdk.base_url).rstrip("/")
        headers = {k: v for k, v in dict(sdk.default_headers).items() if isinstance(v, str)}
        if sdk.api_key:
            headers["Authorization"] = f"Bearer {sdk.api_key}"
        self.headers = headers
        timeout = sdk.timeout
        self.timeout = float(timeout) if isinstance(timeout, (int, float)) else None
        #: The ``HTTP(S)_PROXY`` for ``base_url`` (None under ``NO_PROXY`` or when unset), read
        #: once: aiohttp's ``trust_env`` would re-read the environment and netrc per request.
        self.proxy = env_proxy_for(self.base_url)
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def session(self) -> aiohttp.ClientSession:
        """The keep-alive ``aiohttp`` session of the running event loop (made on first use).

        It verifies TLS against certifi's bundle when certifi is installed, like the SDK's
        httpx client; requests to ``base_url``'s host should pass ``proxy=self.proxy``.
        """
        loop = asyncio.get_running_loop()
        if self._session is None or self._loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1000, ssl=_ssl_context()),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                json_serialize=json.dumps,
            )
            self._loop = loop
        return self._session

    async def create(self, kind: str, kwargs: dict[str, Any]) -> Any:
        """Send one ``kind`` (``"chat"`` or ``"text"``) request; ``None`` if the SDK should."""
        route, model_cls, params = self._ROUTES[kind]
        body: dict[str, Any] = {}
        headers = self.headers
        timeout: Any = None
        for key, value in kwargs.items():
            if key not in params or key in ("stream", "extra_query"):
                if key == "stream" and not value:
                    continue
                return None  # streaming, query params, or a TypeError the SDK should raise
            if _NOT_SENT and isinstance(value, _NOT_SENT):
                continue
            if key == "extra_body":
                if value is not None:
                    if not isinstance(value, dict):
                        return None
                    body.update(value)
            elif key == "extra_headers":
                if value:
                    headers = {**headers, **value}
                    headers = {k: v for k, v in headers.items() if isinstance(v, str)}
            elif key == "timeout":
                if value is not None and not isinstance(value, (int, float)):
                    return None
                timeout = value
            else:
                body[key] = value
        try:
            data = json.dumps(body).encode()
        except (TypeError, ValueError):
            return None  # pydantic objects, iterators...: the SDK knows how to send those
        url = f"{self.base_url}/{route}"
        session = self.session()
        extra: dict[str, Any] = {}
        if self.proxy is not None:
            extra["proxy"] = self.proxy
        if timeout is not None:
            extra["timeout"] = aiohttp.ClientTimeout(total=float(timeout))
        try:
            async with session.post(url, data=data, headers=headers, **extra) as response:
                raw = await response.read()
                status = response.status
                resp_headers = dict(response.headers)
                _policy.note_response(response.headers)
        except asyncio.TimeoutError as exc:
            raise openai.APITimeoutError(request=self._request(url, headers, data)) from exc
        except aiohttp.ClientError as exc:
            raise openai.APIConnectionError(
                message=f"Connection error: {exc}", request=self._request(url, headers, data)
            ) from exc
        if status >= 400:
            raise self._status_error(url, headers, data, status, resp_headers, raw)
        payload = json.loads(raw)
        try:
            return model_cls.model_validate(payload)
        except pydantic.ValidationError:
            # as lenient as the SDK: build what is there without validating
            from openai._models import construct_type

            return construct_type(type_=model_cls, value=payload)

    def _httpx(self) -> Any:
        # the httpx flavour the SDK is built on (httpx or httpx2, by SDK version)
        for cls in type(self.sdk._client).__mro__:
            top = cls.__module__.split(".")[0]
            if top.startswith("httpx"):
                return sys.modules[top]
        raise RuntimeError("cannot find the SDK's httpx module")

    def _request(self, url: str, headers: dict[str, str], data: bytes) -> Any:
        return self._httpx().Request("POST", url, headers=headers, content=data)

    def _status_error(
        self,
        url: str,
        headers: dict[str, str],
        data: bytes,
        status: int,
        resp_headers: dict[str, str],
        raw: bytes,
    ) -> Exception:
        httpx_mod = self._httpx()
        response = httpx_mod.Response(
            status,
            headers=resp_headers,
            content=raw,
            request=self._request(url, headers, data),
        )
        return self.sdk._make_status_error_from_response(response)

    async def close(self) -> None:
        """Close the keep-alive connections."""
        if self._session is not None and not self._session.closed:
            try:
                await self._session.close()
            except RuntimeError:  # its event loop is gone: nothing left to close
                pass
        self._session = None


class OpenAIServer(APIServer):
    """Chat and text completions against an OpenAI-compatible API.

    Some providers ignore ``n`` and return one choice. The first time that happens the server
    warns, sets ``config.n_kwarg_is_ignored`` and makes up the difference with concurrent
    single-choice calls; afterwards it fans out ``n`` calls directly. Token-level calls
    (``tokens_and_logprobs_completion``) are not available: use ``VLLMServer`` or
    ``SGLangServer``.
    """

    provides_token_logprobs: ClassVar[bool] = False

    def __init__(
        self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None
    ) -> None:
        self.openai = openai.AsyncClient(
            api_key=config.api_key or "x",
            base_url=config.base_url or None,
            timeout=config.timeout,
            max_retries=0,  # retries are ours (APIServer._run)
        )
        self.lean = LeanOpenAIClient(self.openai)
        super().__init__(config, reasoning_config=reasoning_config)

    async def close(self) -> None:
        """Stop the health loop and close the HTTP clients."""
        await super().close()
        await self.lean.close()
        await self.openai.close()

    async def _completion_probe(self, chat_completion: bool = True) -> None:
        if chat_completion:
            await self.openai.chat.completions.create(
                model=self.config.model_name,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=1,
            )
        else:
            await self.openai.completions.create(
                model=self.config.model_name, prompt="hi", max_tokens=1
            )

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        assert kwargs.get("model") is not None, "Model is required for chat completion!"
        assert kwargs.get("messages") is not None, "Messages are required for chat completion!"
        return await create_n_choices(
            self.config, _creator(self, "chat", self.openai.chat.completions.create), kwargs
        )

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        assert kwargs.get("model") is not None, "Model is required for completion!"
        assert kwargs.get("prompt") is not None, "Prompt is required for completion!"
        return await create_n_choices(
            self.config, _creator(self, "text", self.openai.completions.create), kwargs
        )

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        raise NotImplementedError(
            "Tokens and logprobs not supported by base OpenAI API, use specific API servers "
            "(server_type='vllm' or 'sglang')."
        )


def _creator(server: Any, kind: str, sdk_create: Any) -> Any:
    """``create(**kwargs)`` through the server's lean client, or the SDK when the lean client
    declines (or the server has none: wrappers may be called on bare namespaces)."""
    lean = getattr(server, "lean", None)
    if not isinstance(lean, LeanOpenAIClient):
        return sdk_create

    async def create(**kwargs: Any) -> Any:
        result = await lean.create(kind, kwargs)
        if result is None:
            result = await sdk_create(**kwargs)
        return result

    return create


async def create_n_choices(config: Any, create: Any, kwargs: dict[str, Any]) -> Any:
    """Call ``create(**kwargs)`` so that the result has ``n`` choices, whether or not the
    provider honours ``n`` (recorded in ``config.n_kwarg_is_ignored`` once detected)."""
    n = kwargs.get("n") or 1
    if config.n_kwarg_is_ignored:
        single = {k: v for k, v in kwargs.items() if k != "n"}
        results = await asyncio.gather(*[create(**single) for _ in range(n)])
        return merge_choices(list(results))
    first = await create(**kwargs)
    got = len(first.choices)
    if got == n:
        return first
    if got != 1:
        raise ValueError(f"Expected 1 or {n} completions, got {got}!")
    warnings.warn(
        f"{getattr(config, 'base_url', None) or 'the API'} ignores the n kwarg; "
        "making one request per completion from now on",
        stacklevel=2,
    )
    config.n_kwarg_is_ignored = True
    single = {k: v for k, v in kwargs.items() if k != "n"}
    rest = await asyncio.gather(*[create(**single) for _ in range(n - 1)])
    return merge_choices([first, *rest])


def merge_choices(results: list[Any]) -> Any:
    """Concatenate the choices of several responses into the first, renumbering ``index``."""
    out = results[0]
    for extra in results[1:]:
        out.choices.extend(extra.choices)
    for i, choice in enumerate(out.choices):
        if hasattr(choice, "index"):
            choice.index = i
    return out


class ServerConfigError(ValueError):
    """Server configs that cannot be combined; a CLI exits with ``exit_code``."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


#: The ``openai`` config namespace: YAML key and CLI prefix (``--openai.base_url``).
OPENAI_NAMESPACE = "openai"


def resolve_openai_configs(
    default_server_configs: ServerBaseline | APIServerConfig | list[APIServerConfig],
    openai_config_dict: dict[str, Any],
    yaml_config: dict[str, Any],
    cli_passed_flags: dict[str, Any],
    logger: logging.Logger,
) -> ServerBaseline | list[APIServerConfig]:
    """The server configs an env runs with, from its ``config_init`` default, the YAML
    config and the CLI flags.

    Args:
        default_server_configs: What ``config_init()`` returned for servers.
        openai_config_dict: The single-server settings merged as CLI > YAML > default.
        yaml_config: The whole YAML config (its ``openai`` key may be a dict or a list).
        cli_passed_flags: Flags given on the command line, namespaced
            (``{"openai.base_url": ...}``).
        logger: Where the chosen layout is reported.

    Returns:
        * a YAML ``openai`` list of 2+ servers: one ``APIServerConfig`` each;
        * a default list of 2+ servers: kept as is;
        * a bare ``ServerBaseline`` with no openai overrides: kept (a template for generated
          local/SLURM servers); with overrides: a one-element list of the merged config;
        * otherwise: a one-element list of the merged ``APIServerConfig``.

    Raises:
        ServerConfigError: ``--openai.*`` flags with several servers (exit code 2), or
            settings that do not validate.
    """
    prefix = f"{OPENAI_NAMESPACE}."
    yaml_openai = (yaml_config or {}).get(OPENAI_NAMESPACE)
    cli_openai = {k: v for k, v in (cli_passed_flags or {}).items() if k.startswith(prefix)}
    multi_yaml = isinstance(yaml_openai, list) and len(yaml_openai) >= 2
    multi_default = (
        not multi_yaml
        and isinstance(default_server_configs, list)
        and len(default_server_configs) >= 2
    )
    if (multi_yaml or multi_default) and cli_openai:
        raise ServerConfigError(
            f"CLI overrides for OpenAI settings (--{prefix}*) are not supported when "
            f"multiple servers are defined (a YAML list under '{OPENAI_NAMESPACE}' or a "
            "default list of 2 or more).",
            exit_code=2,
        )
    if multi_yaml:
        logger.info("Using the multi-server configuration from YAML '%s'.", OPENAI_NAMESPACE)
        try:
            return [APIServerConfig(**cfg) for cfg in yaml_openai]
        except Exception as exc:
            raise ServerConfigError(
                f"Invalid server config in YAML '{OPENAI_NAMESPACE}': {exc}"
            ) from exc
    if multi_default:
        logger.info("Using the default multi-server configuration.")
        return list(default_server_configs)

    merged = dict(openai_config_dict)
    if isinstance(yaml_openai, list) and yaml_openai:
        # A one-server YAML list: its settings, then the CLI's on top.
        merged.update(yaml_openai[0])
        merged.update({k[len(prefix) :]: v for k, v in cli_openai.items()})
    if isinstance(default_server_configs, ServerBaseline) and not isinstance(
        default_server_configs, APIServerConfig
    ):
        if not cli_openai and not yaml_openai:
            logger.info("Using the ServerBaseline configuration (generated servers).")
            return default_server_configs
        merged = {**default_server_configs.model_dump(), **merged}
    logger.info("Using a single server configuration (default/YAML/CLI merged).")
    try:
        return [APIServerConfig(**merged)]
    except Exception as exc:
        raise ServerConfigError(f"Invalid server config {merged}: {exc}") from exc
