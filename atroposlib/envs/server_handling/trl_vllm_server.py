"""``TrlVllmServer``: TRL's ``trl vllm-serve`` server (``POST /generate/``).

TRL's server takes prompts and returns ``{"completion_ids": [[...], ...]}``; chat messages
are rendered with the tokenizer's chat template first, and the ids are decoded back into
OpenAI ``ChatCompletion`` / ``Completion`` objects.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar

import aiohttp
from openai.types.chat.chat_completion import ChatCompletion, ChatCompletionMessage, Choice
from openai.types.completion import Completion, CompletionChoice
from transformers import AutoTokenizer

from atroposlib.envs.server_handling.server_baseline import (
    APIServer,
    APIServerConfig,
    ReasoningConfig,
)


class TrlVllmServer(APIServer):
    """A client for TRL's vLLM server. It has no health route, so it always counts as
    healthy; token-level calls are not available."""

    provides_token_logprobs: ClassVar[bool] = False

    def __init__(
        self, config: APIServerConfig, reasoning_config: ReasoningConfig | None = None
    ) -> None:
        name = config.model_name if config.tokenizer_name == "none" else config.tokenizer_name
        self.tokenizer = AutoTokenizer.from_pretrained(name)
        super().__init__(config, reasoning_config=reasoning_config)

    def _ensure_started(self, chat_completion: bool = True) -> None:
        self.initialized = True
        self.server_healthy = True

    async def check_server_status_task(self, chat_completion: bool = True) -> None:
        """TRL's server has no health route: always healthy."""
        self.server_healthy = True

    async def _generate(self, prompt: str, kwargs: dict[str, Any]) -> list[list[int]]:
        payload = {
            "prompts": [prompt],
            "n": kwargs.get("n", 1),
            "repetition_penalty": kwargs.get("repetition_penalty", 1.0),
            "temperature": kwargs.get("temperature", 1.0),
            "top_p": kwargs.get("top_p", 1.0),
            "top_k": kwargs.get("top_k", -1),
            "min_p": kwargs.get("min_p", 0.0),
            "max_tokens": kwargs.get("max_tokens") or kwargs.get("max_completion_tokens") or 1024,
        }
        url = f"{(self.config.base_url or '').rstrip('/')}/generate/"
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url, json=payload, timeout=aiohttp.ClientTimeout(total=self.config.timeout)
            ) as response:
                # Test doubles of aiohttp's response often carry only ``json()``.
                if hasattr(response, "raise_for_status"):
                    response.raise_for_status()
                body = await response.json()
        return body["completion_ids"]

    def _finish_reason(self, ids: list[int]) -> str:
        return "stop" if self.tokenizer.eos_token_id in ids else "length"

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        prompt = self.tokenizer.apply_chat_template(
            kwargs.get("messages", []), tokenize=False, add_generation_prompt=True
        )
        completion_ids = await self._generate(prompt, kwargs)
        return ChatCompletion(
            id=str(uuid.uuid4()),
            object="chat.completion",
            created=int(time.time()),
            model=self.config.model_name,
            choices=[
                Choice(
                    finish_reason=self._finish_reason(ids),
                    index=i,
                    message=ChatCompletionMessage(content=self._decode(ids), role="assistant"),
                )
                for i, ids in enumerate(completion_ids)
            ],
        )

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        completion_ids = await self._generate(kwargs.get("prompt", ""), kwargs)
        return Completion(
            id=str(uuid.uuid4()),
            object="text_completion",
            created=int(time.time()),
            model=self.config.model_name,
            choices=[
                CompletionChoice(
                    finish_reason=self._finish_reason(ids), index=i, text=self._decode(ids)
                )
                for i, ids in enumerate(completion_ids)
            ],
        )

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        raise NotImplementedError(
            "Token-level logprobs are not supported by TRL's vLLM server client; "
            "use VLLMServer or SGLangServer (server_type='vllm' or 'sglang')."
        )
