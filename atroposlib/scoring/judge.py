"""LLM-as-judge scoring: prompts, verdict parsing and group scores.

Two modes:

* **pairwise**: the judge sees a question and two answers and ends with ``[[A]]``, ``[[B]]``
  or ``[[C]]`` (tie), MT-Bench style. ``score_group_pairwise`` compares every pair of a
  group (optionally both orders, to cancel position bias) and turns win rates into scores in
  [-1, 1].
* **rubric**: the judge grades one answer against a rubric and ends with
  ``Rating: [[N]]`` on a configurable scale; ``score_group_rubric`` maps ratings to [-1, 1].

Judges are often small and sloppy: verdicts are parsed leniently (``[[A]]``, ``Verdict: A``,
``Rating: 7/10``...), a reply that cannot be parsed is retried ``retries`` times and then
counted in ``JudgeStats.parse_failures`` and scored as neutral (a tie, or the middle of the
scale) instead of raising. Any async function ``messages -> list[str]`` can be a judge;
``OpenAIJudge`` calls an OpenAI-compatible endpoint.
"""

from __future__ import annotations

import asyncio
import itertools
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "JudgeFn",
    "JudgeStats",
    "OpenAIJudge",
    "PAIRWISE_SYSTEM",
    "RUBRIC_SYSTEM",
    "judge_pair",
    "judge_rubric",
    "pairwise_messages",
    "parse_pairwise_verdict",
    "parse_rubric_rating",
    "rubric_messages",
    "score_group_pairwise",
    "score_group_rubric",
]

Verdict = Literal["A", "B", "tie"]
#: A judge: chat messages in, ``n`` reply texts out.
JudgeFn = Callable[[list[dict[str, str]], int], Awaitable[list[str]]]

PAIRWISE_SYSTEM = (
    "Please act as an impartial judge and evaluate the quality of the responses provided by "
    "two AI assistants to the user question displayed below. Choose the assistant that follows "
    "the user's instructions and answers the question better, considering helpfulness, "
    "relevance, accuracy, depth and clarity. Do not let the order of the responses, their "
    "length or the assistants' names influence you. Explain briefly, then output your final "
    'verdict strictly in this format: "[[A]]" if assistant A is better, "[[B]]" if assistant B '
    'is better, and "[[C]]" for a tie.'
)

RUBRIC_SYSTEM = (
    "Please act as an impartial judge and rate the quality of the AI assistant's response to "
    "the user question displayed below, following the rubric. Explain briefly, then output "
    'your rating strictly in this format: "Rating: [[N]]" where N is an integer from '
    "{low} to {high}."
)

DEFAULT_RUBRIC = (
    "- Correct and relevant to the question.\n"
    "- Follows every instruction in the question.\n"
    "- Clear, well organised and appropriately concise.\n"
    "- Safe and honest."
)


