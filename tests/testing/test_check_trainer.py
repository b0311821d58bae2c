"""``check_trainer`` / ``atropos-check-trainer`` against real trainers: the example trainer and
the reference trainer of ``wrong_trainer.py`` pass; each deliberate defect fails the rule that
names it, and only the rules it breaks.

Every run is real: run-api with a store, the proxy that loses one batch response, the scripted
env, the trainer as a subprocess on the tiny random model (CPU, a few steps).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atroposlib.testing import CheckResult, check_trainer

WRONG = str(Path(__file__).with_name("wrong_trainer.py"))

EXAMPLE_TRAINER = [
    sys.executable, "-m", "example_trainer.grpo",
    "--model", "$ATROPOS_CHECK_MODEL",
    "--atropos-url", "$ATROPOS_API_URL",
    "--save-path", "$ATROPOS_CHECK_OUTPUT",
    "--training-steps", "$ATROPOS_CHECK_STEPS",
    "--batch-size", "$ATROPOS_CHECK_BATCH_SIZE",
    "--gradient-accumulation-steps", "1",
    "--seq-len", "256",
    "--dtype", "float32",
    "--lr", "1e-3",
    "--batch-timeout", "120",
    "--no-progress",
]  # fmt: skip


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "disabled")


def _check(tmp_path: Path, model: Path, command: list[str], **options) -> CheckResult:
    result = check_trainer(
        command, model=str(model), workdir=str(tmp_path / "check"), timeout=300, **options
    )
    print(result.render())
    return result


def _checked(result: CheckResult) -> set[str]:
    return {r.name for r in result.rules if r.status != "skip"}


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
def test_reference_trainer_passes(tmp_path: Path, tiny_model_dir: Path) -> None:
    result = _check(tmp_path, tiny_model_dir, [sys.executable, WRONG])
    assert result.passed, result.render()
    # everything was checked (policy versions from the report: there is no server)
    assert _checked(result) == {r.name for r in result.rules}
    assert "reported versions" in result.rule("policy_version").detail
    assert "left out" not in result.rule("trained_once").detail
    redelivered = [line for line in _api_log(tmp_path) if "again" in line]
    assert redelivered, "run-api never handed a batch out again"


def _api_log(tmp_path: Path) -> list[str]:
    return (tmp_path / "check" / "run-api.log").read_text().splitlines()


#: Each defect alone, and the rules it must fail (no others). zero-score, ignore-explicit and
#: multi-turn-as-one are run together as --verl below, and zero-score alone with a fixed size.
DEFECTS = {
    "flip-sign": {"advantage_sign", "explicit_advantages", "set_advantage_to_zero"},
    "ignore-mask": {"masks", "multi_turn_masks"},
    # the lost batch never comes back; the trainer waits for it until the check stops it
    "no-ack": {"ack", "redelivery", "trainer_runs"},
    # every batch comes again: the first one is trained at every step, the others never
    "stale-ack": {"ack", "redelivery", "trained_once"},
    "version-from-step": {"policy_version"},
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_defect_fails_its_rule(tmp_path: Path, tiny_model_dir: Path, defect: str) -> None:
    # no model, no final_model: the report-based rules alone must name the defect
    command = [sys.executable, WRONG, f"--{defect}", "--report-only"]
    result = _check(tmp_path, tiny_model_dir, command)
    assert set(result.failed) == DEFECTS[defect], result.render()
    assert result.rule("weights").status == "skip"


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
def test_a_registration_that_refuses_the_groups(tmp_path: Path, tiny_model_dir: Path) -> None:
    """run-api refuses sequences longer than the registered max_token_len: the check says so
    and stops the trainer waiting for batches that cannot come (instead of the timeout)."""
    command = [sys.executable, WRONG, "--report-only", "--max-token-len", "12"]
    started = time.monotonic()
    result = _check(tmp_path, tiny_model_dir, command)
    assert time.monotonic() - started < 120  # not the 300 s timeout
    assert {"register", "trainer_runs"} <= set(result.failed), result.render()
    assert (
        "max_token_len=12, below ATROPOS_CHECK_MAX_TOKEN_LEN" in result.rule("register").problems[0]
    )
    assert "refused" in result.rule("trainer_runs").problems[0]


@pytest.mark.nightly  # out of per-commit CI (time budget): .ci/nightly runs it
def test_a_report_that_lies_is_caught_by_the_weights(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Trains with flipped signs but reports the right advantages: only the log-probabilities
    of the saved model show it."""
    result = _check(tmp_path, tiny_model_dir, [sys.executable, WRONG, "--lie"])
    assert result.failed == ["weights"], result.render()
    assert "moved against the advantages" in result.rule("weights").problems[0]


