"""``atropos-dpo-gen FILEPATH``: turn environment rollouts into DPO preference pairs.

Acts as the trainer of a run: resets the trajectory API, registers with
``batch_size = group_size * 8``, and from every scored group draws (chosen, rejected) pairs whose
scores differ by more than ``--minimum-score-diff-max-min``
(:func:`atroposlib.datagen.select_dpo_pairs`), one JSONL line each
(:func:`atroposlib.datagen.dpo_lines` lists the shapes). The work is done by
:mod:`atroposlib.datagen`; the options are :class:`~atroposlib.datagen.DpoOptions`.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from atroposlib.datagen import DpoOptions, dpo_lines, dpo_num_steps, main_guard, run
from atroposlib.datagen.options import DPO_GROUPS_PER_BATCH
from atroposlib.utils.cli import ModelArgumentParser, ModelFlags, parse_model

PROG = "atropos-dpo-gen"
FLAGS = ModelFlags(DpoOptions, positional=("filepath",))


def build_parser() -> ModelArgumentParser:
    """The ``atropos-dpo-gen`` argument parser (upstream's options plus ``--format``, ``--seed``)."""
    parser = ModelArgumentParser(
        prog=PROG,
        description="Collect environment rollouts from a trajectory API (run-api) into a DPO "
        "JSONL file of (chosen, rejected) pairs from the same group.",
    )
    FLAGS.add_to(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-dpo-gen``."""
    options, _ = parse_model(FLAGS, build_parser(), argv)
    assert isinstance(options, DpoOptions)
    rng = random.Random(options.seed)
    main_guard(
        lambda: run(
            options,
            batch_size=options.group_size * DPO_GROUPS_PER_BATCH,
            num_steps=dpo_num_steps(options),
            lines_for_group=lambda tok, group: dpo_lines(tok, group, options, rng),
            prog=PROG,
        )
    )


if __name__ == "__main__":
    main()
