"""Trajectory helpers: strip or shorten ``<think>`` blocks, keep multi-step trajectories in budget.

Same names, signatures and results as upstream Atropos, with two fixes:

* ``strip_thinking`` only removes a block whose ``</think>`` comes after its ``<think>``
  (upstream duplicated text when the order was reversed), and removes everything up to a lone
  ``</think>`` (reasoning models whose opening tag is part of the prompt emit only the closing
  one; upstream left those untouched).
* ``ensure_trajectory_token_limit`` does not need ``atroposlib.envs`` importable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from atroposlib.schema import ScoredDataGroup
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

logger = logging.getLogger(__name__)

THINK_START = "<think>"
THINK_END = "</think>"
AGENT_ROLES = ("agent", "assistant")

__all__ = ["ensure_trajectory_token_limit", "strip_thinking", "truncate_thinking"]


def strip_thinking(response_text: str) -> str:
    """Remove the ``<think>...</think>`` block (the first one) from a response.

    A response with a ``</think>`` but no ``<think>`` before it loses everything up to and
    including the ``</think>``. Text without a closing tag is returned unchanged.
    """
    end = response_text.find(THINK_END)
    if end == -1:
        return response_text
    start = response_text.find(THINK_START)
    if start == -1 or start > end:
        return response_text[end + len(THINK_END) :]
    return response_text[:start] + response_text[end + len(THINK_END) :]


def truncate_thinking(response_text: str, tokenizer: Any, max_think_tokens: int) -> str:
    """Shorten the ``<think>`` block of a response to at most ``max_think_tokens`` tokens.

    A block that fits is kept (re-formatted as ``<think>\\n...\\n</think>``). A block that
    does not fit keeps its last paragraph if that fits, else its last ``max_think_tokens``
    tokens, prefixed with ``"... "``. An empty block becomes ``<think></think>``. Text without a
    well-formed block is returned unchanged, and so is the text on any tokenizer error (logged).

    Args:
        response_text: The response.
        tokenizer: Anything with ``encode(text, add_special_tokens=False)`` and
            ``decode(ids, skip_special_tokens=True)``.
        max_think_tokens: The token budget for the block's content.
    """
    try:
        start = response_text.find(THINK_START)
        end = response_text.find(THINK_END)
        if start == -1 or end == -1 or start >= end:
            return response_text

        before = response_text[: start + len(THINK_START)]
        inner = response_text[start + len(THINK_START) : end].strip()
        after = response_text[end:]
        if not inner:
            return f"{before.rstrip()}{after.lstrip()}"

        tokens = tokenizer.encode(inner, add_special_tokens=False)
        truncated = len(tokens) > max_think_tokens
        if truncated:
            kept = None
            paragraphs = [p.strip() for p in inner.split("\n\n") if p.strip()]
            if paragraphs and len(paragraphs[-1]) < len(inner):
                last = tokenizer.encode(paragraphs[-1], add_special_tokens=False)
                if len(last) <= max_think_tokens:
                    kept = last
            if kept is None:
                kept = tokens[max(0, len(tokens) - max_think_tokens) :]
            tokens = kept

        text = tokenizer.decode(tokens, skip_special_tokens=True)
        if truncated and text.strip():
            text = "... " + text.lstrip()
        text = text.strip()
        block = "" if not text or text == "..." else f"\n{text}\n"
        return f"{before.rstrip()}{block}{after.lstrip()}"
    except Exception as exc:  # noqa: BLE001 - never lose the response over a tokenizer error
        logger.error(
            "Error in truncate_thinking for text '%s...': %s",
            response_text[:200],
            exc,
            exc_info=True,
        )
        return response_text


def _max_len(token_lists: Sequence[Any]) -> int:
    lengths = [len(t) for t in token_lists if isinstance(t, list)]
    return max(lengths) if lengths else 0


def _pop_count(messages: Sequence[Any]) -> int:
    """How many messages after the first may be dropped from this alternative this round.

    The first message (system prompt) and the final agent reply (plus the environment
    observation right before it) are always kept; an environment+agent pair is dropped
    together when possible.
    """
    keep_at_end = 0
    if len(messages) > 1 and messages[-1]["role"] in AGENT_ROLES:
        keep_at_end = 1
        if len(messages) > 2 and messages[-2]["role"] == "environment":
            keep_at_end = 2
    available = len(messages) - 1 - keep_at_end
    if available <= 0:
        return 0
    pair = (
        available >= 2
        and len(messages) > 2
        and messages[1]["role"] == "environment"
        and messages[2]["role"] in AGENT_ROLES
    )
    return 2 if pair else 1


def ensure_trajectory_token_limit(
    trajectory: list[ScoredDataGroup],
    tokenizer: Any,
    max_trajectory_tokens: int,
) -> list[ScoredDataGroup]:
    """Keep every step of a multi-step trajectory within ``max_trajectory_tokens`` tokens.

    Each step is a ``ScoredDataGroup`` with per-alternative ``messages``, ``tokens`` and
    ``masks`` plus ``seed`` and ``parsed_actions``. A step whose longest alternative is too long
    has its oldest messages (after the first) dropped uniformly from all alternatives, an
    environment+agent pair at a time where possible, and is re-tokenized with
    :func:`~atroposlib.utils.tokenize_for_trainer.tokenize_for_trainer`. The first message and
    the last observation+reply are always kept; a step that still does not fit (or fails to
    re-tokenize, or lacks those fields) is dropped.

    Returns:
        The steps that fit, truncated ones replaced by new groups holding ``seed``,
        ``messages``, ``tokens``, ``masks``, ``scores`` and ``parsed_actions``.
    """
    if not trajectory:
        return trajectory

    kept_steps: list[ScoredDataGroup] = []
    for step_idx, step in enumerate(trajectory):
        if not (
            step.get("messages")
            and step.get("tokens")
            and step.get("masks")
            and step.get("seed") is not None
            and step.get("parsed_actions") is not None
        ):
            logger.warning(
                "[ensure_trajectory_token_limit] Step %d is missing critical data. Skipping.",
                step_idx,
            )
            continue

        current_max = _max_len(step["tokens"])
        if current_max <= max_trajectory_tokens:
            kept_steps.append(step)
            continue

        logger.info(
            "[ensure_trajectory_token_limit] Step %d has %d tokens, over the limit of %d; "
            "truncating",
            step_idx,
            current_max,
            max_trajectory_tokens,
        )
        messages = [list(alt) for alt in step["messages"] or []]
        tokens = [list(alt) for alt in step["tokens"] or []]
        masks = [list(alt) for alt in step["masks"] or []]
        failed = False
        while current_max > max_trajectory_tokens:
            counts = [c for c in (_pop_count(alt) for alt in messages) if c > 0]
            if not counts:
                break
            pop = min(counts)
            new_tokens, new_masks = [], []
            for alt_idx, alt in enumerate(messages):
                if len(alt) <= pop:
                    logger.error(
                        "[ensure_trajectory_token_limit] Step %d alternative %d is too short to "
                        "truncate",
                        step_idx,
                        alt_idx,
                    )
                    failed = True
                    break
                del alt[1 : 1 + pop]
                try:
                    out = tokenize_for_trainer(tokenizer, alt)
                except Exception as exc:  # noqa: BLE001 - the step is dropped, not the run
                    logger.error(
                        "[ensure_trajectory_token_limit] Step %d alternative %d failed to "
                        "re-tokenize: %s",
                        step_idx,
                        alt_idx,
                        exc,
                    )
                    failed = True
                    break
                new_tokens.append(out["tokens"])
                new_masks.append(out["masks"])
            if failed:
                break
            tokens, masks = new_tokens, new_masks
            current_max = _max_len(tokens)

        if not failed and current_max <= max_trajectory_tokens:
            kept_steps.append(
                {
                    "seed": step["seed"],
                    "messages": messages,
                    "tokens": tokens,
                    "masks": masks,
                    "scores": step.get("scores"),
                    "parsed_actions": step.get("parsed_actions"),
                }
            )
        else:
            logger.warning(
                "[ensure_trajectory_token_limit] Discarding step %d: %d tokens still exceed the "
                "limit of %d (or re-tokenization failed)",
                step_idx,
                current_max,
                max_trajectory_tokens,
            )

    if len(kept_steps) < len(trajectory):
        logger.warning(
            "[ensure_trajectory_token_limit] Dropped %d of %d steps over the token limit",
            len(trajectory) - len(kept_steps),
            len(trajectory),
        )
    return kept_steps
