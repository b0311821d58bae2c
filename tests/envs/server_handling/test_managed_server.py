"""ManagedServer on a real VLLMServer (tiny ``atropos-serve``): exact tokens across turns."""

from __future__ import annotations

from typing import Any

import pytest

from atroposlib.envs.server_handling.managed_server import (
    DummyManagedServer,
    ManagedServer,
    SequenceNode,
)
from atroposlib.envs.server_handling.server_baseline import APIServerConfig
from atroposlib.envs.server_handling.server_harness import (
    ServerHarness,
    create_chat_completion,
)
from atroposlib.envs.server_handling.vllm_server import VLLMServer

SAMPLING = {"max_tokens": 6, "temperature": 1.0}


@pytest.fixture()
async def vllm(tiny_config: APIServerConfig):
    server = VLLMServer(tiny_config)
    yield server
    await server.close()


async def assert_logprobs_exact(server: VLLMServer, node: SequenceNode) -> None:
    """Every trained position's logprob is what the model gives that token in context."""
    scored = await server.get_logprobs(input_ids=node.tokens)
    trained = [i for i, t in enumerate(node.masked_tokens) if t != -100]
    assert trained
    for i in trained:
        assert node.masked_tokens[i] == node.tokens[i]
        assert scored["prompt_topk_token_ids"][i][0] == node.tokens[i]
        assert scored["prompt_topk_logprobs"][i][0] == pytest.approx(node.logprobs[i], abs=1e-3)


async def test_single_chat_turn(vllm: VLLMServer) -> None:
    managed = ManagedServer(vllm)
    assert managed.tokenizer is vllm.tokenizer  # taken from the server
    messages = [{"role": "user", "content": "Hello"}]
    out = await managed.chat_completion(messages=messages, seed=0, **SAMPLING)
    assert out.id.startswith("chatcmpl-") and len(out.choices) == 1
    (node,) = managed.get_state()["nodes"]
    prompt = vllm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompt_ids = vllm.tokenizer.encode(prompt)
    n_prompt = len(prompt_ids)
    assert node.tokens[:n_prompt] == prompt_ids
    assert node.tokens.count(vllm.tokenizer.bos_token_id) >= 1 and node.tokens[1] != node.tokens[0]
    assert node.masked_tokens[:n_prompt] == [-100] * n_prompt
    assert node.masked_tokens[n_prompt:] == node.tokens[n_prompt:]
    assert node.logprobs[:n_prompt] == [1.0] * n_prompt
    assert all(lp <= 0 for lp in node.logprobs[n_prompt:])
    assert len(node.tokens) == len(node.masked_tokens) == len(node.logprobs)
    assert node.full_text == prompt + out.choices[0].message.content
    assert node.metadata == {"finish_reason": out.choices[0].finish_reason}
    await assert_logprobs_exact(vllm, node)


async def test_two_turn_chat_extends_one_node(vllm: VLLMServer) -> None:
    managed = ManagedServer(vllm)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello"}]
    first = await managed.chat_completion(messages=messages, seed=1, **SAMPLING)
    (node1,) = managed.get_state()["nodes"]
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And then?"},
    ]
    await managed.chat_completion(messages=messages, seed=2, **SAMPLING)
    (node2,) = managed.get_state()["nodes"]  # extended in place: still one node

    # The first turn's tokens are reused verbatim, its completion stays trainable.
    assert node2.tokens[: len(node1.tokens)] == node1.tokens
    assert node2.masked_tokens[: len(node1.tokens)] == node1.masked_tokens
    assert node2.logprobs[: len(node1.tokens)] == node1.logprobs
    # The rendered second prompt, then the new completion.
    prompt2 = vllm.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert node2.full_text.startswith(prompt2)
    assert vllm.tokenizer.decode(node2.tokens).startswith(prompt2)
    suffix = [t for t, m in zip(node2.tokens, node2.masked_tokens, strict=True)][
        len(node1.tokens) :
    ]
    assert suffix  # the new user turn and the generation prompt
    assert node2.tokens.count(vllm.tokenizer.eos_token_id) >= 2  # turns closed once each
    await assert_logprobs_exact(vllm, node2)


