"""Judge prompting and verdict parsing: correct, wrong and malformed judge replies."""

from __future__ import annotations

import pytest

from atroposlib.scoring.judge import (
    JudgeStats,
    judge_pair,
    pairwise_messages,
    parse_pairwise_verdict,
    parse_rubric_rating,
    rubric_messages,
    score_group_pairwise,
    score_group_rubric,
)


@pytest.mark.parametrize(
    ("reply", "verdict"),
    [
        ("A is more accurate. [[A]]", "A"),
        ("Both fine.\n\n[[C]]", "tie"),
        ("First I thought [[A]] but on reflection [[B]]", "B"),
        ("[[ b ]]", "B"),
        ("Final verdict: B", "B"),
        ("The better response is Assistant A.", "A"),
        ("Verdict: tie", "tie"),
        ("I cannot decide.", None),
        ("", None),
        (None, None),
        ("[[D]]", None),
    ],
)
def test_pairwise_verdicts(reply: str | None, verdict: str | None) -> None:
    assert parse_pairwise_verdict(reply) == verdict


@pytest.mark.parametrize(
    ("reply", "rating"),
    [
        ("Good answer. Rating: [[8]]", 8.0),
        ("Rating: [[7.5]]", 7.5),
        ("Score: 6/10", 6.0),
        ("score: 3/5", 1 + 9 * 3 / 5),
        ("Rating: [[11]]", None),  # off the scale
        ("Rating: [[0]]", None),
        ("no rating here", None),
        ("[[A]]", None),
    ],
)
def test_rubric_ratings(reply: str, rating: float | None) -> None:
    assert parse_rubric_rating(reply, (1, 10)) == (pytest.approx(rating) if rating else None)


def test_prompts_carry_question_answers_and_format() -> None:
    msgs = pairwise_messages("Q?", "ans one", "ans two", criteria="be short")
    assert "[[A]]" in msgs[0]["content"] and "be short" in msgs[0]["content"]
    assert "Q?" in msgs[1]["content"]
    assert msgs[1]["content"].index("ans one") < msgs[1]["content"].index("ans two")
    rub = rubric_messages("Q?", "ans", scale=(0, 5), reference="ref")
    assert "from 0 to 5" in rub[0]["content"] and "ref" in rub[1]["content"]


def _length_judge(broken: int = 0):
    """A rule-based judge: prefers the longer answer; first ``broken`` replies are junk."""
    calls = {"n": 0}

    async def judge(messages, n=1):
        calls["n"] += 1
        if calls["n"] <= broken:
            return ["I refuse to answer in the format."]
        text = messages[-1]["content"]
        if "Assistant A's Answer" in text:
            a = text.split("[The Start of Assistant A's Answer]\n")[1].split("\n[The End")[0]
            b = text.split("[The Start of Assistant B's Answer]\n")[1].split("\n[The End")[0]
            return ["[[A]]" if len(a) > len(b) else "[[B]]" if len(b) > len(a) else "[[C]]"]
        answer = text.split("[The Start of Assistant's Answer]\n")[1].split("\n[The End")[0]
        return [f"Rating: [[{min(10, 1 + len(answer))}]]"]

    return judge, calls


async def test_pairwise_group_scores_rank_answers_and_cancel_position() -> None:
    judge, calls = _length_judge()
    stats = JudgeStats()
    scores = await score_group_pairwise(judge, "Q", ["aaa", "a", "aa"], stats=stats)
    assert scores == pytest.approx([1.0, -1.0, 0.0])
    assert calls["n"] == 6  # 3 pairs x both orders
    assert stats.verdicts["A"] == stats.verdicts["B"] == 3
    assert await judge_pair(judge, "Q", "x", "y") == 0.5  # tie


async def test_parse_failures_are_retried_then_neutral() -> None:
    judge, _ = _length_judge(broken=1)
    stats = JudgeStats()
    assert await judge_pair(judge, "Q", "long", "s", swap=False, retries=1, stats=stats) == 1.0
    assert stats.parse_failures == 1 and stats.calls == 2
    judge, _ = _length_judge(broken=100)
    stats = JudgeStats()
    scores = await score_group_pairwise(judge, "Q", ["long", "s"], retries=2, stats=stats)
    assert scores == [0.0, 0.0]
    assert stats.parse_failures == 6 and stats.as_metrics()["judge/parse_failure_rate"] == 1.0


async def test_rubric_group_scores_map_to_unit_range() -> None:
    judge, _ = _length_judge()
    scores = await score_group_rubric(judge, "Q", ["", "aaaa", "x" * 50])
    assert scores == pytest.approx([-1.0, 2 * 4 / 9 - 1, 1.0])

    async def failing(messages, n=1):
        raise ConnectionError("judge down")

    stats = JudgeStats()
    assert await score_group_rubric(failing, "Q", ["a"], stats=stats) == [0.0]
    assert stats.errors == 2