def test_cli_names_verls_three_defects(tmp_path: Path, tiny_model_dir: Path) -> None:
    """verl's Atropos recipe zeroes the score for set_advantage_to_zero, ignores explicit
    advantages and trains tool/user tokens; ``atropos-check-trainer`` exits 1 naming each."""
    proc = subprocess.run(
        [sys.executable, "-m", "atroposlib.cli.check_trainer", "--model", str(tiny_model_dir),
         "--workdir", str(tmp_path / "check"), "--", sys.executable, WRONG, "--verl", "--report-only"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
    failed = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("  FAIL")}
    assert failed == {"set_advantage_to_zero", "explicit_advantages", "multi_turn_masks"}, (
        proc.stdout
    )
    # each rule is failed by the groups made for it
    for example in (
        "group 6 (set_advantage_to_zero) sequence 2",  # zeroed score: its sign flips
        "group 2 (explicit_per_token) sequence 0",
        "group 1 (multi_turn) sequence 0",
    ):
        assert example in proc.stdout, proc.stdout
    assert (tmp_path / "check" / "result.txt").read_text().strip() == proc.stdout.strip()


def test_fixed_group_size(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With --group-size every group has that many sequences (the trainer refuses others: it
    would exit 1), the output says the mixed case was not checked, and set_advantage_to_zero
    applied to the score is still caught with groups of 2."""
    result = _check(
        tmp_path, tiny_model_dir, [sys.executable, WRONG, "--report-only", "--zero-score"],
        group_size=2,
    )  # fmt: skip
    assert result.failed == ["set_advantage_to_zero"], result.render()
    assert any("mixed group sizes" in note for note in result.notes)


def test_example_trainer_passes(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The example trainer (shared prompts run once, zero-advantage rows skipped, padded
    micro-batches) reports through ``train_step`` and passes, weights included."""
    result = _check(tmp_path, tiny_model_dir, [*EXAMPLE_TRAINER, "--inference", "none"])
    assert result.passed, result.render()
    assert result.rule("weights").status == "pass"
    assert result.rule("advantage_value").status == "pass"  # it claims the normalisation
    assert "left out, as allowed" in result.rule("trained_once").detail


@pytest.mark.slow
def test_example_trainer_passes_with_weight_sync(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With --serve the trainer hot-reloads atropos-serve after each step: the served
    log-probabilities move with the advantages and the server reports the last step."""
    result = _check(
        tmp_path, tiny_model_dir,
        [*EXAMPLE_TRAINER, "--inference", "atropos-serve", "--inference-url",
         "$ATROPOS_INFERENCE_URL", "--weight-sync-interval", "1"],
        serve=True,
    )  # fmt: skip
    assert result.passed, result.render()
    assert result.rule("weights").status == "pass"
    assert result.rule("policy_version").status == "pass"
    assert "served version" in result.rule("policy_version").detail


@pytest.mark.slow
def test_a_trainer_that_never_syncs_fails_with_serve(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The reference trainer saves its model but never pushes it to the inference server:
    with --serve the served log-probabilities and policy version stay where they were."""
    result = _check(tmp_path, tiny_model_dir, [sys.executable, WRONG, "--report-only"], serve=True)
    assert set(result.failed) == {"weights", "policy_version"}, result.render()
    assert "did not sync" in result.rule("weights").problems[0]
    assert "policy_version 0" in result.rule("policy_version").problems[0]
