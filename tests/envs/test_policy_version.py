"""Policy versions end to end, all real processes on loopback: ``atropos-serve`` assigns them
(``--policy-version``, ``/reload_weights``), the arithmetic env stamps its groups from the
server it used, ``run-api --max-staleness 0`` (memory and SQLite stores) carries them to
``/batch`` and drops stale groups, counted in ``/metrics``; every group the API accepted is
either served or counted as dropped."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import start_server
from tests.envs.helpers import ARITHMETIC_ENV, Trainer, start_env, stop

pytestmark = pytest.mark.slow


@pytest.fixture()
def own_serve(tmp_path_factory, tiny_model_dir):
    """An ``atropos-serve`` of our own (its weights are reloaded), at policy version 0."""
    server = start_server(
        tmp_path_factory, tiny_model_dir, "--dtype", "float32", "--served-model-name", "tiny"
    )
    try:
        yield server
    finally:
        server.stop()


def _metrics(client: httpx.Client) -> dict:
    return client.get("/metrics", params={"format": "json"}).json()


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.mark.parametrize("store", [False, True], ids=["memory", "sqlite"])
def test_versions_assigned_stamped_carried_and_enforced(
    start_api, own_serve, tiny_model_dir, tmp_path: Path, store: bool
) -> None:
    args = ["--max-staleness", "0"]  # on-policy only: the batch of step s trains version s-1
    if store:
        args += ["--store", str(tmp_path / "queue.sqlite3")]
    api = start_api(*args)
    trainer = Trainer(api.url, batch_size=8, max_token_len=512, num_steps=1000)
    trainer.register()
    env = start_env(
        ARITHMETIC_ENV,
        "serve",
        "--env.rollout_server_url",
        api.url,
        "--openai.base_url",
        f"{own_serve.url}/v1",
        "--openai.model_name",
        "tiny",
        "--env.tokenizer_name",
        str(tiny_model_dir),
        "--env.total_steps",
        "1000",
        "--env.max_answer_tokens",
        "4",
        "--env.max_batches_offpolicy",
        "3",
        log=tmp_path / "env.log",
    )
    served: list[tuple[int, dict]] = []
    reloads = []
    try:
        with httpx.Client(base_url=api.url, timeout=30) as client:

            def pull() -> int:
                while True:
                    reply = client.get("/batch")
                    if reply.json().get("batch"):
                        step = int(reply.headers["X-Atropos-Step"])
                        served.extend((step, g) for g in reply.json()["batch"])
                        return step
                    assert env.poll() is None, (tmp_path / "env.log").read_text()[-3000:]
                    time.sleep(0.05)

            for step in (1, 2, 3):
                assert pull() == step
                # more groups of the old weights wait in the queue: stale at the next step
                _wait(lambda: _metrics(client)["queue_groups"] >= 1, 120, "queued groups")
                # the trainer syncs: the server serves step `step` (the env's cached version
                # follows within its TTL; groups stamped older only look staler than they are)
                reply = httpx.post(
                    f"{own_serve.url}/reload_weights",
                    json={"path": str(tiny_model_dir), "policy_version": step},
                    timeout=120,
                )
                assert reply.status_code == 200, reply.text
                reloads.append(reply.json()["policy_version"])
            assert pull() == 4
            m = _metrics(client)
    finally:
        stop(env)
        trainer.close()

    assert reloads == [1, 2, 3]
    log = (tmp_path / "env.log").read_text()
    versions = [g.get("policy_version") for _, g in served]
    assert None not in versions, log[-3000:]  # every group was stamped by the env
    for step, group in served:
        assert (step - 1) - group["policy_version"] <= 0, (step, group["policy_version"])
    # step 1 can only hold version 0; after each sync the old groups are stale
    assert {g["policy_version"] for s, g in served if s == 1} == {0}
    assert {g["policy_version"] for s, g in served if s == 4} <= {3}
    stale = m["dropped"].get("stale", 0)
    assert stale >= 3, m  # at least the groups queued before each of the three syncs
    assert set(m["dropped"]) == {"stale"}
    # nothing else lost: every accepted group was served, dropped as stale, or is queued
    assert m["accepted_groups"] == len(served) + stale + m["queue_groups"] + m["buffered_groups"]
    assert m["batches_served"] == 4
    api_log = api.log_path.read_text()
    assert "stale group(s)" in api_log
