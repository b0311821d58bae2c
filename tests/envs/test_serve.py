"""``serve`` end to end: real run-api and atropos-serve subprocesses, a trainer-like client."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.envs.helpers import ARITHMETIC_ENV, COUNTING_ENV, Trainer, start_env, stop


def _check_group(group: dict, env_id: int, group_size: int) -> None:
    assert group["env_id"] == env_id
    assert len(group["tokens"]) == len(group["masks"]) == len(group["scores"]) == group_size
    for tokens, masks in zip(group["tokens"], group["masks"], strict=True):
        assert len(tokens) == len(masks)
        prompt = 0
        while prompt < len(masks) and masks[prompt] == -100:
            prompt += 1
        assert prompt > 5, "the chat prompt is masked"
        assert prompt < len(masks), "the completion is trained on"
        assert masks[prompt:] == tokens[prompt:]


@pytest.mark.slow
def test_arithmetic_serve_feeds_a_trainer(start_api, tiny_serve, tiny_model_dir, tmp_path: Path):
    api = start_api()
    trainer = Trainer(api.url, batch_size=8, max_token_len=512, num_steps=3)
    trainer.register()
    proc = start_env(
        ARITHMETIC_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--openai.base_url",
        f"{tiny_serve.url}/v1",
        "--openai.model_name",
        "tiny",
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.total_steps",
        "3",
        "--env.max_answer_tokens",
        "6",
        log=tmp_path / "env.log",
    )
    try:
        trainer.pull(3, timeout=120)
        rc = proc.wait(60)
    finally:
        stop(proc)
        trainer.close()
    log = (tmp_path / "env.log").read_text()
    assert rc == 0, log[-3000:]
    assert "Disconnected env" in log
    groups = trainer.groups()
    assert len(groups) == 6
    env_ids = {g["env_id"] for g in groups}
    assert len(env_ids) == 1
    for group in groups:
        _check_group(group, group["env_id"], 4)
        # the arithmetic env's default reward: 1 for the right answer, else 0
        assert set(group["scores"]) <= {1.0, 0.0}
        # exact tokens from the server: sampler logprobs ride along, 1.0 on the prompt
        assert len(group["inference_logprobs"][0]) == len(group["tokens"][0])
        assert group["inference_logprobs"][0][0] == 1.0
        assert group["messages"][0][-1]["role"] == "assistant"


@pytest.mark.slow
def test_full_queue_pauses_without_losing_in_flight_rollouts(
    start_api, tiny_model_dir, tmp_path: Path
):
    """The queue fills while 8 slow rollouts run: they finish and arrive (nothing is rolled
    out twice), the API's 429s are waited out, and the env resumes when the trainer pulls."""
    api = start_api("--max-queue-sequences", "12", "--retry-after-s", "1")
    trainer = Trainer(api.url, batch_size=4, max_token_len=512)
    trainer.register()
    starts = tmp_path / "starts.txt"
    proc = start_env(
        COUNTING_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.num_items",
        "24",
        "--env.rollout_delay",
        "1.5",
        "--env.max_num_workers",
        "8",
        "--env.max_batches_offpolicy",
        "4",
        "--env.start_log",
        str(starts),
        log=tmp_path / "env.log",
    )
    try:
        # let the queue fill up (and stay full) before the trainer pulls anything
        import time

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if trainer.client.get("/status").json()["queue_size"] >= 6:
                break
            time.sleep(0.2)
        time.sleep(3)
        trainer.pull(12, timeout=120)  # 24 groups of 2 = 12 batches of 4
    finally:
        stop(proc)
        trainer.close()
    ids = sorted(g["tokens"][0][0] - 1000 for g in trainer.groups())
    assert ids == list(range(24)), "every group arrived exactly once"
    started = [int(x) for x in starts.read_text().split()]
    assert sorted(started) == list(range(24)), "no rollout was thrown away and redone"


@pytest.mark.slow
def test_failing_rollouts_are_retried(start_api, tiny_model_dir, tmp_path: Path):
    api = start_api()
    trainer = Trainer(api.url, batch_size=4)
    trainer.register()
    proc = start_env(
        COUNTING_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.num_items",
        "4",
        "--env.fail_first_attempt",
        "--env.rollout_retries",
        "1",
        log=tmp_path / "env.log",
    )
    try:
        trainer.pull(2, timeout=60)
    finally:
        stop(proc)
        trainer.close()
    ids = sorted(g["tokens"][0][0] - 1000 for g in trainer.groups())
    assert ids == [0, 1, 2, 3]
    log = (tmp_path / "env.log").read_text()
    assert "first attempt of item 0 fails on purpose" in log  # the traceback is logged
    assert "retrying" in log


@pytest.mark.slow
def test_api_killed_and_restarted_mid_run(start_api, tiny_model_dir, tmp_path: Path):
    from tests.conftest import free_port

    port = free_port()
    api = start_api(port=port)
    trainer = Trainer(api.url, batch_size=4)
    trainer.register()
    proc = start_env(
        COUNTING_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.total_steps",
        "4",
        "--env.rollout_delay",
        "0.3",
        "--env.max_num_workers",
        "1",
        "--env.max_batches_offpolicy",
        "1",
        log=tmp_path / "env.log",
    )
    try:
        trainer.pull(1, timeout=60)
        api.kill9()
        import time

        time.sleep(2)
        assert proc.poll() is None, "the env survives the API going away"
        api = start_api(port=port)  # in memory: the env id and the run are forgotten
        trainer.batches = []
        trainer.register()
        trainer.pull(4 - len(trainer.batches), timeout=90)
        rc = proc.wait(60)
    finally:
        stop(proc)
        trainer.close()
    log = (tmp_path / "env.log").read_text()
    assert rc == 0, log[-3000:]
    assert "registering again" in log


def test_trainer_without_length_limit_is_announced(start_api, tiny_model_dir, tmp_path: Path):
    """A trainer registering max_token_len -1 (upstream's "ignore max length") is honoured,
    and the env says so once instead of dropping nothing silently."""
    api = start_api()
    trainer = Trainer(api.url, batch_size=4, max_token_len=-1, num_steps=2)
    trainer.register()
    proc = start_env(
        COUNTING_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.total_steps",
        "2",
        log=tmp_path / "env.log",
    )
    try:
        trainer.pull(1, timeout=60)
    finally:
        stop(proc)
        trainer.close()
    log = (tmp_path / "env.log").read_text()
    assert log.count("the trainer registered max_token_len=-1: no length limit") == 1, log[-3000:]
