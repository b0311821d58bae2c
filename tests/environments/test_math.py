"""MATH-style env: LaTeX gold answers, local JSONL, one ``process`` run end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from environments.math_server import MathEnv
from tests.environments.test_gsm8k import (
    assert_valid_groups,
    fake_sample,
    make_env,
    run_process,
)

ROWS = [
    {"problem": "Simplify $\\frac{2}{4}$.", "answer": "\\frac{1}{2}"},
    {"problem": "What is $\\sqrt{18}$ in simplest form?", "answer": "3\\sqrt{2}"},
]


@pytest.fixture()
def math_dir(tmp_path: Path) -> Path:
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    return tmp_path


async def test_latex_answers_are_verified(tiny_model_dir: Path, math_dir: Path) -> None:
    env = make_env(MathEnv, tiny_model_dir, dataset_path=str(math_dir), max_token_length=100)
    env.config.ensure_scores_are_not_same = False
    await env.setup()
    assert env.test[1]["gold_answer"] == "3\\sqrt{2}"
    group = env.score_samples(
        [
            fake_sample("\\boxed{0.5}"),
            fake_sample("\\boxed{\\frac{2}{4}}"),
            fake_sample("\\boxed{\\frac{1}{3}}"),
            fake_sample("one half"),
        ],
        "\\frac{1}{2}",
    )
    assert group["scores"] == [1.0, 1.0, -1.0, -1.0]


async def test_missing_fields_are_named(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "train.jsonl").write_text('{"q": "x"}\n')
    env = make_env(MathEnv, tiny_model_dir, dataset_path=str(tmp_path / "train.jsonl"))
    with pytest.raises(ValueError, match="question_field 'problem'"):
        await env.setup()


@pytest.mark.slow
def test_process_end_to_end(
    tiny_serve, tiny_model_dir: Path, math_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    groups = run_process(
        "math_server.py",
        out,
        tiny_serve,
        tiny_model_dir,
        "--env.dataset_path",
        str(math_dir),
        "--env.total_steps",
        "2",
        "--env.group_size",
        "2",
        "--env.max_token_length",
        "32",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 2)
