"""``TrlVllmServer``: TRL's ``trl vllm-serve`` (``server_type: trl``), token-exact.

Since TRL 1.x ``trl vllm-serve`` runs vLLM's own OpenAI server (dev mode and NCCL weight
transfer on, ``--logprobs-mode processed_logprobs``), and TRL's ``VLLMClient`` generates with
``POST /v1/completions {"prompt": [token ids], "return_token_ids": true,
"return_tokens_as_token_ids": true, "logprobs": 0, ...}``, reading each choice's
``prompt_token_ids``, ``token_ids`` and ``logprobs``. This client does the same
(:mod:`~atroposlib.envs.server_handling.token_completions`), so ``ManagedServer`` gets the exact
prompt ids, sampled ids and sampler log-probs.

Older TRL servers have no ``/v1/completions``: on its 404 the client falls back, for good, to
their ``POST /generate/ {"prompts": [text], "n", ..., "logprobs": 0}``, which answers
``{"prompt_ids", "completion_ids", "logprobs", "logprob_token_ids"}`` (TRL 1.0) or only
``{"completion_ids"}`` (earlier: no log-probs, so no token-level calls). That route takes text
only: token-id prompts are decoded first, and the server tokenizes them again.

Chat messages are rendered with the tokenizer's chat template here (as before), and sent
without the tokenizer's special tokens (the template holds them).
"""

from __future__ import annotations

import json
import logging
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
    server_root,
)
from atroposlib.envs.server_handling.token_completions import (
    TokenChoices,
    completions_payload,
    read_token_choices,
    route_missing,
    sampling_kwargs,
)

logger = logging.getLogger(__name__)

#: Sampling fields of the legacy ``/generate/`` request (TRL's ``GenerateRequest``).
_LEGACY_FIELDS = {
    "n": 1,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
}
DEFAULT_MAX_TOKENS = 1024
"""``max_tokens`` when a call gives none (vLLM's own default, 16, cuts most answers)."""


