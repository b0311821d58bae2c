"""Long-polled ``GET /batch?wait=SECONDS``: answered as soon as a batch can form, ``{"batch":
null}`` when the wait runs out, composed with acknowledgements, redelivery and held parts of
groups; bad values are a 422 naming ``wait``; a plain ``/batch`` is unchanged. Through HTTP
against real run-api processes. Timings are asserted relative to the events (the reply comes
after the POST that completes the batch, and long before the wait would end), never as
absolute latencies."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from typing import Any

import httpx
import pytest

from atroposlib.api.client import TrainerClient, TrajectoryAPIError
from tests.api.helpers import add_env, group, start_run, tags
from tests.api.test_partial_groups import PROMPT_A, PROMPT_B, answers, outcomes, prompt_of

#: a wait no test should come near: a reply long before it was woken, not timed out
LONG_WAIT = 20.0


class Waiting:
    """``GET /batch`` with ``params`` in a thread; records when the reply arrived."""

    def __init__(self, url: str, params: dict[str, Any], timeout: float = 60.0) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.replied_at: float | None = None
        self.sent_at = time.monotonic()

        def run() -> None:
            try:
                with httpx.Client(base_url=url, timeout=timeout) as client:
                    self.response = client.get("/batch", params=params)
            except BaseException as exc:  # reported by result()
                self.error = exc
            self.replied_at = time.monotonic()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def still_waiting(self, seconds: float = 0.5) -> bool:
        """Whether the request is still held after ``seconds``."""
        self.thread.join(seconds)
        return self.thread.is_alive()

    def result(self, timeout: float = 60.0) -> httpx.Response:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the long poll never answered"
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


def test_long_poll_answers_when_the_batch_forms(api: httpx.Client) -> None:
    start_run(api, batch_size=4)
    waiting = Waiting(str(api.base_url), {"wait": LONG_WAIT})
    assert waiting.still_waiting()
    assert api.post("/scored_data", json=group(2, tag=1)).status_code == 200
    assert waiting.still_waiting(), "half a batch must not end the wait"
    posted = time.monotonic()
    assert api.post("/scored_data", json=group(2, tag=2)).status_code == 200
    response = waiting.result()
    assert response.status_code == 200
    assert tags(response.json()["batch"]) == [1, 2]
    assert response.headers["X-Atropos-Wait"] == "20"
    assert response.headers["X-Atropos-Step"] == "1"
    assert waiting.replied_at is not None and waiting.replied_at >= posted
    # woken by the POST, not by the wait running out
    assert waiting.replied_at - waiting.sent_at < LONG_WAIT / 2


def test_long_poll_answers_null_when_the_wait_runs_out(api: httpx.Client) -> None:
    start_run(api, batch_size=4)
    assert api.post("/scored_data", json=group(2, tag=1)).status_code == 200
    sent = time.monotonic()
    response = api.get("/batch", params={"wait": 0.5})
    assert time.monotonic() - sent >= 0.5
    assert response.status_code == 200
    assert response.json() == {"batch": None}
    assert response.headers["X-Atropos-Wait"] == "0.5"
    # what the trainer waits for: 2 of its 4 sequences are queued
    assert response.headers["X-Atropos-Queued-Sequences"] == "2"
    assert response.headers["X-Atropos-Held-Sequences"] == "0"
    assert api.get("/status").json()["current_step"] == 0  # nothing handed out


def test_plain_batch_is_unchanged(api: httpx.Client) -> None:
    """Upstream's /batch: no wait, no extra headers, and wait=0 answers at once as well."""
    start_run(api, batch_size=4)
    response = api.get("/batch")
    assert response.json() == {"batch": None}
    assert "X-Atropos-Wait" not in response.headers
    assert api.get("/batch", params={"wait": 0}).json() == {"batch": None}


def test_before_register_the_error_comes_at_once(api: httpx.Client) -> None:
    sent = time.monotonic()
    reply = api.get("/batch", params={"wait": LONG_WAIT}).json()
    assert time.monotonic() - sent < LONG_WAIT / 2
    assert reply["status"] == "error" and reply["batch"] == []


@pytest.mark.parametrize("value", ["31", "-1", "nan", "inf", "soon", ""])
def test_bad_wait_is_a_422_naming_it(api: httpx.Client, value: str) -> None:
    start_run(api, batch_size=4)
    response = api.get("/batch", params={"wait": value})
    assert response.status_code == 422
    (error,) = response.json()["detail"]
    assert error["loc"] == ["query", "wait"]
    assert "wait must be a number of seconds from 0 to 30" in error["msg"]


