"""Translation between OpenAI ``tool_calls`` and the raw text a model writes.

Outbound (model -> client): raw text with tool-call markup becomes OpenAI ``tool_calls``.
Inbound (client -> model): assistant messages carrying ``tool_calls`` become the raw text the
model produced, so the chat template renders the same tokens the model generated.

With vLLM installed (``VLLM_AVAILABLE``), any of vLLM's tool parsers can be named. Without
it, only the ``hermes`` format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
also used by Qwen) is parsed, by a small built-in parser; other parser names leave the output
unparsed, with a warning.
"""

from __future__ import annotations

import json
import re
import uuid
import warnings
from typing import Any

try:  # openai>=1.99 splits function and custom tool calls
    from openai.types.chat import ChatCompletionMessageFunctionToolCall as ToolCall
except ImportError:  # older openai
    from openai.types.chat import ChatCompletionMessageToolCall as ToolCall

try:  # vLLM is optional: its parsers cover 30+ model formats.
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.abstract_tool_parser import ToolParserManager

    VLLM_AVAILABLE = True
except Exception:  # ImportError, or a broken vLLM install
    ChatCompletionRequest = None
    ToolParserManager = None
    VLLM_AVAILABLE = False

BUILTIN_PARSERS = ("hermes", "qwen", "qwen2_5", "qwen3")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolCallTranslator:
    """Bidirectional tool-call translation for one tokenizer and parser.

    Tool calls parsed from model output are remembered by id (``call_id_to_raw_text``) so the
    exact raw text can be restored when the client sends the conversation back.
    """

    def __init__(self, tokenizer: Any, parser_name: str = "hermes") -> None:
        """
        Args:
            tokenizer: The HuggingFace tokenizer of the served model.
            parser_name: vLLM tool parser name (``hermes``, ``llama3_json``, ``mistral``, ...).
                Without vLLM only ``hermes`` (and its Qwen aliases) parses.
        """
        self.tokenizer = tokenizer
        self.parser_name = parser_name
        self.parser: Any = None
        self.call_id_to_raw_text: dict[str, str] = {}
        if VLLM_AVAILABLE:
            self.parser = ToolParserManager.get_tool_parser(parser_name)(tokenizer)
        elif parser_name not in BUILTIN_PARSERS:
            warnings.warn(
                f"vLLM is not installed and the built-in parser only reads the hermes format; "
                f"tool calls in {parser_name!r} output will not be parsed (pip install vllm).",
                stacklevel=2,
            )

    @property
    def can_parse(self) -> bool:
        """Whether ``parse_model_output`` can extract tool calls at all."""
        return self.parser is not None or self.parser_name in BUILTIN_PARSERS

    def parse_model_output(
        self,
        raw_text: str,
        tool_choice: str | None = None,
        tools: list[dict] | None = None,
    ) -> tuple[str | None, list[ToolCall] | None, str]:
        """Split raw model output into ``(content, tool_calls, finish_reason)``.

        ``tool_calls`` are OpenAI SDK tool calls (``.id``, ``.function.name``,
        ``.function.arguments`` as a JSON string) or None; ``content`` is the text before
        the calls (None when there is none); ``finish_reason`` is ``"tool_calls"`` when any
        were found, else ``"stop"``. Nothing is parsed when ``tool_choice`` is ``"none"`` or
        no tools are defined.
        """
        if tool_choice == "none" or not tools:
            return raw_text, None, "stop"
        if self.parser is not None:
            calls, content = self._parse_with_vllm(raw_text, tool_choice, tools)
        elif self.parser_name in BUILTIN_PARSERS:
            calls, content = self._parse_hermes(raw_text)
        else:
            return raw_text, None, "stop"
        if not calls:
            return raw_text, None, "stop"
        for call in calls:
            self.call_id_to_raw_text[call["id"]] = raw_text
        return content, [ToolCall.model_validate(call) for call in calls], "tool_calls"

    def _parse_with_vllm(
        self, raw_text: str, tool_choice: str | None, tools: list[dict]
    ) -> tuple[list[dict[str, Any]], str | None]:
        request = ChatCompletionRequest(
            messages=[{"role": "user", "content": ""}],
            model="proxy",
            tools=tools,
            tool_choice=tool_choice,
        )
        result = self.parser.extract_tool_calls(raw_text, request)
        if not (result.tools_called and result.tool_calls):
            return [], raw_text
        calls = [
            {
                "id": tc.id,
                "type": "function",
                "function": {"name": tc.function.name, "arguments": tc.function.arguments},
            }
            for tc in result.tool_calls
        ]
        return calls, result.content

    @staticmethod
    def _parse_hermes(raw_text: str) -> tuple[list[dict[str, Any]], str | None]:
        calls = []
        for match in _HERMES_CALL.finditer(raw_text):
            try:
                obj = json.loads(match.group(1))
            except json.JSONDecodeError:
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                continue
            arguments = obj.get("arguments", obj.get("parameters", {}))
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            calls.append(
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": obj["name"], "arguments": arguments},
                }
            )
        if not calls:
            return [], raw_text
        content = raw_text[: raw_text.find("<tool_call>")].strip()
        return calls, content or None

    def reconstruct_raw_text_from_tool_calls(self, tool_calls: list[Any]) -> str:
        """The raw text behind ``tool_calls``: exact when the calls came from this translator,
        else rebuilt in the hermes format."""
        if not tool_calls:
            return ""
        tool_calls = [_as_dict(call) for call in tool_calls]
        first_id = tool_calls[0].get("id", "")
        if first_id in self.call_id_to_raw_text:
            return self.call_id_to_raw_text[first_id]
        parts = []
        for call in tool_calls:
            function = call.get("function", {})
            arguments = function.get("arguments", "{}")
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                pass
            body = json.dumps({"name": function.get("name", ""), "arguments": arguments})
            parts.append(f"<tool_call>{body}</tool_call>")
        return "\n".join(parts)

    def convert_messages_for_template(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Replace assistant messages that carry ``tool_calls`` with their raw text; other
        messages pass through unchanged."""
        converted = []
        for msg in messages:
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                calls = [_as_dict(call) for call in msg["tool_calls"]]
                exact = calls[0].get("id", "") in self.call_id_to_raw_text
                raw = self.reconstruct_raw_text_from_tool_calls(calls)
                if not exact and msg.get("content"):
                    raw = f"{msg['content']}\n{raw}"
                converted.append({"role": "assistant", "content": raw})
            else:
                converted.append(msg)
        return converted

    def decode_with_tool_awareness(self, token_ids: list[int], has_tools: bool = False) -> str:
        """Decode, keeping special tokens when tools are active (tool tags may be special)."""
        return self.tokenizer.decode(token_ids, skip_special_tokens=not has_tools)


def _as_dict(tool_call: Any) -> dict[str, Any]:
    """A tool call as a dict, whether given as one or as an OpenAI SDK object."""
    if isinstance(tool_call, dict):
        return tool_call
    if hasattr(tool_call, "model_dump"):
        return tool_call.model_dump()
    return dict(tool_call)
