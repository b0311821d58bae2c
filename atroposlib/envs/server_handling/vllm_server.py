"""``VLLMServer``: a vLLM (or ``atropos-serve``) server, with token-level generation.

Chat and text completions go through the OpenAI routes. Token ids and logprobs come from
vLLM's native ``POST /generate`` (as served by ``example_trainer/vllm_api_server.py`` or
``atropos-serve``): prompt token ids in, per-token ``{token_id: logprob}`` entries out.
"""

from __future__ import annotations

from typing import Any, ClassVar

import aiohttp
from transformers import AutoTokenizer

from atroposlib.envs.server_handling.openai_server import (  # noqa: F401 - re-exported
    LeanOpenAIClient,
    OpenAIServer,
    resolve_openai_configs,
)
from atroposlib.envs.server_handling.server_baseline import (
    APIServerConfig,
    ReasoningConfig,
    server_root,
)


def tokenizer_name_for(config: APIServerConfig) -> str:
    """``config.tokenizer_name``, or ``config.model_name`` when it is ``"none"``."""
    return config.model_name if config.tokenizer_name == "none" else config.tokenizer_name


def drop_double_bos(tokens: list[int], bos_token_id: int | None) -> list[int]:
    """Remove one BOS when the prompt starts with two (a chat template plus the tokenizer's)."""
    if bos_token_id is not None and len(tokens) >= 2 and tokens[0] == tokens[1] == bos_token_id:
        return tokens[1:]
    return tokens


class VLLMServer(OpenAIServer):
    """vLLM server: OpenAI routes plus ``/generate`` for ``tokens_and_logprobs_completion``
    and ``get_logprobs``. Health is ``GET /health``."""

    provides_token_logprobs: ClassVar[bool] = True

    def __init__(
        self,
        config: APIServerConfig,
        reasoning_config: ReasoningConfig | None = None,
        tokenizer: Any = None,
    ) -> None:
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(tokenizer_name_for(config))
        super().__init__(config, reasoning_config=reasoning_config)

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    async def _post_generate(self, payload: dict[str, Any]) -> dict[str, Any]:
        url = f"{server_root(self.config.base_url or '')}/generate"
        lean = getattr(self, "lean", None)
        if isinstance(lean, LeanOpenAIClient):
            # the server's keep-alive pool: no new connection per request
            return await self._read_generate(lean.session(), url, payload, lean.proxy)
        async with aiohttp.ClientSession(trust_env=True) as session:
            return await self._read_generate(session, url, payload)

    async def _read_generate(
        self,
        session: aiohttp.ClientSession,
        url: str,
        payload: dict[str, Any],
        proxy: str | None = None,
    ) -> dict[str, Any]:
        async with session.post(
            url,
            json=payload,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(total=self.config.timeout),
            proxy=proxy,
        ) as response:
            if response.status >= 400:
                text = await response.text()
                raise aiohttp.ClientResponseError(
                    response.request_info,
                    response.history,
                    status=response.status,
                    message=text[:500],
                )
            return await response.json()

    def _prompt_tokens(self, kwargs: dict[str, Any]) -> list[int]:
        """Pop ``input_ids`` (used as given) or ``prompt`` (tokenized; a doubled BOS dropped)."""
        if kwargs.get("input_ids") is not None:
            kwargs.pop("prompt", None)
            return list(kwargs.pop("input_ids"))
        kwargs.pop("input_ids", None)
        tokens = self.tokenizer.encode(kwargs.pop("prompt"))
        return drop_double_bos(tokens, getattr(self.tokenizer, "bos_token_id", None))

    @staticmethod
    def _sampling_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
        if "max_new_tokens" in kwargs:
            kwargs["max_tokens"] = kwargs.pop("max_new_tokens")
        if "max_completion_tokens" in kwargs:
            kwargs["max_tokens"] = kwargs.pop("max_completion_tokens")
        for key in ("model", "split", "skip_reasoning", "extra_body"):
            kwargs.pop(key, None)
        return kwargs

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        assert kwargs.get("model") is not None, "Model is required for completion!"
        assert kwargs.get("prompt") is not None or kwargs.get("input_ids") is not None, (
            "Prompt or input_ids is required for completion!"
        )
        prompt_tokens = self._prompt_tokens(kwargs)
        request = {
            "prompt": {"prompt_token_ids": prompt_tokens},
            "logprobs": 0,
            **self._sampling_kwargs(kwargs),
        }
        results = await self._post_generate(request)
        output_tokens: list[list[int]] = []
        output_logprobs: list[list[float]] = []
        for per_token in results["logprobs"]:
            ids, lps = [], []
            for entry in per_token:
                # [{token_id: logprob, ...}]: the first key is the sampled token.
                token_id, logprob = next(iter(entry[0].items()))
                ids.append(int(token_id))
                lps.append(float(logprob))
            output_tokens.append(ids)
            output_logprobs.append(lps)
        return prompt_tokens, output_tokens, output_logprobs, list(results["finish_reasons"])

    @staticmethod
    def _normalize_topk_entry(entry: Any) -> tuple[list[int], list[float]]:
        """One prompt position's logprobs (``{id: lp}``, ``[{id: lp}, ...]`` or None) as
        parallel id and logprob lists."""
        if isinstance(entry, dict):
            return [int(k) for k in entry], [float(v) for v in entry.values()]
        ids: list[int] = []
        lps: list[float] = []
        if isinstance(entry, list):
            for item in entry:
                if isinstance(item, dict):
                    for key, value in item.items():
                        ids.append(int(key))
                        lps.append(float(value))
        return ids, lps

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> dict[str, Any]:
        assert kwargs.get("prompt") is not None or kwargs.get("input_ids") is not None, (
            "Prompt or input_ids is required for get_logprobs!"
        )
        top_k = max(1, int(kwargs.pop("top_k", kwargs.pop("top_logprobs", 1)) or 1))
        prompt_tokens = self._prompt_tokens(kwargs)
        request = {
            "prompt": {"prompt_token_ids": prompt_tokens},
            **self._sampling_kwargs(kwargs),
            "prompt_logprobs": top_k,
            "n": 1,
            "temperature": 0.0,
            "top_p": 1.0,
        }
        request.setdefault("max_tokens", 1)
        results = await self._post_generate(request)
        raw = results.get("prompt_logprobs")
        if raw is None:
            raise ValueError(
                "vLLM /generate response missing 'prompt_logprobs'. "
                "Ensure backend supports prompt logprobs."
            )
        entries = raw[0] if raw and isinstance(raw[0], list) else raw
        topk_ids: list[list[int]] = []
        topk_lps: list[list[float]] = []
        for entry in entries:
            ids, lps = self._normalize_topk_entry(entry)
            topk_ids.append(ids)
            topk_lps.append(lps)
        return {
            "prompt_tokens": prompt_tokens,
            "prompt_topk_token_ids": topk_ids,
            "prompt_topk_logprobs": topk_lps,
        }
