"""``OpenEnvEnv``: OpenEnv environments played in process and against their server (WebSocket
sessions), with the scripted model on a real ``atropos-serve``: every episode of a group starts
from the same ``reset(seed)``, observations are masked, every model turn is trained on, and the
score is the episode's rewards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from atroposlib.envs.openenv_env import OpenEnvEnv
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.schema import ScoredData, check_group
from atroposlib.utils.processes import ChildProcess
from tests.conftest import REPO, free_port
from tests.envs.conftest import ACT
from tests.envs.test_environment_class import _process, reply_ids, trained_turns

GUESS_PATHS = {"pear": (["pear"], 1.0), "apple": (["apple", "pear"], 0.75)}
WALK_PATHS = {
    ACT % ("north", 3): ([ACT % ("north", 3)], 1.0),
    ACT % ("north", 1): ([ACT % ("north", 1), ACT % ("north", 2)], 0.5),
    # refused by step (ValueError): the error goes back, the model gives up; no reward at all
    ACT % ("south", 1): ([ACT % ("south", 1), "Sorry."], 0.0),
}


@pytest.fixture()
async def made() -> Any:
    envs: list[OpenEnvEnv] = []
    yield envs
    for env in envs:
        await env.server.close()


def make(scripted_tools, made: list, **overrides: Any) -> OpenEnvEnv:
    serve, model = scripted_tools
    config, _ = OpenEnvEnv.config_init()
    config = config.model_copy(
        update={"tokenizer_name": str(model), "group_size": 8, "eval_items": 2, **overrides}
    )
    server = APIServerConfig(
        model_name="tiny", base_url=serve.url + "/v1", api_key="x", server_type="vllm",
        tokenizer_name=str(model), timeout=120,
    )  # fmt: skip
    env = OpenEnvEnv(config, [server])
    made.append(env)
    return env


def assert_paths(group: dict, tokenizer: Any, paths: dict) -> set[str]:
    """Every sequence follows a known path: its trained spans are exactly the path's replies,
    its score is the path's; the observations are in the sequence but masked."""
    check_group(ScoredData(**group))
    seen = set()
    for tokens, masks, logprobs, score in zip(
        group["tokens"], group["masks"], group["inference_logprobs"], group["scores"], strict=True
    ):
        spans = trained_turns(tokens, masks)
        first = tokenizer.decode(spans[0], skip_special_tokens=True)
        replies, reward = paths[first]
        seen.add(first)
        assert spans == [reply_ids(tokenizer, r) for r in replies]
        assert score == pytest.approx(reward)
        assert all(lp == 1.0 for lp, m in zip(logprobs, masks, strict=True) if m == -100)
    return seen


async def test_a_text_game_in_process(scripted_tools, made) -> None:
    env = make(
        scripted_tools, made, environment="tests.envs.openenv_envs:WordGuess", seeds=1, eval_items=1
    )
    await env.setup()
    assert env.action_mode == "text" and env.text_field == "guess"
    tokenizer = AutoTokenizer.from_pretrained(str(scripted_tools[1]))
    group, _ = await env.collect_trajectories({"seed": 1})  # the fruit of seed 1 is pear
    seen = assert_paths(group, tokenizer, GUESS_PATHS)
    assert seen
    for messages in group["messages"]:
        assert messages[0] == {"role": "user", "content": "Guess my fruit (4 letters)."}
        if messages[1]["content"] == "apple":
            assert messages[2] == {"role": "user", "content": "Not my fruit."}
    # greedy, on the seed after the training ones (1: pear): "pear" and "apple" tie and the
    # scripted model's argmax takes the lower first token id (pear's): right at once
    metrics = await env.evaluate()
    assert metrics == {
        "eval/mean_reward": 1.0, "eval/turns": 1.0, "eval/invalid_actions": 0.0,
        "eval/done_rate": 1.0,
    }  # fmt: skip


async def test_tool_actions_in_process(scripted_tools, made, tmp_path: Path) -> None:
    traces = tmp_path / "traces.jsonl"
    env = make(
        scripted_tools, made, environment="tests.envs.openenv_envs:Walk",
        training_trace_path=str(traces),
    )  # fmt: skip
    await env.setup()
    assert env.action_mode == "tool"  # two fields: direction and steps
    assert set(env.action_schema["properties"]) == {"direction", "steps"}
    tokenizer = AutoTokenizer.from_pretrained(str(scripted_tools[1]))
    group, _ = await env.collect_trajectories({"seed": 0})
    assert assert_paths(group, tokenizer, WALK_PATHS)
    overrides = group.get("overrides") or [{}] * len(group["tokens"])
    for messages, override in zip(group["messages"], overrides, strict=True):
        refused = "no way 'south'" in json.dumps(messages)
        assert bool(override.get("set_advantage_to_zero")) == refused  # unscored: no signal
        assert messages[0]["role"] == "system" and '"name": "act"' in messages[0]["content"]
        tools = [m["content"] for m in messages if m["role"] == "tool"]
        if (
            len(tools) == 1 and not refused
        ):  # one step north, then two: the corridor observation in between
            assert json.loads(tools[0].split("\n")[1]) == {"position": 1, "message": "corridor"}
    assert_training_traces(group, traces, seed=0)


