"""math answer extraction and math-verify checking on hand-written answers."""

from __future__ import annotations

import threading

import pytest

from atroposlib.scoring import math as m


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{18}.", "18"),
        ("\\boxed{\\frac{1}{2}} then \\boxed{7}", "7"),
        ("nested \\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),
        ("truncated \\boxed{12", None),
        ("no box at all", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert m.extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so she has \\boxed{18} eggs", "18"),
        ("\\boxed{\\$1,250}", "1250"),
        ("\\boxed{12 \\text{ eggs}}", "12"),
        ("\\boxed{-3.50}", "-3.5"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{\\text{18}}", "18"),
        ("<think>\\boxed{3}</think> then \\boxed{4}", "4"),
        ("\\boxed{N}", None),  # the instruction's placeholder is no answer
        ("\\boxed{x + 1}", None),
        ("\\boxed{1,2}", None),
        ("\\boxed{}", None),
        ("\\boxed{18", None),  # cut off by the token budget
        ("the answer is 18", None),
    ],
)
def test_boxed_number(text: str, expected: str | None) -> None:
    assert m.boxed_number(text) == expected


@pytest.mark.parametrize(
    ("text", "finish_reason", "expected"),
    [
        ("so she has \\boxed{18} eggs", "stop", "18"),
        ("so she has \\boxed{18} eggs", "length", None),  # cut off: no final answer
        ("\\boxed{222} \\boxed{222} \\boxed{222}", "stop", None),  # repeated boxes
        ("first \\boxed{36}, then \\boxed{18}", "stop", None),  # one final box only
        ("<think>\\boxed{3}</think> so \\boxed{4}", "stop", "4"),  # thinking is not counted
        ("\\boxed{N}", "stop", None),
    ],
)
def test_final_boxed_number(text: str, finish_reason: str, expected: str | None) -> None:
    assert m.final_boxed_number(text, finish_reason) == expected
    assert m.count_boxes("a \\boxed{1} b \\fbox{2}") == 2


def test_final_box_is_the_only_box_of_a_finished_reply() -> None:
    assert m.final_box("so \\boxed{17 eggs} in all", "stop") == "17 eggs"
    assert m.final_box("so \\boxed{N}", "stop") == "N"
    assert m.final_box("so \\boxed{17}", "length") is None
    assert m.final_box("\\boxed{1} and \\boxed{2}", "stop") is None
    assert m.final_box("so \\boxed{17", "stop") is None  # unterminated
    assert m.number_in_box("\\$1,250") == "1250"
    assert m.number_in_box("17 eggs?") is None


def test_gsm8k_gold_answer_and_missing_marker() -> None:
    assert m.gsm8k_gold_answer("She makes 9 * 2 = $18.\n#### 1,018") == "1018"
    with pytest.raises(ValueError, match="####"):
        m.gsm8k_gold_answer("no marker here")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>maybe 3</think> The answer is 1,234.", "1234"),
        ("work... #### 72", "72"),
        ("I computed 5 then 7.50", "7.5"),
        ("\\boxed{42} and later 5", "42"),
        ("nothing numeric", None),
    ],
)
def test_extract_final_answer(text: str, expected: str | None) -> None:
    assert m.extract_final_answer(text) == expected


@pytest.mark.parametrize(
    ("response", "gold", "correct"),
    [
        ("<think>16-3-4=9, 9*2</think>She makes \\boxed{18} dollars.", "18", True),
        ("The answer is \\boxed{18.0}", "18", True),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{17}", "18", False),
        # upstream requires LaTeX/boxed: a bare number in prose earns nothing
        ("The answer is 18", "18", False),
        # only the text after </think> counts
        ("<think>\\boxed{18}</think> I am not sure.", "18", False),
        ("", "18", False),
        ("\\boxed{", "18", False),
    ],
)
def test_is_correct(response: str, gold: str, correct: bool) -> None:
    assert m.is_correct(response, gold) is correct


def test_lenient_mode_accepts_plain_numbers() -> None:
    assert m.is_correct("The answer is 18", "18", require_boxed_or_latex=False)


def test_verification_works_off_the_main_thread() -> None:
    out: list[bool] = []
    thread = threading.Thread(target=lambda: out.append(m.is_correct("\\boxed{4}", "4")))
    thread.start()
    thread.join(30)
    assert out == [True]
