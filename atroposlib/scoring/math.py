"""Math answer extraction and verification (``math-verify``), as upstream's math environments.

Two layers:

- **Extraction** without sympy: :func:`extract_boxed` (the last ``\\boxed{...}``, nested braces
  handled), :func:`gsm8k_gold_answer` (the number after GSM8K's ``####``),
  :func:`extract_last_number` and :func:`extract_final_answer` (boxed, then ``####``, then
  "the answer is", then the last number).
- **Verification** with ``math-verify``: :func:`parse_gold` and :func:`parse_response` use the
  same extraction configs as upstream's ``gsm8k_server.py`` (the model must give its answer in
  LaTeX, ``\\boxed{}`` first; text after ``</think>`` only), and :func:`verify_answer` /
  :func:`is_correct` compare them. ``math-verify`` times out with ``signal.alarm``, which only
  works in the main thread; in other threads the timeout is turned off instead of raising.
"""

from __future__ import annotations

import re
import threading
from typing import Any

__all__ = [
    "boxed_number",
    "count_boxes",
    "final_box",
    "final_boxed_number",
    "extract_boxed",
    "extract_final_answer",
    "extract_last_number",
    "gsm8k_gold_answer",
    "is_correct",
    "normalize_number",
    "number_in_box",
    "parse_gold",
    "parse_response",
    "strip_think",
    "verify_answer",
]

_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_ANSWER_IS_RE = re.compile(
    r"(?:final answer|the answer)\s*(?:is|:)\s*\$?\\?\(?\s*([^\n]+)", re.IGNORECASE
)