def assert_training_traces(group: dict, path: Path, seed: int) -> None:
    """``--env.training_trace_path``: each sequence as an OpenEnv TrainingTrace (validated by
    OpenEnv), one turn per trained span: its prompt is the sequence before it, its completion
    the span, with the sampler's log-probs; loss mask 0 on the prompt, 1 on the completion."""
    from openenv.core.harness import TrainingTrace

    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["score"] for r in records] == group["scores"]
    assert {r["seed"] for r in records} == {seed}
    for record, tokens, masks, logprobs in zip(
        records, group["tokens"], group["masks"], group["inference_logprobs"], strict=True
    ):
        trace = TrainingTrace.model_validate(record["training_trace"])
        assert len(trace.turns) == len(trained_turns(tokens, masks)) >= 1
        for turn in trace.turns:
            start = len(turn.prompt_token_ids)
            end = start + len(turn.completion_token_ids)
            assert tokens[:end] == turn.prompt_token_ids + turn.completion_token_ids
            assert masks[start:end] == turn.completion_token_ids
            assert turn.per_token_logps == logprobs[start:end]
            assert turn.loss_mask == [0] * start + [1] * (end - start)
        last = trace.turns[-1]
        assert len(last.prompt_token_ids) + len(last.completion_token_ids) <= len(tokens)


def test_training_traces_need_sampler_logprobs() -> None:
    from atroposlib.envs.openenv_env import training_traces

    group = {"tokens": [[1, 2, 3]], "masks": [[-100, 2, 3]], "scores": [1.0]}
    with pytest.raises(ValueError, match="inference_logprobs"):
        training_traces(group)
    group["inference_logprobs"] = [[1.0, 0.5, -0.1]]  # a positive log-prob: OpenEnv refuses
    with pytest.raises(ValueError, match="logprobs must not be positive"):
        training_traces(group)


def test_the_server_in_session_mode(scripted_tools, tmp_path: Path) -> None:
    """The word game behind OpenEnv's own server (uvicorn): one WebSocket session an episode."""
    model = scripted_tools[1]
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    server = ChildProcess(
        "openenv-server",
        [sys.executable, "-m", "uvicorn", "tests.envs.openenv_envs:app", "--port", str(port)],
        tmp_path / "openenv.log",
        env=env,
        cwd=REPO,
    ).start()
    try:
        server.wait_ready(f"http://127.0.0.1:{port}/health", timeout=60)
        out = tmp_path / "groups.jsonl"
        argv = ["-m", "atroposlib.envs.openenv_env"]
        url = f"http://127.0.0.1:{port}"
        steps = ["--env.total_steps", "2", "--env.seeds", "2"]
        proc = _process(scripted_tools, tmp_path, argv, "--env.url", url, *steps)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    groups = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(groups) == 2
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    by_seed = {}
    for group in groups:
        first = group["messages"][0][0]["content"]
        by_seed[first] = group
        assert len({json.dumps(m[0]) for m in group["messages"]}) == 1  # one reset per group
    # seed 1 (pear) follows the scripted paths; seed 0 (apple, 5 letters) has no script
    assert_paths(by_seed["Guess my fruit (4 letters)."], tokenizer, GUESS_PATHS)
    assert "Guess my fruit (5 letters)." in by_seed


def test_settings_errors_name_the_flag(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    both = subprocess.run(
        [
            sys.executable,
            "-m",
            "atroposlib.envs.openenv_env",
            "process",
            "--env.environment",
            "tests.envs.openenv_envs:WordGuess",
            "--env.url",
            "http://127.0.0.1:9",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    assert both.returncode == 2
    assert "give --env.environment (in process) or --env.url (a server), not both" in both.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "atroposlib.envs.openenv_env", "process", "--env.environment", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and "--env.environment 'x'" in bad.stderr


def test_an_openenv_environment_passes_check(scripted_tools) -> None:
    from atroposlib.envs.check import check_env

    serve, model = scripted_tools
    report = check_env(
        OpenEnvEnv,
        [
            "--env.environment",
            "tests.envs.openenv_envs:Walk",
            "--env.group_size",
            "4",
            "--env.tokenizer_name",
            str(model),
            "--openai.base_url",
            serve.url + "/v1",
            "--openai.model_name",
            "tiny",
            "--openai.server_type",
            "vllm",
            "--openai.api_key",
            "x",
            "--check.serve",
            "never",
            "--check.eval_items",
            "2",
        ],  # fmt: skip
    )
    assert report.ok, report.render()
    assert report.evaluated is not None and "eval/mean_reward" in report.evaluated
