"""``atropos-sft-gen FILEPATH``: rejection-sample environment rollouts into an SFT dataset.

Acts as the trainer of a run: resets the trajectory API, registers with
``batch_size = group_size * tasks_per_step``, and from every scored group keeps the best
sequences (:func:`atroposlib.datagen.select_sft`), one JSONL line each
(:func:`atroposlib.datagen.sft_lines` lists the shapes). The work is done by
:mod:`atroposlib.datagen`; the options are :class:`~atroposlib.datagen.SftOptions`.
"""

from __future__ import annotations

from collections.abc import Sequence

from atroposlib.datagen import SftOptions, main_guard, run, sft_lines, sft_num_steps
from atroposlib.utils.cli import ModelArgumentParser, ModelFlags, parse_model

PROG = "atropos-sft-gen"
FLAGS = ModelFlags(SftOptions, positional=("filepath",))


def build_parser() -> ModelArgumentParser:
    """The ``atropos-sft-gen`` argument parser (upstream's options plus ``--format``)."""
    parser = ModelArgumentParser(
        prog=PROG,
        description="Collect environment rollouts from a trajectory API (run-api) into an SFT "
        "JSONL file: the top-scoring sequences of every group.",
    )
    FLAGS.add_to(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-sft-gen``."""
    options, _ = parse_model(FLAGS, build_parser(), argv)
    assert isinstance(options, SftOptions)
    main_guard(
        lambda: run(
            options,
            batch_size=options.group_size * options.tasks_per_step,
            num_steps=sft_num_steps(options),
            lines_for_group=lambda tok, group: sft_lines(tok, group, options),
            prog=PROG,
        )
    )


if __name__ == "__main__":
    main()
