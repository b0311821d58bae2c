"""The check's pieces without processes: the report writer, the contract's expectations and the
scripted groups (each must make its rule visible)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from atroposlib.testing import TrainerReport, expected_rows, read_report, report_from_env
from atroposlib.testing.expected import same_sign, score_advantages
from atroposlib.testing.report import REPORT_ENV, ReportError
from atroposlib.testing.scenario import build_scenario


def test_importing_the_package_needs_no_torch() -> None:
    code = "import sys, atroposlib.testing, atroposlib.cli.check_trainer; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_shifted_rows_become_token_aligned_sequences(tmp_path) -> None:
    """A shared prefix run once, right padding, and a trained last token that exists only as
    a label: the report holds the full sequence with one flag and advantage per token."""
    path = tmp_path / "report.jsonl"
    with TrainerReport(path, standard_advantages=True, name="t") as report:
        # sequence A = [5, 6, 7, 8, 9]: prompt [5, 6, 7], trained 8 and 9 (advantage 0.5)
        # sequence B = [5, 6, 7, 4]: trained 4 (advantage -1); its row is padded with 0
        report.shifted_rows(
            input_ids=[[7, 8], [7, 0]],  # after the prefix [5, 6]
            labels=[[8, 9], [4, -100]],
            advantages=[[0.5, 0.5], [-1.0, -1.0]],
            prefix_ids=[5, 6],
            policy_versions=[3, None],
        )
        report.end_step()
        report.sequence([1, 2, 3], [0, 1, 1], 2.0)
    data = read_report(path)
    assert data.standard_advantages and data.names == ["t"] and data.steps == [1]
    a, b, c = data.sequences
    assert (a.tokens, a.trained, a.advantages) == ([5, 6, 7, 8, 9], [0, 0, 0, 1, 1],
                                                   [0, 0, 0, 0.5, 0.5])  # fmt: skip
    assert a.policy_version == 3 and a.step == 1
    # the padding position after B's last token stays, untrained
    assert (b.tokens, b.trained, b.advantages) == ([5, 6, 7, 4], [0, 0, 0, 1], [0, 0, 0, -1.0])
    assert b.policy_version is None
    assert (c.step, c.advantages) == (2, [0.0, 2.0, 2.0])


def test_report_errors_name_the_line(tmp_path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text(
        '{"record": "trainer", "format": 1}\n'
        '{"record": "sequence", "tokens": [1, 2], "trained": [0], "advantages": [0, 1]}\n'
    )
    with pytest.raises(ReportError, match="line 2: tokens, trained and advantages differ"):
        read_report(path)


def test_report_from_env(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(REPORT_ENV, raising=False)
    assert report_from_env() is None
    monkeypatch.setenv(REPORT_ENV, str(tmp_path / "sub" / "report.jsonl"))
    first = report_from_env(standard_advantages=True)
    assert first is not None and first is report_from_env()
    first.close()


def test_expected_rows_follow_the_contract() -> None:
    assert score_advantages([2.0]) == [2.0]  # a group of one keeps its score
    assert score_advantages([0.5, 0.5]) == [0.0, 0.0]
    assert score_advantages([1.0, 0.0]) == pytest.approx([0.7071, -0.7071], abs=1e-4)
    group = {
        "tokens": [[1, 2, 3, 4], [1, 2, 5, 6], [1, 2, 7, 8]],
        "masks": [[-100, -100, 3, 4], [-100, 2, -100, 6], [1, -100, 7, 8]],
        "scores": [9.0, 1.0, 0.0],
        "overrides": [{"set_advantage_to_zero": True}, None, {}],
    }
    zeroed, second, third = expected_rows(group)
    # token 0 is never trained, whatever its mask
    assert third.trained == (False, False, True, True)
    assert second.trained == (False, True, False, True)
    assert zeroed.advantages == (0.0, 0.0, 0.0, 0.0) and zeroed.no_signal
    # the zeroed sequence's score still counts: both others are below the mean
    assert second.advantages[1] < 0 and third.advantages[2] < 0
    assert second.advantages[2] == 0.0  # not trained
    group["advantages"] = [[1.0], [0.1, 0.2, 0.3, 0.4], [-2.0]]
    zeroed, second, third = expected_rows(group)
    assert zeroed.no_signal  # zeroed after the explicit advantages too
    assert second.advantages == (0.0, 0.2, 0.0, 0.4)
    assert third.advantages == (0.0, 0.0, -2.0, -2.0)


@pytest.mark.parametrize("group_size", [None, 2, 3, 8])
def test_every_scripted_group_makes_its_rule_visible(group_size) -> None:
    scenario = build_scenario(group_size=group_size)
    seqs = [t for g in scenario.groups for t in g.payload["tokens"]]
    assert len({tuple(t[:11]) for t in seqs}) == len(seqs)  # each is told apart by its start
    for batch in range(1, scenario.steps + 1):
        assert sum(g.size for g in scenario.groups if g.batch == batch) == scenario.batch_size
    if group_size:
        assert {g.size for g in scenario.groups} == {group_size}
    else:
        assert {g.size for g in scenario.groups} >= {1, 2, 3, 4, 5}
    features = {g.feature for g in scenario.groups}
    assert features >= {"scores", "multi_turn", "explicit_per_token", "explicit_per_sequence",
                        "set_advantage_to_zero", "equal_scores"}  # fmt: skip
    for group in scenario.groups:
        payload = group.payload
        rows = expected_rows(payload)
        from_scores = score_advantages(payload["scores"])
        if group.feature == "scores":
            assert all(abs(a) > 0.05 for a in from_scores)
        if group.feature == "multi_turn":
            for row in rows:  # a masked token after the first trained one
                first = row.trained.index(True)
                assert not all(row.trained[first:])
        if payload.get("advantages") is not None:
            # ignoring them gives the wrong sign somewhere in every sequence with a signal
            for row, score_adv in zip(rows, from_scores, strict=True):
                if not row.no_signal:
                    assert any(
                        t and (a > 0) != (score_adv > 0) or (t and score_adv == 0)
                        for a, t in zip(row.advantages, row.trained, strict=True)
                    )
        if group.feature == "set_advantage_to_zero" and payload.get("advantages") is None:
            zeroed = [0.0 if (o or {}).get("set_advantage_to_zero") else s
                      for s, o in zip(payload["scores"], payload["overrides"], strict=True)]  # fmt: skip
            wrong = score_advantages(zeroed)
            right = [r.advantages[-1] for r in rows]
            # zeroing the score instead gives another sign (or 0) to some other member
            assert any(not same_sign(r, w, 1e-6) for w, r in zip(wrong[1:], right[1:], strict=True))
            assert all(r < 0 for r in right[1:])
    versions = {g.payload.get("policy_version") for g in scenario.groups}
    assert None in versions and len(versions) > 2


def test_cli_needs_a_trainer_command(capsys) -> None:
    from atroposlib.cli.check_trainer import main

    with pytest.raises(SystemExit) as exc:
        main(["--group-size", "4"])
    assert exc.value.code == 2
    assert "give the trainer command after --" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["--group-size", "1", "--", "true"])
    assert exc.value.code == 2
