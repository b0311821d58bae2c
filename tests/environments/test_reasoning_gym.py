"""ReasoningGymEnv: answer extraction and the tasks' own scoring on hand-written answers, config
errors naming the field, and ``process`` / ``evaluate`` end to end against atropos-serve (no
dataset download: every item is generated)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed")

from environments.reasoning_gym_environment.reasoning_gym_environment import (  # noqa: E402
    ReasoningGymEnv,
    ReasoningGymEnvConfig,
    extract_answer,
    score_answer,
)
from tests.conftest import REPO  # noqa: E402
from tests.environments.test_gsm8k import (  # noqa: E402
    assert_valid_groups,
    fake_sample,
    make_env,
    run_process,
)

SCRIPT = REPO / "environments" / "reasoning_gym_environment" / "reasoning_gym_environment.py"


@pytest.fixture()
def env(tiny_model_dir: Path):
    return make_env(
        ReasoningGymEnv,
        tiny_model_dir,
        group_size=4,
        max_token_length=100,
        tasks=["basic_arithmetic", "gsm_symbolic"],
    )


@pytest.fixture(scope="module")
def arithmetic():
    """A generated basic_arithmetic item, its answer and the dataset that scores it."""
    entry, dataset = ReasoningGymEnv.make_item("basic_arithmetic", 7)
    return entry, dataset, str(entry["answer"])


# ----------------------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>3+4</think>So: <answer>7</answer>", "7"),
        ("<answer> 7 </answer> because 3+4", "7"),
        ("<think><answer>6</answer> no wait</think><answer>7</answer>", "7"),
        ("<answer>6</answer> or <answer>7</answer>", None),  # hedging: upstream gives 0
        ("<think>inside only <answer>7</answer></think>done", "7"),
        ("3 + 4 = 7, so \\boxed{7}", "7"),
        ("Let me add.\nThe answer is 7.", "7"),
        ("Final answer: 7", "7"),
        ("So, the answer is 144.\n\nI hope this helps!", "144"),
        ("The answer is: 2", "2"),
        ("<think>never closed 7", None),
        ("", None),
        (None, None),
    ],
)
def test_extract_answer(text, expected) -> None:
    assert extract_answer(text) == expected


def test_strict_mode_needs_answer_tags() -> None:
    assert extract_answer("\\boxed{7}", require_tags=True) is None
    assert extract_answer("Answer: 7", require_tags=True) is None
    assert extract_answer("<answer>7</answer>", require_tags=True) == "7"


# ----------------------------------------------------------------------------- scoring


def test_task_scoring_of_correct_wrong_and_malformed_answers(env, arithmetic) -> None:
    entry, dataset, answer = arithmetic
    assert env.score_text(f"<think>...</think><answer>{answer}</answer>", entry, dataset) == 1.0
    assert env.score_text(f"Working it out.\n{answer}", entry, dataset) == 1.0
    assert env.score_text(f"\\boxed{{{answer}}}", entry, dataset) == 1.0
    assert env.score_text("<answer>123456789</answer>", entry, dataset) == 0.0
    assert env.score_text(f"<answer>{answer}</answer><answer>1</answer>", entry, dataset) == 0.0
    assert env.score_text(f"<think>{answer}", entry, dataset) == 0.0  # truncated thinking
    assert env.score_text("", entry, dataset) == 0.0
    env.config.require_answer_tags = True
    assert env.score_text(f"\\boxed{{{answer}}}", entry, dataset) == 0.0


def test_better_of_two_formats_and_verifier_errors(arithmetic) -> None:
    entry, _, answer = arithmetic

    class TagOnlyVerifier:
        """A task verifier that only accepts the tagged form (as some reasoning-gym tasks do)."""

        def score_answer(self, answer: str, entry: dict) -> float:
            return 1.0 if answer == f"<answer>{entry['answer']}</answer>" else 0.1

    class BrokenVerifier:
        def score_answer(self, answer: str, entry: dict) -> float:
            raise RuntimeError("verifier bug")

    assert score_answer(TagOnlyVerifier(), entry, answer) == 1.0
    assert score_answer(TagOnlyVerifier(), entry, "0") == 0.1
    assert score_answer(BrokenVerifier(), entry, answer) == 0.0
    assert score_answer(TagOnlyVerifier(), entry, None) == 0.0


def test_gsm_symbolic_task(env) -> None:
    entry, dataset = ReasoningGymEnv.make_item("gsm_symbolic", 3)
    right = f"<think>step by step</think><answer>{entry['answer']}</answer>"
    assert env.score_text(right, entry, dataset) == 1.0
    # a wrong but well-formed number gets the task's own small partial credit (0.01)
    wrong = env.score_text("<answer>-1</answer>", entry, dataset)
    assert wrong == dataset.score_answer(answer="-1", entry=entry) < 0.5
    assert env.score_text("I am not sure.\n\n<answer></answer>", entry, dataset) < 0.5
    assert env.score_text("<think>20", entry, dataset) == 0.0


def test_group_lengths_overrides_and_length_penalty(env, arithmetic) -> None:
    entry, dataset, answer = arithmetic
    cut = fake_sample("<think>still going", 30)
    cut.finish_reason = "length"
    samples = [fake_sample(f"<answer>{answer}</answer>"), fake_sample("<answer>0</answer>"), cut]
    group = env.score_samples(samples, entry, dataset)
    assert group["scores"] == [1.0, 0.0, 0.0]
    assert group["overrides"] == [{}, {}, {"set_advantage_to_zero": True}]
    assert len(group["tokens"]) == len(group["masks"]) == len(group["inference_logprobs"]) == 3
    assert group["group_overrides"] == {"group_size": 3}
    # all correct: lengths 15, 80, 90, 100 with max 100 and upstream's 75% threshold
    right = [fake_sample(f"<answer>{answer}</answer>", n) for n in (10, 75, 85, 95)]
    group = env.score_samples(right, entry, dataset)
    assert group["scores"] == pytest.approx([1.0, 0.8, 0.4, 0.0])
    env.config.ensure_scores_are_not_same = True
    flat = env.score_samples([fake_sample("x"), fake_sample("y")], entry, dataset)
    assert flat is not None and len(set(flat["scores"])) == 1  # the sender drops it, counted
    assert env._check_group(flat, abort_on_too_long=False) == "same_scores"
    short = env.score_samples([fake_sample(f"<answer>{answer}</answer>", 3)], entry, dataset)
    assert short is None  # fewer than min_completion_tokens (10) trainable tokens


# ----------------------------------------------------------------------------- items & config


async def test_items_are_generated_offline_and_deterministic(env) -> None:
    await env.setup()
    assert len(env.test) == 2 * env.config.num_eval_samples_per_task
    first = [(await env.get_next_item())["entry"]["question"] for _ in range(4)]
    tasks = {(await env.get_next_item())["task"] for _ in range(20)}
    assert tasks == {"basic_arithmetic", "gsm_symbolic"}
    await env.setup()
    assert [(await env.get_next_item())["entry"]["question"] for _ in range(4)] == first
    assert len(set(first)) == 4


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"tasks": "basic_arithmetc"}, "tasks", "did you mean basic_arithmetic"),
        ({"tasks": []}, "tasks", "at least one"),
        ({"tasks": [3]}, "tasks", "list of task names"),
        ({"num_eval_samples_per_task": 0}, "num_eval_samples_per_task", "greater than"),
        ({"length_penalty_threshold": 1.0}, "length_penalty_threshold", "less than"),
    ],
)
def test_config_errors_name_the_field(fields: dict, field: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        ReasoningGymEnvConfig(**fields)
    errors = info.value.errors()
    assert [e["loc"][0] for e in errors] == [field]
    assert message in errors[0]["msg"]


def test_tasks_flag_forms() -> None:
    assert ReasoningGymEnvConfig(tasks="gcd, chain_sum").tasks == ["gcd", "chain_sum"]
    assert len(ReasoningGymEnvConfig(tasks="all").tasks) > 100


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cli_error_names_the_flag(tmp_path: Path) -> None:
    proc = cli("process", "--env.tasks", "gsm_symbolik", cwd=tmp_path)
    assert proc.returncode == 2
    assert "--env.tasks 'gsm_symbolik'" in proc.stderr and "gsm_symbolic" in proc.stderr


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_process_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = run_process(
        "reasoning_gym_environment/reasoning_gym_environment.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.tasks",
        "basic_arithmetic,gsm_symbolic",
        "--env.total_steps",
        "2",
        "--env.group_size",
        "3",
        "--env.max_token_length",
        "48",
        "--env.min_completion_tokens",
        "1",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 3)
    assert all(0.0 <= s <= 1.0 for g in groups for s in g["scores"])
    for group in groups:
        assert len(group["overrides"]) == len(group["tokens"])
        assert group["messages"][0][1]["content"]  # the generated question


@pytest.mark.slow
def test_evaluate_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "evals"
    proc = cli(
        "evaluate",
        "--env.tasks",
        "basic_arithmetic,chain_sum",
        "--env.num_eval_samples_per_task",
        "2",
        "--env.max_token_length",
        "24",
        "--env.use_wandb",
        "false",
        "--env.data_dir_to_save_evals",
        str(out),
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--openai.base_url",
        tiny_serve.url + "/v1",
        "--openai.model_name",
        "tiny",
        "--openai.tokenizer_name",
        str(tiny_model_dir),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = (out / "metrics.json").read_text()
    for key in ("eval/percent_correct", "eval/basic_arithmetic/score", "eval/chain_sum/score"):
        assert key in text
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    assert {s["task"] for s in samples} == {"basic_arithmetic", "chain_sum"}
    assert all(0.0 <= s["score"] <= 1.0 for s in samples)


@pytest.mark.slow
def test_serve_feeds_a_trainer(start_api, tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.envs.helpers import Trainer, start_env, stop

    api = start_api()
    trainer = Trainer(api.url, batch_size=8, max_token_len=512, num_steps=1)
    trainer.register()
    proc = start_env(
        SCRIPT,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--openai.base_url",
        f"{tiny_serve.url}/v1",
        "--openai.model_name",
        "tiny",
        "--openai.tokenizer_name",
        str(tiny_model_dir),
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.use_wandb",
        "false",
        "--env.tasks",
        "basic_arithmetic",
        "--env.total_steps",
        "1",
        "--env.group_size",
        "4",
        "--env.max_token_length",
        "32",
        "--env.min_completion_tokens",
        "1",
        "--env.ensure_scores_are_not_same",
        "false",
        log=tmp_path / "env.log",
    )
    try:
        trainer.pull(1, timeout=120)
        rc = proc.wait(60)
    finally:
        stop(proc)
        trainer.close()
    log = (tmp_path / "env.log").read_text()
    assert rc == 0, log[-3000:]
    groups = trainer.groups()
    assert len(groups) >= 2
    assert_valid_groups(groups, 4)
