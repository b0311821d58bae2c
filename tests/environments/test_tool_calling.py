"""Tool calling: task generation, answer scoring, a scripted multi-turn episode where the
tools really run (both call formats), and ``process`` end to end against atropos-serve."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

from atroposlib.envs.server_handling.server_harness import ServerHarness
from atroposlib.scoring.tools import CORPUS
from tests.conftest import REPO
from tests.environments.test_gsm8k import assert_valid_groups, make_env, run_process

sys.path.insert(0, str(REPO / "environments"))

from tool_calling_server import (  # noqa: E402
    ToolCallingEnv,
    answer_matches,
    extract_answer,
    load_tasks,
    make_task,
    score_episode,
)


def test_generated_tasks_are_seeded_and_answerable() -> None:
    a = [make_task(random.Random(3)) for _ in range(1)]
    b = [make_task(random.Random(3)) for _ in range(1)]
    assert a == b
    rng = random.Random(0)
    kinds = {make_task(rng)["kind"] for _ in range(200)}
    assert kinds == {"capital", "population", "moons", "atomic", "convert", "arith"}


@pytest.mark.parametrize(
    ("text", "gold", "ok"),
    [
        ("<answer>Paris</answer>", "Paris", True),
        ("<answer> paris. </answer>", "Paris", True),
        ("<answer>Berlin</answer>", "Paris", False),
        ("<answer>204</answer>", 204.0, True),
        ("<answer>about 1,234.5 km</answer>", 1234.5, True),
        ("<answer>205</answer>", 204, False),
        ("The answer is 204", 204, False),  # no tags
        ("<answer>", 204, False),  # malformed
    ],
)
def test_answers(text: str, gold: Any, ok: bool) -> None:
    assert answer_matches(extract_answer(text), gold) is ok


def test_episode_scores() -> None:
    assert score_episode("97", 97, valid_calls=2, invalid_calls=0) == pytest.approx(1.0)
    assert score_episode("97", 97, valid_calls=0, invalid_calls=0) == pytest.approx(0.8)
    assert score_episode("97", 97, valid_calls=1, invalid_calls=1) == pytest.approx(0.8)
    assert score_episode("3", 97, valid_calls=1, invalid_calls=0) == pytest.approx(-0.3)
    assert score_episode(None, 97, valid_calls=0, invalid_calls=5) == -1.0


def test_task_file_errors_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tasks_path"):
        load_tasks(tmp_path / "none.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": 1}\n{"question": "no answer"}\n')
    with pytest.raises(ValueError, match="tasks_path: .*line 2 lacks \\['answer'\\]"):
        load_tasks(bad)


class ScriptedToolUser(ServerHarness):
    """A token-level backend that behaves like a tool-using policy: first it looks up the
    moons of both planets named in the question (one bad call too), then adds them up with
    the calculator, then answers from the tool results it was given."""

    provides_token_logprobs = True

    async def tokens_and_logprobs_completion(self, **kwargs: Any):
        self.calls.append(("tokens_and_logprobs_completion", kwargs))
        question, _, prompt = (
            kwargs["prompt"].split("<|im_start|>user\n")[1].partition("<|im_end|>")
        )
        results = _tool_results(prompt)
        responses = len(results)
        planets = [p for p in CORPUS if p.title() in question]
        if responses == 0:
            text = (
                "".join(
                    f'<tool_call>{{"name": "lookup", "arguments": {{"entity": "{p}", '
                    f'"attribute": "moons"}}}}</tool_call>'
                    for p in planets
                )
                + '<tool_call>{"name": "teleport", "arguments": {}}</tool_call>'
            )
        elif responses == 3:
            moons = results[:2]
            text = (
                '<tool_call>{"name": "calculator", "arguments": {"expression": "'
                f'{moons[0]} + {moons[1]}"}}}}</tool_call>'
            )
        else:
            total = results[-1]
            text = f"They have <answer>{total}</answer> moons."
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return list(kwargs["input_ids"]), [ids], [[-0.25] * len(ids)], ["stop"]


def _tool_results(prompt: str) -> list[Any]:
    """The values in the prompt's tool messages (Hermes ``<tool_response>`` or plain JSON)."""
    values = []
    for block in prompt.split("<|im_start|>tool\n")[1:]:
        body = block.split("<|im_end|>")[0].replace("<tool_response>", "")
        value = json.loads(body.replace("</tool_response>", "").strip())
        values.append(value.get("content", value) if isinstance(value, dict) else value)
    return values


@pytest.mark.parametrize("tool_format", ["hermes", "openai"])
async def test_scripted_episode_runs_tools_and_feeds_results_back(
    tiny_model_dir: Path, tool_format: str
) -> None:
    env = make_env(
        ToolCallingEnv, tiny_model_dir, group_size=2, max_token_length=2048, tool_format=tool_format
    )
    await env.setup()
    env.server.servers = [ScriptedToolUser(tokenizer=env.tokenizer)]
    task = {"question": "How many moons do Mars and Jupiter have together?", "answer": 97}
    group, _ = await env.collect_trajectories(task)
    assert group["scores"] == [pytest.approx(0.8 + 0.2 * 3 / 4 - 0.1)] * 2
    tokens, masks, logprobs = group["tokens"][0], group["masks"][0], group["inference_logprobs"][0]
    assert len(tokens) == len(masks) == len(logprobs)
    spans = sum(1 for i, m in enumerate(masks) if m != -100 and (i == 0 or masks[i - 1] == -100))
    assert spans == 3  # three assistant turns, all trained on
    text = env.tokenizer.decode(tokens)
    assert text.count("<|im_start|>tool\n") == 4  # two lookups, the bad call, the sum
    moons = '"content": 2}' if tool_format == "hermes" else "<|im_start|>tool\n2<|im_end|>"
    assert moons in text and "95" in text
    assert "unknown tool 'teleport'" in text
    assert "<answer>97</answer>" in text
    roles = [m["role"] for m in group["messages"][0]]
    assert roles == [
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "tool",
        "assistant",
        "tool",
        "assistant",
    ]
    if tool_format == "openai":
        assert group["messages"][0][2]["tool_calls"][0]["function"]["name"] == "lookup"
        assert group["messages"][0][3]["tool_call_id"].startswith("call_")
    # the trained tokens are exactly the policy's outputs
    trained = [t for t, m in zip(tokens, masks, strict=True) if m != -100]
    assert env.tokenizer.decode(trained).count("<tool_call>") == 4


@pytest.mark.slow
def test_process_end_to_end(tiny_serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    groups = run_process(
        "tool_calling_server.py",
        tmp_path,
        tiny_serve,
        tiny_model_dir,
        "--env.total_steps",
        "2",
        "--env.group_size",
        "2",
        "--env.max_turns",
        "2",
        "--env.max_tokens_per_turn",
        "16",
        "--env.max_token_length",
        "1024",
    )
    assert len(groups) == 2
    assert_valid_groups(groups, 2)
    for group in groups:
        assert all(-1.0 <= s <= 1.0 for s in group["scores"])
        assert "<tools>" in group["messages"][0][0]["content"]


def test_example_config_resolves() -> None:
    from atroposlib.envs.cli import resolve_config

    resolved = resolve_config(
        ToolCallingEnv,
        ["serve", "--config", str(REPO / "environments" / "configs" / "example.yaml")],
    )
    assert resolved.env_config.tool_format == "hermes"
    assert resolved.env_config.max_turns == 4
    assert resolved.server_configs[0].base_url == "http://localhost:9001/v1"
