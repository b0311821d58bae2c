"""Turn a chat into ``tokens`` and loss ``masks`` for the trainer.

``masks`` has one entry per token: ``-100`` where the trainer must not compute a loss (system,
user and tool turns, chat-template scaffolding) and the token id itself where it should (the
assistant's own output).

Two masking modes, as in upstream Atropos:

* **last turn only** (default): everything up to the last message's generation prompt is masked;
  the last message (and whatever the template appends after it) is trained on.
* **all assistant turns** (``train_on_all_assistant_turns=True``): every ``assistant`` / ``agent``
  message is trained on, everything else is masked.

The boundaries come from rendering prefixes of the chat with the tokenizer's chat template.
Upstream assumes templates render prefixes *stably* (the tokens of ``chat[:i]`` are a prefix of
the tokens of ``chat``); templates that break this (date-stamped or message-counting system
prompts, templates that drop earlier reasoning, generation prompts that open a think block) gave
it masks of the wrong length. Here a boundary whose rendering is not a prefix is located by
aligning the rendering's *end* with the full tokens (the last messages and the generation prompt
still match, shifted by a few positions), with a warning logged; ``masks`` always has exactly
``len(tokens)`` entries. A message whose role differs from the generation prompt's (``agent``
under a template whose generation prompt says ``assistant``) is located by the template's own
header for that message.

Differences from upstream, all deliberate:

* Works with ``transformers`` 5, whose ``apply_chat_template`` returns a ``BatchEncoding`` and
  refuses an empty conversation (the prefix of a one-message chat).
* ``finish_reason == "length"`` also drops the end-of-turn EOS when the template appends
  whitespace after it (ChatML templates such as SmolLM2's or Qwen's end every turn with
  ``<|im_end|>\\n``), so a truncated generation never learns to stop; upstream only drops a
  literally final EOS, which never happens with those templates.
* An empty chat raises ``ValueError`` instead of an obscure template error.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

UNMASKED_ROLES = ["assistant", "agent"]
"""Roles whose messages are trained on when ``train_on_all_assistant_turns`` is set."""

MASK_VALUE = -100
"""Label value the trainer ignores (PyTorch's ``CrossEntropyLoss`` default ``ignore_index``)."""

_SENTINEL = "\u2063ATROPOS_CONTENT_SENTINEL\u2063"
# Alignment of unstable prefix renderings: how far the boundary may shift, and how long a
# matching suffix is enough.
_ALIGN_WINDOW = 64
_ALIGN_MAX_MATCH = 256
# How many whitespace-only tokens may follow the final EOS for the length-truncation drop.
_MAX_TRAILING_WHITESPACE_TOKENS = 4

__all__ = [
    "IMAGE_PLACEHOLDER",
    "MASK_VALUE",
    "UNMASKED_ROLES",
    "chat_for_template",
    "tokenize_for_trainer",
]

IMAGE_PLACEHOLDER = "<image>"
"""What ``chat_for_template`` writes in place of an image content part."""


def chat_for_template(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """``messages`` as a plain text chat template renders them: ``{"role", "content"}`` only,
    ``None`` content as "", content parts joined (each image part as ``\\n<image>\\n``), and
    an assistant's ``tool_calls`` written after its text as Hermes
    ``<tool_call>{"name", "arguments"}</tool_call>`` lines.

    This is how a re-tokenized trajectory (a server without token ids) sees a multi-turn,
    tool-using or multimodal chat; templates that render ``tool_calls`` or images themselves
    are not relied on."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            pieces = []
            for part in content:
                if not isinstance(part, Mapping):
                    continue
                if part.get("type") == "text":
                    pieces.append(part.get("text", ""))
                elif part.get("type") in ("image_url", "image"):
                    pieces.append(f"\n{IMAGE_PLACEHOLDER}\n")
            content = "".join(pieces).strip()
        content = content or ""
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call.get("function", {}) if isinstance(call, Mapping) else {}
                args = fn.get("arguments", "{}")
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except json.JSONDecodeError:
                    pass
                body = json.dumps({"name": fn.get("name", ""), "arguments": args})
                calls.append(f"<tool_call>{body}</tool_call>")
            content = (content + "\n" if content else "") + "\n".join(calls)
        out.append({"role": m["role"], "content": content})
    return out


def _as_token_list(result: Any) -> list[int]:
    """Normalise what ``apply_chat_template`` / a tokenizer call returns into ``list[int]``."""
    if isinstance(result, Mapping) or hasattr(result, "input_ids"):
        result = result["input_ids"] if isinstance(result, Mapping) else result.input_ids
    if hasattr(result, "tolist"):
        result = result.tolist()
    result = list(result)
    if result and isinstance(result[0], (list, tuple)):
        # A batch of one conversation.
        if len(result) != 1:
            raise ValueError(f"expected one tokenized conversation, got a batch of {len(result)}")
        result = list(result[0])
    return [int(t) for t in result]


def _render(
    tokenizer: Any, messages: Sequence[Any], add_generation_prompt: bool = False
) -> list[int]:
    """Token ids of ``messages`` through the chat template."""
    if add_generation_prompt:
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
    else:
        out = tokenizer.apply_chat_template(list(messages))
    return _as_token_list(out)


def _is_prefix(prefix: Sequence[int], tokens: Sequence[int]) -> bool:
    return len(prefix) <= len(tokens) and list(tokens[: len(prefix)]) == list(prefix)


def _align_end(tokens: Sequence[int], rendered: Sequence[int]) -> tuple[int, int]:
    """Where ``rendered`` (a prefix rendering that is *not* a prefix of ``tokens``) ends in
    ``tokens``.

    An unstable template changes something early on (a date, a message count, a dropped
    reasoning block) while the tokens just before the boundary (the last messages and the
    generation prompt) stay the same, shifted by a few positions. So the end position whose
    preceding tokens match the longest suffix of ``rendered`` is the boundary; ties go to the
    smallest shift. Returns ``(position, matched_suffix_length)``; a length of 0 means no match.
    """
    n = len(rendered)
    best_pos, best_len = min(n, len(tokens)), 0
    for delta in sorted(range(-_ALIGN_WINDOW, _ALIGN_WINDOW + 1), key=abs):
        pos = n + delta
        if pos < 0 or pos > len(tokens):
            continue
        length = 0
        limit = min(n, pos, _ALIGN_MAX_MATCH)
        while length < limit and tokens[pos - 1 - length] == rendered[n - 1 - length]:
            length += 1
        if length > best_len:
            best_pos, best_len = pos, length
            if length >= _ALIGN_MAX_MATCH:
                break
    return best_pos, best_len


def _header_tokens(tokenizer: Any, history: Sequence[Any], message: Any) -> list[int] | None:
    """Tokens the template renders for ``history`` and ``message`` up to ``message``'s content.

    ``history + [message]`` is rendered as text with a sentinel in place of the message's
    content, and the text before the sentinel is tokenized. This finds where a message's content
    starts even when the generation prompt does not match the message (an ``agent`` role under a
    template whose generation prompt says ``assistant``) or the template cannot render an empty
    conversation. ``None`` if that is not possible (e.g. non-string content).
    """
    if not isinstance(message, Mapping) or not isinstance(message.get("content"), str):
        return None
    probe = dict(message)
    probe["content"] = _SENTINEL
    try:
        text = tokenizer.apply_chat_template([*history, probe], tokenize=False)
        if not isinstance(text, str) or text.count(_SENTINEL) != 1:
            return None
        before = text[: text.index(_SENTINEL)]
        return _as_token_list(tokenizer(before, add_special_tokens=False))
    except Exception:  # noqa: BLE001 - any failure here just means "cannot tell"
        return None


_EXACT = 1 << 30


def _boundary(tokens: Sequence[int], rendered: Sequence[int]) -> tuple[int, int]:
    """Where the rendering of a chat prefix ends in ``tokens``, and how sure that is.

    Returns ``(position, score)``: ``_EXACT`` when ``rendered`` is a prefix of ``tokens``;
    ``_EXACT - 1`` when only its last token differs (say the template's trailing whitespace merged
    with the content's first characters into one token), keeping upstream's boundary; the
    matched suffix length when found by :func:`_align_end` (2 tokens at least, fewer is noise);
    else 0, with upstream's answer, the rendered length clipped to ``len(tokens)``.
    """
    n = len(rendered)
    if _is_prefix(rendered, tokens):
        return n, _EXACT
    common = 0
    while common < min(n, len(tokens)) and tokens[common] == rendered[common]:
        common += 1
    if common >= n - 1:
        return min(n, len(tokens)), _EXACT - 1
    pos, length = _align_end(tokens, rendered)
    if length >= 2:
        return pos, length
    return min(n, len(tokens)), 0


def _content_start(tokenizer: Any, chat: Sequence[Any], i: int, tokens: list[int]) -> int:
    """Index in ``tokens`` where message ``i``'s generated part starts.

    Upstream's definition: the length of ``chat[:i]`` rendered with the generation prompt. When
    that rendering is not a prefix of ``tokens``, the template's own header for the message (see
    :func:`_header_tokens`) is tried too, and the more reliable of the two boundaries found by
    :func:`_boundary` wins.
    """
    prompt: list[int] | None
    try:
        prompt = _render(tokenizer, chat[:i], add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - e.g. transformers>=5 refuses empty conversations
        if i > 0:
            raise
        prompt = None
    if prompt is not None and _is_prefix(prompt, tokens):
        return len(prompt)
    header = _header_tokens(tokenizer, chat[:i], chat[i])

    best_pos, best_score = 0, -1
    for candidate in (prompt, header):
        if candidate is not None:
            pos, score = _boundary(tokens, candidate)
            if score > best_score:
                best_pos, best_score = pos, score
    if best_score < _EXACT:
        # A merge of the last prompt token with the content's first characters is routine.
        logger.log(
            logging.DEBUG if best_score == _EXACT - 1 else logging.WARNING,
            "tokenize_for_trainer: the chat template does not render the prompt before message "
            "%d as a prefix of the full chat; its content is taken to start at token %d",
            i,
            best_pos,
        )
    return best_pos


def _content_end(tokenizer: Any, chat: Sequence[Any], i: int, tokens: list[int]) -> int:
    """Index in ``tokens`` just past message ``i`` (the length of ``chat[: i + 1]`` rendered)."""
    if i == len(chat) - 1:
        return len(tokens)
    pos, score = _boundary(tokens, _render(tokenizer, chat[: i + 1]))
    if score < _EXACT:
        logger.log(
            logging.DEBUG if score == _EXACT - 1 else logging.WARNING,
            "tokenize_for_trainer: the chat template does not render the chat up to message %d "
            "as a prefix of the full chat; the message is taken to end at token %d",
            i,
            pos,
        )
    return pos


def _length_truncation_cut(tokenizer: Any, tokens: list[int]) -> int | None:
    """Where to cut ``tokens`` for a length-truncated generation, or ``None`` to keep them.

    Cuts at a final EOS, or at an EOS followed only by a few whitespace tokens that the template
    appends after every turn.
    """
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None or not tokens:
        return None
    eos_ids = set(eos) if isinstance(eos, (list, tuple, set)) else {eos}
    for back in range(min(len(tokens), _MAX_TRAILING_WHITESPACE_TOKENS + 1)):
        idx = len(tokens) - 1 - back
        tok = tokens[idx]
        if tok in eos_ids:
            return idx
        try:
            text = tokenizer.decode([tok])
        except Exception:  # noqa: BLE001 - a tokenizer without decode: only a final EOS counts
            return None
        if not isinstance(text, str) or text.strip():
            return None
    return None


def tokenize_for_trainer(
    tokenizer: Any,
    chat: Sequence[Mapping[str, Any]],
    include_messages: bool = False,
    train_on_all_assistant_turns: bool = False,
    finish_reason: str = "",
) -> dict[str, Any]:
    """Tokenize ``chat`` with the tokenizer's chat template and build the trainer's loss masks.

    Args:
        tokenizer: A Hugging Face tokenizer (anything with ``apply_chat_template``).
        chat: The messages (``{"role": ..., "content": ...}`` dicts), the last one usually the
            model's completion.
        include_messages: Also return ``chat`` under ``"messages"``.
        train_on_all_assistant_turns: Unmask every ``assistant``/``agent`` message instead of
            only the last message.
        finish_reason: The completion's finish reason; ``"length"`` drops the trailing EOS (and
            any template whitespace after it) so a truncated generation does not learn to stop.

    Returns:
        ``{"tokens": list[int], "masks": list[int]}`` of equal length (``masks`` holds ``-100``
        for positions without loss and the token id elsewhere), plus ``"messages": chat`` when
        ``include_messages`` is set.

    Raises:
        ValueError: ``chat`` is empty.
    """
    if not chat:
        raise ValueError("tokenize_for_trainer: chat is empty; need at least one message")

    tokens = _render(tokenizer, chat)

    if not train_on_all_assistant_turns:
        start = _content_start(tokenizer, chat, len(chat) - 1, tokens)
        masks = [MASK_VALUE] * start + tokens[start:]
    else:
        masks = [MASK_VALUE] * len(tokens)
        for i, msg in enumerate(chat):
            if msg.get("role") not in UNMASKED_ROLES:
                continue
            start = _content_start(tokenizer, chat, i, tokens)
            end = _content_end(tokenizer, chat, i, tokens)
            end = max(start, end)
            masks[start:end] = tokens[start:end]

    if finish_reason == "length":
        cut = _length_truncation_cut(tokenizer, tokens)
        if cut is not None:
            logger.debug(
                "tokenize_for_trainer: dropping %d trailing token(s) (EOS) of a length-truncated "
                "generation",
                len(tokens) - cut,
            )
            tokens = tokens[:cut]
            masks = masks[:cut]

    result: dict[str, Any] = {"tokens": tokens, "masks": masks}
    if include_messages:
        result["messages"] = chat
    return result
