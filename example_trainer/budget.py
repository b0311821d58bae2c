"""A wall-clock budget for training: take steps while another one still fits.

``max_time`` in :class:`~example_trainer.config.TrainingConfig` (and ``--max-time`` of
``atropos-quickstart``) follows PyTorch Lightning's ``max_time``/``min_steps``: ``training_steps``
stays the upper bound, ``min_steps`` are always taken, and after each later step the trainer
asks whether one more step (the median wall time of its last steps) and what the caller keeps
for the end (a final evaluation) would still end within the budget. If not, that step is the
last one: it is saved as ``final_model`` and synced like any last step. The wait for the next
batch is bounded too: a batch that does not come while its training and the end would still fit
(late in a run most groups can score alike and be dropped, so one wait can take minutes) ends
training at the step before it. Before ``min_steps`` the trainer waits until the budget has run
out, and at least ``patience`` for each batch (2 minutes, or a quarter of a shorter budget): a
batch that has not come by then ends training short of ``min_steps`` with a warning (an
environment whose groups all score alike sends none, however long it runs). The step being
trained always finishes, so the budget is a target, not a hard limit.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([hms])")


def parse_duration(value: object) -> float:
    """Seconds from ``value``: a number of seconds (``720``, ``"720"``), units (``"12m"``,
    ``"11m30s"``, ``"1.5h"``, ``"90s"``) or a clock (``"11:30"`` = MM:SS, ``"1:02:00"`` =
    HH:MM:SS). Raises ``ValueError`` with the accepted forms for anything else or a duration
    that is not positive."""
    if isinstance(value, bool):
        raise ValueError(f"not a duration: {value!r}")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        text = str(value).strip().lower().replace(" ", "")
        seconds = _parse_text(text)
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ValueError(f"a duration must be positive and finite, got {value!r}")
    return seconds


def _parse_text(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    if ":" in text:
        parts = text.split(":")
        if 2 <= len(parts) <= 3 and all(re.fullmatch(r"\d+(\.\d+)?", p) for p in parts):
            seconds = 0.0
            for part in parts:
                seconds = seconds * 60 + float(part)
            return seconds
    elif text and _PART.sub("", text) == "":
        units = [unit for _, unit in _PART.findall(text)]
        if len(set(units)) == len(units):
            return sum(float(n) * _UNITS[u] for n, u in _PART.findall(text))
    raise ValueError(
        f"not a duration: {text!r} (seconds, e.g. 720; units, e.g. 12m, 11m30s, 1.5h; "
        "or MM:SS / HH:MM:SS)"
    )


def format_duration(seconds: float) -> str:
    """``seconds`` as ``"11 min 30 s"`` (or ``"45 s"``)."""
    whole = int(round(seconds))
    minutes, rest = divmod(whole, 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


class TimeBudget:
    """Decides, after each optimizer step, whether it is the last one that fits.

    ``seconds`` count from ``started`` (``time.monotonic()``; default: now). ``reserve``, asked
    at each decision, is the time the caller needs after the last step (atropos-quickstart: as
    long as its "before" evaluation took, for the "after" one). A step's wall time is measured
    from asking for its batch to the end of its weight sync; one more step is predicted as the
    median of the last ``window`` of them (the step in progress, when none has ended yet).
    """

    def __init__(
        self,
        seconds: float,
        *,
        min_steps: int = 0,
        started: float | None = None,
        reserve: Callable[[], float] | None = None,
        window: int = 5,
        patience: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.seconds = parse_duration(seconds)
        self.min_steps = min_steps
        self.clock = clock
        self.started = clock() if started is None else started
        self.reserve = reserve
        self.window = window
        #: the least a wait for a batch before ``min_steps`` lasts, even past the deadline
        self.patience = min(120.0, self.seconds / 4) if patience is None else patience
        self.durations: list[float] = []
        #: each step's wall time less its wait for the batch
        self.work: list[float] = []
        #: the step the budget ended training at (None while it has not)
        self.stopped_at: int | None = None
        #: why, in words, for logs and summaries
        self.reason = ""

    @property
    def deadline(self) -> float:
        """The monotonic time the budget runs out."""
        return self.started + self.seconds

    def record(self, seconds: float, waited: float = 0.0) -> None:
        """One step's wall time (batch wait, training, save and sync), ``waited`` of it for
        the batch."""
        self.durations.append(seconds)
        self.work.append(max(0.0, seconds - waited))

    def _reserve(self) -> float:
        return max(0.0, float(self.reserve())) if self.reserve is not None else 0.0

    def wait_left(self, step: int) -> float | None:
        """How long the trainer may wait for the batch of step ``step + 1`` (``step`` steps
        taken): until its training (the median of the last steps' work) and the reserve would
        no longer end within the budget. Before ``min_steps``: until the deadline, and at
        least :attr:`patience`. None: wait as long as it takes (for the first batch, which
        waits for the environments and servers to start)."""
        if step < 1:
            return None
        if step < self.min_steps:
            return max(self.deadline - self.clock(), self.patience)
        recent = self.work[-self.window :]
        work = statistics.median(recent) if recent else 0.0
        return self.deadline - self.clock() - work - self._reserve()

    def stop_waiting(self, step: int, waited: float) -> None:
        """No batch came within :meth:`wait_left`: training ends at ``step``, the step before
        (short of ``min_steps`` with a warning)."""
        self.stopped_at = step
        if step < self.min_steps:
            self.reason = (
                f"time budget {format_duration(self.seconds)}: no batch for step {step + 1} "
                f"within {format_duration(waited)} of waiting, {step} of min_steps "
                f"{self.min_steps} taken (does the environment still send groups? one whose "
                "groups all score alike drops them all)"
            )
            logger.warning("step %d is the last one: %s", step, self.reason)
            return
        self.reason = (
            f"time budget {format_duration(self.seconds)}: no batch for step {step + 1} within "
            f"{format_duration(waited)} of waiting, the time its training"
            + (" and the end" if self.reserve is not None else "")
            + " still had"
        )
        logger.info("step %d is the last one: %s", step, self.reason)

    def predicted_step(self, running: float) -> float:
        """Seconds one more step is expected to take (``running``: the current step so far)."""
        recent = self.durations[-self.window :]
        return statistics.median(recent) if recent else running

    def is_last(self, step: int, running: float) -> bool:
        """Whether ``step`` (just trained, ``running`` seconds into it) must be the last one:
        never before ``min_steps``; after, when one more step plus the reserve would end past
        the deadline. Logs the reason once."""
        if step < self.min_steps:
            return False
        now = self.clock()
        next_step = self.predicted_step(running)
        reserve = self._reserve()
        left = self.deadline - now
        if left >= next_step + reserve:
            return False
        self.stopped_at = step
        self.reason = (
            f"time budget {format_duration(self.seconds)}: {format_duration(max(left, 0.0))} "
            f"left, one more step takes ~{format_duration(next_step)}"
            + (f" and the end needs ~{format_duration(reserve)}" if reserve else "")
        )
        logger.info("step %d is the last one: %s", step, self.reason)
        return True
