"""``atropos-check-trainer [options] -- CMD ...``: check a trainer against the contract.

Starts run-api (and with ``--serve`` atropos-serve), a scripted environment and ``CMD`` as the
trainer, then prints which rules of the trainer's half of the contract hold and which do not;
exit status 0 when all hold, 1 when any fails, 2 for a usage error. ``$ATROPOS_*`` in ``CMD``'s
arguments (quote them so your shell leaves them alone) are replaced by the check's values.
The work is done by :func:`atroposlib.testing.check_trainer`; see ``docs/check-trainer.md``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from atroposlib.testing import CheckTrainerOptions, check_trainer
from atroposlib.testing.trainer_check import TRAINER_ENV
from atroposlib.utils.cli import ModelArgumentParser, ModelFlags, parse_model

PROG = "atropos-check-trainer"
FLAGS = ModelFlags(CheckTrainerOptions)


def build_parser() -> ModelArgumentParser:
    """The ``atropos-check-trainer`` argument parser (the trainer command follows ``--``)."""
    variables = "; ".join(f"{name}: {text}" for name, text in TRAINER_ENV.items())
    parser = ModelArgumentParser(
        prog=PROG,
        usage=f"{PROG} [options] -- TRAINER_COMMAND [ARG ...]",
        description="Run a trainer against a real run-api and a scripted environment and "
        "report which rules of the trainer's half of the Atropos contract it breaks "
        "(registration, acknowledgement and redelivery, trained tokens, advantages, policy "
        "versions, weights). The trainer command gets these environment variables (and "
        f"$NAME in its arguments is replaced): {variables}.",
    )
    FLAGS.add_to(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of ``atropos-check-trainer``."""
    args = list(sys.argv[1:] if argv is None else argv)
    command: list[str] = []
    if "--" in args:
        split = args.index("--")
        args, command = args[:split], args[split + 1 :]
    parser = build_parser()
    options, _ = parse_model(FLAGS, parser, args)
    assert isinstance(options, CheckTrainerOptions)
    if not command:
        parser.error("give the trainer command after --, e.g. -- python train.py")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    result = check_trainer(command, options)
    print(result.render())
    raise SystemExit(0 if result.passed else 1)


if __name__ == "__main__":
    main()
