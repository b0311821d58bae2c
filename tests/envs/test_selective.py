"""Selective rollouts (``flat_item_retry_prob``): items whose groups keep scoring alike are
asked less often, with the probability law, the reset and the bound on skips; and through the
CLI, an env's ``process`` run rolls out its flat items less often than its others."""

from __future__ import annotations

import collections
import subprocess
import sys
from pathlib import Path

import pytest

from atroposlib.envs.config import BaseEnvConfig
from atroposlib.envs.selective import MAX_SKIPS_IN_A_ROW, FlatItemFilter, item_key
from tests.envs.helpers import COUNTING_ENV, Trainer, env_environ, start_env, stop


def test_item_key_is_content_not_identity() -> None:
    assert item_key({"question": "1 + 2", "answer": 3}) == item_key(
        {"answer": 3, "question": "1 + 2"}
    )
    assert item_key({"q": "1 + 2"}) != item_key({"q": "1 + 3"})
    assert item_key((1, object())) is not None  # what JSON cannot hold goes through repr


def test_retry_probability_is_p_to_the_streak_and_a_signal_resets_it() -> None:
    selective = FlatItemFilter(0.5, seed=1)
    item = {"question": "What is 3 + 4?"}
    assert not any(selective.skip(item) for _ in range(50))  # never flat: always rolled out

    def retried(streak: int, draws: int = 20000) -> float:
        selective.streaks[item_key(item)] = streak
        kept = 0
        for _ in range(draws):
            kept += not selective.skip(item)
            selective._skips_in_a_row = 0  # measure the law, not the bound below
        return kept / draws

    assert retried(1) == pytest.approx(0.5, abs=0.02)
    assert retried(2) == pytest.approx(0.25, abs=0.02)
    assert retried(3) == pytest.approx(0.125, abs=0.015)
    selective.streaks.clear()
    selective.record(item, flat=True)
    selective.record(item, flat=True)
    assert selective.streaks[item_key(item)] == 2
    selective.record(item, flat=False)  # a group with a signal: back to always
    assert item_key(item) not in selective.streaks
    assert not any(selective.skip(item) for _ in range(50))


def test_skips_in_a_row_are_bounded() -> None:
    """When every item is on a long flat streak the env still rolls something out."""
    selective = FlatItemFilter(0.01, seed=0)
    item = {"q": 1}
    for _ in range(10):
        selective.record(item, flat=True)
    decisions = [selective.skip(item) for _ in range(3 * (MAX_SKIPS_IN_A_ROW + 1))]
    assert decisions.count(False) == 3  # one roll-out after each run of skips
    assert decisions[:MAX_SKIPS_IN_A_ROW] == [True] * MAX_SKIPS_IN_A_ROW
    assert selective.skipped == 3 * MAX_SKIPS_IN_A_ROW


def test_config_bounds() -> None:
    assert BaseEnvConfig().flat_item_retry_prob is None  # off by default, as upstream
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValueError, match="flat_item_retry_prob"):
            BaseEnvConfig(flat_item_retry_prob=bad)


def _recurring_flags(tiny_model_dir: Path, starts: Path) -> list[str]:
    """The counting env with items 0-9 drawn over and over, 0-4 always scoring alike, two
    rollouts at a time, each start logged to ``starts``."""
    return [
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.cycle",
        "10",
        "--env.flat_below",
        "5",
        "--env.max_num_workers",
        "2",
        "--env.start_log",
        str(starts),
    ]


def _starts(path: Path) -> collections.Counter:
    """Rollouts started per item, from the env's start log."""
    return collections.Counter(int(x) for x in path.read_text().split())


def _process_starts(tmp_path: Path, tiny_model_dir: Path, *flags: str) -> collections.Counter:
    tmp_path.mkdir()
    starts = tmp_path / "starts.txt"
    out = tmp_path / "groups.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            str(COUNTING_ENV),
            "process",
            *_recurring_flags(tiny_model_dir, starts),
            "--env.total_steps",
            "40",
            "--env.data_path_to_save_groups",
            str(out),
            "--env.use_wandb",
            "false",
            *flags,
        ],
        capture_output=True,
        text=True,
        env=env_environ(),
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(out.read_text().splitlines()) == 40  # 40 groups with a signal either way
    return _starts(starts)


def test_process_rolls_out_flat_items_less_often(tmp_path: Path, tiny_model_dir) -> None:
    """Items 0-4 always score alike, 5-9 never. ``process`` keeps flat groups (upstream:
    ensure_scores_are_not_same is off there), so without the option 40 groups are 4 rollouts of
    each item; with it the flat items are mostly skipped and the others fill the 40."""
    plain = _process_starts(tmp_path / "plain", tiny_model_dir)
    assert plain == {i: 4 for i in range(10)}
    selective = _process_starts(
        tmp_path / "selective", tiny_model_dir, "--env.flat_item_retry_prob", "0.2"
    )
    flat_selective = sum(selective[i] for i in range(5))
    # each flat item: once to learn it is flat, then p**k of the draws (0.2, 0.04, ...)
    assert 5 <= flat_selective <= 12, selective
    assert sum(selective.values()) == 40
    assert all(selective[i] >= 5 for i in range(5, 10)), selective


@pytest.mark.slow
def test_serve_skips_items_whose_groups_were_dropped_as_flat(
    start_api, tiny_model_dir, tmp_path: Path
) -> None:
    """``serve`` drops flat groups (ensure_scores_are_not_same); with the option on, items whose
    groups were dropped are mostly skipped, and the trainer gets only groups with a signal."""
    api = start_api()
    trainer = Trainer(api.url, batch_size=4)
    trainer.register()
    starts = tmp_path / "starts.txt"
    proc = start_env(
        COUNTING_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        *_recurring_flags(tiny_model_dir, starts),
        "--env.flat_item_retry_prob",
        "0.2",
        log=tmp_path / "env.log",
    )
    try:
        trainer.pull(20, timeout=120)  # 40 groups of 2
    finally:
        stop(proc)
        trainer.close()
    ids = collections.Counter(g["tokens"][0][0] - 1000 for g in trainer.groups())
    assert set(ids) <= set(range(5, 10))  # flat groups never reach the trainer
    started = _starts(starts)
    assert sum(started[i] for i in range(5)) <= 15, started