class TrlVllmServer(APIServer):
    """A client for ``trl vllm-serve``: chat and text completions, and token ids with the
    sampler's log-probs for ``ManagedServer`` (module docstring). TRL's server is counted as
    healthy without probing (its older versions have no ``/health``)."""

    provides_token_logprobs: ClassVar[bool] = True
    protocol: str | None = None
    """``"completions"`` (vLLM's ``/v1/completions``), ``"legacy"`` (TRL's ``/generate/``), or
    None until the first request."""

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
        """TRL's older servers have no health route: always healthy."""
        self.server_healthy = True

    # ---------------------------------------------------------------- HTTP

    async def _post(self, path: str, payload: dict[str, Any]) -> tuple[int, Any]:
        """POST to the server's root; ``(status, body)``, raising for errors other than a
        missing route."""
        url = f"{server_root(self.config.base_url or '')}{path}"
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
        async with aiohttp.ClientSession() as session:
            async with session.post(
                url,
                json=payload,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self.config.timeout),
            ) as response:
                # test doubles of aiohttp's response often carry only ``json()``
                status = getattr(response, "status", 200)
                if status < 400:
                    return status, await response.json()
                text = await response.text()
                try:
                    body: Any = json.loads(text)
                except ValueError:
                    body = text
                if route_missing(status, body):
                    return status, body
                raise aiohttp.ClientResponseError(
                    response.request_info,
                    response.history,
                    status=status,
                    message=f"{url}: {text[:500]}",
                )

    async def _generate(
        self, prompt: str | list[int], kwargs: dict[str, Any], *, logprobs: bool
    ) -> TokenChoices:
        """One generation request for ``prompt`` (text, or token ids) over whichever route
        the server has."""
        sampling = sampling_kwargs(kwargs)
        sampling["max_tokens"] = sampling.get("max_tokens") or DEFAULT_MAX_TOKENS
        if self.protocol != "legacy":
            body = completions_payload(self.config.model_name, prompt, sampling, logprobs=logprobs)
            if isinstance(prompt, str):
                # a rendered chat template (or text) already holds its special tokens
                body["add_special_tokens"] = bool(kwargs.get("add_special_tokens", True))
            status, reply = await self._post("/v1/completions", body)
            if not route_missing(status, reply):
                self.protocol = "completions"
                return read_token_choices(reply, eos_token_id=self.tokenizer.eos_token_id)
            self.protocol = "legacy"
            logger.warning(
                "%s has no /v1/completions: using TRL's older /generate/ (text prompts, "
                "re-tokenized by the server); trl >= 1.0's vllm-serve is token-exact",
                self.config.base_url,
            )
        text = prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)
        legacy = {key: sampling.get(key, default) for key, default in _LEGACY_FIELDS.items()}
        legacy = {"prompts": [text], **legacy, "max_tokens": sampling["max_tokens"]}
        if logprobs:
            legacy["logprobs"] = 0
        _, reply = await self._post("/generate/", legacy)
        return read_token_choices(reply, eos_token_id=self.tokenizer.eos_token_id)

    # ---------------------------------------------------------------- OpenAI shapes

    def _finish_reason(self, ids: list[int]) -> str:
        return "stop" if self.tokenizer.eos_token_id in ids else "length"

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _texts(self, result: TokenChoices) -> list[tuple[str, str]]:
        """``(text, finish_reason)`` per choice."""
        out = []
        for i, ids in enumerate(result.token_ids):
            text = result.texts[i] if result.texts is not None else self._decode(ids)
            reason = result.finish_reasons[i] if i < len(result.finish_reasons) else None
            out.append((text, reason or self._finish_reason(ids)))
        return out

    async def _chat_completion_wrapper(self, **kwargs: Any) -> ChatCompletion:
        prompt = self.tokenizer.apply_chat_template(
            kwargs.pop("messages", []), tokenize=False, add_generation_prompt=True
        )
        result = await self._generate(
            prompt, {**kwargs, "add_special_tokens": False}, logprobs=False
        )
        return ChatCompletion(
            id=str(uuid.uuid4()),
            object="chat.completion",
            created=int(time.time()),
            model=self.config.model_name,
            choices=[
                Choice(
                    finish_reason=reason,
                    index=i,
                    message=ChatCompletionMessage(content=text, role="assistant"),
                )
                for i, (text, reason) in enumerate(self._texts(result))
            ],
        )

    async def _completion_wrapper(self, **kwargs: Any) -> Completion:
        result = await self._generate(kwargs.pop("prompt", ""), kwargs, logprobs=False)
        return Completion(
            id=str(uuid.uuid4()),
            object="text_completion",
            created=int(time.time()),
            model=self.config.model_name,
            choices=[
                CompletionChoice(finish_reason=reason, index=i, text=text)
                for i, (text, reason) in enumerate(self._texts(result))
            ],
        )

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        """``(prompt_tokens, output_tokens, output_logprobs, finish_reasons)`` for
        ``input_ids`` (sent as given) or ``prompt`` (tokenized here)."""
        input_ids = kwargs.pop("input_ids", None)
        prompt = kwargs.pop("prompt", None)
        if input_ids is None and prompt is None:
            raise ValueError("tokens_and_logprobs_completion needs prompt or input_ids")
        ids = list(input_ids) if input_ids is not None else self.tokenizer.encode(prompt)
        result = await self._generate(ids, kwargs, logprobs=True)
        if result.logprobs is None:
            raise NotImplementedError(
                f"the TRL server at {self.config.base_url} returns no log-probs (TRL older than "
                "1.0); upgrade TRL (trl vllm-serve >= 1.0 is token-exact)"
            )
        prompt_tokens = result.prompt_ids if result.prompt_ids is not None else ids
        reasons = [
            reason or self._finish_reason(out)
            for reason, out in zip(result.finish_reasons, result.token_ids, strict=True)
        ]
        return prompt_tokens, result.token_ids, result.logprobs, reasons
