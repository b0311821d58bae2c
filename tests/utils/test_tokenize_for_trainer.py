"""``tokenize_for_trainer`` on the real SmolLM2 tokenizer (ChatML template), offline."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

IM_START, IM_END, NL = 1, 2, 198  # SmolLM2: <|im_start|>, <|im_end|> (also EOS), "\n"

CHAT = [
    {"role": "system", "content": "sys"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "more"},
    {"role": "assistant", "content": "Sure thing"},
]
# Token ids of CHAT through SmolLM2's chat template.
CHAT_TOKENS = [
    *[IM_START, 9690, NL, 11801, IM_END, NL],  # <|im_start|>system\nsys<|im_end|>\n
    *[IM_START, 4093, NL, 6004, IM_END, NL],  # <|im_start|>user\nhi<|im_end|>\n
    *[IM_START, 520, 9531, NL, 19556, 665, IM_END, NL],  # ...assistant\nHello there...
    *[IM_START, 4093, NL, 3143, IM_END, NL],  # <|im_start|>user\nmore<|im_end|>\n
    *[IM_START, 520, 9531, NL, 34355, 2775, IM_END, NL],  # ...assistant\nSure thing...
]
FIRST_REPLY = slice(16, 20)  # "Hello there<|im_end|>\n"
LAST_REPLY = slice(30, 34)  # "Sure thing<|im_end|>\n"


def _ids(tokenizer: Any, messages: list[dict], **kwargs: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _check_shape(result: dict) -> None:
    tokens, masks = result["tokens"], result["masks"]
    assert len(tokens) == len(masks)
    assert all(isinstance(t, int) for t in tokens)
    for tok, mask in zip(tokens, masks, strict=True):
        assert mask == -100 or mask == tok


def test_last_turn_exact_tokens_and_masks(smollm2_tokenizer: Any) -> None:
    result = tokenize_for_trainer(smollm2_tokenizer, CHAT)
    assert set(result) == {"tokens", "masks"}
    assert result["tokens"] == CHAT_TOKENS
    assert result["masks"] == [-100] * 30 + CHAT_TOKENS[LAST_REPLY]
    # -100 covers exactly the template of everything before, plus the generation prompt.
    prefix = _ids(smollm2_tokenizer, CHAT[:-1], add_generation_prompt=True)
    assert len(prefix) == 30
    assert result["tokens"][:30] == prefix
    _check_shape(result)


def test_include_messages(smollm2_tokenizer: Any) -> None:
    result = tokenize_for_trainer(smollm2_tokenizer, CHAT, include_messages=True)
    assert result["messages"] is CHAT


def test_all_assistant_turns_spans(smollm2_tokenizer: Any) -> None:
    result = tokenize_for_trainer(smollm2_tokenizer, CHAT, train_on_all_assistant_turns=True)
    assert result["tokens"] == CHAT_TOKENS
    expected = [-100] * len(CHAT_TOKENS)
    expected[FIRST_REPLY] = CHAT_TOKENS[FIRST_REPLY]
    expected[LAST_REPLY] = CHAT_TOKENS[LAST_REPLY]
    assert result["masks"] == expected
    trained = smollm2_tokenizer.decode([m for m in result["masks"] if m != -100])
    assert trained == "Hello there<|im_end|>\nSure thing<|im_end|>\n"


def test_agent_role_is_trained(smollm2_tokenizer: Any) -> None:
    chat = [
        {"role": "user", "content": "go"},
        {"role": "agent", "content": "move north"},
        {"role": "environment", "content": "a wall"},
        {"role": "agent", "content": "move east"},
    ]
    result = tokenize_for_trainer(smollm2_tokenizer, chat, train_on_all_assistant_turns=True)
    _check_shape(result)
    trained = smollm2_tokenizer.decode([m for m in result["masks"] if m != -100])
    assert trained == "move north<|im_end|>\nmove east<|im_end|>\n"


def test_single_message_chat(smollm2_tokenizer: Any) -> None:
    """The prefix of a one-message chat is empty, which transformers 5 refuses to render."""
    chat = [{"role": "assistant", "content": "only"}]
    for all_turns in (False, True):
        result = tokenize_for_trainer(
            smollm2_tokenizer, chat, train_on_all_assistant_turns=all_turns
        )
        _check_shape(result)
        trained = [m for m in result["masks"] if m != -100]
        assert smollm2_tokenizer.decode(trained) == "only<|im_end|>\n"
        # Everything before the content (default system prompt + header) is masked.
        assert result["masks"][: len(result["tokens"]) - len(trained)] == [-100] * (
            len(result["tokens"]) - len(trained)
        )


def test_length_finish_drops_eos(smollm2_tokenizer: Any) -> None:
    """ChatML ends every turn with ``<|im_end|>\\n``: the EOS and the newline go."""
    full = tokenize_for_trainer(smollm2_tokenizer, CHAT)
    cut = tokenize_for_trainer(smollm2_tokenizer, CHAT, finish_reason="length")
    assert cut["tokens"] == CHAT_TOKENS[:-2]
    assert cut["masks"] == full["masks"][:-2]
    assert smollm2_tokenizer.eos_token_id not in cut["masks"][30:]
    stop = tokenize_for_trainer(smollm2_tokenizer, CHAT, finish_reason="stop")
    assert stop == full
    cut_all = tokenize_for_trainer(
        smollm2_tokenizer, CHAT, train_on_all_assistant_turns=True, finish_reason="length"
    )
    assert cut_all["tokens"] == CHAT_TOKENS[:-2]
    _check_shape(cut_all)


def test_length_finish_drops_literal_final_eos(smollm2_tokenizer: Any) -> None:
    """A template whose last token is EOS (upstream's case): exactly that token is dropped."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
        "{% if not loop.last %}{{ '<|im_end|>\n' }}{% else %}{{ '<|im_end|>' }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '\n<|im_start|>assistant\n' }}{% endif %}"
    )
    full = tokenize_for_trainer(tok, CHAT)
    assert full["tokens"][-1] == tok.eos_token_id
    cut = tokenize_for_trainer(tok, CHAT, finish_reason="length")
    assert cut["tokens"] == full["tokens"][:-1]
    assert cut["masks"] == full["masks"][:-1]


