"""``message_history_utils``: results match upstream Atropos 0.4 on the same inputs.

A word-level fake tokenizer keeps the expected values small; they were produced by upstream
``atroposlib==0.4.0`` with the same tokenizer and inputs.
"""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from atroposlib.utils.message_history_utils import (
    ensure_trajectory_token_limit,
    strip_thinking,
    truncate_thinking,
)


class WordTok:
    """Words are tokens (ids from a hash); the chat template is ``<role> words <eos>``."""

    eos_token_id = 0

    def __init__(self) -> None:
        self.inv: dict[int, str] = {0: "<eos>"}

    def _id(self, word: str) -> int:
        i = zlib.crc32(word.encode()) % 100000 + 1
        self.inv[i] = word
        return i

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self._id(w) for w in text.split(" ")]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.inv[i] for i in ids)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True
    ) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += [self._id("<" + m["role"] + ">"), *self.encode(m["content"]), 0]
        if add_generation_prompt:
            out.append(self._id("<assistant>"))
        return out


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a <think>xx</think> b", "a  b"),
        ("no tags", "no tags"),
        ("<think>unclosed", "<think>unclosed"),
        ("<think>a</think><think>b</think>c", "<think>b</think>c"),
        # Fixed: a lone closing tag (opening tag was in the prompt) strips the reasoning.
        ("reasoning</think>answer", "answer"),
        # Fixed: reversed tags no longer duplicate text.
        ("x</think>y<think>z", "y<think>z"),
    ],
)
def test_strip_thinking(text: str, expected: str) -> None:
    assert strip_thinking(text) == expected


@pytest.mark.parametrize(
    ("text", "budget", "expected"),
    [
        ("pre <think>one two three</think> post", 5, "pre <think>\none two three\n</think> post"),
        (
            "pre <think>one two three four five six</think> post",
            3,
            "pre <think>\n... four five six\n</think> post",
        ),
        (
            "<think>para one is long here\n\nshort end</think>answer",
            3,
            "<think>\n... short end\n</think>answer",
        ),
        (
            "<think>para one\n\nlast para is way too long for it</think>answer",
            2,
            "<think>\n... for it\n</think>answer",
        ),
        ("<think>   </think>x", 3, "<think></think>x"),
        ("<think>\n\nonly para too long</think>x", 2, "<think>\n... too long\n</think>x"),
        ("<think>a b c</think>", 0, "<think></think>"),
        ("</think>x<think>", 3, "</think>x<think>"),
        ("plain", 3, "plain"),
    ],
)
def test_truncate_thinking_matches_upstream(text: str, budget: int, expected: str) -> None:
    assert truncate_thinking(text, WordTok(), budget) == expected


def test_truncate_thinking_tokenizer_error_returns_input() -> None:
    class Broken:
        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise RuntimeError("no")

    assert truncate_thinking("<think>a</think>b", Broken(), 3) == "<think>a</think>b"


def _trajectory() -> list[dict]:
    sys_ = {"role": "system", "content": "sys prompt"}

    def env(i: int) -> dict:
        return {"role": "environment", "content": f"obs {i} " + "w " * 3}

    def ag(i: int) -> dict:
        return {"role": "agent", "content": f"act {i} " + "z " * 2}

    long_a = [sys_, env(1), ag(1), env(2), ag(2), env(3), ag(3)]
    long_b = [sys_, env(1), ag(1), env(2), ag(2), env(3), {"role": "agent", "content": "other"}]
    short = [sys_, env(1), ag(1)]
    return [
        {
            "seed": 1,
            "messages": [short],
            "tokens": [[1] * 10],
            "masks": [[1] * 10],
            "scores": [1.0],
            "parsed_actions": [1],
        },
        {
            "seed": 2,
            "messages": [long_a, long_b],
            "tokens": [[1] * 40, [1] * 30],
            "masks": [[1] * 40, [1] * 30],
            "scores": [0.5, 0.1],
            "parsed_actions": [1, 2],
        },
        {
            "seed": 3,
            "messages": [[sys_, env(1), ag(1)]],
            "tokens": [[1] * 100],
            "masks": [[1] * 100],
            "scores": [0.0],
            "parsed_actions": [0],
        },
        {
            "seed": None,
            "messages": [short],
            "tokens": [[1]],
            "masks": [[1]],
            "scores": [0],
            "parsed_actions": [0],
        },
    ]


def _summary(steps: list[dict]) -> list[tuple]:
    return [
        (
            s["seed"],
            [len(m) for m in s["messages"]],
            [len(t) for t in s["tokens"]],
            [m.count(-100) for m in s["masks"]],
        )
        for s in steps
    ]


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (12, [(1, [3], [10], [0])]),
        (20, [(1, [3], [10], [0]), (2, [3, 3], [19, 15], [13, 13])]),
        (25, [(1, [3], [10], [0]), (2, [3, 3], [19, 15], [13, 13])]),
        (60, [(1, [3], [10], [0]), (2, [7, 7], [40, 30], [0, 0])]),
    ],
)
def test_ensure_trajectory_token_limit_matches_upstream(limit: int, expected: list) -> None:
    tok = WordTok()
    trajectory = _trajectory()
    out = ensure_trajectory_token_limit(trajectory, tok, limit)
    assert _summary(out) == expected
    for step in out:
        if step["seed"] == 2 and limit < 40:
            # The first message and the last observation + reply are kept.
            for alt, original in zip(step["messages"], trajectory[1]["messages"], strict=True):
                assert alt == [original[0], original[-2], original[-1]]
            assert step["scores"] == [0.5, 0.1] and step["parsed_actions"] == [1, 2]
            # The retokenized masks train exactly on the final agent reply.
            tokens, masks = step["tokens"][1], step["masks"][1]
            trained = [t for t, m in zip(tokens, masks, strict=True) if m != -100]
            reply = step["messages"][1][-1]
            assert trained == tok.apply_chat_template([reply])[1:]  # content + eos
    # The input is not modified.
    assert _summary(trajectory) == _summary(_trajectory())
    assert ensure_trajectory_token_limit([], tok, 10) == []
