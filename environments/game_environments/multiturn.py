"""Multi-turn rollouts for text games and tool use: one conversation, one exact trajectory.

``ChatSession`` plays one conversation against ``env.server``: the env appends user/tool
messages (observations, tool results), ``await session.generate()`` asks the model for the
next assistant turn, and ``session.trajectory()`` returns the training sequence.

* With a token-level server (``server_type`` vllm/sglang/trl, which includes atropos-serve),
  every turn goes through one ``ManagedServer`` session: each new prompt extends the previous
  node, so the final node holds the exact tokens the model saw and produced, with **every
  assistant turn unmasked** (labels = token ids) and observations/prompts masked (-100), plus
  the sampler's ``inference_logprobs``.
* With a plain OpenAI endpoint the chat is re-tokenized with
  ``tokenize_for_trainer(..., train_on_all_assistant_turns=True)`` (no logprobs).

The session keeps the whole conversation under ``max_token_length``: each turn's
``max_tokens`` is capped by the room left, and ``generate()`` returns None when there is no
room for another turn (the env then ends the episode as truncated).

Used by the game environments in this folder and by ``environments/tool_calling_server.py``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

logger = logging.getLogger(__name__)

__all__ = ["ChatSession", "uses_token_server"]


def uses_token_server(env: Any) -> bool:
    """True when ``env``'s first server returns token ids and logprobs (ManagedServer works)."""
    servers = getattr(env.server, "servers", None) or []
    return bool(servers) and bool(getattr(servers[0], "provides_token_logprobs", False))


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages a plain chat template can render: tool calls written out as Hermes text,
    ``None`` content as ""."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        content = content or ""
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = tc.get("function", {}) if isinstance(tc, dict) else {}
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


class ChatSession:
    """One multi-turn conversation and its trajectory (use as ``async with``).

    Args:
        env: The ``BaseEnv`` (its ``server``, ``tokenizer`` and ``config`` are used).
        messages: The opening messages (system, first observation...).
        max_tokens_per_turn: Generation budget of one assistant turn.
        max_token_length: Budget of the whole conversation (prompt + all turns).
        temperature: Sampling temperature.
        tools: OpenAI ``tools`` passed with every request (the managed server then parses
            ``tool_calls`` with the hermes parser); None for plain text turns.
        min_turn_tokens: ``generate()`` returns None when fewer tokens than this are left.
    """

    def __init__(
        self,
        env: Any,
        messages: list[dict[str, Any]],
        *,
        max_tokens_per_turn: int,
        max_token_length: int,
        temperature: float = 1.0,
        tools: list[dict[str, Any]] | None = None,
        min_turn_tokens: int = 4,
    ) -> None:
        self.env = env
        self.messages: list[dict[str, Any]] = [dict(m) for m in messages]
        self.max_tokens_per_turn = max_tokens_per_turn
        self.max_token_length = max_token_length
        self.temperature = temperature
        self.tools = tools
        self.min_turn_tokens = min_turn_tokens
        self.token_server = uses_token_server(env)
        self.finish_reasons: list[str] = []
        self.turns = 0
        self.truncated = False
        self._cm: Any = None
        self.managed: Any = None

    async def __aenter__(self) -> ChatSession:
        if self.token_server:
            if self.tools and getattr(self.env.server, "tool_parser", None) is None:
                self.env.server.tool_parser = "hermes"
            self._cm = self.env.server.managed_server(tokenizer=self.env.tokenizer)
            self.managed = await self._cm.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self._cm is not None:
            await self._cm.__aexit__(*exc)

    def add(self, role: str, content: Any, **extra: Any) -> None:
        """Append a message (an observation, a tool result...)."""
        self.messages.append({"role": role, "content": content, **extra})

    def prompt_length(self) -> int:
        """Tokens of the conversation so far plus the generation prompt."""
        ids = self.env.tokenizer.apply_chat_template(
            _template_messages(self.messages), add_generation_prompt=True, tokenize=True
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return len(ids)

    async def generate(self, **kwargs: Any) -> Any | None:
        """The model's next turn (an OpenAI ``Choice``), appended to ``messages``; None when
        the conversation has no room left (``truncated`` is then set)."""
        room = self.max_token_length - self.prompt_length() - 1
        if room < self.min_turn_tokens:
            self.truncated = True
            return None
        request: dict[str, Any] = {
            "messages": self.messages,
            "n": 1,
            "max_tokens": min(self.max_tokens_per_turn, room),
            "temperature": self.temperature,
            **kwargs,
        }
        if self.tools:
            request["tools"] = self.tools
        if self.managed is not None:
            reply = await self.managed.chat_completion(**request)
        else:
            reply = await self.env.server.chat_completion(**request)
        choice = reply.choices[0]
        message: dict[str, Any] = {"role": "assistant", "content": choice.message.content or ""}
        tool_calls = getattr(choice.message, "tool_calls", None)
        if tool_calls:
            message["tool_calls"] = [
                tc.model_dump() if hasattr(tc, "model_dump") else dict(tc) for tc in tool_calls
            ]
            if not choice.message.content:
                message["content"] = None
        self.messages.append(message)
        self.finish_reasons.append(choice.finish_reason or "")
        self.turns += 1
        return choice

    def trajectory(self) -> dict[str, Any] | None:
        """``{"tokens", "masks", "inference_logprobs" (token servers only), "messages"}`` for
        the conversation up to the model's last turn; None when the model never spoke."""
        if self.turns == 0:
            return None
        if self.managed is not None:
            nodes = self.managed.get_state()["nodes"]
            if not nodes:
                return None
            if len(nodes) > 1:
                # a prompt did not extend the previous node (the template rewrote history);
                # the last node still masks its prompt, so earlier turns are not trained on
                logger.warning("multi-turn conversation split into %d nodes", len(nodes))
            node = nodes[-1]
            return {
                "tokens": list(node.tokens),
                "masks": list(node.masked_tokens),
                "inference_logprobs": list(node.logprobs),
                "messages": [dict(m) for m in self.messages],
            }
        last = max(i for i, m in enumerate(self.messages) if m["role"] == "assistant")
        chat = _template_messages(self.messages[: last + 1])
        out = tokenize_for_trainer(
            self.env.tokenizer,
            chat,
            train_on_all_assistant_turns=True,
            finish_reason=self.finish_reasons[-1] if self.finish_reasons else "",
        )
        return {
            "tokens": out["tokens"],
            "masks": out["masks"],
            "messages": [dict(m) for m in self.messages],
        }
