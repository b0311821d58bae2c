"""DatasetEnv: named weighted rewards on hand-written answers, config and data errors naming the
field, local JSONL/JSON data, and ``process`` / ``evaluate`` end to end against atropos-serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from environments.dataset_environment.dataset_env import (
    DatasetEnv,
    DatasetEnvConfig,
    load_local_rows,
    normalise_reward_spec,
    render_prompt,
)
from tests.conftest import REPO
from tests.environments.test_gsm8k import assert_valid_groups, fake_sample, make_env, run_process

GSM8K = REPO / "environments" / "data" / "gsm8k"
SCRIPT = REPO / "environments" / "dataset_environment" / "dataset_env.py"
LOCAL_CONFIG = REPO / "environments" / "dataset_environment" / "configs" / "gsm8k_local.yaml"
ROW = {"question": "Janet has 16 eggs, eats 3 and bakes 4. How many are left?", "answer": "#### 9"}


@pytest.fixture()
def env(tiny_model_dir: Path):
    return make_env(
        DatasetEnv,
        tiny_model_dir,
        group_size=4,
        max_token_length=100,
        reward_functions=normalise_reward_spec(
            ["math_verify", {"name": "boxed_format", "weight": 0.5}]
        ),
    )


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------- scoring


def test_weighted_rewards_on_correct_wrong_and_malformed_answers(env) -> None:
    assert env.score_text("16 - 3 - 4 = 9, so \\boxed{9}", ROW) == pytest.approx(1.5)
    assert env.score_text("<think>16-7</think> \\boxed{9}", ROW) == pytest.approx(1.5)
    assert env.score_text("\\boxed{10}", ROW) == pytest.approx(0.5)  # format only
    assert env.score_text("It is 9.", ROW) == 0.0  # math_verify needs a box, like GSM8K
    assert env.score_text("\\boxed{9", ROW) == 0.0  # truncated
    assert env.score_text("", ROW) == 0.0
    assert env.reward_breakdown("\\boxed{10}", ROW) == {"math_verify": 0.0, "boxed_format": 1.0}


def test_group_has_matching_lengths_and_length_penalty_when_all_are_best(env) -> None:
    samples = [fake_sample("\\boxed{9}", 10), fake_sample("\\boxed{8}", 20)]
    group = env.score_samples(samples, ROW)
    assert group["scores"] == [1.5, 0.5]
    assert len(group["tokens"]) == len(group["masks"]) == len(group["inference_logprobs"]) == 2
    assert group["group_overrides"] == {"group_size": 2}
    env.config.length_penalty = True
    group = env.score_samples([fake_sample("\\boxed{9}", n) for n in (10, 80, 95, 60)], ROW)
    # lengths 15, 85, 100, 65 with max 100: factors 1, 0.3, 0, 0.7, times the best reward 1.5
    assert group["scores"] == pytest.approx([1.5, 0.45, 0.0, 1.05])
    env.config.ensure_scores_are_not_same = True
    flat = env.score_samples([fake_sample("no"), fake_sample("nope")], ROW)
    assert flat is not None and len(set(flat["scores"])) == 1  # the sender drops it, counted
    assert env._check_group(flat, abort_on_too_long=False) == "same_scores"


def test_upstream_reward_entries_and_params(tiny_model_dir: Path) -> None:
    spec = normalise_reward_spec(
        [{"type": "choice_letter", "weight": 2, "params": {"num_choices": 5}}, "format"]
    )
    assert spec == [
        {"name": "choice_letter", "weight": 2.0, "params": {"num_choices": 5}},
        {"name": "format", "weight": 1.0, "params": {}},
    ]
    env = make_env(DatasetEnv, tiny_model_dir, reward_functions=spec, answer_field="label")
    row = {"question": "Pick one", "label": "E"}
    assert env.score_text("<think>hm</think>The answer is E", row) == 3.0  # E exists: 5 choices
    assert env.score_text("The answer is E", row) == 2.0  # no think block
    assert env.score_text("The answer is B", row) == 0.0
    assert normalise_reward_spec("math_verify, contains") == [
        {"name": "math_verify", "weight": 1.0, "params": {}},
        {"name": "contains", "weight": 1.0, "params": {}},
    ]


def test_prompt_template_and_system_prompt(env) -> None:
    env.config.prompt_template = "Question: {question}\nAnswer:"
    env.config.system_prompt = "Be brief."
    messages = env.messages_for(ROW)
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"Question: {ROW['question']}\nAnswer:"},
    ]
    with pytest.raises(KeyError, match="prompt_field 'text'"):
        render_prompt(None, ROW, "text")
    with pytest.raises(KeyError, match="prompt_template uses field 'context'"):
        render_prompt("{context} {question}", ROW, "question")


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("fields", "field", "message"),
    [
        ({"dataset_name": None}, "dataset_path", "set dataset_name"),
        ({"dataset_name": "x", "reward_functions": ["nope"]}, "reward_functions", "'nope'"),
        ({"dataset_name": "x", "reward_functions": []}, "reward_functions", "at least one"),
        (
            {"dataset_name": "x", "reward_functions": [{"name": "contains", "weight": "w"}]},
            "reward_functions",
            "weight must be a number",
        ),
        (
            {"dataset_name": "x", "reward_functions": [{"name": "contains", "scale": 2}]},
            "reward_functions",
            "unknown keys",
        ),
        ({"dataset_name": "x", "prompt_template": "{a b}"}, "prompt_template", "field names"),
        ({"dataset_name": "x", "prompt_template": "{oops"}, "prompt_template", "template"),
        ({"dataset_name": "x", "temperature": -1}, "temperature", "greater than"),
    ],
)
def test_config_errors_name_the_field(fields: dict, field: str, message: str) -> None:
    with pytest.raises(ValidationError) as info:
        DatasetEnvConfig(**fields)
    errors = info.value.errors()
    assert [e["loc"][0] for e in errors] == [field]
    assert message in errors[0]["msg"]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_yaml_errors_name_the_key_and_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("env:\n  dataset_path: x.jsonl\n  reward_functions: [math_verify, nope]\n")
    proc = run_cli("process", "--config", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"env.reward_functions in {bad}" in proc.stderr and "'nope'" in proc.stderr
    typo = tmp_path / "typo.yaml"
    typo.write_text("env:\n  dataset_path: x.jsonl\n  prompt_feild: question\n")
    proc = run_cli("process", "--config", str(typo), cwd=tmp_path)
    assert proc.returncode == 2
    assert "env.prompt_feild" in proc.stderr and "prompt_field" in proc.stderr


def test_shipped_configs_validate() -> None:
    import yaml

    for path in (LOCAL_CONFIG.parent).glob("*.yaml"):
        section = yaml.safe_load(path.read_text())["env"]
        config = DatasetEnvConfig(**section)
        assert config.reward_functions, path


# ----------------------------------------------------------------------------- data


def test_local_files_jsonl_json_and_folder(tmp_path: Path) -> None:
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    assert load_local_rows(write_jsonl(tmp_path / "a.jsonl", rows), "train") == rows
    (tmp_path / "b.json").write_text(json.dumps(rows))
    assert load_local_rows(tmp_path / "b.json", "train") == rows
    (tmp_path / "c.json").write_text(json.dumps({"data": rows}))
    assert load_local_rows(tmp_path / "c.json", "train") == rows
    folder = tmp_path / "set"
    folder.mkdir()
    write_jsonl(folder / "test.jsonl", rows[:1])
    assert load_local_rows(folder, "test") == rows[:1]
    with pytest.raises(FileNotFoundError, match="dataset_path: no such file .*train.jsonl"):
        load_local_rows(folder, "train")
    (tmp_path / "bad.jsonl").write_text('{"question": "q"}\n{oops\n')
    with pytest.raises(ValueError, match="line 2"):
        load_local_rows(tmp_path / "bad.jsonl", "train")
    (tmp_path / "d.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="list of rows"):
        load_local_rows(tmp_path / "d.json", "train")
    (tmp_path / "e.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="e.jsonl line 1 is not an object"):
        load_local_rows(tmp_path / "e.jsonl", "train")


async def test_setup_checks_fields_against_the_rows(env, tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"problem": "1+1?", "solution": "2"}])
    env.config.dataset_path = str(data)
    with pytest.raises(KeyError, match="prompt_field 'question'.*problem"):
        await env.setup()
    env.config.prompt_field = "problem"
    with pytest.raises(KeyError, match="answer_field 'answer'.*solution"):
        await env.setup()
    env.config.answer_field = "solution"
    await env.setup()
    assert (await env.get_next_item())["problem"] == "1+1?"
    assert env.test == []  # no eval set configured, a file has no test split


async def test_setup_reads_the_bundled_gsm8k_from_anywhere(env, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # the relative path is found from the repository root
    env.config.dataset_path = "environments/data/gsm8k"
    env.config.max_eval_items = 20
    await env.setup()
    assert len(env.train) == 7473 and len(env.test) == 20
    assert env.test[0]["answer"].endswith("#### 18")  # Janet's ducks, the first test row
    gold_answer = env.test[0]["answer"]
    assert env.score_text("\\boxed{18}", {"answer": gold_answer, "question": "q"}) == 1.5


# ----------------------------------------------------------------------------- end to end


def _metrics(path: Path) -> dict[str, Any]:
    data = json.loads(path.read_text())

    def find(node: Any) -> dict[str, Any] | None:
        if isinstance(node, dict):
            if any(str(k).startswith("eval/") for k in node):
                return node
            for value in node.values():
                found = find(value)
                if found is not None:
                    return found
        return None

    found = find(data)
    assert found is not None, data
    return found


@pytest.mark.slow
def test_process_end_to_end_with_the_shipped_yaml(
    tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    groups = run_process(
        "dataset_environment/dataset_env.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--config",
        str(LOCAL_CONFIG),
        "--env.total_steps",
        "2",
        "--env.group_size",
        "3",
        "--env.max_token_length",
        "48",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 3)
    assert all(0.0 <= s <= 1.2 for g in groups for s in g["scores"])
    assert groups[0]["messages"][0][0]["content"].startswith("Solve the problem step by step")


@pytest.mark.slow
def test_evaluate_end_to_end_on_generated_data(
    tiny_serve, tiny_model_dir: Path, tmp_path: Path
) -> None:
    rows = [{"text": f"What is {i} + {i}?", "label": str(2 * i)} for i in range(4)]
    data = write_jsonl(tmp_path / "eval.jsonl", rows)
    out = tmp_path / "evals"
    proc = run_cli(
        "evaluate",
        "--env.dataset_path",
        str(data),
        "--env.eval_dataset_path",
        str(data),
        "--env.prompt_field",
        "text",
        "--env.answer_field",
        "label",
        "--env.reward_functions",
        '["exact_match", {"name": "contains", "weight": 0.5}]',
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
    metrics = _metrics(out / "metrics.json")
    assert metrics["eval/num_items"] == 4
    for key in ("eval/mean_score", "eval/percent_correct", "eval/reward/exact_match"):
        assert 0.0 <= metrics[key] <= 1.5
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    assert {s["gold_answer"] for s in samples} == {"0", "2", "4", "6"}
    assert all(set(s["rewards"]) == {"exact_match", "contains"} for s in samples)