def test_length_finish_keeps_non_eos_ending(smollm2_tokenizer: Any) -> None:
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
    )
    full = tokenize_for_trainer(tok, CHAT)
    assert tokenize_for_trainer(tok, CHAT, finish_reason="length") == full


def test_empty_chat_raises(smollm2_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        tokenize_for_trainer(smollm2_tokenizer, [])


UNSTABLE_TEMPLATES = {
    # The system line counts the messages: same token length, different token.
    "count": "{{ '<|im_start|>system\\nturns: ' + (messages|length|string) + '<|im_end|>\\n' }}",
    # The system line grows with the conversation (a date crossing midnight, say).
    "grows": "{{ '<|im_start|>system\\n' + ('tick ' * (messages|length)) + '<|im_end|>\\n' }}",
}


@pytest.mark.parametrize("kind", sorted(UNSTABLE_TEMPLATES))
def test_unstable_template_exact_masks(
    smollm2_tokenizer: Any, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """Prefixes that render differently from the full chat are aligned by their ends."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = UNSTABLE_TEMPLATES[kind] + (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    with caplog.at_level(logging.WARNING, logger="atroposlib.utils.tokenize_for_trainer"):
        last = tokenize_for_trainer(tok, CHAT)
        every = tokenize_for_trainer(tok, CHAT, train_on_all_assistant_turns=True)
    assert "not render" in caplog.text
    for result in (last, every):
        _check_shape(result)
        assert result["tokens"] == _ids(tok, CHAT)
    assert tok.decode([m for m in last["masks"] if m != -100]) == "Sure thing<|im_end|>\n"
    assert tok.decode([m for m in every["masks"] if m != -100]) == (
        "Hello there<|im_end|>\nSure thing<|im_end|>\n"
    )
    # The masked part is exactly everything before the last reply's content.
    n_masked = last["masks"].count(-100)
    assert last["masks"][:n_masked] == [-100] * n_masked


def test_template_dropping_earlier_reasoning(smollm2_tokenizer: Any) -> None:
    """Qwen3-style: reasoning of assistant turns before the last user turn is not rendered."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% set ns = namespace(last_user=-1) %}"
        "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last_user = loop.index0 %}"
        "{% endif %}{% endfor %}"
        "{% for m in messages %}{% set c = m['content'] %}"
        "{% if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in c %}"
        "{% set c = c.split('</think>')[-1].lstrip() %}{% endif %}"
        "{{ '<|im_start|>' + m['role'] + '\\n' + c + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    chat = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>hmm</think>a1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "<think>ok</think>a2"},
    ]
    result = tokenize_for_trainer(tok, chat, train_on_all_assistant_turns=True)
    _check_shape(result)
    assert tok.decode(result["tokens"]).count("hmm") == 0
    # The first reply is trained on as rendered in the full chat (without its reasoning).
    assert tok.decode([m for m in result["masks"] if m != -100]) == (
        "a1<|im_end|>\n<think>ok</think>a2<|im_end|>\n"
    )


def test_generation_prompt_longer_than_rendered_turn(smollm2_tokenizer: Any) -> None:
    """Templates that open a think block in the generation prompt (Qwen3-style)."""
    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + "
        "'<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' }}"
        "{% endif %}"
    )
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    result = tokenize_for_trainer(tok, chat)
    _check_shape(result)
    assert smollm2_tokenizer.decode([m for m in result["masks"] if m != -100]) == "a<|im_end|>\n"