def test_long_poll_with_ack_and_redelivery(api: httpx.Client) -> None:
    start_run(api, batch_size=2)  # nothing handed out yet: ack from step 0
    waiting = Waiting(str(api.base_url), {"wait": LONG_WAIT, "ack": 0})
    assert waiting.still_waiting()
    posted = time.monotonic()
    assert api.post("/scored_data", json=group(2, tag=7)).status_code == 200
    first = waiting.result()
    assert waiting.replied_at is not None and waiting.replied_at >= posted
    assert tags(first.json()["batch"]) == [7]
    step = first.headers["X-Atropos-Step"]
    # the response was "lost": asking again with the old ack gets the same batch at once
    sent = time.monotonic()
    again = api.get("/batch", params={"wait": LONG_WAIT, "ack": 0})
    assert time.monotonic() - sent < LONG_WAIT / 2
    assert again.headers["X-Atropos-Redelivered"] == "1"
    assert again.headers["X-Atropos-Step"] == step
    assert tags(again.json()["batch"]) == [7]
    # acknowledged: nothing more to hand out, so the wait runs out
    done = api.get("/batch", params={"wait": 0.3, "ack": step})
    assert done.json() == {"batch": None}
    assert api.get("/metrics", params={"format": "json"}).json()["unacknowledged_batches"] == 0


def test_two_waiting_ranks_get_one_batch_each(api: httpx.Client) -> None:
    start_run(api, batch_size=2)
    waiters = [Waiting(str(api.base_url), {"wait": LONG_WAIT, "ack": 0, "rank": r}) for r in (0, 1)]
    assert all(w.still_waiting() for w in waiters)
    posted = time.monotonic()
    assert api.post("/scored_data_list", json=[group(2, tag=1), group(2, tag=2)]).json()
    batches = sorted(tags(w.result().json()["batch"]) for w in waiters)
    assert batches == [[1], [2]]
    assert all(w.replied_at is not None and w.replied_at >= posted for w in waiters)


def test_held_parts_released_when_the_wait_begins_and_ends(api: httpx.Client) -> None:
    """Parts are released as a plain /batch releases them when the wait begins and when it
    runs out; a part arriving during the wait stays held (it may complete its group)."""
    start_run(api, batch_size=8)
    env = add_env(api, group_size=4)
    before = outcomes(api)
    assert api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env, 4)).json()["status"] == (
        "buffered"
    )
    waiting = Waiting(str(api.base_url), {"wait": 1.5})
    assert waiting.still_waiting(0.3)
    assert outcomes(api) - before == Counter(released=1)  # the wait began: A's part queued
    assert api.post("/scored_data", json=answers(PROMPT_B, [3, 4], env, 4)).json()["status"] == (
        "buffered"
    )
    assert waiting.still_waiting(0.3)
    assert outcomes(api) - before == Counter(released=1)  # B's part still held
    response = waiting.result()
    assert response.json() == {"batch": None}
    assert outcomes(api) - before == Counter(released=2)  # the wait ran out: B's part queued
    assert response.headers["X-Atropos-Queued-Sequences"] == "4"
    assert response.headers["X-Atropos-Held-Sequences"] == "0"


def test_parts_arriving_during_the_wait_complete_their_group(api: httpx.Client) -> None:
    start_run(api, batch_size=8)
    env = add_env(api, group_size=4)
    before = outcomes(api)
    waiting = Waiting(str(api.base_url), {"wait": LONG_WAIT})
    assert waiting.still_waiting()
    api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env, 4))
    api.post("/scored_data", json=answers(PROMPT_B, [3, 4], env, 4))
    api.post("/scored_data", json=answers(PROMPT_A, [5, 6], env, 4))  # completes A
    assert waiting.still_waiting(0.3)
    posted = time.monotonic()
    api.post("/scored_data", json=answers(PROMPT_B, [7, 8], env, 4))  # completes B: 8 queued
    response = waiting.result()
    assert waiting.replied_at is not None and waiting.replied_at >= posted
    batch = response.json()["batch"]
    assert [len(g["tokens"]) for g in batch] == [4, 4]
    assert [prompt_of(g) for g in batch] == [{tuple(PROMPT_A)}, {tuple(PROMPT_B)}]
    assert outcomes(api) - before == Counter(merged=4)