async def test_n_branches_then_reset(vllm: VLLMServer) -> None:
    managed = ManagedServer(vllm)
    out = await managed.chat_completion(
        messages=[{"role": "user", "content": "Pick"}], n=3, seed=4, **SAMPLING
    )
    assert len(out.choices) == 3
    nodes = managed.get_state()["nodes"]
    assert len(nodes) == 3
    n_prompt = nodes[0].masked_tokens.count(-100)
    assert all(n.tokens[:n_prompt] == nodes[0].tokens[:n_prompt] for n in nodes)
    state = managed.get_state()
    managed.reset()
    assert managed.get_state() == {"nodes": []} and len(state["nodes"]) == 3


async def test_completion_path_extension_keeps_earlier_outputs(vllm: VLLMServer) -> None:
    managed = ManagedServer(vllm)
    out1 = await managed.completion(prompt="Q: 1+1?\nA:", seed=5, **SAMPLING)
    (node1,) = managed.get_state()["nodes"]
    prompt2 = "Q: 1+1?\nA:" + out1.choices[0].text + "\nQ: 2+2?\nA:"
    await managed.completion(prompt=prompt2, seed=6, **SAMPLING)
    (node2,) = managed.get_state()["nodes"]
    # Regression: upstream's completion() path masked the first answer on extension.
    assert node2.masked_tokens[: len(node1.tokens)] == node1.masked_tokens
    assert any(t != -100 for t in node2.masked_tokens[: len(node1.tokens)])
    assert managed._compute_input_ids(prompt2, node1)[: len(node1.tokens)] == node1.tokens
    await assert_logprobs_exact(vllm, node2)


async def test_tree_mode_keeps_every_node(vllm: VLLMServer) -> None:
    managed = ManagedServer(vllm, track_tree=True)
    out = await managed.completion(prompt="Once", seed=7, **SAMPLING)
    await managed.completion(prompt="Once" + out.choices[0].text + " more", seed=8, **SAMPLING)
    state = managed.get_state()
    assert set(state) == {"sequences", "tree"} and len(state["sequences"]) == 2
    short, long = sorted(state["sequences"].values(), key=lambda n: len(n.tokens))
    assert long.tokens[: len(short.tokens)] == short.tokens
    assert long.masked_tokens[: len(short.tokens)] == short.masked_tokens


async def test_get_logprobs_passthrough(vllm: VLLMServer) -> None:
    managed = ManagedServer(vllm)
    payload = await managed.get_logprobs(messages=[{"role": "user", "content": "x"}], top_k=1)
    assert set(payload) == {"prompt_tokens", "prompt_topk_token_ids", "prompt_topk_logprobs"}
    assert len(payload["prompt_tokens"]) == len(payload["prompt_topk_logprobs"])

    class NoLogprobs:
        config = APIServerConfig()
        tokenizer = vllm.tokenizer

    with pytest.raises(NotImplementedError, match="does not implement get_logprobs"):
        await ManagedServer(NoLogprobs()).get_logprobs(prompt="x")  # type: ignore[arg-type]


# ---------------------------------------------------------------- scripted backend