class _ListTokenizer:
    """A transformers-4-style tokenizer stub: lists out, empty conversations allowed."""

    eos_token_id = 99

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False):
        out: list[int] = []
        for m in messages:
            out += [10 if m["role"] == "user" else 11] + [len(m["content"])] + [99]
        if add_generation_prompt:
            out.append(11)
        return out

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def test_plain_list_tokenizer() -> None:
    chat = [{"role": "user", "content": "abc"}, {"role": "assistant", "content": "xy"}]
    result = tokenize_for_trainer(_ListTokenizer(), chat)
    assert result == {"tokens": [10, 3, 99, 11, 2, 99], "masks": [-100] * 4 + [2, 99]}
    cut = tokenize_for_trainer(_ListTokenizer(), chat, finish_reason="length")
    assert cut == {"tokens": [10, 3, 99, 11, 2], "masks": [-100] * 4 + [2]}
    alone = tokenize_for_trainer(
        _ListTokenizer(), [{"role": "assistant", "content": "x"}], train_on_all_assistant_turns=True
    )
    assert alone["masks"] == [-100, 1, 99]


roles = st.sampled_from(["system", "user", "assistant", "tool"])
text = st.text(
    # Characters that survive an encode/decode round trip through the GGUF-extracted tokenizer.
    alphabet=st.sampled_from(list("abcxyzABC 0129.,!?'\"<>/{}#*-_`\n\téü中文🙂")),
    min_size=1,
    max_size=20,
).filter(lambda s: s.strip() == s and "<|" not in s)
chats = st.lists(st.fixed_dictionaries({"role": roles, "content": text}), min_size=1, max_size=6)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chat=chats, all_turns=st.booleans(), finish=st.sampled_from(["", "stop", "length"]))
def test_properties(smollm2_tokenizer: Any, chat: list[dict], all_turns: bool, finish: str) -> None:
    result = tokenize_for_trainer(
        smollm2_tokenizer, chat, train_on_all_assistant_turns=all_turns, finish_reason=finish
    )
    _check_shape(result)
    full = _ids(smollm2_tokenizer, chat)
    tokens = result["tokens"]
    if finish == "length":
        assert tokens == full[:-2]  # ChatML: "<|im_end|>\n" dropped
    else:
        assert tokens == full
    unmasked = [i for i, m in enumerate(result["masks"]) if m != -100]
    if not all_turns:
        # A single contiguous span at the end: the last message.
        if unmasked:
            assert unmasked == list(range(unmasked[0], len(tokens)))
        expected = chat[-1]["content"] + ("" if finish == "length" else "<|im_end|>\n")
        assert smollm2_tokenizer.decode([tokens[i] for i in unmasked]) == expected
    else:
        pieces = [m["content"] + "<|im_end|>\n" for m in chat if m["role"] == "assistant"]
        expected = "".join(pieces)
        if finish == "length" and chat[-1]["role"] == "assistant":
            expected = expected[: -len("<|im_end|>\n")]
        assert smollm2_tokenizer.decode([tokens[i] for i in unmasked]) == expected


edgy_text = st.text(alphabet=st.sampled_from(list("ab .\n\t")), min_size=1, max_size=12)
edgy_chats = st.lists(
    st.fixed_dictionaries({"role": roles, "content": edgy_text}), min_size=1, max_size=5
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(chat=edgy_chats, all_turns=st.booleans())
def test_properties_whitespace_edges(
    smollm2_tokenizer: Any, chat: list[dict], all_turns: bool
) -> None:
    """Leading whitespace can merge with the template's newline into one (masked) token."""
    result = tokenize_for_trainer(smollm2_tokenizer, chat, train_on_all_assistant_turns=all_turns)
    _check_shape(result)
    assert result["tokens"] == _ids(smollm2_tokenizer, chat)
    trained = smollm2_tokenizer.decode([m for m in result["masks"] if m != -100])
    if all_turns:
        replies = [m["content"] for m in chat if m["role"] == "assistant"]
    else:
        replies = [chat[-1]["content"]]
    # Each reply is trained on, except possibly leading whitespace merged into the prompt.
    rest = trained
    for reply in replies:
        end = rest.index("<|im_end|>\n")
        piece, rest = rest[:end], rest[end + len("<|im_end|>\n") :]
        assert reply.endswith(piece)
        assert piece == reply[len(reply) - len(piece) :]
        assert reply[: len(reply) - len(piece)].strip() == ""
    assert rest == ""
