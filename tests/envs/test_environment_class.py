"""``EnvironmentClassEnv``: TRL-style environment classes (``environment_factory``) played as
multi-turn tool envs against a real ``atropos-serve``.

The server runs the scripted model (``tests/upstream_envs/standins/scripted_lm.py``): a causal
LM whose replies are chosen by what the prompt contains, so each episode follows one of a few
known paths (call a tool, read its result, call again or answer), and the trained tokens can be
checked against the replies' exact token ids.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from atroposlib.envs import EnvironmentClassEnv
from atroposlib.envs.environment_class import EnvironmentContractError, load_factory
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.schema import ScoredData, check_group
from tests.conftest import REPO
from tests.envs.conftest import BAD, CALL, MOVE
from tests.envs.env_classes import Counter, NoReset, NoReward, TinyTextGame, Undescribed

#: Each counter path: the assistant turns, the tool results, the reward.
COUNTER_PATHS = {
    CALL % 1: ([CALL % 1, CALL % 1, "Done."], ["1", "2"], 1.0),
    CALL % 2: ([CALL % 2, "Done."], ["2"], 1.0),
    "I give up.": (["I give up."], [], 0.0),
    BAD: ([BAD, "Sorry."], ['{"error": "arguments.step: expected integer, got str"}'], 0.0),
}
GAME_PATHS = {
    MOVE % "north": (
        [MOVE % "north", MOVE % "north", "I won."],
        ["You see a door.", "You found the treasure!"],
        1.0,
    ),
    MOVE % "up": (
        [MOVE % "up", "Sorry."],
        ['{"error": "ValueError: no such direction \'up\'"}'],
        0.0,
    ),
}


@pytest.fixture(scope="module")
def scripted(scripted_tools):
    return scripted_tools


@pytest.fixture(scope="module")
def tokenizer(scripted) -> Any:
    return AutoTokenizer.from_pretrained(str(scripted[1]))


@pytest.fixture()
async def made() -> Any:
    """Envs made by the test; their server connections are closed afterwards."""
    envs: list[EnvironmentClassEnv] = []
    yield envs
    for env in envs:
        await env.server.close()


def make(
    env_cls: type[EnvironmentClassEnv], scripted, made: list | None = None, **overrides: Any
) -> EnvironmentClassEnv:
    """An env built as the CLI builds it, on the scripted server as a token server."""
    serve, model = scripted
    config, _ = env_cls.config_init()
    config = config.model_copy(
        update={"tokenizer_name": str(model), "use_wandb": False, "group_size": 8, **overrides}
    )
    server = APIServerConfig(
        model_name="tiny",
        base_url=serve.url + "/v1",
        api_key="x",
        server_type="vllm",
        tokenizer_name=str(model),
        timeout=120,
    )
    env = env_cls(config, [server])
    if made is not None:
        made.append(env)
    return env


def reply_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def trained_turns(tokens: list[int], masks: list[int]) -> list[list[int]]:
    """The token ids of each trained span (one per assistant turn)."""
    spans: list[list[int]] = []
    for i, (token, mask) in enumerate(zip(tokens, masks, strict=True)):
        if mask != -100:
            if i == 0 or masks[i - 1] == -100:
                spans.append([])
            spans[-1].append(token)
    return spans


def assert_episodes_follow_paths(
    group: dict, tokenizer: Any, paths: dict, tool_format: str = "hermes"
) -> set[str]:
    """Each sequence is one known path: every trained span is exactly one of the path's replies
    (its token ids and the end-of-turn token; nothing else is trained on), the tool results are
    in the sequence but masked, the score is the path's reward. Returns the paths seen."""
    check_group(ScoredData(**group))
    seen = set()
    for tokens, masks, logprobs, score, messages in zip(
        group["tokens"],
        group["masks"],
        group["inference_logprobs"],
        group["scores"],
        group["messages"],
        strict=True,
    ):
        spans = trained_turns(tokens, masks)
        first = tokenizer.decode(spans[0], skip_special_tokens=True)
        replies, results, reward = paths[first]
        seen.add(first)
        assert spans == [reply_ids(tokenizer, reply) for reply in replies]
        assert score == reward
        wrap = "<tool_response>\n{}\n</tool_response>" if tool_format == "hermes" else "{}"
        tool_results = [m["content"] for m in messages if m["role"] == "tool"]
        assert tool_results == [wrap.format(r) for r in results]
        assert sum(m["role"] == "assistant" for m in messages) == len(replies)
        text = tokenizer.decode(tokens)
        for result in results:  # the tool results are in the sequence, not trained on
            assert f"<|im_start|>tool\n{wrap.format(result)}<|im_end|>" in text
        assert all(lp == 1.0 for lp, m in zip(logprobs, masks, strict=True) if m == -100)
        assert all(-1.0 < lp <= 0.0 for lp, m in zip(logprobs, masks, strict=True) if m != -100)
    return seen


