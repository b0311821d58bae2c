"""The trainer's time budget (``max_time``/``min_steps``, ``--max-time``/``--min-steps``): how a
duration is written, when a step is the last one, and how bad values are reported. The whole
loop stopping on the budget (final model, the "after" evaluation on that step, the summary line)
is checked by ``test_quickstart_runs_the_loop_and_cleans_up``."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from example_trainer import quickstart
from example_trainer.budget import TimeBudget, format_duration, parse_duration
from example_trainer.config import TrainingConfig


@pytest.mark.parametrize(
    ("written", "seconds"),
    [
        (720, 720.0),
        (90.5, 90.5),
        ("720", 720.0),
        ("12m", 720.0),
        ("11m30s", 690.0),
        ("11M 30S", 690.0),
        ("1.5h", 5400.0),
        ("1h2m3s", 3723.0),
        ("90s", 90.0),
        ("11:30", 690.0),
        ("1:02:00", 3720.0),
    ],
)
def test_durations_in_every_accepted_form(written: object, seconds: float) -> None:
    assert parse_duration(written) == seconds


@pytest.mark.parametrize(
    "written", ["soon", "", "12x", "m", "1m1m", "1:2:3:4", "-5", 0, "0s", True, "nan", "inf"]
)
def test_anything_else_is_refused_with_the_forms_it_accepts(written: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(written)


def test_durations_read_back_in_minutes_and_seconds() -> None:
    assert format_duration(690.4) == "11 min 30 s"
    assert format_duration(45) == "45 s"


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_steps_go_on_while_one_more_fits_then_the_step_is_the_last() -> None:
    clock = _Clock()
    budget = TimeBudget(100, clock=clock)
    for step, seconds in enumerate([30.0, 10.0, 10.0], start=1):
        clock.now += seconds
        assert not budget.is_last(step, seconds)
        budget.record(seconds)
    # 50 s used; the median of the last steps is 10 s: 50 s left fits
    clock.now += 40.0  # a slow step: 90 s used, 10 s left, the median (10 s) still fits
    assert not budget.is_last(4, 40.0)
    budget.record(40.0)
    clock.now += 5.0  # 95 s used: 5 s left; one more step: the median of 30, 10, 10, 40 s
    assert budget.is_last(5, 5.0)
    assert budget.stopped_at == 5
    assert budget.reason == "time budget 1 min 40 s: 5 s left, one more step takes ~20 s"


def test_the_first_step_is_judged_by_its_own_time_so_far() -> None:
    clock = _Clock()
    budget = TimeBudget(60, clock=clock)
    clock.now += 35.0
    assert budget.is_last(1, 35.0)  # 25 s left, a step took 35 s
    assert budget.predicted_step(35.0) == 35.0


def test_the_reserve_is_kept_for_the_end() -> None:
    clock = _Clock()
    reserve = [0.0]
    budget = TimeBudget(100, clock=clock, reserve=lambda: reserve[0])
    clock.now += 10.0
    budget.record(10.0)
    assert not budget.is_last(1, 10.0)  # 90 s left
    reserve[0] = 85.0  # e.g. the "before" evaluation took 85 s: 90 < 10 + 85
    assert budget.is_last(1, 10.0)
    assert budget.reason.endswith("and the end needs ~1 min 25 s")


def test_min_steps_are_taken_whatever_the_clock_says(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock()
    budget = TimeBudget(1, min_steps=3, clock=clock, started=clock.now - 500)
    with caplog.at_level(logging.INFO, logger="example_trainer.budget"):
        assert not budget.is_last(1, 5.0)
        assert not budget.is_last(2, 5.0)
        assert budget.is_last(3, 5.0)
    assert "step 3 is the last one: time budget 1 s: 0 s left" in caplog.text


def test_the_prediction_follows_the_last_steps_not_the_first() -> None:
    budget = TimeBudget(1000, window=3)
    for seconds in (200.0, 10.0, 12.0, 11.0):
        budget.record(seconds)
    assert budget.predicted_step(1.0) == 11.0


def test_trainer_settings_accept_durations_and_refuse_bad_ones() -> None:
    config = TrainingConfig(model_name="m", max_time="11m30s", min_steps=3, training_steps=5)
    assert config.max_time == 690.0
    assert TrainingConfig(model_name="m").max_time is None
    with pytest.raises(ValidationError, match="not a duration"):
        TrainingConfig(model_name="m", max_time="soon")
    with pytest.raises(ValidationError, match=r"min_steps \(6\) is more than training_steps"):
        TrainingConfig(model_name="m", min_steps=6, training_steps=5)


def test_quickstart_flags() -> None:
    args = quickstart.parse_args(["--max-time", "12m", "--min-steps", "2", "--steps", "9"])
    assert (args.max_time, args.min_steps, args.steps) == (720.0, 2, 9)
    # a recipe's budget can be turned off, and --steps below its --min-steps wins
    assert (
        quickstart.parse_args(["--recipe", "gsm8k-format", "--max-time", "none"]).max_time is None
    )
    args = quickstart.parse_args(["--recipe", "gsm8k-format", "--steps", "5"])
    assert args.steps == 5 and args.min_steps > 5


def test_the_wait_for_a_batch_is_bounded_by_what_its_training_and_the_end_need() -> None:
    clock = _Clock()
    budget = TimeBudget(300, min_steps=2, clock=clock, reserve=lambda: 60.0)
    assert budget.wait_left(0) is None  # the first batch waits as long as it takes
    clock.now += 50.0
    budget.record(50.0, waited=40.0)  # 10 s of work
    # below min_steps: until the deadline (250 s away), whatever the training and the end need
    assert budget.wait_left(1) == pytest.approx(250.0)
    clock.now += 30.0
    budget.record(30.0, waited=18.0)  # 12 s of work
    # 80 s used: 220 s left, less ~11 s of training and the 60-s reserve
    assert budget.wait_left(2) == pytest.approx(149.0)
    clock.now += 149.0
    budget.stop_waiting(2, 149.0)
    assert budget.stopped_at == 2
    assert budget.reason == (
        "time budget 5 min 0 s: no batch for step 3 within 2 min 29 s of waiting, the time its "
        "training and the end still had"
    )


def test_below_min_steps_a_batch_that_never_comes_ends_training_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An environment whose groups all score alike sends no batch at all: before min_steps the
    wait lasts until the deadline, and at least ``patience``, then training ends short of
    min_steps and says so (it used to wait without end)."""
    clock = _Clock()
    budget = TimeBudget(100, min_steps=10, clock=clock, patience=30.0)
    clock.now += 20.0
    budget.record(20.0, waited=5.0)
    assert budget.wait_left(1) == pytest.approx(80.0)
    clock.now += 95.0  # past the deadline: still the patience
    assert budget.wait_left(1) == pytest.approx(30.0)
    with caplog.at_level("WARNING", logger="example_trainer.budget"):
        budget.stop_waiting(1, 125.0)
    assert budget.stopped_at == 1
    assert "1 of min_steps 10 taken" in budget.reason
    assert "no batch for step 2 within 2 min 5 s" in budget.reason
    assert any(r.levelname == "WARNING" and "min_steps" in r.getMessage() for r in caplog.records)


