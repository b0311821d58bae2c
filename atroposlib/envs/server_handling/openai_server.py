"""``OpenAIServer``: any OpenAI-compatible endpoint, through ``openai.AsyncClient``."""

from __future__ import annotations

import asyncio
import warnings
from typing import Any, ClassVar

import openai
from openai.types.chat.chat_completion import ChatCompletion
from openai.types.completion import Completion

from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
)

__all__ = ["APIServerConfig", "OpenAIServer"]


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

    async def _create_n(self, create: Any, kwargs: dict[str, Any]) -> Any:
        """Call ``create`` so that the result has ``n`` choices, whether or not the provider
        honours ``n``."""
        n = kwargs.get("n") or 1
        if self.config.n_kwarg_is_ignored:
            single = {k: v for k, v in kwargs.items() if k != "n"}
            results = await asyncio.gather(*[create(**single) for _ in range(n)])
            return _merge_choices(list(results))
        first = await create(**kwargs)
        got = len(first.choices)
        if got == n:
            return first
        if got != 1:
            raise ValueError(f"Expected 1 or {n} completions, got {got}!")
        warnings.warn(
            f"{self.config.base_url or 'the API'} ignores the n kwarg; "
            "making one request per completion from now on",
            stacklevel=2,
        )
        self.config.n_kwarg_is_ignored = True
        single = {k: v for k, v in kwargs.items() if k != "n"}
        rest = await asyncio.gather(*[create(**single) for _ in range(n - 1)])
        return _merge_choices([first, *rest])

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        assert kwargs.get("model") is not None, "Model is required for chat completion!"
        assert kwargs.get("messages") is not None, "Messages are required for chat completion!"
        return await self._create_n(self.openai.chat.completions.create, kwargs)

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        assert kwargs.get("model") is not None, "Model is required for completion!"
        assert kwargs.get("prompt") is not None, "Prompt is required for completion!"
        return await self._create_n(self.openai.completions.create, kwargs)

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        raise NotImplementedError(
            "Tokens and logprobs not supported by base OpenAI API, use specific API servers "
            "(server_type='vllm' or 'sglang')."
        )


def _merge_choices(results: list[Any]) -> Any:
    """Concatenate the choices of several responses into the first, renumbering ``index``."""
    out = results[0]
    for extra in results[1:]:
        out.choices.extend(extra.choices)
    for i, choice in enumerate(out.choices):
        choice.index = i
    return out