@pytest.mark.parametrize("tool_format", ["auto", "openai"])
async def test_counter_group_is_token_exact_across_turns(
    scripted, tokenizer, made, tool_format: str
) -> None:
    env_cls = EnvironmentClassEnv.wrap(Counter, rows=[{"prompt": "Use the counter."}])
    env = make(env_cls, scripted, made, tool_format=tool_format)
    await env.setup()
    # SmolLM2's template does not render tools: auto lists them in the system prompt (hermes)
    resolved = "hermes" if tool_format == "auto" else tool_format
    assert env.resolved_tool_format == resolved
    group, backlog = await env.collect_trajectories({"prompt": "Use the counter.", "target": 2})
    assert backlog == [] and len(group["tokens"]) == 8
    seen = assert_episodes_follow_paths(group, tokenizer, COUNTER_PATHS, resolved)
    assert len(seen) >= 2  # 8 samples over 4 paths
    user = {"role": "user", "content": "Use the counter. Reach 2."}
    if resolved == "hermes":
        system, first = group["messages"][0][:2]
        assert system["role"] == "system" and '"name": "increment"' in system["content"]
    else:  # the tools travel in the request; the replies' calls come back parsed
        first = group["messages"][0][0]
        for messages in group["messages"]:
            for message in messages:
                if message["role"] == "assistant" and message.get("tool_calls"):
                    assert message["tool_calls"][0]["function"]["name"] == "increment"
                if message["role"] == "tool":
                    assert message["name"] == "increment" and message["tool_call_id"]
    assert first == user
    assert group["generation_params"] == {"temperature": 1.0}
    assert "overrides" not in group  # get_reward scored every episode
    # the instances went back to the pool, to be reset for the next group
    assert len(env._pool) == 8
    await env.collect_trajectories({"prompt": "Use the counter.", "target": 2})
    assert len(env._pool) == 8


async def test_game_without_rows_tool_errors_reach_the_model(scripted, tokenizer, made) -> None:
    env = make(EnvironmentClassEnv.wrap(TinyTextGame), scripted, made, eval_items=2)
    await env.setup()
    assert env.train_rows == [] and await env.get_next_item() == {}
    group, _ = await env.collect_trajectories({})
    seen = assert_episodes_follow_paths(group, tokenizer, GAME_PATHS)
    assert seen  # winning and/or erroring episodes, each checked
    system = group["messages"][0][0]["content"]
    assert '"name": "move"' in system and '"name": "look"' in system  # async tools too
    assert "_secret" not in system and '"name": "reset"' not in system
    # greedy evaluation: "north" and "up" tie after their shared start and the scripted model's
    # argmax takes the lower token id ("up"): an error from the tool, then "Sorry."
    metrics = await env.evaluate()
    assert metrics["eval/mean_reward"] == 0.0 and metrics["eval/TinyTextGame"] == 0.0
    assert metrics["eval/turns"] == 2.0
    assert metrics["eval/tool_calls"] == 1.0 and metrics["eval/tool_failures"] == 1.0


