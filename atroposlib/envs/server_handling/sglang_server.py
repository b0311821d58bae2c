"""``SGLangServer``: an SGLang server, with token-level generation through ``POST /generate``."""

from __future__ import annotations

from typing import Any, ClassVar

from atroposlib.envs.server_handling.openai_server import (  # noqa: F401 - re-exported
    resolve_openai_configs,
)
from atroposlib.envs.server_handling.vllm_server import VLLMServer


class SGLangServer(VLLMServer):
    """SGLang server: OpenAI routes plus SGLang's native ``/generate``.

    ``tokens_and_logprobs_completion`` sends ``{input_ids, sampling_params, return_logprob:
    true, return_text_in_logprobs: false}`` (``max_tokens`` renamed to ``max_new_tokens``)
    and reads ``meta_info.output_token_logprobs`` ``(logprob, token_id, text)`` triples.
    Health is ``GET /health`` (SGLang serves it), like vLLM.
    """

    provides_token_logprobs: ClassVar[bool] = True

    async def _tokens_and_logprobs_completion_wrapper(
        self, **kwargs: Any
    ) -> tuple[list, list, list, list]:
        assert kwargs.get("model") is not None, "Model is required for completion!"
        assert kwargs.get("prompt") is not None or kwargs.get("input_ids") is not None, (
            "Prompt or input_ids is required for completion!"
        )
        prompt_tokens = self._prompt_tokens(kwargs)
        sampling = self._sampling_kwargs(kwargs)
        if "max_tokens" in sampling:
            sampling["max_new_tokens"] = sampling.pop("max_tokens")
        request = {
            "input_ids": prompt_tokens,
            "sampling_params": sampling,
            "return_logprob": True,
            "return_text_in_logprobs": False,
        }
        results = await self._post_generate(request)
        if not isinstance(results, list):
            results = [results]
        output_tokens, output_logprobs, finish_reasons = [], [], []
        for result in results:
            meta = result.get("meta_info", {})
            triples = meta.get("output_token_logprobs", [])
            output_logprobs.append([float(item[0]) for item in triples])
            output_tokens.append([int(item[1]) for item in triples])
            finish_reasons.append(meta.get("finish_reason"))
        return prompt_tokens, output_tokens, output_logprobs, finish_reasons

    async def _get_logprobs_wrapper(self, **kwargs: Any) -> dict[str, Any]:
        raise NotImplementedError("SGLangServer does not implement get_logprobs yet.")