def test_held_parts_that_fill_a_batch_are_released_during_the_wait(api: httpx.Client) -> None:
    """Queued and held sequences together reach the batch size: the wait does not hold the
    trainer back for parts that might still complete."""
    start_run(api, batch_size=4)
    env = add_env(api, group_size=4)
    waiting = Waiting(str(api.base_url), {"wait": LONG_WAIT})
    assert waiting.still_waiting()
    api.post("/scored_data", json=answers(PROMPT_A, [1, 2], env, 4))
    assert waiting.still_waiting(0.3)
    posted = time.monotonic()
    api.post("/scored_data", json=answers(PROMPT_B, [3, 4], env, 4))
    batch = waiting.result().json()["batch"]
    assert waiting.replied_at is not None and waiting.replied_at >= posted
    assert waiting.replied_at - waiting.sent_at < LONG_WAIT / 2
    assert [prompt_of(g) for g in batch] == [{tuple(PROMPT_A)}, {tuple(PROMPT_B)}]


def test_a_client_that_gave_up_is_handed_nothing(api: httpx.Client) -> None:
    """A trainer whose request timed out while waiting (no ack: at-most-once) must not lose the
    batch that forms after it left."""
    start_run(api, batch_size=2)
    with httpx.Client(base_url=api.base_url, timeout=0.3) as impatient:
        with pytest.raises(httpx.ReadTimeout):
            impatient.get("/batch", params={"wait": 5})
    time.sleep(0.2)  # the server sees the connection close
    api.post("/scored_data", json=group(2, tag=9))
    time.sleep(0.2)
    response = api.get("/batch")
    assert tags(response.json()["batch"]) == [9]


def test_staleness_drop_applies_to_a_long_poll(start_api) -> None:
    server = start_api("--max-staleness", "0")
    with httpx.Client(base_url=server.url, timeout=30) as api:
        start_run(api, batch_size=2)
        api.post("/scored_data", json={**group(2, tag=0), "policy_version": 0})
        assert tags(api.get("/batch").json()["batch"]) == [0]  # step 1; next: version 1's
        waiting = Waiting(server.url, {"wait": LONG_WAIT})
        assert waiting.still_waiting()
        api.post("/scored_data", json={**group(2, tag=1), "policy_version": 0})  # stale
        assert waiting.still_waiting(0.3)
        posted = time.monotonic()
        api.post("/scored_data", json={**group(2, tag=2), "policy_version": 1})
        assert tags(waiting.result().json()["batch"]) == [2]
        assert waiting.replied_at is not None and waiting.replied_at >= posted
        dropped = api.get("/metrics", params={"format": "json"}).json()["dropped"]
        assert dropped.get("stale") == 1


def test_stopping_run_api_answers_a_waiting_trainer(start_api) -> None:
    """uvicorn waits for requests in progress when told to stop: a long poll is answered at
    once instead of holding the shutdown for its whole wait."""
    server = start_api()
    with httpx.Client(base_url=server.url, timeout=30) as api:
        start_run(api, batch_size=2)
    waiting = Waiting(server.url, {"wait": 30})
    assert waiting.still_waiting()
    assert server.proc is not None
    stopped = time.monotonic()
    server.proc.terminate()
    # uvicorn re-raises the SIGTERM it caught once it has shut down
    assert server.proc.wait(20) in (0, -signal.SIGTERM)
    assert time.monotonic() - stopped < 15  # not the 30 s wait
    assert waiting.result().json() == {"batch": None}


def test_trainer_client_long_polls(api: httpx.Client) -> None:
    with TrainerClient(str(api.base_url), api_key="", long_poll=LONG_WAIT) as client:
        client.register(batch_size=2, max_token_len=64, num_steps=5)
        assert client.try_batch() is None  # opens env registration
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(client.get_batch(timeout=60)))
        started = time.monotonic()
        thread.start()
        thread.join(0.5)
        assert thread.is_alive()
        posted = time.monotonic()
        api.post("/scored_data", json=group(2, tag=3))
        thread.join(60)
        assert tags(got[0]) == [3]
        assert client.long_poll_supported is True
        # one request: answered when the group came, not at the next 1 s poll or the wait's end
        assert time.monotonic() - started < LONG_WAIT / 2
        assert time.monotonic() >= posted


