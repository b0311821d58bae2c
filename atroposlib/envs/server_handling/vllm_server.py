"""``VLLMServer``: a vLLM (or ``atropos-serve``) server, with token-level generation.

Chat and text completions go through the OpenAI routes. Token ids and logprobs come from
``POST /generate`` where the server has it (``atropos-serve``, upstream's
``example_trainer/vllm_api_server.py``): prompt token ids in, per-token ``{token_id: logprob}``
entries out. vLLM's own OpenAI server has no ``/generate``: on its 404 the client switches, for
good, to ``POST /v1/completions`` with vLLM's ``return_token_ids`` and
``return_tokens_as_token_ids`` (token ids in, sampled ids and their log-probs out; prompt
log-probs through ``prompt_logprobs``), so ``server_type: vllm`` is token-exact against a real
vLLM too (:mod:`atroposlib.envs.server_handling.token_completions`).
"""

from __future__ import annotations

import json
import logging
from typing import Any, ClassVar

import aiohttp
from transformers import AutoTokenizer

from atroposlib.envs.server_handling import policy_version as _policy
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
from atroposlib.envs.server_handling.token_completions import (
    completions_payload,
    read_prompt_logprobs,
    read_token_choices,
    route_missing,
)

logger = logging.getLogger(__name__)


def tokenizer_name_for(config: APIServerConfig) -> str:
    """``config.tokenizer_name``, or ``config.model_name`` when it is ``"none"``."""
    return config.model_name if config.tokenizer_name == "none" else config.tokenizer_name


def drop_double_bos(tokens: list[int], bos_token_id: int | None) -> list[int]:
    """Remove one BOS when the prompt starts with two (a chat template plus the tokenizer's)."""
    if bos_token_id is not None and len(tokens) >= 2 and tokens[0] == tokens[1] == bos_token_id:
        return tokens[1:]
    return tokens


class VLLMServer(OpenAIServer):
    """vLLM server: OpenAI routes plus ``/generate`` (else vLLM's ``/v1/completions`` with
    token ids) for ``tokens_and_logprobs_completion`` and ``get_logprobs``. Health is
    ``GET /health``."""

    provides_token_logprobs: ClassVar[bool] = True
    has_generate_route: bool | None = None
    """Whether the server answers ``POST /generate`` (None until the first token request)."""

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
        _, body = await self._post_json("/generate", payload)
        return body

    async def _post_json(
        self, path: str, payload: dict[str, Any], *, missing_ok: bool = False
    ) -> tuple[int, Any]:
        """POST ``payload`` to ``path`` on the server's root; ``(status, body)``. Errors raise
        ``aiohttp.ClientResponseError``, except a missing route with ``missing_ok``."""
        url = f"{server_root(self.config.base_url or '')}{path}"
        lean = getattr(self, "lean", None)
        if isinstance(lean, LeanOpenAIClient):
            # the server's keep-alive pool: no new connection per request
            return await self._read_json(lean.session(), url, payload, lean.proxy, missing_ok)
        async with aiohttp.ClientSession(trust_env=True) as session:
            return await self._read_json(session, url, payload, None, missing_ok)

    async def _read_json(
        self,
        session: aiohttp.ClientSession,
        url: str,
        payload: dict[str, Any],
        proxy: str | None = None,
        missing_ok: bool = False,
    ) -> tuple[int, Any]:
        async with session.post(
            url,
            json=payload,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(total=self.config.timeout),
            proxy=proxy,
        ) as response:
            _policy.note_response(response.headers)
            text = await response.text()
            try:
                body = json.loads(text)
            except ValueError:
                body = text
            if response.status >= 400 and not (missing_ok and route_missing(response.status, body)):
                raise aiohttp.ClientResponseError(
                    response.request_info,
                    response.history,
                    status=response.status,
                    message=text[:500],
                )
            return response.status, body

    async def _post_token_route(self, generate: dict[str, Any], completions: dict[str, Any]) -> Any:
        """``generate`` to ``/generate`` while the server has it, else ``completions`` to
        ``/v1/completions``; returns ``("generate" | "completions", body)``."""
        if self.has_generate_route is not False:
            status, body = await self._post_json("/generate", generate, missing_ok=True)
            if not route_missing(status, body):
                self.has_generate_route = True
                return "generate", body
            self.has_generate_route = False
            logger.info(
                "%s has no /generate (vLLM's own server): token ids and log-probs from "
                "/v1/completions with return_token_ids",
                self.config.base_url,
            )
        _, body = await self._post_json("/v1/completions", completions)
        return "completions", body

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
        sampling = self._sampling_kwargs(kwargs)
        request = {"prompt": {"prompt_token_ids": prompt_tokens}, "logprobs": 0, **sampling}
        route, results = await self._post_token_route(
            request, completions_payload(self.config.model_name, prompt_tokens, sampling)
        )
        if route == "completions":
            choices = read_token_choices(results)
            if choices.logprobs is None:
                raise ValueError(f"{self.config.base_url}: /v1/completions returned no logprobs")
            return prompt_tokens, choices.token_ids, choices.logprobs, choices.finish_reasons
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
        sampling = {
            **self._sampling_kwargs(kwargs),
            "prompt_logprobs": top_k,
            "n": 1,
            "temperature": 0.0,
            "top_p": 1.0,
        }
        sampling.setdefault("max_tokens", 1)
        request = {"prompt": {"prompt_token_ids": prompt_tokens}, **sampling}
        completions = {"model": self.config.model_name, "prompt": prompt_tokens, **sampling}
        route, results = await self._post_token_route(request, completions)
        if route == "completions":
            entries: list[Any] = read_prompt_logprobs(results)
        else:
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