async def test_eight_way_branching_multi_turn(tiny_tokenizer: Any) -> None:
    """8 branches, each continued twice (n=2): 16 nodes, all sharing turn one's prompt."""
    harness = ServerHarness()
    tok = tiny_tokenizer
    managed = ManagedServer(harness, tokenizer=tok)
    messages = [{"role": "user", "content": "Go"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok.encode(prompt)
    answers = [f" answer{i}" for i in range(8)]
    harness.set_tokens_and_logprobs_response(
        prompt,
        prompt_ids,
        [tok.encode(a) + [tok.eos_token_id] for a in answers],
        [[-0.1] * (len(tok.encode(a)) + 1) for a in answers],
        ["stop"] * 8,
    )
    out = await managed.chat_completion(messages=messages, n=8)
    assert [c.message.content for c in out.choices] == answers
    for i, answer in enumerate(answers):
        turn2 = [
            *messages,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Again"},
        ]
        prompt2 = tok.apply_chat_template(turn2, tokenize=False, add_generation_prompt=True)
        node = managed.get_state()["nodes"][i]
        expected_ids = node.tokens + tok.encode(prompt2[len(node.full_text) + len("<|im_end|>") :])
        harness.set_tokens_and_logprobs_response(
            prompt2, expected_ids, [[11, 12], [13]], [[-1.0, -2.0], [-3.0]], ["length", "length"]
        )
        await managed.chat_completion(messages=turn2, n=2)
        sent = harness.calls[-1][1]["input_ids"]
        # The generated EOS is not doubled by the template's closing tag.
        assert sent == expected_ids
    nodes = managed.get_state()["nodes"]
    assert len(nodes) == 16
    assert all(n.tokens[: len(prompt_ids)] == prompt_ids for n in nodes)
    assert [n.masked_tokens[-1] for n in nodes[:8]] == [12] * 8
    assert sorted(n.masked_tokens[-1] for n in nodes[8:]) == [13] * 8


async def test_logprobs_padded_or_truncated(tiny_tokenizer: Any) -> None:
    managed = ManagedServer(ServerHarness(), tokenizer=tiny_tokenizer)
    node = managed._create_sequence_node("p", None, [5], [7, 8, 9], [-1.0], "xyz")
    assert node.logprobs == [1.0, -1.0, 1.0, 1.0]
    node = managed._create_sequence_node("p", None, [5], [7], [-1.0, -2.0], "x")
    assert node.logprobs == [1.0, -1.0] and node.masked_tokens == [-100, 7]


async def test_think_blocks_protected_from_templates(tiny_tokenizer: Any) -> None:
    managed = ManagedServer(ServerHarness(), tokenizer=tiny_tokenizer)
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "<think>hmm</think>ok"},
        {"role": "user", "content": "q2"},
    ]
    assert "<think>hmm</think>ok" in managed._convert_messages_to_prompt(messages)
    assert managed._protect_think_blocks(messages)[1]["content"] == (
        "__MNGD_THINK__hmm__MNGD_ENDTHINK__ok"
    )


async def test_dummy_managed_server() -> None:
    harness = ServerHarness()
    messages = [{"role": "user", "content": "hi"}]
    harness.set_desired_response(messages, create_chat_completion(["a", "b"], n=2))
    dummy = DummyManagedServer(harness)
    out = await dummy.chat_completion(messages=messages)
    assert len(out.choices) == 2
    nodes = dummy.get_state()["nodes"]
    assert [n.full_text for n in nodes] == ["user:hi\n\nassistant:a", "user:hi\n\nassistant:b"]
    assert nodes[0].metadata["dummy_tokens"] and nodes[0].masked_tokens[0] == -100
    with pytest.raises(NotImplementedError):
        await dummy.get_logprobs(prompt="x")


async def test_new_context_appends_instead_of_extending(tiny_tokenizer: Any) -> None:
    tok = tiny_tokenizer
    harness = ServerHarness(tokenizer=tok)
    managed = ManagedServer(harness)
    assert managed.tokenizer is tok
    plain = [{"role": "user", "content": "Hi"}]
    with_system = [{"role": "system", "content": "Be brief."}, *plain]
    for messages in (plain, with_system, plain):
        prompt = managed._convert_messages_to_prompt(messages)
        harness.set_tokens_and_logprobs_response(prompt, None, [[42]], [[-0.3]], ["length"])
        await managed.chat_completion(messages=messages)
    nodes = managed.get_state()["nodes"]
    # The system-prompt conversation is a new context; repeating the first prompt extends
    # nothing either (its text is not a continuation of a node), so it is a third node.
    assert len(nodes) == 3
    assert "Be brief." in nodes[1].full_text and "Be brief." not in nodes[0].full_text
    assert all(n.masked_tokens[-1] == 42 and n.logprobs[-1] == -0.3 for n in nodes)
    assert harness.calls[1][1]["input_ids"] == tok.encode(
        managed._convert_messages_to_prompt(with_system)
    )
