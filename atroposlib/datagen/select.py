"""Which sequences of a scored group become data, and how they are split into prompt and
completion (upstream's selection rules for SFT and DPO)."""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from typing import Any

#: Keys a chat message keeps in the TRL output (others, such as ``reward``, are env bookkeeping).
CHAT_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def common_prefix(texts: Sequence[str]) -> str:
    """The longest common character prefix of ``texts`` (``""`` for none)."""
    return os.path.commonprefix(list(texts)) if texts else ""


def split_group(tokenizer: Any, group: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``(prompt, completion)`` text for every sequence of a group.

    The boundary is the first trained token (first mask that is not -100): the completion is
    exactly what a trainer learns. A sequence trained from its first token or not at all falls
    back to upstream's rule, the group's longest common character prefix (which may be empty: then
    the prompt is ``""`` and the completion is the whole text).
    """
    tokens: list[list[int]] = group["tokens"]
    masks: list[list[int]] | None = group.get("masks")
    fulls = [tokenizer.decode(t) for t in tokens]
    shared = common_prefix(fulls) if len(fulls) > 1 else ""
    out = []
    for i, full in enumerate(fulls):
        boundary = None
        if masks is not None and i < len(masks):
            trained = [j for j, m in enumerate(masks[i]) if m != -100]
            if trained and trained[0] > 0:
                boundary = trained[0]
        if boundary is None:
            out.append((shared, full[len(shared) :]))
            continue
        prompt = tokenizer.decode(tokens[i][:boundary])
        if full.startswith(prompt):
            out.append((prompt, full[len(prompt) :]))
        else:
            out.append((prompt, tokenizer.decode(tokens[i][boundary:])))
    return out


def select_sft(
    scores: Sequence[float], top_n: int, allow_negative: bool, min_diff: float
) -> list[int]:
    """Indices of the sequences to keep from one group, best first (upstream's rules).

    Sort by score, highest first; unless ``allow_negative``, keep only scores **> 0** (zero is
    dropped too); when ``min_diff > 0`` keep only scores more than ``min_diff`` above the group's
    lowest; keep the first ``top_n``.
    """
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if not allow_negative:
        order = [i for i in order if scores[i] > 0]
    if min_diff > 0 and scores:
        low = min(scores)
        order = [i for i in order if scores[i] - low > min_diff]
    return order[:top_n]


def select_dpo_pairs(
    scores: Sequence[float],
    n_pairs: int,
    allow_negative: bool,
    min_diff: float,
    rng: random.Random,
) -> list[tuple[int, int]]:
    """``(chosen, rejected)`` index pairs from one group (upstream's rules).

    Chosen candidates are the sequences sorted high to low (only scores > 0 unless
    ``allow_negative``); the rejected pool is the ``n_pairs`` lowest-scoring sequences. For each
    of the first ``n_pairs`` chosen, a rejected one with ``score < chosen - min_diff`` is drawn at
    random and taken out of the pool; a chosen with no such partner is skipped. So every pair's
    chosen score exceeds its rejected score by more than ``min_diff``.
    """
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    positives = order if allow_negative else [i for i in order if scores[i] > 0]
    pool = sorted(range(len(scores)), key=lambda i: scores[i])[:n_pairs]
    pairs = []
    for pos in positives[:n_pairs]:
        candidates = [j for j in pool if scores[pos] - scores[j] > min_diff]
        if not candidates:
            continue
        neg = rng.choice(candidates)
        pool.remove(neg)
        pairs.append((pos, neg))
    return pairs


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as TRL reads them: role, content and tool-call keys; nulls and env keys dropped."""
    return [{k: m[k] for k in CHAT_KEYS if m.get(k) is not None} for m in messages]


def group_messages(group: Mapping[str, Any], index: int) -> list[dict[str, Any]] | None:
    """The message list of sequence ``index``, or None when the group carries none."""
    messages = group.get("messages")
    if not messages or index >= len(messages) or not isinstance(messages[index], list):
        return None
    return messages[index]
