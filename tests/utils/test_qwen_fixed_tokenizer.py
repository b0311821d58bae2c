"""``QwenFixedTokenizer``: the fixed tool-calling template, on the real SmolLM2 tokenizer files
(ChatML special tokens, like Qwen's)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest

from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer
from atroposlib.utils.tokenizers import QwenFixedTokenizer

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
CHAT = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {
        "role": "assistant",
        "content": "c",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}],
    },
    {"role": "tool", "content": "R1"},
    {"role": "assistant", "content": "done"},
]
# What upstream's template renders for CHAT with TOOLS.
UPSTREAM_RENDERING = (
    "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the "
    "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    '<tools>\n{"type": "function", "function": {"name": "f", "parameters": {}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
    "<args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    '<|im_start|>assistant\nc\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n'
    "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nR1\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\ndone<|im_end|>\n"
)


@pytest.fixture(scope="module")
def qwen(smollm2_tokenizer: Any) -> QwenFixedTokenizer:
    return QwenFixedTokenizer(smollm2_tokenizer.name_or_path)


def test_matches_upstream_rendering(qwen: QwenFixedTokenizer) -> None:
    assert qwen.apply_chat_template(CHAT, tools=TOOLS, tokenize=False) == UPSTREAM_RENDERING
    without_tools = qwen.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    assert without_tools == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )


def test_fixes(qwen: QwenFixedTokenizer) -> None:
    chat = [
        {"role": "user", "content": "U"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"function": {"name": "f", "arguments": {"x": 1}}},  # a dict, not a string
                {"function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "content": "R1"},
        {"role": "tool", "content": "R2"},
        {"role": "assistant", "content": "ok", "tool_calls": None},  # as OpenAI dumps it
    ]
    text = qwen.apply_chat_template(chat, tokenize=False)
    assert text == (
        "<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
        '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nR1\n</tool_response>\n"
        "<tool_response>\nR2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nok<|im_end|>\n"
    )


def test_delegates_and_trains_on_tool_calls(qwen: QwenFixedTokenizer) -> None:
    assert qwen.eos_token == "<|im_end|>"
    assert qwen.decode(qwen.encode("hello", add_special_tokens=False)) == "hello"
    assert qwen("hi")["input_ids"] == qwen.tokenizer("hi")["input_ids"]
    assert len(qwen) == len(qwen.tokenizer)
    result = tokenize_for_trainer(qwen, CHAT, train_on_all_assistant_turns=True)
    trained = qwen.decode([m for m in result["masks"] if m != -100])
    assert trained == (
        'c\n\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call><|im_end|>\n'
        "done<|im_end|>\n"
    )


def test_copy_and_pickle(qwen: QwenFixedTokenizer) -> None:
    clone = copy.deepcopy(qwen)
    assert clone.apply_chat_template(CHAT[:2], tokenize=False) == qwen.apply_chat_template(
        CHAT[:2], tokenize=False
    )
    restored = pickle.loads(pickle.dumps(qwen))
    assert restored.eos_token_id == qwen.eos_token_id
