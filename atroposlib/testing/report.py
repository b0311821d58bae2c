"""The trainer report: what a trainer trained on, written for ``atropos-check-trainer``.

A trainer under the check writes, through :class:`TrainerReport`, one JSON line per sequence it
puts through its loss, from the very tensors its loss consumes. The check compares those lines
with what the contract says the trainer should have trained on (:mod:`atroposlib.testing.expected`).

**Format** (JSON lines, UTF-8, appended; ``record`` says what a line is):

- ``{"record": "trainer", "format": 1, "standard_advantages": bool, "name": str}``: written once
  by each writer when it opens the file. ``standard_advantages`` true claims the contract's
  normalisation (``(score - mean) / max(std, 1e-8)``, unbiased std; explicit ``advantages``
  unscaled): the check then compares advantage *values*, not only their signs.
- ``{"record": "sequence", "step": int, "tokens": [int], "trained": [0|1], "advantages": [float],
  "policy_version": int | null}``: one sequence as the loss saw it, **token-aligned**: position
  ``j`` of ``trained`` and ``advantages`` is about ``tokens[j]``: 1 when the log-probability of
  ``tokens[j]`` (predicted from the tokens before it) is in the loss, and the advantage that
  weighs it (0 where not trained). ``tokens[0]`` is never trained. ``tokens`` may end with
  padding (positions not trained), and may lack the last token of the sequence when that one is
  not trained. ``step`` counts optimizer steps from 1 (:meth:`TrainerReport.end_step` closes one).
  ``policy_version``: the group's ``policy_version`` as the trainer read it (null: not reported).
- ``{"record": "step", "step": int, "sequences": int}``: written by :meth:`TrainerReport.end_step`
  after an optimizer step, with the number of sequences reported for it.

A sequence whose advantage is 0 on every trained token adds nothing to a policy-gradient loss;
a trainer may leave it out of the report (and out of its forward pass).

The module is torch-free: tensors are read through ``.tolist()``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "REPORT_ENV",
    "ReportedSequence",
    "ReportError",
    "TrainerReport",
    "TrainerReportData",
    "read_report",
    "report_from_env",
]

#: Environment variable naming the report file; set by ``atropos-check-trainer``.
REPORT_ENV = "ATROPOS_TRAINER_REPORT"
FORMAT = 1
IGNORE_INDEX = -100


def _as_list(values: Any) -> list:
    """A Python list from a list, tuple or tensor/array (``.tolist()``), detached from autograd."""
    if hasattr(values, "detach"):
        values = values.detach()
    if hasattr(values, "cpu"):
        values = values.cpu()
    if hasattr(values, "tolist"):
        values = values.tolist()
    return list(values)


class TrainerReport:
    """Writes the report ``atropos-check-trainer`` reads (format: the module docstring).

    Args:
        path: the report file (appended; created with its folder).
        standard_advantages: the trainer computes advantages exactly as the contract says
            (see the module docstring): the check then compares values too.
        name: the trainer's name, for the check's output.

    Call :meth:`sequence` (token-aligned rows) or :meth:`shifted_rows` (next-token rows, as
    most causal-LM losses hold them) for every row the loss consumes, then :meth:`end_step`
    after each optimizer step. Each line is written with one ``write`` in append mode, so
    several processes (ranks) may share one file.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, standard_advantages: bool = False, name: str = ""
    ) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()
        self.step = 1
        self._in_step = 0
        self._write(
            {
                "record": "trainer",
                "format": FORMAT,
                "standard_advantages": bool(standard_advantages),
                "name": name,
            }
        )

    def _write(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
            self._file.flush()

    def sequence(
        self,
        tokens: Any,
        trained: Any,
        advantages: Any,
        *,
        policy_version: int | None = None,
    ) -> None:
        """Report one sequence, token-aligned: ``trained[j]`` (bool or 0/1) says whether the
        log-probability of ``tokens[j]`` is in the loss, ``advantages[j]`` weighs it (a single
        number is used for every trained token)."""
        ids = [int(t) for t in _as_list(tokens)]
        flags = [1 if bool(f) else 0 for f in _as_list(trained)]
        if len(flags) != len(ids):
            raise ValueError(f"trained has {len(flags)} entries but tokens has {len(ids)}")
        if isinstance(advantages, (int, float)):
            advs = [float(advantages)] * len(ids)
        else:
            advs = [float(a) for a in _as_list(advantages)]
        if len(advs) != len(ids):
            raise ValueError(f"advantages has {len(advs)} entries but tokens has {len(ids)}")
        self._write(
            {
                "record": "sequence",
                "step": self.step,
                "tokens": ids,
                "trained": flags,
                "advantages": [a if f else 0.0 for a, f in zip(advs, flags, strict=True)],
                "policy_version": policy_version,
            }
        )
        self._in_step += 1

    def shifted_rows(
        self,
        input_ids: Any,
        labels: Any,
        advantages: Any,
        *,
        prefix_ids: Any = None,
        policy_versions: Sequence[int | None] | None = None,
        ignore_index: int = IGNORE_INDEX,
    ) -> None:
        """Report a ``[B, T]`` micro-batch in the next-token layout: position ``t`` of a row
        feeds ``input_ids[t]`` and trains the prediction of ``labels[t]`` (``ignore_index``
        where the loss leaves it out) with weight ``advantages[t]``.

        ``prefix_ids`` (``[P]``): tokens every row continues (a shared prompt run once); none
        of them is trained. Rows may be right-padded (padding labelled ``ignore_index``).
        """
        prefix = [] if prefix_ids is None else [int(t) for t in _as_list(prefix_ids)]
        rows = _as_list(input_ids)
        label_rows = _as_list(labels)
        adv_rows = _as_list(advantages)
        for b, row in enumerate(rows):
            inputs = prefix + [int(t) for t in row]
            targets = [ignore_index] * len(prefix) + [int(t) for t in label_rows[b]]
            advs = [0.0] * len(prefix) + [float(a) for a in adv_rows[b]]
            tokens = list(inputs)
            trained = [0] * len(inputs)
            weights = [0.0] * len(inputs)
            for t, target in enumerate(targets):
                if target == ignore_index:
                    continue
                if t + 1 == len(tokens):  # the last token exists only as a target
                    tokens.append(target)
                    trained.append(0)
                    weights.append(0.0)
                # the target is what is trained (after a row's last real input, the next
                # input position is padding)
                tokens[t + 1] = target
                trained[t + 1] = 1
                weights[t + 1] = advs[t]
            version = None if policy_versions is None else policy_versions[b]
            self.sequence(tokens, trained, weights, policy_version=version)

    def end_step(self) -> None:
        """Close the current optimizer step (call after each ``optimizer.step()``)."""
        self._write({"record": "step", "step": self.step, "sequences": self._in_step})
        self.step += 1
        self._in_step = 0

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> TrainerReport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FROM_ENV: dict[str, TrainerReport] = {}
_FROM_ENV_LOCK = threading.Lock()


def report_from_env(*, standard_advantages: bool = False, name: str = "") -> TrainerReport | None:
    """The :class:`TrainerReport` writing to ``$ATROPOS_TRAINER_REPORT``, or None when the
    variable is unset (the trainer is not under the check). One writer per path and process:
    every call returns the same one, so a training loop may call this at each step."""
    path = os.environ.get(REPORT_ENV, "")
    if not path:
        return None
    with _FROM_ENV_LOCK:
        report = _FROM_ENV.get(path)
        if report is None:
            report = TrainerReport(path, standard_advantages=standard_advantages, name=name)
            _FROM_ENV[path] = report
        return report


# ------------------------------------------------------------------------------ reading


class ReportError(ValueError):
    """A report line that is not in the format (the message names the line)."""


@dataclass
class ReportedSequence:
    """One ``sequence`` record; ``line`` is its 1-based line number in the file."""

    line: int
    step: int
    tokens: list[int]
    trained: list[int]
    advantages: list[float]
    policy_version: int | None


@dataclass
class TrainerReportData:
    """What a report file holds."""

    standard_advantages: bool = False
    names: list[str] = field(default_factory=list)
    sequences: list[ReportedSequence] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    writers: int = 0


def read_report(path: str | os.PathLike[str]) -> TrainerReportData:
    """Parse a report file. Raises :class:`ReportError` naming the first bad line."""
    data = TrainerReportData()
    claims: set[bool] = set()
    text = Path(path).read_text(encoding="utf-8")
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            kind = record["record"]
            if kind == "trainer":
                if record.get("format") != FORMAT:
                    raise ReportError(f"line {number}: format {record.get('format')!r}, not 1")
                data.writers += 1
                claims.add(bool(record.get("standard_advantages")))
                if record.get("name"):
                    data.names.append(str(record["name"]))
            elif kind == "sequence":
                tokens = [int(t) for t in record["tokens"]]
                trained = [int(f) for f in record["trained"]]
                advantages = [float(a) for a in record["advantages"]]
                if not len(tokens) == len(trained) == len(advantages):
                    raise ReportError(
                        f"line {number}: tokens, trained and advantages differ in length "
                        f"({len(tokens)}, {len(trained)}, {len(advantages)})"
                    )
                version = record.get("policy_version")
                data.sequences.append(
                    ReportedSequence(
                        line=number,
                        step=int(record.get("step", 0)),
                        tokens=tokens,
                        trained=trained,
                        advantages=advantages,
                        policy_version=None if version is None else int(version),
                    )
                )
            elif kind == "step":
                data.steps.append(int(record["step"]))
            else:
                raise ReportError(f"line {number}: unknown record {kind!r}")
        except ReportError:
            raise
        except (ValueError, KeyError, TypeError) as exc:
            raise ReportError(f"line {number}: {type(exc).__name__}: {exc}") from exc
    # several writers (ranks) may share a file; the claim holds only if every one makes it
    data.standard_advantages = claims == {True}
    return data
