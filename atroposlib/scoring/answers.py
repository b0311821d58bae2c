"""Answer extraction for multiple-choice and free-text tasks.

- :func:`extract_choice_letter`: the option letter a response commits to (``\\boxed{B}``,
  ``Answer: B``, ``(B)``, ``The answer is B``, a lone ``B``), or None when it commits to none or
  names several different letters in its final statement.
- :func:`extract_tag`: the content of the last ``<answer>...</answer>``-style tag.
- :func:`normalize_text` / :func:`exact_match`: SQuAD-style normalised string comparison.
"""

from __future__ import annotations

import re
import string

from atroposlib.scoring.math import extract_boxed, strip_think

__all__ = [
    "choice_letters",
    "exact_match",
    "extract_choice_letter",
    "extract_tag",
    "format_choices",
    "normalize_text",
]


def choice_letters(num_choices: int) -> str:
    """``"ABCD"`` for 4 choices; ValueError outside 2..26."""
    if not 2 <= num_choices <= 26:
        raise ValueError(f"num_choices must be between 2 and 26, got {num_choices}")
    return string.ascii_uppercase[:num_choices]


def format_choices(choices: list[str]) -> str:
    """``"A. first\\nB. second..."`` for the prompt."""
    letters = choice_letters(len(choices))
    return "\n".join(f"{letter}. {text}" for letter, text in zip(letters, choices, strict=True))


def extract_tag(text: str, tag: str = "answer") -> str | None:
    """Content of the last ``<tag>...</tag>`` in ``text`` (stripped), or None."""
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL | re.IGNORECASE)
    return found[-1].strip() if found else None


def extract_choice_letter(text: str, num_choices: int = 4) -> str | None:
    """The option letter the response answers with, or None.

    Looks (in this order, in the text after ``</think>``) at ``\\boxed{X}``, an ``<answer>`` tag,
    "answer is/answer: X", then a line holding only ``X``, ``(X)`` or ``X.``; a response that
    names two different letters in the deciding statement gives None (no credit for hedging).
    """
    letters = choice_letters(num_choices)
    body = strip_think(text)
    letter_re = rf"\(?\b([{letters}])\b\)?"

    for candidate in (extract_boxed(body), extract_tag(body, "answer")):
        if candidate is not None:
            found = set(re.findall(rf"\b([{letters}])\b", candidate.replace("\\text", "")))
            return found.pop() if len(found) == 1 else None

    statements = re.findall(
        rf"answer\s*(?:is|:)?\s*(?:option\s*)?[:\s]*\**\s*({letter_re}(?:\s*(?:or|and|,)\s*{letter_re})*)",
        body,
        flags=re.IGNORECASE,
    )
    if statements:
        last = statements[-1][0]
        found = set(re.findall(rf"\b([{letters}])\b", last))
        return found.pop() if len(found) == 1 else None

    for line in reversed(body.strip().splitlines()):
        match = re.fullmatch(rf"\s*\**\(?([{letters}])[).:]?\**\s*", line)
        if match:
            return match.group(1)
    return None


def normalize_text(text: str) -> str:
    """Lower-case, drop punctuation and articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def exact_match(prediction: str | None, gold: str) -> bool:
    """Normalised string equality; None never matches."""
    return prediction is not None and normalize_text(prediction) == normalize_text(gold)
