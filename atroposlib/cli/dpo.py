"""``atropos-dpo-gen FILEPATH``: turn environment rollouts into DPO preference pairs.

Acts as the trainer of a run: resets the trajectory API, registers with
``batch_size = group_size * 8``, and from every scored group draws (chosen, rejected) pairs whose
scores differ by more than ``--minimum-score-diff-max-min`` (see
:func:`atroposlib.cli.datagen.select_dpo_pairs`), one JSONL line each:

- ``--format atropos`` (default, upstream's shape plus ``neg_score``):
  ``{"prefix", "pos", "neg", "score", "neg_score"}``, or with ``--save-messages``
  ``{"pos": messages, "neg": messages, "score", "neg_score"}``;
- ``--format trl``: ``{"prompt", "chosen", "rejected"}``: message lists (the shared leading
  messages as the prompt) when the groups carry messages, else text.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Mapping, Sequence
from typing import Any

from atroposlib.cli.datagen import (
    DatagenError,
    add_common_arguments,
    chat_messages,
    check_positive,
    common_prefix,
    group_messages,
    main_guard,
    run,
    select_dpo_pairs,
    split_group,
)

PROG = "atropos-dpo-gen"
GROUPS_PER_BATCH = 8


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-dpo-gen`` argument parser (upstream's options plus ``--format``, ``--seed``)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Collect environment rollouts from a trajectory API (run-api) into a DPO "
        "JSONL file of (chosen, rejected) pairs from the same group.",
    )
    add_common_arguments(parser, min_diff_default=0.5)
    parser.add_argument(
        "--save-n-pairs-per-group",
        type=int,
        default=3,
        help="Draw at most this many pairs from each group.",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="Seed for drawing rejected sequences (reproducible pairs).",
    )
    parser.epilog = (
        "A pair is written only when chosen score - rejected score > "
        "--minimum-score-diff-max-min (default 0.5)."
    )
    return parser


def _split_messages(
    pos: list[dict[str, Any]], neg: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(shared leading messages, rest of chosen, rest of rejected)."""
    k = 0
    while k < min(len(pos), len(neg)) - 1 and pos[k] == neg[k]:
        k += 1
    return pos[:k], pos[k:], neg[k:]


def dpo_lines(
    tokenizer: Any, group: Mapping[str, Any], args: argparse.Namespace, rng: random.Random
) -> list[dict[str, Any]]:
    """The output lines for one scored group."""
    scores = group["scores"]
    pairs = select_dpo_pairs(
        scores,
        args.save_n_pairs_per_group,
        args.allow_negative_scores,
        args.minimum_score_diff_max_min,
        rng,
    )
    if not pairs:
        return []
    texts = split_group(tokenizer, group)
    lines = []
    for pos, neg in pairs:
        pos_msgs, neg_msgs = group_messages(group, pos), group_messages(group, neg)
        has_messages = pos_msgs is not None and neg_msgs is not None
        if args.save_messages and not has_messages:
            raise DatagenError(
                "--save-messages: the groups carry no messages; start the "
                "environment with include_messages, or drop --save-messages"
            )
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
        if args.format == "trl":
            if has_messages:
                prompt, pos_rest, neg_rest = _split_messages(
                    chat_messages(pos_msgs), chat_messages(neg_msgs)
                )
                lines.append({"prompt": prompt, "chosen": pos_rest, "rejected": neg_rest})
            else:
                lines.append({"prompt": prefix, "chosen": chosen, "rejected": rejected})
        elif args.save_messages:
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


def num_steps_for(args: argparse.Namespace) -> int:
    """Batches needed when every group yields its maximum number of pairs."""
    per_group = min(args.save_n_pairs_per_group, args.group_size - 1)
    return math.ceil(args.num_seqs_to_save / (GROUPS_PER_BATCH * per_group))


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-dpo-gen``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_positive(
        parser, args, ["group_size", "max_token_len", "num_seqs_to_save", "save_n_pairs_per_group"]
    )
    if args.group_size < 2:
        parser.error("--group-size must be at least 2: a pair needs two sequences of a group")
    rng = random.Random(args.seed)
    main_guard(
        lambda: run(
            args,
            batch_size=args.group_size * GROUPS_PER_BATCH,
            num_steps=num_steps_for(args),
            lines_for_group=lambda tok, group: dpo_lines(tok, group, args, rng),
            prog=PROG,
        )
    )


if __name__ == "__main__":
    main()
