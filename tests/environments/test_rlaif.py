"""RLAIF: prompt loading, judge scoring against a real endpoint (the tiny atropos-serve,
whose replies never parse: failures are counted and neutral), ``process`` and ``evaluate``
end to end with the same server as policy and judge."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.environments.test_gsm8k import assert_valid_groups, make_env, run_env, run_process

sys.path.insert(0, str(REPO / "environments"))

from rlaif_server import PROMPTS, RLAIFEnv, load_prompts  # noqa: E402


def test_prompt_file_and_config_errors(tmp_path: Path, tiny_model_dir: Path) -> None:
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "Say hi", "reference": "Hi!"}\n\n{"prompt": "Say bye"}\n')
    assert load_prompts(good) == [
        {"prompt": "Say hi", "reference": "Hi!"},
        {"prompt": "Say bye", "reference": None},
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="line 2 lacks \\['prompt'\\]"):
        load_prompts(bad)
    with pytest.raises(FileNotFoundError, match="prompts_path"):
        load_prompts(tmp_path / "missing.jsonl")
    assert len(PROMPTS) >= 20 and all(p and r for p, r in PROMPTS)


async def test_bad_rubric_scale_is_named(tiny_model_dir: Path) -> None:
    env = make_env(RLAIFEnv, tiny_model_dir, rubric_min=5, rubric_max=5)
    with pytest.raises(ValueError, match="rubric_max"):
        await env.setup()


@pytest.mark.slow
async def test_unparseable_judge_replies_are_counted_and_neutral(
    tiny_serve, tiny_model_dir: Path
) -> None:
    for mode in ("pairwise", "rubric"):
        env = make_env(
            RLAIFEnv,
            tiny_model_dir,
            judge_base_url=tiny_serve.url + "/v1",
            judge_model_name="tiny",
            judge_mode=mode,
            judge_max_tokens=8,
            judge_retries=1,
        )
        await env.setup()
        scores = await env.score_answers("Say hi", ["Hi!", "Hello there.", "hey"])
        assert len(scores) == 3 and all(-1.0 <= s <= 1.0 for s in scores)
        stats = env.judge_stats
        assert stats.calls > 0 and stats.errors == 0
        # a random tiny model never writes a verdict: every call failed to parse, was
        # retried once, and the answers scored neutral
        assert stats.parse_failures == stats.calls
        assert scores == [0.0, 0.0, 0.0]
        await env.client.close()


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
@pytest.mark.slow
def test_process_and_evaluate_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    judge = ["--env.judge_base_url", tiny_serve.url + "/v1", "--env.judge_model_name", "tiny"]
    groups = run_process(
        "rlaif_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        *judge,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "3",
        "--env.max_answer_tokens",
        "16",
        "--env.judge_max_tokens",
        "8",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 3)
    assert all(-1.0 <= s <= 1.0 for g in groups for s in g["scores"])
    evals = tmp_path / "evals"
    proc = run_env(
        "rlaif_server.py", "evaluate", tmp_path, tiny_serve, tiny_model_dir, *judge,
        "--env.num_eval_prompts", "2", "--env.max_answer_tokens", "16",
        "--env.judge_max_tokens", "8", "--env.data_dir_to_save_evals", str(evals),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((evals / "metrics.json").read_text())
    flat = json.dumps(metrics)
    for key in (
        "eval/mean_rubric_score",
        "eval/win_rate_vs_reference",
        "eval/judge_parse_failure_rate",
    ):
        assert key in flat
