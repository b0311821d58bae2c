"""Conformance checks: does an implementation keep the contract?

``check_trainer`` (also ``atropos-check-trainer -- CMD``) runs a trainer against a real run-api
and a scripted environment and names every rule of the trainer's half of the contract it
breaks; a trainer under the check writes what it trained on with :class:`TrainerReport`
(``report_from_env()`` in its loss step). See ``docs/check-trainer.md``.

Importing this package needs no torch (the weight-based check and the default tiny model
import it when they run).
"""

from atroposlib.testing.expected import ExpectedRow, expected_rows, score_advantages
from atroposlib.testing.report import (
    REPORT_ENV,
    ReportedSequence,
    ReportError,
    TrainerReport,
    TrainerReportData,
    read_report,
    report_from_env,
)
from atroposlib.testing.trainer_check import (
    RULES,
    TRAINER_ENV,
    CheckResult,
    CheckTrainerOptions,
    RuleResult,
    check_trainer,
)

__all__ = [
    "REPORT_ENV",
    "RULES",
    "TRAINER_ENV",
    "CheckResult",
    "CheckTrainerOptions",
    "ExpectedRow",
    "ReportError",
    "ReportedSequence",
    "RuleResult",
    "TrainerReport",
    "TrainerReportData",
    "check_trainer",
    "expected_rows",
    "read_report",
    "report_from_env",
    "score_advantages",
]