def test_the_summary_counts_the_steps_skipped_for_a_gradient_spike(
    tmp_path, capsys: pytest.CaptureFixture
) -> None:
    """A run whose trainer skipped optimizer steps (skip_grad_spikes) says which, at the end."""
    import json

    records = [
        {"step": 0, "eval/percent_correct": 0.1},
        {"step": 1, "loss": 0.1, "grad_spike_skipped": 0.0},
        {"step": 2, "loss": 0.1, "grad_spike_skipped": 1.0},
        {"step": 3, "loss": 0.1, "grad_spike_skipped": 0.0},
        {"step": 4, "loss": 0.1, "grad_spike_skipped": 1.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = quickstart.parse_args(["--output", str(tmp_path)])
    quickstart._summary(
        tmp_path, tmp_path / "rollouts.jsonl", tmp_path / "checkpoints", None,
        tmp_path / "logs", 12.0, args,
    )  # fmt: skip
    err = capsys.readouterr().err
    assert "skipped       2 optimizer step(s) for a gradient spike (step 2, 4" in err
    (tmp_path / "metrics.jsonl").write_text(json.dumps(records[1]) + "\n")
    quickstart._summary(
        tmp_path, tmp_path / "rollouts.jsonl", tmp_path / "checkpoints", None,
        tmp_path / "logs", 12.0, args,
    )  # fmt: skip
    assert "gradient spike" not in capsys.readouterr().err