def pairwise_messages(
    question: str, answer_a: str, answer_b: str, criteria: str | None = None
) -> list[dict[str, str]]:
    """The judge's chat for comparing two answers to ``question``."""
    system = PAIRWISE_SYSTEM + (f"\n\nAdditional criteria:\n{criteria}" if criteria else "")
    user = (
        f"[User Question]\n{question}\n\n"
        f"[The Start of Assistant A's Answer]\n{answer_a}\n[The End of Assistant A's Answer]\n\n"
        f"[The Start of Assistant B's Answer]\n{answer_b}\n[The End of Assistant B's Answer]"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


def rubric_messages(
    question: str,
    answer: str,
    rubric: str = DEFAULT_RUBRIC,
    scale: tuple[int, int] = (1, 10),
    reference: str | None = None,
) -> list[dict[str, str]]:
    """The judge's chat for grading one answer on ``scale`` against ``rubric``."""
    low, high = scale
    system = RUBRIC_SYSTEM.format(low=low, high=high) + f"\n\n[Rubric]\n{rubric}"
    ref = f"[Reference Answer]\n{reference}\n\n" if reference else ""
    user = (
        f"[User Question]\n{question}\n\n{ref}"
        f"[The Start of Assistant's Answer]\n{answer}\n[The End of Assistant's Answer]"
    )
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


_BRACKET_VERDICT = re.compile(r"\[\[\s*([ABC]|tie)\s*\]\]", re.IGNORECASE)
_WORD_VERDICT = re.compile(
    r"(?:verdict|winner|better(?: answer| response)? is|choose|choice)\s*(?:is)?\s*[:\-]?\s*"
    r"\**\s*(?:assistant\s+)?\(?\b([AB]|tie)\b",
    re.IGNORECASE,
)


def parse_pairwise_verdict(text: str | None) -> Verdict | None:
    """``"A"``, ``"B"`` or ``"tie"`` from a judge reply, or None when it has no verdict.

    The last ``[[A]]``/``[[B]]``/``[[C]]`` wins; without one, a ``Verdict: A`` style phrase;
    two different bracketed verdicts in a row with nothing after count as the last one.
    """
    if not text:
        return None
    found = _BRACKET_VERDICT.findall(text)
    if found:
        v = found[-1].upper()
        return "tie" if v in ("C", "TIE") else v  # type: ignore[return-value]
    words = _WORD_VERDICT.findall(text)
    if words:
        v = words[-1].upper()
        return "tie" if v == "TIE" else v  # type: ignore[return-value]
    return None


_BRACKET_RATING = re.compile(r"\[\[\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*\d+)?\s*\]\]")
_WORD_RATING = re.compile(
    r"(?:rating|score|grade)\s*(?:is)?\s*[:=]?\s*\**\s*(-?\d+(?:\.\d+)?)\s*(?:/\s*(\d+))?",
    re.IGNORECASE,
)


def parse_rubric_rating(text: str | None, scale: tuple[int, int] = (1, 10)) -> float | None:
    """The rating in a judge reply (``Rating: [[7]]``, ``Score: 7/10``...), or None when
    there is none or it lies outside ``scale``."""
    if not text:
        return None
    low, high = scale
    value: float | None = None
    found = _BRACKET_RATING.findall(text)
    if found:
        value = float(found[-1])
    else:
        words = _WORD_RATING.findall(text)
        if words:
            number, denominator = words[-1]
            value = float(number)
            if denominator and int(denominator) not in (0, high) and int(denominator) > 0:
                value = low + (high - low) * value / int(denominator)
    if value is None or not low <= value <= high:
        return None
    return value


@dataclass
class JudgeStats:
    """Counters across judge calls (``as_metrics()`` for W&B)."""

    calls: int = 0
    parse_failures: int = 0
    errors: int = 0
    verdicts: dict[str, int] = field(default_factory=lambda: {"A": 0, "B": 0, "tie": 0})

    def as_metrics(self, prefix: str = "judge/") -> dict[str, float]:
        """Rates and counts, e.g. ``judge/parse_failure_rate``."""
        out = {
            f"{prefix}calls": float(self.calls),
            f"{prefix}parse_failures": float(self.parse_failures),
            f"{prefix}errors": float(self.errors),
            f"{prefix}parse_failure_rate": self.parse_failures / self.calls if self.calls else 0.0,
        }
        decided = sum(self.verdicts.values())
        if decided:
            out[f"{prefix}first_position_rate"] = self.verdicts["A"] / decided
        return out


async def _ask(
    judge: JudgeFn,
    messages: list[dict[str, str]],
    parse: Callable[[str], Any],
    retries: int,
    stats: JudgeStats | None,
) -> Any:
    """Ask until a reply parses (``1 + retries`` attempts); None when none did."""
    for _ in range(1 + max(0, retries)):
        if stats is not None:
            stats.calls += 1
        try:
            replies = await judge(messages, 1)
        except Exception:  # noqa: BLE001 - a failing judge is counted, the rollout survives
            if stats is not None:
                stats.errors += 1
            continue
        parsed = parse(replies[0] if replies else "")
        if parsed is not None:
            return parsed
        if stats is not None:
            stats.parse_failures += 1
    return None


async def judge_pair(
    judge: JudgeFn,
    question: str,
    answer_a: str,
    answer_b: str,
    *,
    swap: bool = True,
    retries: int = 1,
    criteria: str | None = None,
    stats: JudgeStats | None = None,
) -> float:
    """How much ``answer_a`` beats ``answer_b``: 1.0 win, 0.0 loss, 0.5 tie or no verdict.

    With ``swap`` the judge sees both orders and the two results are averaged (position bias
    cancels)."""
    orders = [(answer_a, answer_b, False)] + ([(answer_b, answer_a, True)] if swap else [])

    async def one(first: str, second: str, swapped: bool) -> float:
        verdict = await _ask(
            judge, pairwise_messages(question, first, second, criteria), parse_pairwise_verdict,
            retries, stats,
        )  # fmt: skip
        if verdict is None:
            return 0.5
        if stats is not None:
            stats.verdicts[verdict] += 1
        if verdict == "tie":
            return 0.5
        a_won = (verdict == "A") != swapped
        return 1.0 if a_won else 0.0

    results = await asyncio.gather(*(one(*o) for o in orders))
    return sum(results) / len(results)


async def judge_rubric(
    judge: JudgeFn,
    question: str,
    answer: str,
    *,
    rubric: str = DEFAULT_RUBRIC,
    scale: tuple[int, int] = (1, 10),
    reference: str | None = None,
    retries: int = 1,
    stats: JudgeStats | None = None,
) -> float | None:
    """The judge's rating of ``answer`` on ``scale``, or None when no reply parsed."""
    return await _ask(
        judge,
        rubric_messages(question, answer, rubric, scale, reference),
        lambda text: parse_rubric_rating(text, scale),
        retries,
        stats,
    )


async def score_group_pairwise(
    judge: JudgeFn,
    question: str,
    answers: Sequence[str],
    *,
    swap: bool = True,
    retries: int = 1,
    criteria: str | None = None,
    stats: JudgeStats | None = None,
) -> list[float]:
    """Round-robin: every pair of ``answers`` is judged; each answer's score is
    ``2 * win_rate - 1`` in [-1, 1] (0 when the group has one answer)."""
    n = len(answers)
    if n < 2:
        return [0.0] * n
    pairs = list(itertools.combinations(range(n), 2))
    results = await asyncio.gather(
        *(
            judge_pair(
                judge,
                question,
                answers[i],
                answers[j],
                swap=swap,
                retries=retries,
                criteria=criteria,
                stats=stats,
            )  # fmt: skip
            for i, j in pairs
        )
    )
    wins = [0.0] * n
    for (i, j), a_beats_b in zip(pairs, results, strict=True):
        wins[i] += a_beats_b
        wins[j] += 1.0 - a_beats_b
    return [2.0 * w / (n - 1) - 1.0 for w in wins]


async def score_group_rubric(
    judge: JudgeFn,
    question: str,
    answers: Sequence[str],
    *,
    rubric: str = DEFAULT_RUBRIC,
    scale: tuple[int, int] = (1, 10),
    reference: str | None = None,
    retries: int = 1,
    stats: JudgeStats | None = None,
) -> list[float]:
    """Each answer's rating mapped linearly from ``scale`` to [-1, 1]; an unparsed rating
    scores 0 (the middle)."""
    low, high = scale
    ratings = await asyncio.gather(
        *(
            judge_rubric(
                judge,
                question,
                a,
                rubric=rubric,
                scale=scale,
                reference=reference,
                retries=retries,
                stats=stats,
            )  # fmt: skip
            for a in answers
        )
    )
    return [0.0 if r is None else 2.0 * (r - low) / (high - low) - 1.0 for r in ratings]


class OpenAIJudge:
    """A judge behind an OpenAI-compatible chat endpoint (any server: vLLM, atropos-serve,
    a hosted API). Call it as ``await judge(messages, n)``."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str = "x",
        temperature: float = 0.0,
        max_tokens: int = 512,
        timeout: float = 120.0,
    ) -> None:
        from openai import AsyncOpenAI

        self.model = model
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.client = AsyncOpenAI(base_url=base_url, api_key=api_key, timeout=timeout)

    async def __call__(self, messages: list[dict[str, str]], n: int = 1) -> list[str]:
        reply = await self.client.chat.completions.create(
            model=self.model,
            messages=messages,  # type: ignore[arg-type]
            n=n,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
        )
        return [c.message.content or "" for c in reply.choices]

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.client.close()
