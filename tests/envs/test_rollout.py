"""The rollout toolkit (``atroposlib.envs.rollout``) against a real ``atropos-serve``, on both
paths: as a token server (``server_type`` vllm: exact tokens and logprobs) and as a plain
OpenAI endpoint (``server_type`` openai: the chat re-tokenized locally, no logprobs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from atroposlib.envs.rollout import (
    ChatSession,
    eval_completion,
    group_from_samples,
    sample_chat_group,
)
from atroposlib.envs.server_handling.managed_server import (
    ManagedServer,
    RetokenizingManagedServer,
)
from atroposlib.envs.server_handling.server_manager import ServerManager
from atroposlib.schema import ScoredData, check_group
from atroposlib.utils.tokenize_for_trainer import chat_for_template, tokenize_for_trainer
from tests.envs.server_handling.conftest import server_config

MESSAGES = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 2 + 3?"},
]


class Env:
    """What the toolkit uses of a ``BaseEnv``: its ``server`` and ``tokenizer``."""

    def __init__(self, server: ServerManager, tokenizer: Any) -> None:
        self.server = server
        self.tokenizer = tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(params=["vllm", "openai"])
async def env(request, tiny_serve: Any, tiny_model_dir: Path, tokenizer: Any):
    """An env on ``atropos-serve`` as a token server (vllm) or a plain OpenAI endpoint."""
    manager = ServerManager([server_config(tiny_serve, tiny_model_dir, request.param)])
    yield Env(manager, tokenizer)
    await manager.close()


def token_server(env: Env) -> bool:
    return env.server.servers[0].provides_token_logprobs


async def test_sample_chat_group_on_both_paths(env: Env) -> None:
    samples = await sample_chat_group(env, MESSAGES, n=3, max_tokens=8, temperature=1.0)
    assert len(samples) == 3
    prompt = env.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    prompt = prompt["input_ids"] if hasattr(prompt, "input_ids") else prompt
    for sample in samples:
        assert sample.messages == [*MESSAGES, {"role": "assistant", "content": sample.text}]
        assert len(sample.tokens) == len(sample.masks)
        assert sample.tokens[: len(prompt)] == list(prompt)  # the prompt, exactly
        assert sample.masks[: len(prompt)] == [-100] * len(prompt)  # and not trained on
        assert sample.trainable_tokens > 0
        assert all(m in (-100, t) for t, m in zip(sample.tokens, sample.masks, strict=True))
        if token_server(env):
            assert sample.logprobs is not None and len(sample.logprobs) == len(sample.tokens)
            assert sample.trainable_tokens <= 8 + 1  # the sampled tokens (+ end of turn)
            assert all(
                lp <= 0 for lp, m in zip(sample.logprobs, sample.masks, strict=True) if m != -100
            )
        else:
            assert sample.logprobs is None
            chat = sample.messages
            expected = tokenize_for_trainer(env.tokenizer, chat, finish_reason=sample.finish_reason)
            assert (sample.tokens, sample.masks) == (expected["tokens"], expected["masks"])


async def test_group_from_samples_is_a_valid_group_on_both_paths(env: Env) -> None:
    samples = await sample_chat_group(env, MESSAGES, n=3, max_tokens=8, temperature=1.0)
    group = group_from_samples(samples, [1, 0, 0.5], group_size=3)
    assert group["tokens"] == [s.tokens for s in samples]
    assert group["masks"] == [s.masks for s in samples]
    assert group["messages"] == [s.messages for s in samples]
    assert group["scores"] == [1.0, 0.0, 0.5]
    assert "group_overrides" not in group  # the size it was asked for
    # sampler logprobs travel only from a token server (a plain endpoint has none)
    assert ("inference_logprobs" in group) == token_server(env)
    check_group(ScoredData(**group))  # what run-api will accept

    # two samples filtered out of a group of 3: the API is told the size it really has
    short = group_from_samples(samples[:2], [1, 0], group_size=3)
    assert short["group_overrides"] == {"group_size": 2}
    check_group(ScoredData(**short))
    # logprobs from some samples but not all would misalign the trainer: none are sent
    mixed = [samples[0], type(samples[1])(**{**vars(samples[1]), "logprobs": None})]
    assert "inference_logprobs" not in group_from_samples(mixed, [1, 0])
    with pytest.raises(ValueError, match="3 samples but 2 scores"):
        group_from_samples(samples, [1, 0])


async def test_groups_say_how_they_were_sampled(env: Env) -> None:
    """The trainer replays temperature and truncation: groups carry them."""
    samples = await sample_chat_group(env, MESSAGES, n=2, max_tokens=4, temperature=0.7, top_p=0.9)
    assert all(s.generation_params == {"temperature": 0.7, "top_p": 0.9} for s in samples)
    group = group_from_samples(samples, [1, 0])
    assert group["generation_params"] == {"temperature": 0.7, "top_p": 0.9}
    assert "overrides" not in group
    check_group(ScoredData(**group))
    other = type(samples[1])(**{**vars(samples[1]), "generation_params": {"temperature": 1.0}})
    mixed = group_from_samples([samples[0], other], [1, 0])
    assert "generation_params" not in mixed
    assert mixed["overrides"] == [{"temperature": 0.7, "top_p": 0.9}, {"temperature": 1.0}]


async def test_retokenize_on_a_token_server(env: Env) -> None:
    samples = await sample_chat_group(
        env, MESSAGES, n=2, max_tokens=4, temperature=1.0, retokenize=True
    )
    for sample in samples:
        assert sample.logprobs is None
        expected = tokenize_for_trainer(
            env.tokenizer, sample.messages, finish_reason=sample.finish_reason
        )
        assert sample.tokens == expected["tokens"]


async def test_eval_completion_uses_the_eval_slots(env: Env) -> None:
    server = env.server.servers[0]
    before = len(server.eval_request_timings)
    text, finish = await eval_completion(env, MESSAGES, 4, 0.0)
    assert isinstance(text, str) and finish in ("stop", "length")
    assert len(server.eval_request_timings) == before + 1
    assert (text, finish) == await eval_completion(env, MESSAGES, 4, 0.0)  # greedy


async def test_chat_session_trains_on_every_assistant_turn(env: Env) -> None:
    async with ChatSession(
        env, MESSAGES, max_tokens_per_turn=5, max_token_length=512, temperature=1.0
    ) as session:
        assert await session.generate() is not None
        session.add("user", "And 4 + 4?")
        assert await session.generate() is not None
        session.add("user", "Thanks.")  # an observation after the last turn is not trained
        traj = session.trajectory()
    assert session.turns == 2 and not session.truncated
    assert traj["messages"] == session.messages and traj["messages"][-1]["content"] == "Thanks."
    tokens, masks = traj["tokens"], traj["masks"]
    assert len(tokens) == len(masks)
    # two trained stretches (the two replies), separated by the masked user turn
    stretches = sum(
        1 for i, m in enumerate(masks) if m != -100 and (i == 0 or masks[i - 1] == -100)
    )
    assert stretches == 2
    chat = chat_for_template(session.messages[:-1])
    if token_server(env):
        assert len(traj["inference_logprobs"]) == len(tokens)
    else:
        assert "inference_logprobs" not in traj
        expected = tokenize_for_trainer(
            env.tokenizer,
            chat,
            train_on_all_assistant_turns=True,
            finish_reason=session.finish_reasons[-1],
        )
        assert (tokens, masks) == (expected["tokens"], expected["masks"])
    # the trained text is the model's two replies
    trained = env.tokenizer.decode([t for t, m in zip(tokens, masks, strict=True) if m != -100])
    for reply in (chat[2]["content"], chat[4]["content"]):
        assert reply.strip() in trained


async def test_chat_session_stops_when_the_context_is_full(env: Env) -> None:
    prompt_len = len(env.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True))
    async with ChatSession(
        env, MESSAGES, max_tokens_per_turn=50, max_token_length=prompt_len + 3
    ) as session:
        assert await session.generate() is None
        assert session.truncated and session.trajectory() is None


async def test_tool_parser_is_per_session(env: Env) -> None:
    """Tools on one session must not turn on tool parsing for every user of the manager."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "add",
                "description": "Add two numbers",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    async with ChatSession(
        env, MESSAGES, max_tokens_per_turn=4, max_token_length=1024, tools=tools
    ) as session:
        assert session.tool_parser == "hermes"
        if token_server(env):
            assert isinstance(session.managed, ManagedServer)
            assert session.managed._tool_parser_name == "hermes"
            assert await session.generate() is not None
        else:  # the endpoint parses tool calls itself (atropos-serve's OpenAI route has none)
            assert isinstance(session.managed, RetokenizingManagedServer)
    assert env.server.tool_parser is None  # the shared manager is untouched
    async with env.server.managed_server(tokenizer=env.tokenizer, tokens="auto") as plain:
        if token_server(env):
            assert plain._tool_parser_name is None