def test_trainer_client_falls_back_to_polling_without_long_poll() -> None:
    """An upstream run-api ignores ``wait`` and answers at once: the client notices on the
    first request, stops sending ``wait`` and polls."""
    seen: list[httpx.URL] = []

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/register":
            return httpx.Response(200, json={"uuid": 1})
        seen.append(request.url)
        if len(seen) < 3:
            return httpx.Response(200, json={"batch": None})
        return httpx.Response(200, json={"batch": [group(2, tag=4)]})

    client = TrainerClient("http://upstream", api_key="", ack=False)
    client._http = httpx.Client(base_url="http://upstream", transport=httpx.MockTransport(upstream))
    client.register(batch_size=2, max_token_len=64, num_steps=5)
    assert tags(client.get_batch(timeout=30, poll=0.05)) == [4]
    assert client.long_poll_supported is False
    assert "wait" in seen[0].params
    assert all("wait" not in url.params for url in seen[1:])


def test_a_waiting_trainer_says_when_the_queue_cannot_make_a_batch(api: httpx.Client) -> None:
    """Enough sequences queued but no exact batch (16 + 15 + 15 for 32): the client's
    "waiting for a batch" line says so instead of asking whether envs are running."""
    with TrainerClient(str(api.base_url), api_key="", long_poll=0.2) as client:
        client.register(batch_size=32, max_token_len=64, num_steps=5)
        assert client.try_batch() is None  # opens env registration
        env = add_env(api, group_size=16)
        for size, tag in ((16, 0), (15, 1), (15, 2)):
            api.post("/scored_data", json=group(size, env_id=env, tag=tag))
        assert client.try_batch(wait=0.2) is None
        waiting = client._waits_for()
        assert "46 queued" in waiting and "adds up to exactly 32" in waiting, waiting
        api.post("/scored_data", json=group(16, env_id=env, tag=3))
        assert tags(client.get_batch(timeout=30)) == [0, 3]


def test_a_waiting_trainer_says_what_the_envs_dropped(api: httpx.Client) -> None:
    """Envs that drop every group (all replies scored alike) send nothing; they report their
    drop counts with /status-env, run-api passes the sum on with each long poll, and the
    client's waiting line and timeout say what was dropped since the last batch instead of
    asking whether envs are running."""
    with TrainerClient(str(api.base_url), api_key="", long_poll=0.2) as client:
        client.register(batch_size=2, max_token_len=64, num_steps=5)
        assert client.try_batch() is None  # opens env registration
        a, b = add_env(api, group_size=2), add_env(api, group_size=2)
        assert client.try_batch(wait=0.1) is None
        assert "are environments running" in client._waits_for()
        api.post("/status-env", json={"env_id": a, "dropped": {"same_scores": 5}})
        api.post("/status-env", json={"env_id": b, "dropped": {"same_scores": 2, "too_long": 1}})
        response = api.get("/batch", params={"wait": 0.1})
        assert json.loads(response.headers["X-Atropos-Env-Dropped-Groups"]) == {
            "same_scores": 7,
            "too_long": 1,
        }
        with pytest.raises(TrajectoryAPIError) as err:
            client.get_batch(timeout=0.5)
        message = str(err.value)
        assert "the envs dropped 8 group(s) before sending them" in message, message
        assert "7 same_scores (all replies scored alike, no learning signal)" in message
        assert "are environments running" not in message
        # a batch resets the count: what was dropped since then is what a wait is spent on
        api.post("/scored_data", json=group(2, env_id=a, tag=1))
        assert tags(client.get_batch(timeout=30)) == [1]
        assert "are environments running" in client._waits_for()
        api.post("/status-env", json={"env_id": a, "dropped": {"same_scores": 9}})
        assert client.try_batch(wait=0.1) is None
        assert "dropped 4 group(s)" in client._waits_for()
        # per env, by reason, in /metrics
        metrics = api.get("/metrics", params={"format": "json"}).json()
        assert metrics["env_dropped"] == {"same_scores": 11, "too_long": 1}
        by_env = {e["env_id"]: e["dropped_before_send"] for e in metrics["envs"]}
        assert by_env == {a: {"same_scores": 9}, b: {"same_scores": 2, "too_long": 1}}
        text = api.get("/metrics").text
        assert f'atropos_env_dropped_before_send_total{{env_id="{a}",' in text


@pytest.mark.parametrize(
    "dropped",
    [{"same_scores": -1}, {"same_scores": "5"}, {"same_scores": 1.5}, ["same_scores"], 3],
)
def test_bad_drop_counts_are_refused_naming_the_field(api: httpx.Client, dropped: Any) -> None:
    start_run(api, batch_size=2)
    env = add_env(api, group_size=2)
    response = api.post("/status-env", json={"env_id": env, "dropped": dropped})
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"][-1] == "dropped"
    # upstream's body, without the key, still works
    assert api.post("/status-env", json={"env_id": env}).status_code == 200