def strip_think(text: str) -> str:
    """The text after the last ``</think>`` (all of it when there is none), as upstream."""
    return text.split("</think>")[-1]


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent.

    An unterminated box (``\\boxed{12`` at the end of a truncated completion) gives None.
    """
    best: str | None = None
    for match in re.finditer(r"\\(?:boxed|fbox)\s*\{", text):
        depth = 1
        i = match.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = text[match.end() : i - 1].strip()
    return best


_BOXED_NOISE = re.compile(r"\\text\{([^{}]*)\}|\\[$%,!;: ]|[$%\s]")
_PLAIN_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def boxed_number(text: str) -> str | None:
    """The number in the reply's last ``\\boxed{}`` (after ``</think>``), normalised; None when
    there is no box or it holds anything but a number (``\\boxed{N}``, ``\\boxed{x+1}``).

    Dollar and percent signs, LaTeX spaces and ``\\text{}`` units are ignored:
    ``\\boxed{\\$1,250}`` gives ``"1250"``, ``\\boxed{12 \\text{ eggs}}`` gives ``"12"``.
    """
    content = extract_boxed(strip_think(text))
    return None if content is None else number_in_box(content)


def number_in_box(content: str) -> str | None:
    """The number a box's content holds, normalised (see :func:`boxed_number`); None when it
    holds anything else."""
    # \text{18} keeps its number; \text{ dollars} (a unit) goes
    cleaned = _BOXED_NOISE.sub(
        lambda m: m.group(1) if m.group(1) and any(c.isdigit() for c in m.group(1)) else "",
        content,
    )
    if not _PLAIN_NUMBER.fullmatch(cleaned):
        return None
    return normalize_number(cleaned)


def count_boxes(text: str) -> int:
    """How many ``\\boxed{`` / ``\\fbox{`` openings the reply has after ``</think>``."""
    return len(re.findall(r"\\(?:boxed|fbox)\s*\{", strip_think(text)))


def final_box(text: str, finish_reason: str = "stop") -> str | None:
    """Content of the reply's only box, when the reply ended on its own (``finish_reason`` is
    not ``"length"``) and has exactly one complete ``\\boxed{}`` after ``</think>``; else None.
    """
    if finish_reason == "length" or count_boxes(text) != 1:
        return None
    return extract_boxed(strip_think(text))


def final_boxed_number(text: str, finish_reason: str = "stop") -> str | None:
    """The reply's final answer when it is well formed, else None.

    Well formed: the reply ended on its own (a reply cut off by the token budget has no final
    answer), it has exactly one ``\\boxed{}`` (:func:`final_box`) and that box holds a number
    (:func:`number_in_box`). A reply that repeats ``\\boxed{222} \\boxed{222} ...`` until the
    budget runs out, or boxes intermediate results, is not well formed.
    """
    box = final_box(text, finish_reason)
    return None if box is None else number_in_box(box)


def normalize_number(text: str) -> str:
    """``"$1,234.50"`` -> ``"1234.5"``; text that is not a plain number is returned stripped."""
    cleaned = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(cleaned)
    except ValueError:
        return text.strip()
    if value.is_integer():
        return str(int(value))
    return repr(value)


def gsm8k_gold_answer(answer: str) -> str:
    """The gold answer of a GSM8K row: what follows ``####``, commas removed (as upstream).

    Raises ValueError naming the row text when there is no ``####``.
    """
    if "####" not in answer:
        raise ValueError(f"GSM8K answer has no '####' final-answer marker: {answer[-80:]!r}")
    return answer.split("####")[-1].strip().replace(",", "")


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (commas dropped, trailing dot removed), or None."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return normalize_number(found[-1])


def extract_final_answer(text: str) -> str | None:
    """Best-effort final answer: ``\\boxed{}``, then ``#### N``, then "the answer is X", then the
    last number; None when the text holds none of these."""
    text = strip_think(text)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        tail = text.split("####")[-1].strip().splitlines()
        if tail and tail[0].strip():
            return tail[0].strip().replace(",", "")
    statements = list(_ANSWER_IS_RE.finditer(text))
    if statements:
        match = statements[-1]
        number = extract_last_number(match.group(1))
        if number is not None:
            return number
    return extract_last_number(text)


def _timeout() -> int | None:
    # math-verify's timeout uses signal.alarm: main thread only.
    return 5 if threading.current_thread() is threading.main_thread() else None


def parse_gold(gold: str) -> list[Any]:
    """Parse a gold answer (``"18"``, ``"\\frac{1}{2}"`` or already ``"\\boxed{..}"``).

    Returns math-verify's parsed list; empty when the gold cannot be parsed.
    """
    from math_verify import LatexExtractionConfig, parse

    text = gold if "\\boxed" in gold else "\\boxed{" + gold + "}"
    return parse(
        text,
        extraction_mode="first_match",
        extraction_config=[LatexExtractionConfig()],
        parsing_timeout=_timeout(),
    )


def parse_response(response: str, *, require_boxed_or_latex: bool = True) -> list[Any]:
    """Parse a model response the way upstream's GSM8K/MATH envs do.

    Only the text after ``</think>`` counts; ``\\boxed{}`` is tried first; with
    ``require_boxed_or_latex`` (upstream) a bare number in prose does not count, otherwise plain
    expressions (``The answer is 18``) are accepted too.
    """
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    configs: list[Any] = [
        LatexExtractionConfig(
            normalization_config=NormalizationConfig(
                nits=False,
                malformed_operators=False,
                basic_latex=True,
                boxed="all",
                units=True,
            ),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    if not require_boxed_or_latex:
        configs.append(ExprExtractionConfig())
    return parse(
        strip_think(response),
        extraction_config=configs,
        extraction_mode="first_match",
        parsing_timeout=_timeout(),
    )


def verify_answer(parsed_response: list[Any], parsed_gold: list[Any]) -> bool:
    """math-verify equivalence of two parsed answers (False when either is empty)."""
    from math_verify import verify

    if not parsed_response or not parsed_gold:
        return False
    return bool(verify(parsed_gold, parsed_response, timeout_seconds=_timeout()))


def is_correct(response: str, gold: str, *, require_boxed_or_latex: bool = True) -> bool:
    """Whether ``response`` states an answer mathematically equal to ``gold``.

    >>> is_correct("so the total is \\\\boxed{18}", "18")
    True
    """
    return verify_answer(
        parse_response(response, require_boxed_or_latex=require_boxed_or_latex), parse_gold(gold)
    )
