"""Diverse completions by forcing different first tokens.

``generate_with_diverse_first_tokens`` is written as a method body (its first argument is the
environment, which has ``.server``), as in upstream, so environments can bind it:
``MyEnv.generate_diverse = generate_with_diverse_first_tokens``.

Fixed relative to upstream: it returns the completions (upstream fell off the end and returned
``None``), samples the first tokens without replacement (upstream's resampling could repeat
tokens), and falls back to plain sampling when the environment has no ``fallback_generate``.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

TOP_LOGPROBS = 20
"""How many first-token candidates are requested from the server."""

__all__ = ["generate_with_diverse_first_tokens", "sample_distinct"]


def sample_distinct(
    weights: Sequence[float], k: int, rng: random.Random | None = None
) -> list[int]:
    """``k`` distinct indices drawn without replacement with probability ∝ ``weights``.

    Zero-weight indices are only drawn once every positive one has been; at most
    ``len(weights)`` indices are returned.
    """
    rng = rng or random.Random()
    keyed = []
    for i, w in enumerate(weights):
        # Efraimidis-Spirakis: the k largest u**(1/w) keys are a weighted sample without
        # replacement. Zero weights sort last, in random order.
        u = rng.random()
        keyed.append((u ** (1.0 / w) if w > 0 else -1.0 + u, i))
    keyed.sort(reverse=True)
    return [i for _, i in keyed[: max(0, min(k, len(keyed)))]]


async def _fallback(
    env: Any, messages: list[dict], prefill: str, n: int, max_tokens: int, temperature: float
) -> list[str]:
    fallback = getattr(env, "fallback_generate", None)
    if fallback is not None:
        return await fallback(messages, prefill, n, max_tokens, temperature)
    prompt = messages + ([{"role": "assistant", "content": prefill}] if prefill else [])
    completion = await env.server.chat_completion(
        messages=prompt, n=n, max_tokens=max_tokens, temperature=temperature
    )
    return [choice.message.content or "" for choice in completion.choices]


async def generate_with_diverse_first_tokens(
    self: Any,
    messages: list[dict],
    prefill: str = "",
    n: int = 8,
    max_tokens: int = 4096,
    temperature: float = 1.0,
    rng: random.Random | None = None,
) -> list[str]:
    """Generate up to ``n`` completions that each start with a different first token.

    1. One greedy request for a single token with the top-20 logprobs gives the candidates.
    2. ``n`` distinct candidates are sampled with probabilities ``softmax(logprob / temperature)``.
    3. Each candidate is appended to the assistant prefill and the rest is generated with
       ``top_p=0.3``, ``min_p=0.5`` and ``repetition_penalty=1.05`` (upstream's settings: the
       diversity comes from the first token, the continuation stays focused).

    Args:
        self: The environment; ``self.server.chat_completion`` is awaited.
        messages: The prompt messages.
        prefill: Text the assistant message starts with.
        n: How many completions (fewer if the server offers fewer first-token candidates).
        max_tokens: Budget per completion, first token included.
        temperature: Temperature for choosing first tokens and for the continuations.
        rng: Random source for the first-token choice (tests pass a seeded one).

    Returns:
        The completions, each starting with its forced first token (the prefill excluded). If
        the logprobs are unavailable, ``self.fallback_generate(...)`` or plain sampling.
    """
    probe = await self.server.chat_completion(
        messages=messages + [{"role": "assistant", "content": prefill}],
        n=1,
        max_tokens=1,
        temperature=0.0,
        logprobs=True,
        top_logprobs=TOP_LOGPROBS,
    )
    try:
        candidates = [
            (item.token, item.logprob) for item in probe.choices[0].logprobs.content[0].top_logprobs
        ]
    except (AttributeError, IndexError, KeyError, TypeError) as exc:
        logger.warning("No first-token logprobs (%s); sampling without forcing", exc)
        return await _fallback(self, messages, prefill, n, max_tokens, temperature)
    if not candidates:
        return await _fallback(self, messages, prefill, n, max_tokens, temperature)

    temp = max(temperature, 1e-6)
    top = max(lp for _, lp in candidates)
    weights = [math.exp((lp - top) / temp) for _, lp in candidates]
    chosen = [candidates[i][0] for i in sample_distinct(weights, n, rng)]

    completions = []
    for token in chosen:
        completion = await self.server.chat_completion(
            messages=messages + [{"role": "assistant", "content": prefill + token}],
            n=1,
            max_tokens=max(1, max_tokens - 1),
            temperature=temperature,
            top_p=0.3,
            extra_body={"min_p": 0.5, "repetition_penalty": 1.05},
        )
        completions.append(token + (completion.choices[0].message.content or ""))
    return completions
