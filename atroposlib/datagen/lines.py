"""The JSONL lines each scored group becomes, per tool and ``--format``.

``atropos-sft-gen`` (:func:`sft_lines`):

- ``atropos`` (default, upstream's shapes): ``{"prefix", "completion", "score"}``, or
  ``{"messages", "score"}`` with ``--save-messages``;
- ``trl``: ``{"messages"}`` when the groups carry messages (TRL's conversational format), else
  ``{"prompt", "completion"}`` (TRL's prompt-completion format).

``atropos-dpo-gen`` (:func:`dpo_lines`):

- ``atropos`` (default, upstream's shape plus ``neg_score``):
  ``{"prefix", "pos", "neg", "score", "neg_score"}``, or with ``--save-messages``
  ``{"pos": messages, "neg": messages, "score", "neg_score"}``;
- ``trl``: ``{"prompt", "chosen", "rejected"}``: message lists (the shared leading messages as
  the prompt) when the groups carry messages, else text.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from typing import Any

from atroposlib.datagen.options import (
    DPO_GROUPS_PER_BATCH,
    DatagenError,
    DpoOptions,
    SftOptions,
)
from atroposlib.datagen.select import (
    chat_messages,
    common_prefix,
    group_messages,
    select_dpo_pairs,
    select_sft,
    split_group,
)

_NO_MESSAGES = (
    "--save-messages: the groups carry no messages; start the environment with "
    "include_messages, or drop --save-messages"
)


def sft_lines(
    tokenizer: Any, group: Mapping[str, Any], options: SftOptions
) -> list[dict[str, Any]]:
    """The ``atropos-sft-gen`` output lines for one scored group."""
    scores = group["scores"]
    keep = select_sft(
        scores,
        options.save_top_n_per_group,
        options.allow_negative_scores,
        options.minimum_score_diff_max_min,
    )
    if not keep:
        return []
    texts = split_group(tokenizer, group)
    lines = []
    for i in keep:
        messages = group_messages(group, i)
        if options.save_messages and messages is None:
            raise DatagenError(_NO_MESSAGES)
        prefix, completion = texts[i]
        if options.format == "trl":
            if messages is not None:
                lines.append({"messages": chat_messages(messages)})
            else:
                lines.append({"prompt": prefix, "completion": completion})
        elif options.save_messages:
            lines.append({"messages": messages, "score": scores[i]})
        else:
            lines.append({"prefix": prefix, "completion": completion, "score": scores[i]})
    return lines


def sft_num_steps(options: SftOptions) -> int:
    """Batches needed when every group yields its maximum number of lines."""
    per_step = options.tasks_per_step * min(options.save_top_n_per_group, options.group_size)
    return math.ceil(options.num_seqs_to_save / per_step)


def _split_messages(
    pos: list[dict[str, Any]], neg: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(shared leading messages, rest of chosen, rest of rejected)."""
    k = 0
    while k < min(len(pos), len(neg)) - 1 and pos[k] == neg[k]:
        k += 1
    return pos[:k], pos[k:], neg[k:]


def dpo_lines(
    tokenizer: Any, group: Mapping[str, Any], options: DpoOptions, rng: random.Random
) -> list[dict[str, Any]]:
    """The ``atropos-dpo-gen`` output lines for one scored group."""
    scores = group["scores"]
    pairs = select_dpo_pairs(
        scores,
        options.save_n_pairs_per_group,
        options.allow_negative_scores,
        options.minimum_score_diff_max_min,
        rng,
    )
    if not pairs:
        return []
    texts = split_group(tokenizer, group)
    lines = []
    for pos, neg in pairs:
        pos_msgs, neg_msgs = group_messages(group, pos), group_messages(group, neg)
        has_messages = pos_msgs is not None and neg_msgs is not None
        if options.save_messages and not has_messages:
            raise DatagenError(_NO_MESSAGES)
        prefix, chosen = texts[pos]
        neg_prefix, rejected = texts[neg]
        if neg_prefix != prefix:
            # Different prompts (multi-turn envs): fall back to their common text.
            shared = common_prefix([prefix + chosen, neg_prefix + rejected])
            prefix, chosen, rejected = (
                shared,
                (prefix + chosen)[len(shared) :],
                (neg_prefix + rejected)[len(shared) :],
            )
        if options.format == "trl":
            if has_messages:
                prompt, pos_rest, neg_rest = _split_messages(
                    chat_messages(pos_msgs), chat_messages(neg_msgs)
                )
                lines.append({"prompt": prompt, "chosen": pos_rest, "rejected": neg_rest})
            else:
                lines.append({"prompt": prefix, "chosen": chosen, "rejected": rejected})
        elif options.save_messages:
            lines.append(
                {"pos": pos_msgs, "score": scores[pos], "neg": neg_msgs, "neg_score": scores[neg]}
            )
        else:
            lines.append(
                {
                    "prefix": prefix,
                    "pos": chosen,
                    "score": scores[pos],
                    "neg": rejected,
                    "neg_score": scores[neg],
                }
            )
    return lines


def dpo_num_steps(options: DpoOptions) -> int:
    """Batches needed when every group yields its maximum number of pairs."""
    per_group = min(options.save_n_pairs_per_group, options.group_size - 1)
    return math.ceil(options.num_seqs_to_save / (DPO_GROUPS_PER_BATCH * per_group))