async def test_upstream_managed_server_contract_is_kept(env: Env) -> None:
    """Without ``tokens``, ``managed_server`` behaves as upstream's: a plain OpenAI endpoint
    has no token ids, so it refuses (unless the dummy is allowed)."""
    if token_server(env):
        async with env.server.managed_server(tokenizer=env.tokenizer) as managed:
            assert isinstance(managed, ManagedServer)
    else:
        with pytest.raises(NotImplementedError):
            async with env.server.managed_server(tokenizer=env.tokenizer):
                pass
    with pytest.raises(ValueError, match="tokens must be"):
        async with env.server.managed_server(tokenizer=env.tokenizer, tokens="exact"):
            pass


def test_chat_for_template() -> None:
    messages = [
        {"role": "user", "content": [
            {"type": "text", "text": "Count:"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        ]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "add", "arguments": '{"a": 1}'}},
        ]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ]  # fmt: skip
    assert chat_for_template(messages) == [
        {"role": "user", "content": "Count:\n<image>"},
        {"role": "assistant", "content": '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'},
        {"role": "tool", "content": "2"},
    ]  # fmt: skip


def test_group_from_trajectories_keeps_what_each_episode_gave() -> None:
    from atroposlib.envs.rollout import group_from_trajectories

    def traj(n: int, logprobs: bool = True, temperature: float = 1.0) -> dict:
        out = {
            "tokens": list(range(n)),
            "masks": [-100] * 2 + list(range(2, n)),
            "messages": [{"role": "user", "content": str(n)}],
            "generation_params": {"temperature": temperature},
        }
        if logprobs:
            out["inference_logprobs"] = [1.0] * 2 + [-0.5] * (n - 2)
        return out

    group = group_from_trajectories([traj(4), None, traj(5)], [1.0, 0.5, None], group_size=3)
    assert group["tokens"] == [[0, 1, 2, 3], [0, 1, 2, 3, 4]]  # the silent episode is left out
    assert group["scores"] == [1.0, 0.0]
    assert group["overrides"] == [{}, {"set_advantage_to_zero": True}]
    assert group["group_overrides"] == {"group_size": 2}
    assert group["generation_params"] == {"temperature": 1.0}
    assert len(group["inference_logprobs"]) == 2
    check_group(ScoredData(**group))
    mixed = group_from_trajectories(
        [traj(4, temperature=0.7), traj(4, logprobs=False)], [1.0, 0.0], group_size=2
    )
    assert "inference_logprobs" not in mixed and "group_overrides" not in mixed
    assert "generation_params" not in mixed
    assert mixed["overrides"] == [{"temperature": 0.7}, {"temperature": 1.0}]
    assert group_from_trajectories([None, None], [1.0, 0.0]) is None
    with pytest.raises(ValueError, match="2 trajectories but 1 scores"):
        group_from_trajectories([None, None], [1.0])


def test_apply_length_penalty_only_on_all_right_groups_and_counts_itself() -> None:
    from types import SimpleNamespace

    from atroposlib.envs import apply_length_penalty

    logged: list[tuple[str, float]] = []
    env = SimpleNamespace(
        config=SimpleNamespace(max_token_length=100),
        log_train_metric=lambda name, value: logged.append((name, value)),
    )
    group = {"tokens": [[0] * 40, [0] * 75, [0] * 100], "scores": [2.0, 2.0, 2.0]}
    assert apply_length_penalty(env, group, full_score=2.0)
    # 1.0 up to half the budget, then down to 0 at the budget, times the score
    assert group["scores"] == pytest.approx([2.0, 1.0, 0.0])
    mixed = {"tokens": [[0] * 90, [0] * 90], "scores": [1.0, 0.0]}
    assert not apply_length_penalty(env, mixed, full_score=1.0)
    assert mixed["scores"] == [1.0, 0.0]
    assert logged == [("train/length_penalty_applied", 1.0), ("train/length_penalty_applied", 0.0)]
