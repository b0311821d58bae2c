"""MMLU: the bundled test set, the Hub path, letter scoring, one ``process`` run end to end."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from environments.mcqa_mmlu_server import BUNDLED_MMLU, MMLUEnv, bundled_mmlu_rows
from tests.environments.test_gsm8k import assert_valid_groups, make_env, run_process

ROW = {"question": "2 + 2 = ?", "choices": ["3", "4", "5", "22"], "answer": "B", "subject": "x"}


def test_bundled_rows_are_the_real_test_set() -> None:
    assert BUNDLED_MMLU.stat().st_size < 2_100_000  # gzip: the repository stays small
    rows = bundled_mmlu_rows()
    assert len(rows) == 14042
    assert all(r["answer"] in "ABCD" and len(r["choices"]) == 4 for r in rows)
    assert not any(r["question"] == "question" for r in rows)
    assert len({r["subject"] for r in rows}) == 57
    assert sum(r["subject"] == "moral scenarios" for r in rows) == 895  # MMLU's own count
    assert (BUNDLED_MMLU.parent / "LICENSE").is_file()


async def test_hub_source_reads_cais_mmlu(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--env.data_source hub`` calls ``datasets.load_dataset("cais/mmlu", "all",
    split="test")`` and maps its integer answers to letters."""
    calls = []

    def load_dataset(*args: object, **kwargs: object) -> list[dict]:
        calls.append((args, kwargs))
        return [
            {"question": f"q{i}", "choices": ["a", "b", "c", "d"], "answer": i % 4, "subject": "s"}
            for i in range(8)
        ]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    env = make_env(MMLUEnv, tiny_model_dir, num_eval_items=2, data_source="hub")
    await env.setup()
    assert calls == [(("cais/mmlu", "all"), {"split": "test"})]
    rows = env.test + env.train
    assert sorted(r["question"] for r in rows) == [f"q{i}" for i in range(8)]
    assert {r["question"]: r["answer"] for r in rows}["q5"] == "B"


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
