"""``generate_with_diverse_first_tokens`` against a fake OpenAI-style server."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from types import SimpleNamespace as NS
from typing import Any

from atroposlib.utils.force_diverse_samples import (
    generate_with_diverse_first_tokens,
    sample_distinct,
)


class FakeServer:
    def __init__(self, logprobs: list[tuple[str, float]] | None) -> None:
        self.logprobs = logprobs
        self.calls: list[dict[str, Any]] = []

    async def chat_completion(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        if kwargs.get("logprobs"):
            if self.logprobs is None:
                return NS(choices=[NS(logprobs=None)])
            top = [NS(token=t, logprob=lp) for t, lp in self.logprobs]
            return NS(choices=[NS(logprobs=NS(content=[NS(top_logprobs=top)]))])
        prefix = kwargs["messages"][-1]["content"] if kwargs["messages"] else ""
        n = kwargs.get("n", 1)
        return NS(choices=[NS(message=NS(content=f"<rest of {prefix!r}>")) for _ in range(n)])


def test_distinct_first_tokens_and_returned() -> None:
    server = FakeServer([("A", -0.1), ("B", -1.0), ("C", -2.0), ("D", -50.0)])
    env = NS(server=server)
    out = asyncio.run(
        generate_with_diverse_first_tokens(
            env,
            [{"role": "user", "content": "q"}],
            prefill="P",
            n=3,
            max_tokens=10,
            rng=random.Random(0),
        )
    )
    assert len(out) == 3
    firsts = [c[0] for c in out]
    assert len(set(firsts)) == 3
    for c in out:
        assert c == f"{c[0]}<rest of 'P{c[0]}'>"
    probe, *rest = server.calls
    assert probe["max_tokens"] == 1 and probe["top_logprobs"] == 20 and probe["temperature"] == 0.0
    assert all(call["max_tokens"] == 9 and call["top_p"] == 0.3 for call in rest)


def test_more_requested_than_candidates() -> None:
    env = NS(server=FakeServer([("x", -1.0), ("y", -1.0)]))
    out = asyncio.run(
        generate_with_diverse_first_tokens(env, [{"role": "user", "content": "q"}], n=8)
    )
    assert sorted(c[0] for c in out) == ["x", "y"]


def test_fallbacks() -> None:
    env = NS(server=FakeServer(None))
    out = asyncio.run(
        generate_with_diverse_first_tokens(env, [{"role": "user", "content": "q"}], n=2)
    )
    assert out == ["<rest of 'q'>", "<rest of 'q'>"]

    async def fallback_generate(*args: Any) -> list[str]:
        return ["fb"]

    env = NS(server=FakeServer(None), fallback_generate=fallback_generate)
    assert asyncio.run(generate_with_diverse_first_tokens(env, [], n=2)) == ["fb"]


def test_sample_distinct_is_weighted_without_replacement() -> None:
    rng = random.Random(1)
    firsts = Counter()
    for _ in range(2000):
        picked = sample_distinct([8.0, 1.0, 1.0, 0.0], 2, rng)
        assert len(set(picked)) == 2 and 3 not in picked
        firsts[picked[0]] += 1
    assert firsts[0] > 1400  # ~80% first
    assert sample_distinct([0.0, 0.0], 5, rng) in ([0, 1], [1, 0])
    assert sample_distinct([1.0], 0, rng) == []
