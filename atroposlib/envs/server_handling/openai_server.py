"""``OpenAIServer``: any OpenAI-compatible endpoint, through ``openai.AsyncClient``."""

from __future__ import annotations

import asyncio
import logging
import warnings
from typing import Any, ClassVar

import openai
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion

from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
    ServerBaseline,
)

__all__ = ["APIServerConfig", "OpenAIServer", "ServerConfigError", "resolve_openai_configs"]


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
        super().__init__(config, reasoning_config=reasoning_config)

    async def close(self) -> None:
        """Stop the health loop and close the HTTP client."""
        await super().close()
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
        return await create_n_choices(self.config, self.openai.chat.completions.create, kwargs)

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        assert kwargs.get("model") is not None, "Model is required for completion!"
        assert kwargs.get("prompt") is not None, "Prompt is required for completion!"
        return await create_n_choices(self.config, self.openai.completions.create, kwargs)

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        raise NotImplementedError(
            "Tokens and logprobs not supported by base OpenAI API, use specific API servers "
            "(server_type='vllm' or 'sglang')."
        )


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