async def test_reward_functions_and_unscored_episodes(scripted, tokenizer, made) -> None:
    """TRL-style reward functions get the group's completions and environments; an episode
    no term scores is sent with set_advantage_to_zero."""
    calls: list[dict] = []

    def counted(completions, environments, target, **kwargs):
        calls.append({"completions": completions, "target": target, **kwargs})
        return [
            float(e.count == t) if e.count else None
            for e, t in zip(environments, target, strict=True)
        ]

    def tool_use(completions, **kwargs):  # None (not scored) when no tool ran
        return [float(sum(m["role"] == "tool" for m in c)) or None for c in completions]

    env_cls = EnvironmentClassEnv.wrap(
        NoReward, reward_funcs=[counted, tool_use], reward_weights=[1.0, 0.0]
    )
    env = make(env_cls, scripted, made)
    await env.setup()
    row = {"prompt": "Use the counter. Reach 2.", "target": 2}
    group, _ = await env.collect_trajectories(row)
    (call,) = calls
    assert call["target"] == [2] * 8 and call["trainer_state"] is None
    assert len(call["prompts"]) == len(call["completion_ids"]) == 8
    for completion, messages in zip(call["completions"], group["messages"], strict=True):
        assert completion == messages[len(messages) - len(completion) :]
        assert completion[0]["role"] == "assistant"
    overrides = group.get("overrides") or [{}] * 8
    for score, override, messages in zip(
        group["scores"], overrides, group["messages"], strict=True
    ):
        first = [m["content"] for m in messages if m["role"] == "assistant"][0]
        if first == "I give up.":  # no term scored it
            assert override == {"set_advantage_to_zero": True} and score == 0.0
        elif first == BAD:  # only tool_use (weight 0) scored it
            assert not override.get("set_advantage_to_zero") and score == 0.0
        else:
            assert not override.get("set_advantage_to_zero") and score == 1.0


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (Undescribed, r"Undescribed\.poke: cannot describe it as a tool .*argument 'x'"),
        (NoReset, r"NoReset\.reset: missing"),
        (NoReward, r"NoReward: no reward source: define get_reward\(\)"),
    ],
)
async def test_contract_errors_name_the_class_and_method(scripted, made, factory, message) -> None:
    env = make(EnvironmentClassEnv.wrap(factory), scripted, made)
    with pytest.raises(EnvironmentContractError, match=message):
        await env.setup()


def test_factory_specs_name_the_flag() -> None:
    assert load_factory("tests.envs.env_classes:Counter") is Counter
    path = str(REPO / "tests" / "envs" / "env_classes.py")
    assert load_factory(f"{path}:TinyTextGame").__name__ == "TinyTextGame"
    for spec, why in [
        ("tests.envs.env_classes", "expected 'package.module:Class'"),
        ("no_such_module_x:Env", "cannot import 'no_such_module_x'"),
        ("tests.envs.env_classes:Missing", "'tests.envs.env_classes' has no callable 'Missing'"),
    ]:
        with pytest.raises(ValueError, match=f"--env.environment_factory: {why}"):
            load_factory(spec)


def _process(scripted, tmp_path: Path, argv: list[str], *extra: str) -> subprocess.CompletedProcess:
    serve, model = scripted
    out = tmp_path / "groups.jsonl"
    cmd = [
        sys.executable,
        *argv,
        "process",
        "--env.total_steps",
        "1",
        "--env.group_size",
        "4",
        "--env.tokenizer_name",
        str(model),
        "--env.data_path_to_save_groups",
        str(out),
        "--openai.base_url",
        serve.url + "/v1",
        "--openai.model_name",
        "tiny",
        "--openai.server_type",
        "vllm",
        "--openai.api_key",
        "x",
        *extra,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONPATH": str(REPO)}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_an_env_file_that_wraps_a_class_processes_a_group(scripted, tokenizer, tmp_path) -> None:
    proc = _process(scripted, tmp_path, [str(REPO / "tests" / "envs" / "env_classes.py")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (group,) = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert_episodes_follow_paths(group, tokenizer, COUNTER_PATHS)


def test_the_module_runs_a_class_named_on_the_command_line(scripted, tokenizer, tmp_path) -> None:
    factory = f"{REPO / 'tests' / 'envs' / 'env_classes.py'}:TinyTextGame"
    argv = ["-m", "atroposlib.envs.environment_class"]
    proc = _process(scripted, tmp_path, argv, "--env.environment_factory", factory)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (group,) = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    assert_episodes_follow_paths(group, tokenizer, GAME_PATHS)
    bad = _process(scripted, tmp_path, argv, "--env.environment_factory", "nowhere")
    assert bad.returncode != 0
    assert bad.returncode == 2
    assert "error: --env.environment_factory 'nowhere': Value error, expected" in bad.stderr
    missing = _process(scripted, tmp_path, argv, "--env.environment_factory", "nowhere:Env")
    assert missing.returncode == 1
    assert "--env.environment_factory: cannot import 'nowhere'" in missing.stderr


def test_the_documented_example_runs(scripted, tmp_path: Path) -> None:
    """docs/env-adapters.md's counter, copied as a user would, processes a group."""
    doc = (REPO / "docs" / "env-adapters.md").read_text()
    section = doc[doc.index("## TRL environment classes") :]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    script = tmp_path / "counter_env.py"
    script.write_text(code)
    proc = _process(scripted, tmp_path, [str(script)], "--env.max_tokens_per_turn", "16")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (group,) = [json.loads(line) for line in (tmp_path / "groups.jsonl").read_text().splitlines()]
    check_group(ScoredData(**group))
    assert len(group["tokens"]) == 4
    assert all(s in (0.0, 1.0) for s in group["scores"])
