"""Extract and validate a tool call written as ``<tool_call>{json}</tool_call>`` in model text."""

from __future__ import annotations

import ast
import json
import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

ERROR_TOOL_NAME = "-ERROR-"

__all__ = ["ERROR_TOOL_NAME", "extract_tool_call", "parse_tool_call"]


def extract_tool_call(text: str, preferred_tags: Sequence[str] | None = None) -> str | None:
    """The stripped content of the first ``<tag>...</tag>`` block, trying each tag in order.

    Args:
        text: The model output.
        preferred_tags: Tag names to look for (default ``["tool_call"]``).

    Returns:
        The content, or ``None`` when no tag pair is present.
    """
    for tag in preferred_tags or ["tool_call"]:
        escaped = re.escape(tag)
        match = re.search(f"<{escaped}>(.*?)</{escaped}>", text, re.DOTALL)
        if match:
            return match.group(1).strip()
    return None


def _loads(content: str) -> Any:
    """JSON, else JSON with single quotes (upstream's only attempt), else a Python literal."""
    try:
        return json.loads(content, strict=False)
    except json.JSONDecodeError:
        pass
    try:
        return json.loads(content.replace("'", '"'), strict=False)
    except json.JSONDecodeError:
        pass
    return ast.literal_eval(content)


def _tool_names(available_tools: Sequence[Any]) -> set[str]:
    names = set()
    for tool in available_tools:
        if not isinstance(tool, Mapping):
            continue
        if "name" in tool:
            names.add(tool["name"])
        elif isinstance(tool.get("function"), Mapping) and "name" in tool["function"]:
            names.add(tool["function"]["name"])
    return names


def parse_tool_call(
    response: str,
    available_tools: Sequence[Mapping[str, Any]] | None = None,
    preferred_tags: Sequence[str] | None = None,
) -> tuple[str, dict[str, Any], bool]:
    """Parse the tool call in ``response``.

    Args:
        response: The model output.
        available_tools: If given, the call must name one of these tools (``{"name": ...}`` or
            OpenAI ``{"function": {"name": ...}}`` entries).
        preferred_tags: Tag names to look for (default ``["tool_call"]``).

    Returns:
        ``(tool_name, arguments, is_error)``; on any error the name is ``"-ERROR-"``. Arguments
        given as a JSON string (OpenAI style) are decoded to a dict.
    """
    content = extract_tool_call(response, preferred_tags)
    if not content:
        logger.debug("No tool call found in response: %.200s", response)
        return ERROR_TOOL_NAME, {}, True
    try:
        call = _loads(content)
    except (ValueError, SyntaxError, MemoryError, RecursionError) as exc:
        logger.debug("Failed to parse tool call %.200s: %s", content, exc)
        return ERROR_TOOL_NAME, {}, True
    if not isinstance(call, Mapping):
        return ERROR_TOOL_NAME, {}, True

    name = call.get("name", "")
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        if isinstance(decoded, dict):
            arguments = decoded
    if available_tools and (not name or name not in _tool_names(available_tools)):
        return ERROR_TOOL_NAME, arguments, True
    return name, arguments, False
