"""``atropos-sft-gen FILEPATH``: rejection-sample environment rollouts into an SFT dataset.

Acts as the trainer of a run: resets the trajectory API, registers with
``batch_size = group_size * tasks_per_step``, and from every scored group keeps the best
sequences (see :func:`atroposlib.cli.datagen.select_sft`), one JSONL line each:

- ``--format atropos`` (default, upstream's shapes): ``{"prefix", "completion", "score"}``, or
  ``{"messages", "score"}`` with ``--save-messages``;
- ``--format trl``: ``{"messages"}`` when the groups carry messages (TRL's conversational
  format), else ``{"prompt", "completion"}`` (TRL's prompt-completion format).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from typing import Any

from atroposlib.cli.datagen import (
    DatagenError,
    add_common_arguments,
    chat_messages,
    check_positive,
    group_messages,
    main_guard,
    run,
    select_sft,
    split_group,
)

PROG = "atropos-sft-gen"


def build_parser() -> argparse.ArgumentParser:
    """The ``atropos-sft-gen`` argument parser (upstream's options plus ``--format``)."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Collect environment rollouts from a trajectory API (run-api) into an SFT "
        "JSONL file: the top-scoring sequences of every group.",
    )
    add_common_arguments(parser, min_diff_default=0.0)
    parser.add_argument(
        "--save-top-n-per-group",
        type=int,
        default=3,
        help="Keep at most this many sequences of each group, best first.",
    )
    parser.add_argument(
        "--tasks-per-step",
        type=int,
        default=64,
        help="Groups per batch (batch_size = group_size * tasks_per_step).",
    )
    parser.epilog = (
        "--minimum-score-diff-max-min D (> 0) keeps only sequences scoring more than D above "
        "their group's lowest score."
    )
    return parser


def sft_lines(
    tokenizer: Any, group: Mapping[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """The output lines for one scored group."""
    scores = group["scores"]
    keep = select_sft(
        scores,
        args.save_top_n_per_group,
        args.allow_negative_scores,
        args.minimum_score_diff_max_min,
    )
    if not keep:
        return []
    texts = split_group(tokenizer, group)
    lines = []
    for i in keep:
        messages = group_messages(group, i)
        if args.save_messages and messages is None:
            raise DatagenError(
                "--save-messages: the groups carry no messages; start the "
                "environment with include_messages, or drop --save-messages"
            )
        prefix, completion = texts[i]
        if args.format == "trl":
            if messages is not None:
                lines.append({"messages": chat_messages(messages)})
            else:
                lines.append({"prompt": prefix, "completion": completion})
        elif args.save_messages:
            lines.append({"messages": messages, "score": scores[i]})
        else:
            lines.append({"prefix": prefix, "completion": completion, "score": scores[i]})
    return lines


def num_steps_for(args: argparse.Namespace) -> int:
    """Batches needed when every group yields its maximum number of lines."""
    per_step = args.tasks_per_step * min(args.save_top_n_per_group, args.group_size)
    return math.ceil(args.num_seqs_to_save / per_step)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-sft-gen``."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_positive(
        parser,
        args,
        [
            "group_size",
            "max_token_len",
            "num_seqs_to_save",
            "save_top_n_per_group",
            "tasks_per_step",
        ],
    )
    main_guard(
        lambda: run(
            args,
            batch_size=args.group_size * args.tasks_per_step,
            num_steps=num_steps_for(args),
            lines_for_group=lambda tok, group: sft_lines(tok, group, args),
            prog=PROG,
        )
    )


if __name__ == "__main__":
    main()
